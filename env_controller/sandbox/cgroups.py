"""One control group per sandbox, so that its limits hold for all of its processes together.

:meth:`CgroupSystem.detect` finds the cgroup hierarchy of the machine (v2 when its ``memory``
controller is there, else v1) and prepares a parent cgroup, ``agentrl`` by default, under the
root of each hierarchy this process can see. :meth:`CgroupSystem.create` makes one child per
sandbox with its limits:

* v2: ``memory.max`` (and ``memory.swap.max`` = 0), ``pids.max``, ``cpu.max``;
* v1: ``memory.limit_in_bytes`` (and ``memory.memsw.limit_in_bytes``, memory plus swap, where
  swap accounting exists), ``pids.max``, ``cpu.cfs_quota_us`` over ``cpu.cfs_period_us``.

Memory counts every process of the sandbox and the tmpfs pages it writes. A sandbox cgroup is
named ``agentrl-sandbox-<pid namespace>-<owner pid>-<owner start time>-<sandbox>``;
:meth:`CgroupSystem.reap_leaked` kills and removes those whose owner process is gone (a crashed
worker; the pid namespace keeps workers in other containers from being taken for gone), and a
backend calls it when it starts. Creating cgroups needs root or a delegated subtree; when that is not possible,
:class:`CgroupUnavailableError` says why.
"""
from __future__ import annotations

import errno
import logging
import os
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from env_controller.sandbox.base import kill_owned, proc_stat

logger = logging.getLogger(__name__)

PREFIX = "agentrl-sandbox-"
CONTROLLERS = ("memory", "pids", "cpu")
CPU_PERIOD_US = 100_000
_NAME = re.compile(rf"^{re.escape(PREFIX)}(\d+)-(\d+)-(\d+)-")


class CgroupUnavailableError(RuntimeError):
    """Sandbox cgroups cannot be made here; the message says why."""


@dataclass(frozen=True)
class CgroupLimits:
    """The limits of one sandbox cgroup: memory in bytes (swap included), tasks, CPUs (quota)."""

    memory_bytes: int
    max_pids: int
    cpus: float


def process_start(pid: int) -> int | None:
    """Start time of process ``pid`` (clock ticks after boot; tells a reused pid apart), or None."""
    fields = proc_stat(pid)
    return int(fields[19]) if fields is not None and len(fields) > 19 else None


def _pid_namespace() -> int:
    """The inode of this process's pid namespace: pids mean something only within it."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def owner_tag(pid: int | None = None) -> str:
    """``<pid namespace>-<pid>-<start time>`` of process ``pid`` (default: this one): a name's owner part."""
    pid = os.getpid() if pid is None else pid
    return f"{_pid_namespace()}-{pid}-{process_start(pid)}"


def owner_is_gone(name: str) -> bool:
    """Whether ``name`` (``agentrl-sandbox-<pid namespace>-<pid>-<start>-...``) belongs to a process of
    this pid namespace that has exited; the names of other namespaces (other containers) are not ours
    to judge."""
    m = _NAME.match(name)
    return (m is not None and int(m.group(1)) == _pid_namespace()
            and process_start(int(m.group(2))) != int(m.group(3)))


def _why(exc: OSError) -> str:
    """``exc``'s reason, with what to do about the usual ones."""
    if exc.errno in (errno.EACCES, errno.EPERM):
        return f"{exc.strerror}: run the worker as root, or pass cgroup_parent= a cgroup delegated to its user"
    if exc.errno == errno.EROFS:
        return f"{exc.strerror}: /sys/fs/cgroup is mounted read-only here"
    return str(exc.strerror)


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _read_pids(path: Path) -> set[int]:
    try:
        return {int(x) for x in path.read_text().split()}
    except (FileNotFoundError, ProcessLookupError):
        return set()


def mountinfo_path(field: str) -> str:
    """A mountinfo path field with its octal escapes (``\\040`` for a space) decoded."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


@dataclass(frozen=True)
class CgroupMount:
    """One mounted cgroup hierarchy: where, which version, which of :data:`CONTROLLERS` it holds."""

    path: Path
    version: int
    controllers: frozenset[str]


def cgroup_mounts(mountinfo: str = "/proc/self/mountinfo") -> list[CgroupMount]:
    """The cgroup hierarchies mounted in this process's mount namespace."""
    out: list[CgroupMount] = []
    try:
        lines = Path(mountinfo).read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3 or tail[0] not in ("cgroup", "cgroup2"):
            continue
        path = Path(mountinfo_path(fields[4]))
        if tail[0] == "cgroup2":
            try:
                names = (path / "cgroup.controllers").read_text().split()
            except OSError:
                continue
            out.append(CgroupMount(path, 2, frozenset(names) & set(CONTROLLERS)))
        else:
            out.append(CgroupMount(path, 1, frozenset(tail[2].split(",")) & set(CONTROLLERS)))
    return out


class SandboxCgroup:
    """The cgroup of one sandbox: one directory (v2) or one per hierarchy (v1)."""

    def __init__(self, name: str, dirs: list[Path], version: int, memory_dir: Path | None) -> None:
        """Wraps directories made by :meth:`CgroupSystem.create`."""
        self.name = name
        self.dirs = dirs
        self.version = version
        self._memory_dir = memory_dir

    def add(self, pid: int) -> None:
        """Move process ``pid`` (all its threads) into the cgroup; OSError when it cannot be moved."""
        for d in self.dirs:
            try:
                _write(d / "cgroup.procs", str(pid))
            except ProcessLookupError:
                return  # it exited meanwhile: nothing left to move
            except OSError as exc:
                if exc.errno == errno.ESRCH:
                    return
                raise

    def procs(self) -> set[int]:
        """Processes in the cgroup now (of every hierarchy, for v1)."""
        out: set[int] = set()
        for d in self.dirs:
            out |= _read_pids(d / "cgroup.procs")
        return out

    def _memory_value(self, v1: str, v2: str) -> int | None:
        if self._memory_dir is None:
            return None
        try:
            return int((self._memory_dir / (v2 if self.version == 2 else v1)).read_text())
        except (OSError, ValueError):
            return None

    def memory_bytes(self) -> int | None:
        """Memory in use by the sandbox now (processes and tmpfs pages), or None when unknown."""
        return self._memory_value("memory.usage_in_bytes", "memory.current")

    def memory_peak_bytes(self) -> int | None:
        """The most memory the sandbox has used at once, or None when the kernel does not say."""
        return self._memory_value("memory.max_usage_in_bytes", "memory.peak")

    def oom_kills(self) -> int | None:
        """Processes the kernel killed so far because the sandbox reached its memory limit."""
        if self._memory_dir is None:
            return None
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            for line in (self._memory_dir / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            return None
        return None

    def process_limit_hits(self) -> int | None:
        """Forks refused so far at the cgroup's task limit (``pids.events``: ``max``), None when unknown."""
        for d in self.dirs:
            try:
                text = (d / "pids.events").read_text()
            except OSError:
                continue
            for line in text.splitlines():
                key, _, value = line.partition(" ")
                if key == "max" and value.strip().isdigit():
                    return int(value)
        return None

    def kill(self, timeout_s: float = 10.0) -> bool:
        """SIGKILL every process in the cgroup and wait until it is empty; False when some remain."""
        use_kill_file = self.version == 2 and (self.dirs[0] / "cgroup.kill").exists()
        deadline = time.monotonic() + timeout_s
        while True:
            pids = self.procs()
            if not pids:
                return True
            if use_kill_file:
                try:
                    _write(self.dirs[0] / "cgroup.kill", "1")
                except FileNotFoundError:
                    return True
            else:  # v1 has no cgroup.kill: kill what is listed until nothing is (the forks of the dying too)
                kill_owned(pids, lambda alive: alive & self.procs())
            if time.monotonic() >= deadline:
                logger.error("cgroup %s: processes %s survived SIGKILL", self.name, sorted(pids))
                return False
            time.sleep(0.01)

    def remove(self, timeout_s: float = 10.0) -> bool:
        """Kill what is left and delete the cgroup; True when every directory is gone."""
        self.kill(timeout_s)
        ok = True
        for d in self.dirs:
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as exc:
                    # EBUSY while exiting processes are still being released
                    if exc.errno != errno.EBUSY or time.monotonic() >= deadline:
                        logger.error("cgroup %s: cannot remove %s: %s", self.name, d, exc)
                        ok = False
                        break
                    time.sleep(0.02)
        return ok


class CgroupSystem:
    """Where sandbox cgroups are made: the cgroup version, its controllers and the parent cgroups."""

    def __init__(self, version: int, parents: dict[Path, frozenset[str]], swap: bool) -> None:
        """Use :meth:`detect`. ``parents``: parent directory -> controllers it holds."""
        self.version = version
        self.parents = parents
        self.controllers = frozenset().union(*parents.values())
        self.swap = swap

    def describe(self) -> str:
        """E.g. ``cgroup v1 (memory with swap, pids, cpu) under /sys/fs/cgroup/memory/agentrl, ...``."""
        names = [("memory with swap" if c == "memory" and self.swap else c) for c in CONTROLLERS
                 if c in self.controllers]
        return f"cgroup v{self.version} ({', '.join(names)}) under {', '.join(map(str, self.parents))}"

    @classmethod
    def detect(cls, parent: str = "agentrl", mountinfo: str = "/proc/self/mountinfo") -> "CgroupSystem":
        """Find the hierarchy, create the parent cgroup and try a child; CgroupUnavailableError says why not."""
        rel = Path(parent.strip("/"))
        if not parent.strip("/") or ".." in rel.parts:
            raise ValueError(f"cgroup_parent={parent!r} must be a relative path without '..', e.g. 'agentrl'")
        mounts = cgroup_mounts(mountinfo)
        v2 = next((m for m in mounts if m.version == 2 and "memory" in m.controllers), None)
        v1 = {c: m for m in mounts if m.version == 1 for c in m.controllers}
        if v2 is not None:
            system = cls._prepare_v2(v2, rel)
        elif "memory" in v1:
            system = cls._prepare_v1(v1, rel)
        elif not mounts:
            raise CgroupUnavailableError("no cgroup file system is mounted (none in /proc/self/mountinfo)")
        else:
            raise CgroupUnavailableError("the cgroup memory controller is not available (neither v2 nor v1 has it)")
        system._probe()
        return system

    @classmethod
    def _prepare_v1(cls, v1: dict[str, CgroupMount], rel: Path) -> "CgroupSystem":
        parents: dict[Path, frozenset[str]] = {}
        for mount in {id(m): m for m in v1.values()}.values():
            d = mount.path / rel
            try:
                d.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise CgroupUnavailableError(f"cannot create the cgroup {d}: {_why(exc)}") from exc
            parents[d] = mount.controllers
        memory_parent = next(d for d, cs in parents.items() if "memory" in cs)
        return cls(1, parents, swap=(memory_parent / "memory.memsw.limit_in_bytes").exists())

    @classmethod
    def _prepare_v2(cls, mount: CgroupMount, rel: Path) -> "CgroupSystem":
        wanted = [c for c in CONTROLLERS if c in mount.controllers]
        d = mount.path
        # v2 hands a controller to a child only when every ancestor enables it for its children
        for part in ("", *rel.parts):
            if part:
                d = d / part
                try:
                    d.mkdir(exist_ok=True)
                except OSError as exc:
                    raise CgroupUnavailableError(f"cannot create the cgroup {d}: {_why(exc)}") from exc
            for c in list(wanted):
                try:
                    enabled = (d / "cgroup.subtree_control").read_text().split()
                    if c not in enabled:
                        _write(d / "cgroup.subtree_control", f"+{c}")
                except OSError as exc:
                    if c == "memory":
                        why = (" (it holds processes: v2 allows controllers only below cgroups without "
                               "processes; pass cgroup_parent= a delegated cgroup)") if exc.errno == errno.EBUSY else ""
                        raise CgroupUnavailableError(
                            f"cannot enable the memory controller in {d}: {exc.strerror}{why}") from exc
                    logger.warning("cgroup v2: cannot enable the %s controller in %s (%s); sandboxes go without it",
                                   c, d, exc.strerror)
                    wanted.remove(c)
        return cls(2, {d: frozenset(wanted)}, swap=True)

    def _probe(self) -> None:
        """Create, limit and remove one cgroup, so that a read-only or foreign tree fails here."""
        try:
            cgroup = self.create(f"probe-{secrets.token_hex(4)}", CgroupLimits(64 << 20, 8, 1.0))
        except OSError as exc:
            raise CgroupUnavailableError(f"cannot create a cgroup in {', '.join(map(str, self.parents))}: "
                                         f"{_why(exc)}") from exc
        cgroup.remove()

    def name_for(self, sandbox_id: str) -> str:
        """The cgroup name of sandbox ``sandbox_id`` owned by this process."""
        return f"{PREFIX}{owner_tag()}-{sandbox_id.removeprefix('agentrl-')}"

    def create(self, sandbox_id: str, limits: CgroupLimits) -> SandboxCgroup:
        """Make the cgroup of sandbox ``sandbox_id`` with ``limits``; OSError when the kernel refuses."""
        name = self.name_for(sandbox_id)
        made: list[Path] = []
        memory_dir: Path | None = None
        try:
            for parent, controllers in self.parents.items():
                d = parent / name
                d.mkdir()
                made.append(d)
                if "memory" in controllers:
                    memory_dir = d
                    self._limit_memory(d, limits.memory_bytes)
                if "pids" in controllers:
                    _write(d / "pids.max", str(limits.max_pids))
                if "cpu" in controllers:
                    quota = max(1000, round(limits.cpus * CPU_PERIOD_US))
                    if self.version == 2:
                        _write(d / "cpu.max", f"{quota} {CPU_PERIOD_US}")
                    else:
                        _write(d / "cpu.cfs_period_us", str(CPU_PERIOD_US))
                        _write(d / "cpu.cfs_quota_us", str(quota))
        except OSError:
            for d in made:
                try:
                    d.rmdir()
                except OSError:
                    pass
            raise
        return SandboxCgroup(name, made, self.version, memory_dir)

    def _limit_memory(self, d: Path, limit: int) -> None:
        if self.version == 2:
            _write(d / "memory.max", str(limit))
            if (d / "memory.swap.max").exists():
                _write(d / "memory.swap.max", "0")
            return
        _write(d / "memory.limit_in_bytes", str(limit))
        if self.swap:  # memory plus swap, written after the memory limit (it may not be below it)
            _write(d / "memory.memsw.limit_in_bytes", str(limit))

    def reap_leaked(self) -> list[str]:
        """Kill and remove the sandbox cgroups whose owner process is gone; returns their names."""
        removed: list[str] = []
        for parent in self.parents:
            try:
                names = [e.name for e in os.scandir(parent) if e.is_dir(follow_symlinks=False)]
            except OSError:
                continue
            for name in names:
                if owner_is_gone(name):
                    cgroup = SandboxCgroup(name, [parent / name], self.version, None)
                    if cgroup.remove(timeout_s=5.0) and name not in removed:
                        removed.append(name)
        if removed:
            logger.info("removed %d leaked sandbox cgroup(s) of exited owners: %s", len(removed), ", ".join(removed))
        return removed
