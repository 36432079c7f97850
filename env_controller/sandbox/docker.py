"""The Docker backend: each sandbox is a container, its persistent bash an attached ``exec``.

A container (from ``image``, which must hold ``bash`` and coreutils) runs ``sleep infinity`` under
Docker's init as root with every capability dropped and ``no-new-privileges``; all commands run as
``user`` (default ``1000:1000``, never root) in one long-lived ``docker exec`` of ``bash`` whose stdin
and multiplexed stdout/stderr are driven by :class:`~env_controller.sandbox.base.ShellSandbox`.

Limits, enforced by the engine for the container as a whole: ``network_mode="none"``, read-only root
filesystem, private tmpfs ``/tmp`` (``tmp_mb``) and home (``home_mb``, owned by the user), ``mem_limit``
= ``memswap_limit`` = ``memory_mb`` (all processes and the tmpfs pages they write), ``pids_limit`` =
``max_processes`` + 2 (init and ``sleep``), ``nano_cpus`` = ``cpus`` (at most the engine's CPUs),
``fsize`` and ``core`` ulimits; wall time and output size per command as in every shell sandbox. With a
writable root, ``disk_mb`` caps the container's own layer: an engine quota (``--storage-opt size``) where the
storage driver has one, else the layer's size read through the engine while commands run
(:meth:`DockerSandbox._over_disk`).

What the limits did is read from the container's cgroup: ``pids.current`` (fork bombs, what a command
left running) and the ``oom_kill`` count (``memory_limit``). When this process sees the engine's
cgroups (a local engine) they are files under ``/sys/fs/cgroup``; otherwise (a remote engine) an
``exec`` of bash builtins reads them inside the container (an exec is costly: one count a second while a
command runs). Docker's ``State.OOMKilled`` is no help: it tells only of the container's init.

A command that breaks a limit is stopped by an ``exec`` that kills every process of the user in the
container (init and the root ``sleep`` survive) and waits until they are gone, then a fresh shell is
attached; files in the tmpfs are kept. Unless ``background_jobs`` is set, what a command left running
is killed the same way when it returns, sparing the shell (whose pid is the first line it prints).
These ``exec`` s use bash builtins only: they need no fork, so they work in a container whose process
table is full.

Every container carries the labels ``org.agentrl.sandbox=1``, ``org.agentrl.owner=<host>:<pid>:
<process start time>`` and ``org.agentrl.created=<unix time>`` (plus the caller's). At start,
the backend removes leaked containers: those labelled ``org.agentrl.sandbox=1`` whose owner
process on this host is gone, and, when ``reap_foreign_after_s`` is set, those of other
hosts older than that. With ``reap="background"`` (what a task worker uses) that removal runs in a
thread, so that a worker restarted after a crash serves while the hundreds of containers its
predecessor left are removed (``wait_reaped``).
"""
from __future__ import annotations

import logging
import os
import secrets
import socket
import struct
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from env_controller.sandbox.base import (
    EMPTY_DIRS,
    WIPE_IPC,
    Channel,
    CommandResult,
    SandboxBackend,
    SandboxError,
    SandboxLimits,
    SandboxUnavailableError,
    ShellSandbox,
    ansi_c_quote,
    nearly_full,
    proc_stat,
    read_when_ready,
    warn_once,
)
from env_controller.sandbox.cgroups import SandboxCgroup, cgroup_mounts
from env_controller.sandbox.options import DockerOptions, parse_user

logger = logging.getLogger(__name__)

LABEL = "org.agentrl.sandbox"
OWNER_LABEL = "org.agentrl.owner"
CREATED_LABEL = "org.agentrl.created"
#: the :class:`DockerBackend` that made the container (several may share one owner process)
BACKEND_LABEL = "org.agentrl.backend"
#: processes of a container besides the user's: Docker's init and ``sleep infinity``
BASE_PROCESSES = 2
#: the shell prints its pid (which ``exec`` keeps) before it reads commands
SHELL_CMD = ["bash", "--noprofile", "--norc", "-c", "printf '%s\\n' \"$$\"; exec bash --noprofile --norc"]
#: the container's tasks, OOM kills and forks refused at its task limit, from inside (cgroup v1 or v2 paths),
#: with builtins only
PROBE_CMD = ["bash", "-c", """p=- o=- r=-
for d in /sys/fs/cgroup/pids /sys/fs/cgroup; do
  [[ -r $d/pids.current ]] || continue
  read -r p < "$d/pids.current"
  [[ -r $d/pids.events ]] && while read -r k v; do [[ $k == max ]] && r=$v; done < "$d/pids.events"
  break
done
for f in /sys/fs/cgroup/memory/memory.oom_control /sys/fs/cgroup/memory.events; do
  [[ -r $f ]] && { while read -r k v; do [[ $k == oom_kill ]] && o=$v; done < "$f"; break; }
done
echo "$p $o $r"
"""]
#: run as the user ($2): kill every process of the user but pid 1, itself and $1 (the shell, or 0), and
#: print how many were killed. ``kill -1`` is no test of what is left: it reports success while any
#: process it may not signal (root's sleep) exists, so /proc is read, until nothing is left to kill;
#: zombies count only when $3 is 1 (restarting: the next shell's count must not include them). Bash
#: builtins only, no fork. It refuses to run as anyone else (a fake daemon running it on a host).
KILL_SCRIPT = """[[ $EUID == "$2" ]] || exit 97
[[ $1 == 0 ]] && kill -KILL -1 2>/dev/null
declare -A seen
end=$((SECONDS + 5))
while ((SECONDS < end)); do
  found=0
  for d in /proc/[0-9]*; do
    p=${d#/proc/}
    [[ $p == 1 || $p == "$$" || $p == "$1" ]] && continue
    { read -r stat < "$d/stat"; } 2>/dev/null || continue
    [[ $3 == 0 && ${stat##*) } == Z* ]] && continue
    kill -KILL "$p" 2>/dev/null && found=1 seen[$p]=1
  done
  ((found)) || break
done
echo "${#seen[@]}"
"""
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: seconds between two process counts while a command runs, when a count is an ``exec``
EXEC_POLL_S = 1.0
#: how the engine's answer to an exec starts when the runtime could not start its process
EXEC_START_FAILED = "OCI runtime exec failed"
#: seconds an exec the runtime could not start is tried again
EXEC_START_RETRY_S = 10.0
#: seconds between two reads of a container's writable-layer size while a command runs (``disk_mb`` without an
#: engine quota); each is one list call to the engine
DISK_POLL_S = 2.0

_warned: set[str] = set()


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
    fields = proc_stat(pid_i)
    # a zombie (killed, its parent not yet waiting) holds /proc/<pid> but will never close its sandboxes
    if fields is None or fields[:1] == [b"Z"]:
        return False
    return _start_time(pid_i) == start


def container_cgroup(pid: int, container_id: str) -> SandboxCgroup | None:
    """A view from this process of the cgroup of the container whose init has host pid ``pid`` (``dirs``:
    its pids cgroup), or None when it is out of sight (a remote engine, another pid namespace).

    For reading only: Docker owns the cgroup, so never call its ``kill`` or ``remove``.
    """
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    paths: dict[str, str] = {}
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) == 3:
            for name in parts[1].split(",") if parts[1] else ["unified"]:
                paths[name] = parts[2]
    mounts = cgroup_mounts()
    v2 = next((m for m in mounts if m.version == 2 and "memory" in m.controllers), None)
    v1 = {c: m for m in mounts if m.version == 1 for c in m.controllers}
    dirs: dict[str, Path] = {}
    for controller in ("pids", "memory"):
        mount = v2 if v2 is not None else v1.get(controller)
        path = paths.get("unified" if v2 is not None else controller)
        if mount is None or path is None or container_id not in path:
            return None
        d = mount.path / path.lstrip("/")
        # the same pid in another namespace, or a cgroup mount rooted elsewhere, fails this check
        try:
            if str(pid) not in (d / "cgroup.procs").read_text().split():
                return None
        except OSError:
            return None
        dirs[controller] = d
    return SandboxCgroup(container_id[:12], [dirs["pids"]], 2 if v2 is not None else 1, dirs["memory"])


class _ExecChannel(Channel):
    """An attached ``docker exec`` socket: raw stdin out, multiplexed stdout/stderr frames in.

    With ``pid_line``, the first line the exec prints is its pid (:attr:`shell_pid`), not output.
    """

    def __init__(self, sock: Any, send_timeout_s: float, pid_line: bool = False) -> None:
        self._holder = sock  # keeps the HTTP response (and so the connection) alive
        raw = getattr(sock, "_sock", sock)
        if not isinstance(raw, socket.socket):
            raise SandboxError(f"docker exec attach returned {type(sock).__name__}, not a socket")
        self._sock = raw
        self._sock.settimeout(send_timeout_s)
        self._raw = bytearray()
        self._eof = False
        self._head: bytearray | None = bytearray() if pid_line else None
        #: the shell's pid inside the container, once it has printed it
        self.shell_pid: int | None = None
        #: writes so far (a count taken before a write is stale after it)
        self.sends = 0

    def send(self, data: bytes) -> None:
        """Write to the exec's stdin."""
        self.sends += 1
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
        if self._head is None:
            return bytes(out)
        self._head += out
        line, newline, rest = self._head.partition(b"\n")
        if not newline:
            return b""
        self._head = None
        self.shell_pid = int(line) if line.strip().isdigit() else None
        return bytes(rest)

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
            return self._frames() or (bytes(self._head or b"") or None)
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
        #: who the shell and the execs run as: the backend's user, another only inside :meth:`run_as`
        self._user, self._uid = backend.user, backend.uid
        self.env = {"HOME": self.workdir, "USER": "user", "LOGNAME": "user", "SHELL": "/bin/bash",
                    "PATH": _PATH, "LANG": "C.UTF-8", "TERM": "dumb", "TMPDIR": "/tmp"}
        import docker.errors
        from docker.types import Ulimit

        self._errors = docker.errors
        self._channel: _ExecChannel | None = None
        self._probed: tuple[int, float, tuple[int | None, int | None, int | None]] | None = None
        all_labels = {**labels, LABEL: "1", OWNER_LABEL: owner_id(), CREATED_LABEL: str(int(time.time())),
                      BACKEND_LABEL: backend.instance}
        file_bytes = limits.max_file_mb << 20
        tmpfs = {"/tmp": f"rw,exec,nosuid,nodev,size={limits.tmp_mb}m,mode=1777"}
        if not backend.writable_root or backend.scratch_workdir:
            # the home is a tmpfs of its own; with a writable root the image's workdir (its files) is used as is
            # unless it is declared scratch, and is readable by others (a verifier runs as another user)
            tmpfs[self.workdir] = (f"rw,exec,nosuid,nodev,size={backend.home_mb}m,uid={backend.uid},"
                                   f"gid={backend.gid},mode={self._workdir_mode:04o}")
        #: the container layer's changes right after the start (a writable root): a reuse must find the same
        self._baseline_diff: set[tuple[str, int]] | None = None
        #: when the writable layer's size was last read (``disk_mb`` without a quota; monotonic seconds)
        self._disk_checked = 0.0

        def start(storage_opt: dict[str, str] | None) -> Any:
            try:
                return backend.client.containers.run(
                    backend.image,
                    command=["sleep", "infinity"],
                    detach=True,
                    name=sandbox_id,
                    labels=all_labels,
                    hostname="sandbox",
                    init=True,
                    network_mode="none",
                    read_only=not backend.writable_root,
                    # Docker mounts a tmpfs noexec unless told: scripts the agent writes there must run
                    tmpfs=tmpfs,
                    mem_limit=f"{limits.memory_mb}m",
                    memswap_limit=f"{limits.memory_mb}m",
                    pids_limit=limits.max_processes + BASE_PROCESSES,
                    nano_cpus=backend.nano_cpus(limits.cpus),
                    cap_drop=["ALL"],
                    security_opt=["no-new-privileges"],
                    ulimits=[Ulimit(name="fsize", soft=file_bytes, hard=file_bytes),
                             Ulimit(name="core", soft=0, hard=0)],
                    environment=self.env,
                    working_dir=self.workdir,
                    storage_opt=storage_opt,
                )
            except docker.errors.DockerException:
                try:  # created, then refused at start (a limit the engine rejects): not left behind
                    backend.client.containers.get(sandbox_id).remove(force=True, v=True)
                except (docker.errors.DockerException, OSError):
                    pass
                raise

        quota = backend.disk_mb is not None and backend.writable_root and backend.quota is not False
        try:
            try:
                self.container = start({"size": f"{backend.disk_mb}M"} if quota else None)
            except docker.errors.APIError as exc:
                if not (quota and "storage-opt" in str(exc)):
                    raise
                # this engine's storage driver has no quota (overlay2 not on xfs with pquota): checked here instead
                backend.no_quota(str(exc))
                self.container = start(None)
        except docker.errors.DockerException as exc:
            raise SandboxError(f"sandbox {sandbox_id}: cannot start a container from {backend.image!r}: {exc}") from exc
        if quota and backend.quota is None:
            backend.quota = True
        logger.debug("sandbox %s: container %s", sandbox_id, self.container.id[:12])
        try:
            self.container.reload()  # run() inspected it before it started: no pid yet
        except (docker.errors.DockerException, OSError) as exc:
            self._cleanup()
            raise SandboxError(f"sandbox {sandbox_id}: the container {self.container.id[:12]} did not start: "
                               f"{exc}") from exc
        pid = (self.container.attrs.get("State") or {}).get("Pid") or 0
        #: the container's cgroup seen from this process (read only), None for a remote engine
        self.cgroup = container_cgroup(pid, self.container.id) if pid > 0 else None
        if self.cgroup is None:
            self.process_poll_s = EXEC_POLL_S
        backend._counted_by("host" if self.cgroup is not None else "exec")
        self._open()
        if backend.writable_root:
            try:
                self._baseline_diff = self._diff()
            except SandboxError:
                self._cleanup()
                raise

    # -- a writable root: files put in as root, changes to the image's filesystem --------------------

    def _diff(self) -> set[tuple[str, int]]:
        """The container layer's changes (``docker diff``: path, kind), mounts excluded."""
        try:
            return {(c["Path"], c["Kind"]) for c in self.container.diff() or []}
        except (self._errors.DockerException, OSError) as exc:
            raise SandboxError(f"sandbox {self.id}: docker diff of {self.container.id[:12]} failed: {exc}") from exc

    def put_files(self, directory: str, files: Mapping[str, bytes | str], mode: int = 0o755,
                  owner: tuple[int, int] | None = None, dir_mode: int = 0o755) -> None:
        """Write ``files`` (paths relative to ``directory``, an absolute path) into the container through the
        engine (as root: the image's permissions do not apply), owned by ``owner`` (default: the sandbox's
        user) with ``mode``; ``directory`` and the directories the paths name are made (or changed) with
        ``dir_mode`` and the same owner: use it for directories of your own. Its missing parents are made root's
        (mode 0755) and existing ones are left as they are. Needs a writable
        root filesystem (or a ``directory`` on a tmpfs). SandboxError when the engine refuses."""
        import io
        import tarfile

        uid, gid = owner if owner is not None else (self._backend.uid, self._backend.gid)
        buf = io.BytesIO()
        made: set[str] = set()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            parts = [p for p in directory.strip("/").split("/") if p]
            paths = sorted(files)
            dirs = ["/".join(parts)]
            for rel in paths:
                pieces = [p for p in rel.split("/") if p not in ("", ".")]
                if not pieces or ".." in pieces:
                    raise ValueError(f"put_files: {rel!r} is not a relative path inside {directory}")
                dirs += ["/".join([*parts, *pieces[:i]]) for i in range(1, len(pieces))]
            for d in dirs:
                if d in made:
                    continue
                made.add(d)
                info = tarfile.TarInfo(d)
                info.type, info.mode, info.uid, info.gid = tarfile.DIRTYPE, dir_mode, uid, gid
                tar.addfile(info)
            for rel in paths:
                data = files[rel].encode() if isinstance(files[rel], str) else bytes(files[rel])
                info = tarfile.TarInfo("/".join([*parts, *(p for p in rel.split("/") if p not in ("", "."))]))
                info.size, info.mode, info.uid, info.gid = len(data), mode, uid, gid
                tar.addfile(info, io.BytesIO(data))
        try:
            ok = self.container.put_archive("/", buf.getvalue())
        except (self._errors.DockerException, OSError) as exc:
            raise SandboxError(f"sandbox {self.id}: copying {len(files)} file(s) into {directory} failed: "
                               f"{exc}") from exc
        if not ok:
            raise SandboxError(f"sandbox {self.id}: the engine refused the files for {directory}")

    @property
    def _workdir_mode(self) -> int:
        """The mode of a tmpfs workdir: readable by others with a writable root (terminal tasks), else 0700."""
        return 0o755 if self._backend.writable_root else 0o700

    def _exec_as(self, user: str, argv: list[str], what: str) -> None:
        """Run ``argv`` as ``user`` (``uid:gid``, ``0`` for root) in the container and wait for it; SandboxError
        naming ``what`` when the engine fails or it exits non-zero."""
        api = self._backend.client.api
        try:
            exec_id = api.exec_create(self.container.id, argv, user=user)["Id"]
            out = api.exec_start(exec_id).decode(errors="replace")
            code = api.exec_inspect(exec_id).get("ExitCode")
        except (self._errors.DockerException, OSError) as exc:
            raise SandboxError(f"sandbox {self.id}: {what} failed: {exc}") from exc
        if code != 0:
            raise SandboxError(f"sandbox {self.id}: {what} failed: {out.strip()[-300:]}")

    def remove_as_root(self, paths: list[str]) -> None:
        """``rm -rf`` ``paths`` as root in the container (no capabilities: the permissions of their directories
        apply); SandboxError when something is left."""
        script = 'rm -rf -- "$@"; for p in "$@"; do [ -e "$p" ] && { echo "left $p"; exit 1; }; done; exit 0'
        self._exec_as("0", ["bash", "-c", script, "rm", *paths], f"removing {paths}")

    def empty_as(self, user: str, dirs: list[str]) -> None:
        """Empty ``dirs`` (those that exist) as ``user`` (``uid:gid``), who can open what it made unreadable;
        SandboxError when something is left. For what another user left where root, without capabilities,
        cannot remove it."""
        words = " ".join(ansi_c_quote(d.encode()) for d in dirs)
        script = EMPTY_DIRS.replace("DIRS", words) + '[[ $left == none ]] || { echo "left $left"; exit 1; }\n'
        self._exec_as(user, ["bash", "-c", script], f"emptying {dirs} as {user}")

    def read_file(self, path: str, max_bytes: int) -> bytes | None:
        """The bytes of the regular file at ``path`` (absolute), read through the engine (as root: the file's
        mode does not apply, and nothing runs in the container); None when there is none. SandboxError when it is
        not a regular file, is larger than ``max_bytes``, or the engine fails."""
        import io
        import tarfile

        try:
            stream, stat = self.container.get_archive(path, chunk_size=65536)
        except self._errors.NotFound:
            return None
        except (self._errors.DockerException, OSError) as exc:
            raise SandboxError(f"sandbox {self.id}: reading {path} failed: {exc}") from exc
        # Go's FileMode: the bits above the permissions mark a directory, link, device, pipe, socket...
        if stat.get("linkTarget") or int(stat.get("mode", 0)) & ~0o7777 & 0xFFFFFFFF:
            raise SandboxError(f"sandbox {self.id}: {path} is not a regular file")
        if int(stat.get("size", 0)) > max_bytes:
            raise SandboxError(f"sandbox {self.id}: {path} has {stat.get('size')} bytes, more than {max_bytes}")
        data = bytearray()
        for chunk in stream:  # the tar of one file: its size plus headers and padding
            data += chunk
            if len(data) > max_bytes + 65536:
                raise SandboxError(f"sandbox {self.id}: {path} grew past {max_bytes} bytes while it was read")
        with tarfile.open(fileobj=io.BytesIO(bytes(data))) as tar:
            member = tar.next()
            if member is None or not member.isfile():
                raise SandboxError(f"sandbox {self.id}: {path} is not a regular file")
            handle = tar.extractfile(member)
            return handle.read(max_bytes) if handle is not None else b""

    def wipe(self) -> None:
        """See :meth:`Sandbox.wipe`. With a writable root the image's workdir is not emptied (its files are the
        task's) unless it is a scratch tmpfs (``scratch_workdir``): every process is killed, ``/tmp``,
        ``/dev/shm`` and ``/dev/mqueue`` are emptied, and the container layer must hold exactly the changes it
        had after its start (``docker diff``), else SandboxError: a session that changed the image's files
        leaves a container that cannot be reused."""
        if not self._backend.writable_root:
            super().wipe()
            return
        self.reset()
        scratch = (self.workdir, "/tmp") if self._backend.scratch_workdir else ("/tmp",)
        dirs = " ".join(ansi_c_quote(d.encode()) for d in (*scratch, *self.scratch_dirs))
        # a scratch workdir gets its mode back: one the agent closed would hide the next episode's work from its
        # verifier
        mode = (f"chmod {self._workdir_mode:04o} -- {ansi_c_quote(self.workdir.encode())}\n"
                if self._backend.scratch_workdir else "")
        script = EMPTY_DIRS.replace("DIRS", dirs) + mode + WIPE_IPC
        result = self.run(f"( {script} )", timeout_s=max(30.0, self.limits.timeout_s))
        if not (result.ok and result.output.endswith("wiped none 0\n")):
            raise SandboxError(f"sandbox {self.id}: the wipe left something behind: "
                               f"{result.error or result.output.strip()[-300:]!r}")
        changed = self._diff() ^ (self._baseline_diff or set())
        if changed:
            sample = ", ".join(f"{path}" for path, _ in sorted(changed)[:3])
            raise SandboxError(f"sandbox {self.id}: the session changed {len(changed)} path(s) of the image's "
                               f"filesystem ({sample}...); not reusable")
        count = self._count_processes()
        if count is not None and count > self._idle_processes:
            raise SandboxError(f"sandbox {self.id}: {count - self._idle_processes} process(es) outlived the wipe")

    # -- running things in the container --------------------------------------------------------

    def run_as(self, user: str, script: str, env: Mapping[str, str], workdir: str, timeout_s: float) -> CommandResult:
        """Run ``script`` as another user (``uid:gid``: neither root nor the sandbox's user) in a fresh shell that
        starts in ``workdir`` with ``env`` over the container's environment, under the sandbox's limits and
        ``timeout_s``. Every process of the sandbox's user is killed before it starts, and every process of
        ``user`` when it ends, so neither sees the other's; the next :meth:`run` starts a fresh shell of the
        sandbox's user. SandboxError when the shell cannot start."""
        uid, _ = parse_user(user)
        if uid == self._backend.uid:
            raise ValueError(f"run_as: {user!r} is the sandbox's own user; give another uid")
        quoted = self._quote(script)
        with self._run_lock:
            if self.closed:
                raise RuntimeError(f"sandbox {self.id} is closed")
            self._stop_shell()
            own = (self._user, self._uid, self.env, self.workdir)
            self._user, self._uid, self.env, self.workdir = user, uid, dict(env), workdir
            try:
                self._start_shell()
                return self._run_locked(quoted, float(timeout_s))
            finally:
                try:
                    self._stop_shell()
                finally:
                    self._user, self._uid, self.env, self.workdir = own

    def _spawn(self) -> Channel:
        """Attach a new ``bash`` exec in the container."""
        api = self._backend.client.api
        try:
            exec_id = api.exec_create(self.container.id, SHELL_CMD, stdin=True, stdout=True, stderr=True,
                                      tty=False, user=self._user, workdir=self.workdir,
                                      environment=self.env)["Id"]
            sock = api.exec_start(exec_id, socket=True)
        except (self._errors.DockerException, OSError) as exc:
            raise SandboxError(
                f"sandbox {self.id}: cannot start bash in container {self.container.id[:12]}: {exc}"
            ) from exc
        self._channel = _ExecChannel(sock, send_timeout_s=self.limits.start_timeout_s, pid_line=True)
        self._probed = None
        return self._channel

    def _exec(self, cmd: list[str], what: str) -> str | None:
        """Run ``cmd`` as the user in the container and wait for it: its output, None when it could not run.

        While a fork bomb holds the container at its process limit the runtime may fail to start the
        exec (its init cannot make a thread); the engine then answers with the runtime's error as the
        output. That is tried again for up to :data:`EXEC_START_RETRY_S` seconds: the kill that ends
        the bomb is such an exec."""
        api = self._backend.client.api
        deadline = time.monotonic() + EXEC_START_RETRY_S
        pause = 0.05
        while True:
            try:
                exec_id = api.exec_create(self.container.id, cmd, user=self._user)["Id"]
                out = api.exec_start(exec_id).decode(errors="replace")
            except self._errors.NotFound:
                return None
            except (self._errors.DockerException, OSError) as exc:
                logger.warning("sandbox %s: %s failed: %s", self.id, what, exc)
                return None
            if not out.startswith(EXEC_START_FAILED):
                return out
            if time.monotonic() + pause > deadline:
                logger.warning("sandbox %s: %s failed for %g s: %s", self.id, what, EXEC_START_RETRY_S,
                               out.strip()[-300:])
                return None
            time.sleep(pause)
            pause = min(2 * pause, 0.5)

    def _kill_cmd(self, spare: int) -> list[str]:
        """The exec that kills every process of the user but ``spare`` (0: none); see :data:`KILL_SCRIPT`."""
        return ["bash", "-c", KILL_SCRIPT, "kill", str(spare), str(self._uid), "0" if spare else "1"]

    def _kill(self) -> None:
        """Kill every process of the user, the shell included, and wait until they are gone."""
        if self.closed:
            return  # the container is removed next, which kills everything
        if self._channel is not None:
            # the engine reports no exec's end while the shell's output waits unread on this connection:
            # closed first, the kill's own exec returns (the kill by uid finds everything regardless)
            self._channel.close()
        self._exec(self._kill_cmd(0), "killing the user's processes")
        self._probed = None

    # -- counts ---------------------------------------------------------------------------------

    def _probed_counts(self) -> tuple[int | None, int | None, int | None]:
        """``(tasks of the container but init and sleep, OOM kills so far, forks refused at its task limit so
        far)`` read from inside by an exec, each None when unknown (a container whose cgroup this process cannot
        see)."""
        # an exec is costly: the counts before a command (or after it) are taken together
        sends = self._channel.sends if self._channel is not None else -1
        probed = self._probed
        if probed is not None and probed[0] == sends and time.monotonic() - probed[1] < 0.05:
            return probed[2]
        values = [int(v) if v.isdigit() else None for v in (self._exec(PROBE_CMD, "counting processes") or "").split()]
        if len(values) != 3:
            values = [None, None, None]
        tasks = values[0] - BASE_PROCESSES - 1 if values[0] is not None else None  # less the probe's own bash
        counts = (tasks, values[1], values[2])
        self._probed = (sends, time.monotonic(), counts)
        return counts

    def _count_processes(self) -> int | None:
        """Tasks in the container besides init and ``sleep`` (the shell included)."""
        if self.cgroup is None:
            return self._probed_counts()[0]
        try:
            return int((self.cgroup.dirs[0] / "pids.current").read_text()) - BASE_PROCESSES
        except (OSError, ValueError):
            return None

    def _oom_kills(self) -> int | None:
        """Processes the kernel killed for reaching the container's memory limit."""
        return self.cgroup.oom_kills() if self.cgroup is not None else self._probed_counts()[1]

    def _process_limit_hits(self) -> int | None:
        """Forks the container's pids cgroup refused at its limit (``pids.events``)."""
        return self.cgroup.process_limit_hits() if self.cgroup is not None else self._probed_counts()[2]

    def _end_stragglers(self) -> int:
        """Kill every process of the user but the shell; how many there were."""
        tasks = self._count_processes()
        if tasks is not None and tasks <= 1:
            return 0  # the shell alone
        shell = self._channel.shell_pid if self._channel is not None else None
        if shell is None:
            logger.warning("sandbox %s: the shell's pid is unknown; background processes are left running", self.id)
            return 0
        out = (self._exec(self._kill_cmd(shell), "stopping background processes") or "").split()
        self._probed = None
        return int(out[-1]) if out and out[-1].isdigit() else 0

    def _over_disk(self, now: bool) -> str | None:
        """See :meth:`ShellSandbox._over_disk`: the writable layer's size (``SizeRw``, from the engine's container
        list) against ``disk_mb`` where the engine has no quota; read at most every :data:`DISK_POLL_S` unless
        ``now``."""
        cap = self._backend.disk_mb
        if cap is None or self._backend.quota is not False:
            return None
        if not now and time.monotonic() - self._disk_checked < DISK_POLL_S:
            return None
        try:
            rows = self._backend.client.api.containers(all=True, filters={"id": self.container.id}, size=True)
            size = int(rows[0].get("SizeRw") or 0) if rows else 0
        except (self._errors.DockerException, OSError, ValueError) as exc:
            logger.warning("sandbox %s: reading the size of its files failed: %s", self.id, exc)
            size = 0
        message = None
        if size > cap << 20:
            message = (f"the container's own files (outside /tmp) hold {size / 2**20:.0f} MB, more than its "
                       f"limit of {cap} MB; delete files to make room")
        self._disk_checked = time.monotonic()
        return message

    def _full_filesystems(self) -> list[tuple[str, int]]:
        """The capped ``/tmp`` and home that are (nearly) full, from ``stat -f`` in the container."""
        caps = [("/tmp", self.limits.tmp_mb)]
        if not self._backend.writable_root:
            caps.append((self.workdir, self._backend.home_mb))
        out = self._exec(["stat", "-f", "-c", "%a %S %d %c", "--", *(d for d, _ in caps)], "checking free space")
        rows = [line.split() for line in (out or "").splitlines()]
        rows = [row for row in rows if len(row) == 4 and all(x.isdigit() for x in row)]
        if len(rows) != len(caps):
            return []
        return [(where, mb) for (where, mb), (avail, block, inodes, total) in zip(caps, rows)
                if nearly_full(int(avail) * int(block), mb, int(inodes) if int(total) else None)]

    def _cleanup(self) -> None:
        """Remove the container (forced, with its anonymous volumes), trying again while the engine fails."""
        try:
            for wait_s in (1.0, 3.0, None):
                try:
                    self.container.remove(force=True, v=True)
                    return
                except self._errors.NotFound:
                    return
                except self._errors.APIError as exc:
                    if exc.status_code == 409:  # a removal already under way (a reap) finishes it
                        return
                    error: Exception = exc
                except (self._errors.DockerException, OSError) as exc:
                    error = exc
                if wait_s is None:
                    # left to the backend's sweep of orphans (and, after this process, to any backend's reap)
                    logger.error("sandbox %s: removing container %s failed: %s", self.id, self.container.id[:12],
                                 error)
                    return
                # an engine under heavy load may not see the container's end in time ("did not receive an
                # exit event"); a later try succeeds
                time.sleep(wait_s)
        finally:
            self._backend._forget(self.id)


class DockerBackend(SandboxBackend):
    """Creates :class:`DockerSandbox` es through the ``docker`` SDK (see the module docstring).

    limits: every sandbox's (:class:`SandboxLimits`). options: the image, the engine, the user and the container
    layout (:class:`~env_controller.sandbox.options.DockerOptions`). client: a ``docker.DockerClient`` to use
    (else one on ``options.docker_host``, else ``docker.from_env``: ``DOCKER_HOST`` or the local socket).
    """

    name = "docker"

    def __init__(self, limits: SandboxLimits | None = None, options: DockerOptions | None = None, *,
                 client: Any = None) -> None:
        """Connect to the daemon and reap leaked containers (``options.reap``: True before returning,
        "background" in a thread, False not at all); SandboxUnavailableError when unreachable."""
        super().__init__(limits)
        options = options if options is not None else DockerOptions()
        self.options = options
        uid, gid = parse_user(options.user)
        base_url, api_timeout_s, reap = options.docker_host, options.api_timeout_s, options.reap
        try:
            import docker
        except ImportError as exc:
            raise SandboxUnavailableError("the docker backend needs the docker SDK: pip install docker") from exc
        self._own_client = client is None
        if client is None:
            where = base_url or f"DOCKER_HOST={os.environ.get('DOCKER_HOST', 'unset')}"
            try:
                if base_url:
                    client = docker.DockerClient(base_url=base_url, timeout=int(api_timeout_s))
                else:
                    client = docker.from_env(timeout=int(api_timeout_s))
                client.ping()
            except docker.errors.DockerException as exc:
                raise SandboxUnavailableError(
                    f"cannot reach a Docker daemon ({where}): {exc}; start Docker (or a private engine, "
                    "env_controller.sandbox.dockerd.DockerEngine), or use the bwrap backend") from exc
        self.client = client
        self.image = options.image
        self.user = options.user
        self.uid, self.gid = uid, gid
        self.workdir = options.workdir.rstrip("/")
        self.home_mb = options.home_mb
        #: the root filesystem is the container's writable layer and ``workdir`` the image's own directory
        #: (terminal tasks: the agent changes the image's files); off, a read-only root and a tmpfs home
        self.writable_root = options.writable_root
        self.scratch_workdir = options.scratch_workdir
        #: the cap on a container's own writable layer, in MB (None: none)
        self.disk_mb = options.disk_mb
        #: whether the engine enforces ``disk_mb`` (``--storage-opt size``): None until the first container
        #: tells; False: the sandboxes check the layer's size themselves (:meth:`DockerSandbox._over_disk`)
        self.quota: bool | None = None
        self.reap_foreign_after_s = options.reap_foreign_after_s
        #: this backend's id, in the label :data:`BACKEND_LABEL` of its containers
        self.instance = secrets.token_hex(6)
        self._docker_errors = docker.errors
        self._warnings: list[str] = []
        self._warnings_lock = threading.Lock()
        #: how sandboxes count processes and OOM kills: "host" (cgroup files), "exec" (inside), None (none yet)
        self.counting: str | None = None
        try:
            self.info: dict[str, Any] = client.info()
        except (docker.errors.DockerException, OSError) as exc:
            self.info = {}
            self._warn(f"the engine's info cannot be read ({exc}): whether it enforces the memory, process and "
                       "CPU limits is unknown")
        self._check_engine()
        #: the containers the start-up reap removed (complete once :meth:`wait_reaped` returns)
        self.reaped: list[str] = []
        self._reap_done = threading.Event()
        if reap == "background":
            threading.Thread(target=self._reap_at_start, name="agentrl-docker-reap", daemon=True).start()
        else:
            if reap:
                self.reaped = self.reap()
            self._reap_done.set()

    def no_quota(self, why: str) -> None:
        """Record that the engine has no disk quota for containers (``why``: its refusal), once."""
        if self.quota is not False:
            self.quota = False
            self._warn(f"the engine's storage driver has no per-container quota ({why.strip()[-160:]}): "
                       f"disk_mb={self.disk_mb} is checked by reading each container's layer size, every "
                       f"{DISK_POLL_S:g} s while a command runs and after it, so a fast writer can overshoot it "
                       "by what it writes in that time")

    def _reap_at_start(self) -> None:
        try:
            self.reaped.extend(self.reap())
        finally:
            self._reap_done.set()

    def wait_reaped(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the start-up reap; whether it has finished."""
        return self._reap_done.wait(timeout_s)

    def _warn(self, warning: str) -> None:
        """Keep ``warning`` for :meth:`health` and log it once per process."""
        with self._warnings_lock:
            if warning in self._warnings:
                return
            self._warnings.append(warning)
        warn_once(logger, f"docker sandboxes: {warning}", _warned)

    def _check_engine(self) -> None:
        """Warn about every limit the engine says it cannot enforce."""
        info = self.info
        if not info:
            return
        if info.get("MemoryLimit") is False:
            self._warn("the engine cannot limit memory (no memory cgroup): memory_mb is not enforced")
        elif info.get("SwapLimit") is False:
            self._warn("the engine has no swap accounting: memory_mb caps memory, but a sandbox may swap beyond it")
        if info.get("PidsLimit") is False:
            self._warn("the engine cannot limit processes (no pids cgroup): max_processes is not enforced "
                       "by the kernel; fork bombs are stopped when counted")
        if info.get("CpuCfsQuota") is False:
            self._warn("the engine has no CPU quota (CFS): cpus is not enforced")

    def nano_cpus(self, cpus: float) -> int:
        """``cpus`` in the engine's unit (1e-9 CPUs), at most the engine's CPUs (it refuses more)."""
        ncpu = self.info.get("NCPU")
        if isinstance(ncpu, int) and ncpu > 0 and cpus > ncpu:
            self._warn(f"cpus={cpus:g} is more than the engine's {ncpu} CPUs; sandboxes get {ncpu}")
            cpus = float(ncpu)
        return round(cpus * 1e9)

    def _counted_by(self, how: str) -> None:
        """Note how a new sandbox counts (see :attr:`counting`); a fallback is worth a warning."""
        self.counting = how
        if how == "exec":
            self._warn("the containers' cgroups are not visible from this process (a remote engine?): process "
                       "and memory-kill counts take an exec in the container each (slower), and fork bombs "
                       f"are looked for every {EXEC_POLL_S:g} s")

    def health(self) -> dict[str, Any]:
        """See :meth:`SandboxBackend.health`; adds ``engine`` (the daemon's version, cgroup version and
        driver) and ``counting`` (see :attr:`counting`)."""
        info = self.info
        engine = (f"Docker {info.get('ServerVersion', '?')}, cgroup v{info.get('CgroupVersion', '?')} "
                  f"({info.get('CgroupDriver', '?')})") if info else None
        with self._warnings_lock:
            warnings = list(self._warnings)
        return {**super().health(), "engine": engine, "counting": self.counting, "warnings": warnings}

    def reap(self) -> list[str]:
        """Remove leaked sandbox containers (see the module docstring); returns their ids."""
        return self._reap_dead_owners()

    def sweep(self, min_age_s: float = 0.0) -> list[str]:
        """Remove the containers of this backend that no open sandbox holds (a removal the engine failed, a
        creation it finished after the call timed out), created at least ``min_age_s`` ago (younger ones may
        still be starting); returns their ids."""
        try:
            found = self.client.api.containers(all=True, filters={"label": [f"{LABEL}=1",
                                                                             f"{BACKEND_LABEL}={self.instance}"]})
        except (self._docker_errors.DockerException, OSError) as exc:
            logger.warning("listing this backend's containers failed: %s", exc)
            return []
        live = {box.id for box in self.live()}
        now = time.time()
        orphans = []
        for container in found:
            labels = container.get("Labels") or {}
            names = {n.lstrip("/") for n in container.get("Names") or []}
            try:
                age = now - float(labels.get(CREATED_LABEL, "nan"))
            except ValueError:
                age = float("nan")
            if not names & live and (min_age_s <= 0 or age >= min_age_s):
                orphans.append(container["Id"])
        removed = self._remove_all(orphans)
        if removed:
            logger.warning("removed %d container(s) of this process that no sandbox held (a removal that had "
                           "failed?): %s", len(removed), ", ".join(c[:12] for c in removed))
        return removed

    def _reap_dead_owners(self) -> list[str]:
        try:
            # one list call with the labels: inspecting each container would fail on any that another
            # worker removes meanwhile
            containers = self.client.api.containers(all=True, filters={"label": f"{LABEL}=1"})
        except (self._docker_errors.DockerException, OSError) as exc:
            logger.warning("listing sandbox containers to reap failed: %s", exc)
            return []
        now = time.time()
        leaked: list[str] = []
        for container in containers:
            labels = container.get("Labels") or {}
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
            leaked.append(container["Id"])
        removed = self._remove_all(leaked)
        if removed:
            logger.info("reaped %d leaked sandbox container(s): %s", len(removed), ", ".join(c[:12] for c in removed))
        return removed

    def _remove_all(self, ids: list[str]) -> list[str]:
        """Remove the containers ``ids`` (a few at once); those removed by this call."""

        def remove(container_id: str) -> str | None:
            try:
                self.client.api.remove_container(container_id, force=True, v=True)
                return container_id
            except self._docker_errors.NotFound:
                return None
            except self._docker_errors.APIError as exc:
                if exc.status_code == 409:  # another worker's reap is removing it now
                    return None
                logger.warning("removing leaked container %s failed: %s", container_id[:12], exc)
                return None
            except (self._docker_errors.DockerException, OSError) as exc:
                logger.warning("removing leaked container %s failed: %s", container_id[:12], exc)
                return None

        if not ids:
            return []
        # a killed worker may leave hundreds: a few removals at once keep the engine busy without a queue
        with ThreadPoolExecutor(4, thread_name_prefix="agentrl-reap") as pool:
            return [c for c in pool.map(remove, ids) if c is not None]

    def _create(self, sandbox_id: str, limits: SandboxLimits, labels: Mapping[str, str]) -> DockerSandbox:
        return DockerSandbox(self, sandbox_id, limits, labels)

    def close(self) -> None:
        """Close every sandbox, remove any container of this backend left behind, then close the client
        when the backend made it."""
        super().close()
        if not self._reap_done.wait(30):  # bounded: the client it uses is about to close
            logger.warning("the start-up reap of leaked containers is still running; closing anyway")
        self.sweep()
        if self._own_client:
            try:
                self.client.close()
            except Exception:  # noqa: BLE001 - closing a connection pool is best effort
                logger.debug("closing the docker client failed", exc_info=True)

