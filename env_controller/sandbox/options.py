"""The options of sandboxes, their pools and the tasks that run commands in them.

* :class:`PoolOptions`: how a :class:`~env_controller.sandbox.pool.SandboxPool` keeps its sandboxes (the cap,
  warm ones by demand, reuse after a verified wipe, its threads' pace);
* :class:`DockerOptions`: how :class:`~env_controller.sandbox.docker.DockerBackend` makes containers;
* :class:`ContainerOptions`: what the OS-shell and terminal tasks expose of both, with the per-command and
  per-container limits, flat keys as their params are written (``memory_mb: 256``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from env_controller.options import Options
from env_controller.sandbox.base import SandboxLimits


def parse_warm(value: Any, what: str = "warm_containers") -> tuple[int, int]:
    """``(min, max)`` of a warm-pool size: ``N`` (a fixed ``N``), ``"MIN:MAX"`` or ``[MIN, MAX]``.

    ValueError naming ``what`` when it is none of these, negative, or MIN > MAX.
    """
    rule = (f"{what}={value!r} must be N (keep N warm) or MIN:MAX (between MIN and MAX, by recent demand), "
            "with 0 <= MIN <= MAX, e.g. 4 or 0:32")
    if isinstance(value, str) and ":" in value:
        parts: list[Any] = value.split(":")
    elif isinstance(value, (list, tuple)):
        parts = list(value)
    else:
        parts = [value, value]
    if len(parts) != 2:
        raise ValueError(rule)
    out = []
    for part in parts:
        if isinstance(part, str) and part.strip().isdigit():
            part = int(part)
        if isinstance(part, bool) or not isinstance(part, int) or part < 0:
            raise ValueError(rule)
        out.append(part)
    if out[0] > out[1]:
        raise ValueError(rule)
    return out[0], out[1]


def parse_user(user: str, key: str = "user") -> tuple[int, int]:
    """``(uid, gid)`` of ``'uid:gid'``; ValueError naming ``key`` unless both are numbers and uid is not root
    (killing "all the user's processes" as root would end the container's own ``sleep``)."""
    try:
        uid, gid = (int(x) for x in str(user).split(":"))
    except ValueError:
        raise ValueError(f"{key}={user!r} must be 'uid:gid' with numbers, e.g. '1000:1000'") from None
    if uid == 0:
        raise ValueError(f"{key}={user!r}: sandbox commands cannot run as root; use e.g. '1000:1000'")
    return uid, gid


@dataclass
class PoolOptions(Options):
    """How a sandbox pool keeps its sandboxes (docs/environments.md, "Containers at scale")."""

    KEY = "pool"

    #: sandboxes live at once, in every state, warm ones included (None: no cap); a worker's ``--max-containers``
    max_containers: int | None = None
    #: sandboxes started ahead of demand: ``N``, or ``"MIN:MAX"`` (also ``[MIN, MAX]``) sized by the most demand
    #: of the last ``warm_window_s``; a worker's ``--warm-containers``
    warm_containers: int | str | list[int] = 0
    #: the demand window of the warm target, seconds
    warm_window_s: float = 30.0
    #: how long the warm target keeps the most demand it saw, and how long an idle sandbox above it is kept unused,
    #: seconds (None: 5 x ``warm_window_s``)
    shrink_after_s: float | None = None
    #: a finished session's sandbox is wiped (and the wipe verified) and serves another; off: a fresh one each
    reuse_containers: bool = False
    #: how long a new session waits for a sandbox at the cap, seconds
    acquire_timeout_s: float = 30.0
    #: sandboxes starting at once (the engine starts them at a fixed rate: more at once only queue inside it)
    max_starting: int = 4
    #: seconds between sweeps of the backend's orphans (0: never)
    sweep_interval_s: float = 60.0
    #: the refill thread's tick, seconds
    refill_interval_s: float = 0.5

    def check(self) -> None:
        """See :class:`Options`."""
        super().check()
        if self.max_containers is not None:
            self.require_positive_int("max_containers")
        try:
            low, _ = parse_warm(self.warm_containers)
        except ValueError:
            raise self.bad("warm_containers", "must be N (keep N warm) or 'MIN:MAX' (between MIN and MAX, by "
                           "recent demand) with 0 <= MIN <= MAX, e.g. 4 or '0:32'") from None
        self.require(self.max_containers is None or low <= self.max_containers, "warm_containers",
                     f"keeps more warm than max_containers={self.max_containers}")
        self.require_seconds("warm_window_s", "acquire_timeout_s", "refill_interval_s")
        if self.shrink_after_s is not None:
            self.require_seconds("shrink_after_s")
        self.require_bool("reuse_containers")
        self.require_positive_int("max_starting")
        self.require_non_negative("sweep_interval_s", why="0: never")

    @property
    def warm_bounds(self) -> tuple[int, int]:
        """``(min, max)`` of the warm target."""
        return parse_warm(self.warm_containers)


@dataclass
class DockerAccess(Options):
    """Which Docker engine makes the containers, and the user their commands run as."""

    #: the engine's URL (``unix:///run/docker.sock``, ``tcp://host:2376``); None: ``$DOCKER_HOST``, else the local
    #: socket
    docker_host: str | None = None
    #: ``uid:gid`` the commands run as, never root
    user: str = "1000:1000"

    def check(self) -> None:
        """See :class:`Options`."""
        super().check()
        self.require_string("docker_host", optional=True)
        try:
            parse_user(self.user)
        except ValueError as e:
            raise self.bad("user", "must be 'uid:gid' of a user other than root, e.g. '1000:1000' "
                           f"({str(e).split(': ', 1)[-1]})") from None


@dataclass
class DockerOptions(DockerAccess):
    """How the Docker backend makes containers (docs/environments.md, "Sandboxes")."""

    KEY = "docker"

    #: the image (it must hold bash and coreutils)
    image: str = "ubuntu:22.04"
    #: where the shell starts: a tmpfs of ``home_mb`` owned by the user; with ``writable_root``, the image's own
    #: directory
    workdir: str = "/home/user"
    #: the size of the tmpfs home, MB
    home_mb: int = 256
    #: limit on each call to the engine, seconds
    api_timeout_s: float = 60.0
    #: remove leaked containers (of owners that are gone) at start: True before the backend is ready,
    #: "background" in a thread, False not at all
    reap: bool | Literal["background"] = True
    #: also remove the containers of other hosts older than this, seconds (None: never)
    reap_foreign_after_s: float | None = None
    #: the root filesystem is the container's writable layer and ``workdir`` the image's own directory (terminal
    #: tasks: the agent changes the image's files); off: a read-only root and a tmpfs home
    writable_root: bool = False
    #: with ``writable_root``: ``workdir`` is a tmpfs of each container after all (the image's files there
    #: hidden), emptied by the wipe, so that what a session writes there does not bar a reuse
    scratch_workdir: bool = False
    #: with ``writable_root``: the cap on a container's own writable layer, MB (None: none); an engine quota where
    #: the storage driver has one, else checked by reading the layer's size
    disk_mb: int | None = None

    def check(self) -> None:
        """See :class:`Options`."""
        super().check()
        self.require_string("image")
        self.require(isinstance(self.workdir, str) and self.workdir.startswith("/")
                     and self.workdir.rstrip("/") not in ("", "/tmp"), "workdir",
                     "must be an absolute path other than / and /tmp")
        self.require_positive_int("home_mb")
        self.require_seconds("api_timeout_s")
        self.require(self.reap in (True, False, "background"), "reap", "must be true, false or 'background'")
        self.require(not self.scratch_workdir or self.writable_root, "scratch_workdir",
                     "needs writable_root=True (without it the workdir is a tmpfs anyway)")
        if self.disk_mb is not None:
            self.require_positive_int("disk_mb")
            self.require(self.writable_root, "disk_mb",
                         "needs writable_root=True (a read-only root's files are capped tmpfs already)")


@dataclass
class ContainerOptions(PoolOptions, DockerAccess):
    """The sandboxes of a task that runs commands (OS shell, terminal): their limits, their pool, and the engine
    and user of Docker sandboxes."""
    #: wall time of one command, seconds
    command_timeout_s: float = 10.0
    #: memory of one sandbox (its processes and in-memory files together), MB
    memory_mb: int = 512
    #: processes in one sandbox at once, its shell included
    max_processes: int = 64
    #: CPU time of one sandbox, in CPUs (0.5: half of one core)
    cpus: float = 1.0
    #: size of one sandbox's private ``/tmp`` (a tmpfs, counted in ``memory_mb``), MB
    tmp_mb: int = 64
    #: characters of a command's output shown to the agent
    max_output_chars: int = 4000

    def check(self) -> None:
        """See :class:`Options`; the limits are :class:`SandboxLimits`' rules, named by these keys."""
        super().check()
        self.require_int("max_output_chars", low=100)
        self.limits()

    #: the limits' own names of the keys that differ
    _LIMIT_NAMES = {"timeout_s": "command_timeout_s"}

    def limits(self, **overrides: object) -> SandboxLimits:
        """The sandbox limits of these options (``overrides``: a :class:`SandboxLimits` field each), a bad value
        named by its key here."""
        values = {"timeout_s": self.command_timeout_s, "memory_mb": self.memory_mb,
                  "max_processes": self.max_processes, "cpus": self.cpus, "tmp_mb": self.tmp_mb, **overrides}
        try:
            return SandboxLimits(**values)  # type: ignore[arg-type]
        except ValueError as e:
            name = getattr(e, "name", None)
            if name is None:
                raise
            raise self.bad(self._LIMIT_NAMES.get(name, name), getattr(e, "rule", str(e))) from None
