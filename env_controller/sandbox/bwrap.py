"""The bubblewrap backend: each sandbox is a ``bwrap`` process tree in its own namespaces.

What a sandbox sees and may do:

* namespaces: user, pid, network, ipc, uts, cgroup and mount are all new (``--unshare-all``);
  the network namespace has only its own loopback, so nothing outside can be reached (not even
  services on the host's 127.0.0.1); creating further user namespaces is disabled.
* files: ``/usr``, ``/etc`` and ``/opt`` of the host read-only (with ``/bin``, ``/lib``... as on
  the host), a fresh ``/proc`` and ``/dev``, a private ``/tmp`` (tmpfs of ``tmp_mb``) and a
  private writable home, ``/home/user`` (a directory on the host, under ``base_dir``, kept
  across shell restarts and deleted on close); everything else, the root included, is
  read-only. ``/etc/passwd`` and ``/etc/group`` are replaced by ones naming ``user`` (uid 1000).
* identity: uid/gid 1000 inside; on the host the sandbox runs as ``host_uid`` (65534,
  ``nobody``, when the worker runs as root; the worker's own uid otherwise), so host files
  keep their permissions and root-owned secrets stay unreadable.
* limits: set with ``ulimit`` inside the new user namespace, where the kernel counts
  processes per namespace: processes (``RLIMIT_NPROC``), address space per process
  (``RLIMIT_AS``), file size (``RLIMIT_FSIZE``), no core files; wall time and output size are
  enforced by :class:`~env_controller.sandbox.base.ShellSandbox`, which also counts the
  sandbox's processes (from the host's ``/proc``) to stop fork bombs early.
* lifetime: the outer ``bwrap`` runs in its own process group and is started from one
  long-lived thread with ``--die-with-parent``, so the sandbox dies with the worker process;
  killing it kills the sandbox's pid namespace, hence every process in it.

Not limited here: total disk use of the home directory (use the docker backend's tmpfs, or a
quota on ``base_dir``) and CPU time (wall time per command bounds it).
"""
from __future__ import annotations

import errno
import logging
import os
import select
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath

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

INSTALL_HINT = "install it with `apt-get install bubblewrap` (Debian/Ubuntu) or `dnf install bubblewrap`"
SANDBOX_UID = 1000
NOBODY = 65534
_SYSTEM_DIRS = ("/usr", "/etc", "/opt")
_TOP_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_PATH = "/usr/local/bin:/usr/local/sbin:/usr/bin:/usr/sbin:/bin:/sbin"

# bwrap runs with --die-with-parent, whose parent-death signal fires when the *thread* that
# forked it ends: fork every sandbox from this one thread, which lives as long as the process.
_SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="agentrl-bwrap-spawn")


def find_bwrap() -> str | None:
    """The path of the ``bwrap`` binary, or None when bubblewrap is not installed."""
    found = shutil.which("bwrap")
    if found:
        return found
    for candidate in ("/usr/bin/bwrap", "/usr/local/bin/bwrap"):
        if os.access(candidate, os.X_OK):
            return candidate
    return None


class _PipeChannel(Channel):
    """The shell's stdin and merged stdout/stderr pipes."""

    def __init__(self, proc: subprocess.Popen[bytes], send_timeout_s: float) -> None:
        assert proc.stdin is not None and proc.stdout is not None
        self._proc = proc
        self._in = proc.stdin.fileno()
        self._out = proc.stdout.fileno()
        os.set_blocking(self._in, False)
        os.set_blocking(self._out, False)
        self._send_timeout_s = send_timeout_s
        self._eof = False

    def send(self, data: bytes) -> None:
        """Write all of ``data``; OSError when the shell is gone or does not read within the timeout."""
        view = memoryview(data)
        deadline = time.monotonic() + self._send_timeout_s
        while view:
            left = deadline - time.monotonic()
            if left <= 0:
                raise OSError(errno.ETIMEDOUT, "the sandbox shell does not read its input")
            _, writable, _ = select.select([], [self._in], [], left)
            if not writable:
                continue
            try:
                n = os.write(self._in, view)
            except BlockingIOError:
                continue
            view = view[n:]

    def recv(self, timeout_s: float) -> bytes | None:
        """See :meth:`Channel.recv`."""
        if self._eof:
            return None
        chunk = read_when_ready(self._out, timeout_s, lambda: os.read(self._out, 1 << 16))
        self._eof = chunk is None
        return chunk

    def close(self) -> None:
        """Close both pipes."""
        for stream in (self._proc.stdin, self._proc.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass


def _scan_processes() -> list[tuple[int, int, bool]]:
    """``(pid, parent pid, is a zombie)`` of every process, from the host's ``/proc``."""
    out: list[tuple[int, int, bool]] = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        fields = proc_stat(name)
        if fields is not None and len(fields) >= 2:
            out.append((int(name), int(fields[1]), fields[0] == b"Z"))
    return out


_scan_lock = threading.Lock()
_scan_cache: tuple[float, list[tuple[int, int, bool]]] = (0.0, [])


def _processes(max_age_s: float) -> list[tuple[int, int, bool]]:
    """:func:`_scan_processes`, shared by all sandboxes of the process when ``max_age_s`` allows."""
    global _scan_cache
    with _scan_lock:
        taken, table = _scan_cache
        if max_age_s > 0 and time.monotonic() - taken <= max_age_s:
            return table
        table = _scan_processes()
        _scan_cache = (time.monotonic(), table)
        return table


def descendants(pid: int, zombies: bool = False, max_age_s: float = 0.0) -> list[int]:
    """Processes below ``pid`` in the host's process tree (zombies, which still count against
    ``RLIMIT_NPROC``, only when ``zombies``); ``max_age_s`` > 0 allows a recent shared scan."""
    children: dict[int, list[int]] = {}
    for p, parent, zombie in _processes(max_age_s):
        if zombies or not zombie:
            children.setdefault(parent, []).append(p)
    out: list[int] = []
    stack = list(children.get(pid, []))
    while stack:
        p = stack.pop()
        out.append(p)
        stack.extend(children.get(p, []))
    return out


def _alive(pid: int) -> bool:
    fields = proc_stat(pid)
    return fields is not None and fields[:1] != [b"Z"]


def _safe_write(root: Path, rel: PurePosixPath, data: bytes, mode: int, uid: int | None) -> None:
    """Write ``root/rel`` without following any symlink the sandbox may have planted."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        for part in rel.parts[:-1]:
            try:
                os.mkdir(part, 0o755, dir_fd=fd)
                if uid is not None:
                    os.chown(part, uid, uid, dir_fd=fd, follow_symlinks=False)
            except FileExistsError:
                pass
            nfd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = nfd
        ffd = os.open(rel.parts[-1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode, dir_fd=fd)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(ffd, view):]
            if uid is not None:
                os.fchown(ffd, uid, uid)
            os.fchmod(ffd, mode)
        finally:
            os.close(ffd)
    finally:
        os.close(fd)


class BwrapSandbox(ShellSandbox):
    """One bubblewrap sandbox (see the module docstring); made by :meth:`BwrapBackend.create`."""

    def __init__(self, backend: "BwrapBackend", sandbox_id: str, limits: SandboxLimits) -> None:
        """Create the sandbox's host directory and start its shell; SandboxError on failure."""
        super().__init__(sandbox_id, limits)
        self._backend = backend
        self._proc: subprocess.Popen[bytes] | None = None
        self.host_dir = backend.base_dir / sandbox_id
        self.host_home = self.host_dir / "home"
        self.host_dir.mkdir(mode=0o711)
        self.host_home.mkdir(mode=0o700)
        if backend.host_uid is not None:
            os.chown(self.host_home, backend.host_uid, backend.host_uid)
        self._open()

    @property
    def pid(self) -> int | None:
        """Host pid of the outer ``bwrap`` process of the current shell (None between shells)."""
        return self._proc.pid if self._proc is not None else None

    def processes(self) -> list[int]:
        """Host pids of every process of the sandbox, the outer ``bwrap`` included."""
        if self._proc is None or self._proc.poll() is not None:
            return []
        return [self._proc.pid, *descendants(self._proc.pid)]

    def _argv(self, passwd_fd: int, group_fd: int) -> list[str]:
        lim = self.limits
        argv = [
            self._backend.bwrap, "--unshare-all", "--unshare-user", "--disable-userns",
            "--die-with-parent", "--new-session", "--hostname", "sandbox",
            "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID),
        ]
        for d in _SYSTEM_DIRS:
            if os.path.isdir(d) and not os.path.islink(d):
                argv += ["--ro-bind", d, d]
        for link in _TOP_LINKS:
            if os.path.islink(link):
                argv += ["--symlink", os.readlink(link), link]
            elif os.path.isdir(link):
                argv += ["--ro-bind", link, link]
        argv += [
            "--ro-bind-data", str(passwd_fd), "/etc/passwd",
            "--ro-bind-data", str(group_fd), "/etc/group",
            "--proc", "/proc", "--dev", "/dev",
            "--size", str(lim.tmp_mb << 20), "--tmpfs", "/tmp",
            "--bind", str(self.host_home), self.workdir,
            "--remount-ro", "/",
            "--chdir", self.workdir,
        ]
        # limits set inside the new user namespace, where RLIMIT_NPROC counts this sandbox only
        prologue = (
            f"ulimit -c 0 && ulimit -u {lim.max_processes} && ulimit -v {lim.memory_mb * 1024} && "
            f"ulimit -f {lim.max_file_mb * 1024} && ulimit -n 1024 && exec /bin/bash --noprofile --norc"
        )
        return [*argv, "/bin/bash", "--noprofile", "--norc", "-c", prologue]

    def _spawn(self) -> Channel:
        """Start ``bwrap`` with a bash inside (from the long-lived spawner thread)."""
        passwd = (f"root:x:0:0:root:/root:/usr/sbin/nologin\nuser:x:{SANDBOX_UID}:{SANDBOX_UID}:user:"
                  f"{self.workdir}:/bin/bash\nnobody:x:{NOBODY}:{NOBODY}:nobody:/nonexistent:/usr/sbin/nologin\n")
        group = f"root:x:0:\nuser:x:{SANDBOX_UID}:\nnogroup:x:{NOBODY}:\n"
        fds: list[int] = []
        try:
            for content in (passwd, group):
                r, w = os.pipe()
                fds += [r, w]
                os.write(w, content.encode())
                os.close(w)
                fds.remove(w)
            argv = self._argv(fds[0], fds[1])
            env = {"PATH": _PATH, "HOME": self.workdir, "USER": "user", "LOGNAME": "user", "SHELL": "/bin/bash",
                   "LANG": "C.UTF-8", "TERM": "dumb", "TMPDIR": "/tmp"}
            uid = self._backend.host_uid
            kwargs: dict[str, object] = {}
            if uid is not None:
                kwargs = {"user": uid, "group": uid, "extra_groups": []}
            future = _SPAWNER.submit(
                subprocess.Popen, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                env=env, start_new_session=True, pass_fds=tuple(fds), close_fds=True, **kwargs,
            )
            try:
                self._proc = future.result(timeout=self.limits.start_timeout_s)
            except OSError as exc:
                raise SandboxError(f"sandbox {self.id}: cannot run {self._backend.bwrap}: {exc}") from exc
        finally:
            for fd in fds:
                os.close(fd)
        if uid is not None:  # so that /dev/stdout and /dev/stderr can be reopened inside
            for stream in (self._proc.stdin, self._proc.stdout):
                assert stream is not None
                os.fchown(stream.fileno(), uid, uid)
        logger.debug("sandbox %s: bwrap pid %d", self.id, self._proc.pid)
        return _PipeChannel(self._proc, send_timeout_s=self.limits.start_timeout_s)

    def _kill(self) -> None:
        """SIGKILL the outer bwrap's process group; its pid namespace, hence every process, dies with it."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        inside = descendants(proc.pid)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for p in inside:  # belt and braces: anything that escaped the group
            try:
                os.kill(p, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            logger.error("sandbox %s: bwrap pid %d did not die within 10 s of SIGKILL", self.id, proc.pid)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in inside) and time.monotonic() < deadline:
            time.sleep(0.02)
        left = [p for p in inside if _alive(p)]
        if left:
            logger.error("sandbox %s: processes %s survived the kill", self.id, left)

    def _count_processes(self) -> int | None:
        """Processes inside the sandbox's pid namespace (its init and shell included)."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return 0
        # sandboxes polling at once share a scan of /proc; 0.04 s is below the 0.05 s between the
        # counts of ShellSandbox._background_bomb, so consecutive counts are never the same scan
        return len(descendants(proc.pid, zombies=True, max_age_s=0.04))

    def copy_in(self, files: Mapping[str, bytes | str], mode: int = 0o644) -> None:
        """See :meth:`Sandbox.copy_in`; files under the home are written from the host directly."""
        through_shell: dict[str, bytes | str] = {}
        home = PurePosixPath(self.workdir)
        for path, content in files.items():
            target = self.resolve(path)
            if home in target.parents:
                data = content.encode() if isinstance(content, str) else bytes(content)
                try:
                    _safe_write(self.host_home, target.relative_to(home), data, mode, self._backend.host_uid)
                except OSError as exc:
                    raise SandboxError(f"sandbox {self.id}: writing {target} failed: {exc}") from exc
            else:
                through_shell[path] = content
        if through_shell:
            super().copy_in(through_shell, mode)

    def _cleanup(self) -> None:
        """Delete the sandbox's host directory."""
        shutil.rmtree(self.host_dir, ignore_errors=True)
        self._backend._forget(self.id)


class BwrapBackend(SandboxBackend):
    """Creates :class:`BwrapSandbox` es (see the module docstring).

    bwrap: path of the binary (default: found on PATH). base_dir: where sandbox homes live on the
    host (default: a new private temporary directory, deleted on :meth:`close`). host_uid: the
    host uid sandboxes run as (default: 65534 when running as root, else the current user).
    """

    name = "bwrap"

    def __init__(self, limits: SandboxLimits | None = None, bwrap: str | None = None,
                 base_dir: str | os.PathLike[str] | None = None, host_uid: int | None = None) -> None:
        """Raises :class:`SandboxUnavailableError` when bwrap is not installed."""
        super().__init__(limits)
        found = bwrap or find_bwrap()
        if not found or not os.access(found, os.X_OK):
            raise SandboxUnavailableError(
                f"bubblewrap is not installed ({bwrap or 'bwrap'} not found); {INSTALL_HINT}")
        self.bwrap = found
        if host_uid is None and os.geteuid() == 0:
            host_uid = NOBODY
        if host_uid is not None and os.geteuid() != 0 and host_uid != os.geteuid():
            raise ValueError(f"host_uid={host_uid} needs root; leave it unset to run sandboxes as yourself")
        self.host_uid = host_uid
        self._own_base = base_dir is None
        self.base_dir = Path(base_dir) if base_dir is not None else Path(tempfile.mkdtemp(prefix="agentrl-bwrap-"))
        self.base_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.base_dir, 0o711)
        self._closed = threading.Event()

    def _create(self, sandbox_id: str, limits: SandboxLimits, labels: Mapping[str, str]) -> BwrapSandbox:
        if self._closed.is_set():
            raise RuntimeError("this BwrapBackend is closed")
        if labels:
            logger.debug("sandbox %s: labels %s", sandbox_id, dict(labels))
        return BwrapSandbox(self, sandbox_id, limits)

    def close(self) -> None:
        """Close every sandbox, then delete ``base_dir`` when the backend created it."""
        self._closed.set()
        super().close()
        if self._own_base:
            shutil.rmtree(self.base_dir, ignore_errors=True)
