"""The Docker backend: each sandbox is a container, its persistent bash an attached ``exec``.

A container (from ``image``, which must hold ``bash``) runs ``sleep infinity`` under Docker's
init as root with every capability dropped and ``no-new-privileges``; all commands run as
``user`` (default ``1000:1000``) in one long-lived ``docker exec`` of ``bash`` whose stdin and
multiplexed stdout/stderr are driven by :class:`~env_controller.sandbox.base.ShellSandbox`.

Limits: ``network_mode="none"``, read-only root filesystem, private tmpfs ``/tmp`` (``tmp_mb``)
and home (``home_mb``, owned by the user), ``mem_limit`` = ``memswap_limit`` = ``memory_mb``,
``pids_limit`` = ``max_processes``, ``fsize`` and ``core`` ulimits; wall time and output size
per command as in every shell sandbox. A command that breaks a limit is stopped by running
``kill -KILL -1`` as the user in the container (every process of the user dies; init and the
root ``sleep`` survive), then a fresh shell is attached; files in the tmpfs are kept.

Every container carries the labels ``org.agentrl.sandbox=1``, ``org.agentrl.owner=<host>:<pid>:
<process start time>`` and ``org.agentrl.created=<unix time>`` (plus the caller's). At start,
the backend removes leaked containers: those labelled ``org.agentrl.sandbox=1`` whose owner
process on this host is gone, and, when ``reap_foreign_after_s`` is set, those of other
hosts older than that.
"""
from __future__ import annotations

import logging
import os
import socket
import struct
import time
from collections.abc import Mapping
from typing import Any

from env_controller.sandbox.base import (
    Channel,
    SandboxBackend,
    SandboxError,
    SandboxLimits,
    SandboxUnavailableError,
    ShellSandbox,
    proc_stat,
    read_when_ready,
)

logger = logging.getLogger(__name__)

LABEL = "org.agentrl.sandbox"
OWNER_LABEL = "org.agentrl.owner"
CREATED_LABEL = "org.agentrl.created"
#: run as the sandbox user to stop everything it started (Linux spares pid 1 and the caller)
KILL_ALL_CMD = ["bash", "-c", "kill -KILL -1"]
SHELL_CMD = ["bash", "--noprofile", "--norc"]
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def _start_time(pid: int) -> str | None:
    """The start time (clock ticks since boot) of process ``pid``, or None when it is gone."""
    fields = proc_stat(pid)
    return fields[19].decode() if fields is not None and len(fields) > 19 else None


def owner_id(pid: int | None = None) -> str:
    """``<hostname>:<pid>:<start time>`` of process ``pid`` (default: this one)."""
    pid = os.getpid() if pid is None else pid
    return f"{socket.gethostname()}:{pid}:{_start_time(pid) or 0}"


def owner_alive(owner: str) -> bool | None:
    """Whether the owner process named by an :func:`owner_id` runs; None when it is on another host."""
    try:
        host, pid, start = owner.rsplit(":", 2)
        pid_i = int(pid)
    except ValueError:
        return False
    if host != socket.gethostname():
        return None
    return _start_time(pid_i) == start


class _ExecChannel(Channel):
    """An attached ``docker exec`` socket: raw stdin out, multiplexed stdout/stderr frames in."""

    def __init__(self, sock: Any, send_timeout_s: float) -> None:
        self._holder = sock  # keeps the HTTP response (and so the connection) alive
        raw = getattr(sock, "_sock", sock)
        if not isinstance(raw, socket.socket):
            raise SandboxError(f"docker exec attach returned {type(sock).__name__}, not a socket")
        self._sock = raw
        self._sock.settimeout(send_timeout_s)
        self._raw = bytearray()
        self._eof = False

    def send(self, data: bytes) -> None:
        """Write to the exec's stdin."""
        self._sock.sendall(data)

    def _frames(self) -> bytes:
        out = bytearray()
        while len(self._raw) >= 8:
            kind, length = struct.unpack(">BxxxL", bytes(self._raw[:8]))
            if len(self._raw) < 8 + length:
                break
            if kind in (1, 2):
                out += self._raw[8:8 + length]
            del self._raw[:8 + length]
        return bytes(out)

    def recv(self, timeout_s: float) -> bytes | None:
        """See :meth:`Channel.recv`."""
        if self._eof:
            return None
        try:
            chunk = read_when_ready(self._sock, timeout_s, lambda: self._sock.recv(1 << 16))
        except OSError:  # a broken attach connection ends the stream like EOF
            chunk = None
        if chunk is None:
            self._eof = True
            return self._frames() or None
        self._raw += chunk
        return self._frames()

    def close(self) -> None:
        """Close the attach connection."""
        try:
            self._sock.close()
        except OSError:
            pass
        close = getattr(self._holder, "close", None)
        if callable(close):
            try:
                close()
            except OSError:
                pass


class DockerSandbox(ShellSandbox):
    """One container (see the module docstring); made by :meth:`DockerBackend.create`."""

    def __init__(self, backend: "DockerBackend", sandbox_id: str, limits: SandboxLimits,
                 labels: Mapping[str, str]) -> None:
        """Create and start the container, then attach its shell; SandboxError on failure."""
        super().__init__(sandbox_id, limits)
        self._backend = backend
        self.workdir = backend.workdir
        self.env = {"HOME": self.workdir, "USER": "user", "LOGNAME": "user", "SHELL": "/bin/bash",
                    "PATH": _PATH, "LANG": "C.UTF-8", "TERM": "dumb", "TMPDIR": "/tmp"}
        import docker.errors
        from docker.types import Ulimit

        self._errors = docker.errors
        all_labels = {**labels, LABEL: "1", OWNER_LABEL: owner_id(), CREATED_LABEL: str(int(time.time()))}
        file_bytes = limits.max_file_mb << 20
        try:
            self.container = backend.client.containers.run(
                backend.image,
                command=["sleep", "infinity"],
                detach=True,
                name=sandbox_id,
                labels=all_labels,
                hostname="sandbox",
                init=True,
                network_mode="none",
                read_only=True,
                tmpfs={
                    "/tmp": f"rw,nosuid,nodev,size={limits.tmp_mb}m,mode=1777",
                    self.workdir: (
                        f"rw,nosuid,nodev,size={backend.home_mb}m,uid={backend.uid},gid={backend.gid},mode=0700"
                    ),
                },
                mem_limit=f"{limits.memory_mb}m",
                memswap_limit=f"{limits.memory_mb}m",
                pids_limit=limits.max_processes,
                cap_drop=["ALL"],
                security_opt=["no-new-privileges"],
                ulimits=[Ulimit(name="fsize", soft=file_bytes, hard=file_bytes), Ulimit(name="core", soft=0, hard=0)],
                environment=self.env,
                working_dir=self.workdir,
            )
        except docker.errors.DockerException as exc:
            raise SandboxError(f"sandbox {sandbox_id}: cannot start a container from {backend.image!r}: {exc}") from exc
        logger.debug("sandbox %s: container %s", sandbox_id, self.container.id[:12])
        self._open()

    def _spawn(self) -> Channel:
        """Attach a new ``bash`` exec in the container."""
        api = self._backend.client.api
        try:
            exec_id = api.exec_create(self.container.id, SHELL_CMD, stdin=True, stdout=True, stderr=True,
                                      tty=False, user=self._backend.user, workdir=self.workdir,
                                      environment=self.env)["Id"]
            sock = api.exec_start(exec_id, socket=True)
        except self._errors.DockerException as exc:
            raise SandboxError(
                f"sandbox {self.id}: cannot start bash in container {self.container.id[:12]}: {exc}"
            ) from exc
        return _ExecChannel(sock, send_timeout_s=self.limits.start_timeout_s)

    def _kill(self) -> None:
        """``kill -KILL -1`` as the user: every process the shell started dies."""
        if self.closed:
            return  # the container is removed next, which kills everything
        api = self._backend.client.api
        try:
            exec_id = api.exec_create(self.container.id, KILL_ALL_CMD, user=self._backend.user)["Id"]
            api.exec_start(exec_id)
        except self._errors.NotFound:
            pass
        except self._errors.DockerException as exc:
            logger.warning("sandbox %s: killing the user's processes failed: %s", self.id, exc)

    def _cleanup(self) -> None:
        """Remove the container (forced, with its anonymous volumes)."""
        try:
            self.container.remove(force=True, v=True)
        except self._errors.NotFound:
            pass
        except self._errors.DockerException as exc:
            logger.error("sandbox %s: removing container %s failed: %s", self.id, self.container.id[:12], exc)
        finally:
            self._backend._forget(self.id)


class DockerBackend(SandboxBackend):
    """Creates :class:`DockerSandbox` es through the ``docker`` SDK (see the module docstring).

    image: the sandbox image (must have bash and coreutils). client: a ``docker.DockerClient``
    (default: ``docker.from_env(timeout=api_timeout_s)``, i.e. ``DOCKER_HOST`` or the local
    socket). user / workdir / home_mb: the user commands run as, its home (a tmpfs) and the
    home's size. reap: remove leaked containers at start (see the module docstring);
    reap_foreign_after_s: also those of other hosts older than this.
    """

    name = "docker"

    def __init__(self, limits: SandboxLimits | None = None, image: str = "ubuntu:22.04", client: Any = None,
                 user: str = "1000:1000", workdir: str = "/home/user", home_mb: int = 256,
                 api_timeout_s: float = 60.0, reap: bool = True, reap_foreign_after_s: float | None = None) -> None:
        """Connect to the daemon and reap leaked containers; SandboxUnavailableError when unreachable."""
        super().__init__(limits)
        try:
            import docker
        except ImportError as exc:
            raise SandboxUnavailableError("the docker backend needs the docker SDK: pip install docker") from exc
        if client is None:
            try:
                client = docker.from_env(timeout=int(api_timeout_s))
                client.ping()
            except docker.errors.DockerException as exc:
                raise SandboxUnavailableError(
                    f"cannot reach a Docker daemon (DOCKER_HOST={os.environ.get('DOCKER_HOST', 'unset')}): {exc}; "
                    "start Docker, or use the bwrap backend") from exc
        try:
            uid, gid = (int(x) for x in user.split(":"))
        except ValueError:
            raise ValueError(f"user={user!r} must be 'uid:gid' with numbers, e.g. '1000:1000'") from None
        if not workdir.startswith("/") or workdir.rstrip("/") in ("", "/tmp"):
            raise ValueError(f"workdir={workdir!r} must be an absolute path other than / and /tmp")
        self.client = client
        self.image = image
        self.user = user
        self.uid, self.gid = uid, gid
        self.workdir = workdir.rstrip("/")
        self.home_mb = int(home_mb)
        self.reap_foreign_after_s = reap_foreign_after_s
        self._docker_errors = docker.errors
        self.reaped: list[str] = self.reap() if reap else []

    def reap(self) -> list[str]:
        """Remove leaked sandbox containers (see the module docstring); returns their ids."""
        removed: list[str] = []
        try:
            containers = self.client.containers.list(all=True, filters={"label": f"{LABEL}=1"})
        except self._docker_errors.DockerException as exc:
            logger.warning("listing sandbox containers to reap failed: %s", exc)
            return removed
        now = time.time()
        for container in containers:
            labels = container.labels or {}
            alive = owner_alive(labels.get(OWNER_LABEL, ""))
            if alive is None:
                try:
                    age = now - float(labels.get(CREATED_LABEL, "nan"))
                except ValueError:
                    age = float("nan")
                if self.reap_foreign_after_s is None or not age > self.reap_foreign_after_s:
                    continue
            elif alive:
                continue
            try:
                container.remove(force=True, v=True)
                removed.append(container.id)
            except self._docker_errors.NotFound:
                pass
            except self._docker_errors.DockerException as exc:
                logger.warning("removing leaked container %s failed: %s", container.id[:12], exc)
        if removed:
            logger.info("reaped %d leaked sandbox container(s): %s", len(removed), ", ".join(c[:12] for c in removed))
        return removed

    def _create(self, sandbox_id: str, limits: SandboxLimits, labels: Mapping[str, str]) -> DockerSandbox:
        return DockerSandbox(self, sandbox_id, limits, labels)
