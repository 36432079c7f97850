"""The bubblewrap backend: each sandbox is a ``bwrap`` process tree in its own namespaces.

What a sandbox sees and may do:

* namespaces: user, pid, network, ipc, uts, cgroup and mount are all new (``--unshare-all``);
  the network namespace has only its own loopback, so nothing outside can be reached (not even
  services on the host's 127.0.0.1); creating further user namespaces is disabled.
* files: ``/usr``, ``/etc`` and ``/opt`` of the host read-only (with ``/bin``, ``/lib``... as on
  the host), a fresh ``/proc`` and a read-only ``/dev``, a private ``/tmp`` and ``/dev/shm``
  (tmpfs of ``tmp_mb`` each, through bwrap's ``--size``) and a private writable home,
  ``/home/user``: a directory on the host, under ``base_dir``, kept across shell restarts and
  deleted on close, itself a tmpfs of ``home_mb`` mounted on the host when the worker may mount
  (root); everything else, the root included, is read-only. ``/etc/passwd`` and ``/etc/group``
  are replaced by ones naming ``user`` (uid 1000).
* identity: uid/gid 1000 inside; on the host the sandbox runs as ``host_uid`` (65534,
  ``nobody``, when the worker runs as root; the worker's own uid otherwise), so host files
  keep their permissions and root-owned secrets stay unreadable.
* limits for the whole sandbox: a cgroup per sandbox (:mod:`~env_controller.sandbox.cgroups`)
  caps the memory of all its processes together, swap off, the tmpfs pages they write included
  (``memory_mb``), its tasks (``max_processes``) and its CPU time (``cpus``). bwrap starts
  blocked (``--block-fd``) until the host has moved it into the cgroup, so every process of the
  sandbox, each command and each background job, starts inside it. Per process, set with
  ``ulimit`` inside the new user namespace (where the kernel counts processes per namespace):
  processes (``RLIMIT_NPROC``), address space (``RLIMIT_AS``), file size (``RLIMIT_FSIZE``), no
  core files. Wall time and output size are enforced by
  :class:`~env_controller.sandbox.base.ShellSandbox`, which also counts the sandbox's processes (from
  its pid namespace's own ``/proc``, seen from the host) to stop fork bombs early, and, unless
  ``background_jobs`` is set, kills whatever a command left running when it returns (the cgroup's
  processes, or the bwrap process tree without a cgroup; each signalled through a pidfd once seen in
  the sandbox's pid namespace, so a pid reused by a host process is never hit; until the namespace's
  own ``/proc`` lists nothing but the idle shell).
* lifetime: the outer ``bwrap`` runs in its own process group and is started from one
  long-lived thread with ``--die-with-parent``, so the sandbox dies with the worker process;
  killing it kills the sandbox's pid namespace, hence every process in it. Cgroups and home
  mounts are named after their owner process (``agentrl-sandbox-<pid namespace>-<pid>-<start
  time>-...``); a backend removes those of exited owners when it starts.

Without root (or a delegated cgroup tree, or with ``/sys/fs/cgroup`` read-only) no cgroup can be
made: the backend says so once in the log and in :meth:`BwrapBackend.health`, and the per-process
limits still hold, but not the sandbox's total memory nor its CPU quota. Without the right to
mount, the home directory is a plain directory on the host, not capped.
"""
from __future__ import annotations

import ctypes
import errno
import logging
import os
import select
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import Any

from env_controller.sandbox.base import (
    Channel,
    PidFds,
    SandboxBackend,
    SandboxError,
    SandboxLimits,
    SandboxUnavailableError,
    ShellSandbox,
    kill_owned,
    nearly_full,
    proc_stat,
    read_when_ready,
    warn_once,
)
from env_controller.sandbox.cgroups import (
    PREFIX,
    CgroupLimits,
    CgroupSystem,
    CgroupUnavailableError,
    SandboxCgroup,
    mountinfo_path,
    owner_is_gone,
    owner_tag,
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

_MS_NOSUID, _MS_NODEV, _MNT_DETACH = 2, 4, 2
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]

_warned: set[str] = set()


def _warn_once(message: str) -> None:
    """Log ``message`` as a warning the first time this process sees it (backends come and go)."""
    warn_once(logger, message, _warned)


def mount_tmpfs(target: Path, size_bytes: int, uid: int | None, source: str) -> None:
    """Mount a tmpfs of ``size_bytes`` on ``target`` (mode 0700, owned by ``uid``); OSError when refused."""
    options = f"size={size_bytes},mode=0700" + (f",uid={uid},gid={uid}" if uid is not None else "")
    if _libc.mount(source.encode(), os.fsencode(target), b"tmpfs", _MS_NOSUID | _MS_NODEV, options.encode()) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(target))


def unmount(target: Path) -> None:
    """Detach the mount on ``target`` (its memory is freed once no process uses it); OSError when refused."""
    if _libc.umount2(os.fsencode(target), _MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOENT):  # not a mount point (any more)
            raise OSError(err, os.strerror(err), str(target))


def supports_size(bwrap: str) -> bool:
    """Whether this bwrap takes ``--size`` (bubblewrap 0.7 and later) to cap a tmpfs; a setuid bwrap
    refuses it."""
    try:
        if os.stat(bwrap).st_mode & stat.S_ISUID:
            return False
        out = subprocess.run([bwrap, "--help"], capture_output=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return b"--size" in out


def _owned_tmpfs_mounts() -> list[tuple[str, Path]]:
    """``(source, mount point)`` of the tmpfs mounts this module made (any owner), from mountinfo."""
    out: list[tuple[str, Path]] = []
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) >= 5 and len(tail) >= 2 and tail[0] == "tmpfs" and tail[1].startswith(PREFIX):
            out.append((tail[1], Path(mountinfo_path(fields[4]))))
    return out


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


def _alive(pid: int | str, proc: str = "/proc") -> bool:
    fields = proc_stat(pid, proc)
    return fields is not None and fields[:1] != [b"Z"]


def _pid_namespace(pid: int) -> str | None:
    """Process ``pid``'s pid namespace (``pid:[inode]``), None when it is gone or unreadable."""
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


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
        """Create the sandbox's host directory, home mount and cgroup, then start its shell; SandboxError
        on failure."""
        super().__init__(sandbox_id, limits)
        self._backend = backend
        self._proc: subprocess.Popen[bytes] | None = None
        #: the sandbox's cgroup, None where cgroups cannot be made
        self.cgroup: SandboxCgroup | None = None
        self._mounts: list[Path] = []
        self._shell_pids: set[int] = set()
        #: the idle shell's pid namespace (``/proc/<pid>/ns/pid``; None when the host cannot read it) and a pid in
        #: it, through which the host sees the namespace's own ``/proc``
        self._pid_ns: str | None = None
        self._ns_pid = 0
        self.host_dir = backend.base_dir / sandbox_id
        self.host_home = self.host_dir / "home"
        self.host_dir.mkdir(mode=0o711)
        self.host_home.mkdir(mode=0o700)
        try:
            self._prepare()
        except OSError as exc:
            self._cleanup()
            raise SandboxError(f"sandbox {sandbox_id}: cannot set up its limits: {exc}") from exc
        self._open()

    def _prepare(self) -> None:
        """Mount the capped home (and /tmp, /dev/shm for a bwrap without ``--size``), make the cgroup."""
        backend, lim = self._backend, self.limits
        uid = backend.host_uid
        if backend.mount_problem is None:
            source = f"{PREFIX}{owner_tag()}-home"
            mounts = [(self.host_home, backend.home_mb)]
            if not backend.tmpfs_size:
                mounts += [(self.host_dir / "tmp", lim.tmp_mb), (self.host_dir / "shm", lim.tmp_mb)]
            for target, mb in mounts:
                target.mkdir(mode=0o700, exist_ok=True)
                mount_tmpfs(target, mb << 20, uid, source)
                self._mounts.append(target)
        elif uid is not None:
            os.chown(self.host_home, uid, uid)
        if backend.cgroups is not None:
            # +1: the outer bwrap sits in the cgroup, outside the namespace RLIMIT_NPROC counts in
            self.cgroup = backend.cgroups.create(
                self.id, CgroupLimits(lim.memory_mb << 20, lim.max_processes + 1, lim.cpus))

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
        ]
        for target, host in (("/dev/shm", "shm"), ("/tmp", "tmp")):
            if self._backend.tmpfs_size:
                argv += ["--size", str(lim.tmp_mb << 20), "--tmpfs", target]
            elif self.host_dir / host in self._mounts:
                argv += ["--bind", str(self.host_dir / host), target]
            else:
                argv += ["--tmpfs", target]
        argv += [
            # /dev is a tmpfs of its own, with no size limit: read-only, it cannot be filled
            "--remount-ro", "/dev",
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
        """Start ``bwrap`` with a bash inside (from the long-lived spawner thread), in the cgroup."""
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
            block_w: int | None = None
            if self.cgroup is not None:
                # bwrap waits on this pipe before it starts anything in the sandbox, so that the
                # host can first move it into the cgroup, where every later process is born
                block_r, block_w = os.pipe()
                fds += [block_r, block_w]
                argv[1:1] = ["--block-fd", str(block_r)]
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
            if self.cgroup is not None and block_w is not None:
                self._enter_cgroup(self._proc.pid, self.cgroup)
                os.write(block_w, b"g")
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
        proc = self._proc
        if proc is None:
            return
        # waited for through pidfds: a pid polled after the kill may already be another process's
        with PidFds(descendants(proc.pid)) as inside:
            inside.keep(self._owned(set(inside.fds)))  # while self._proc still names the tree
            self._proc = None
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            for pid in inside.fds:  # belt and braces: anything that escaped the group
                inside.kill(pid)
            self._pid_ns = None  # the namespace dies with its init; the next shell has its own
            if self.cgroup is not None:
                self.cgroup.kill()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                logger.error("sandbox %s: bwrap pid %d did not die within 10 s of SIGKILL", self.id, proc.pid)
            left = inside.wait_exited(10)
        if left:
            logger.error("sandbox %s: processes %s survived the kill", self.id, left)

    def _enter_cgroup(self, pid: int, cgroup: SandboxCgroup) -> None:
        """Move the blocked bwrap ``pid`` and what it has forked so far into ``cgroup``."""
        try:
            cgroup.add(pid)
            moved = {pid}
            # forks after a move land in the cgroup; repeat until a scan shows none born before it
            while True:
                new = [p for p in descendants(pid) if p not in moved]
                if not new:
                    break
                for p in new:
                    cgroup.add(p)
                moved.update(new)
        except OSError as exc:
            self._kill()
            raise SandboxError(f"sandbox {self.id}: cannot move bwrap into its cgroup {cgroup.name}: {exc}") from exc

    def _sandbox_pids(self) -> set[int]:
        """Host pids of every process of the sandbox (the outer bwrap included)."""
        proc = self._proc
        if self.cgroup is not None:
            return self.cgroup.procs()
        if proc is None or proc.poll() is not None:
            return set()
        return {proc.pid, *descendants(proc.pid)}

    def _shell_ready(self) -> None:
        """Note the idle shell's processes (bwrap, its init, bash; all others are a command's) and its pid
        namespace."""
        self._shell_pids = self._sandbox_pids()
        self._pid_ns = None
        own = _pid_namespace(os.getpid())
        for p in sorted(self._shell_pids):
            ns = _pid_namespace(p)
            if ns is not None and ns != own:
                self._pid_ns, self._ns_pid = ns, p
                break

    def _ns_processes(self, zombies: bool = False) -> int | None:
        """Processes of the sandbox's pid namespace (zombies only when ``zombies``), as its own ``/proc`` lists
        them; None when unreadable. Unlike the host's process tree, this sees a process whose parent exited while
        the tree was read (a fork bomb's processes, mostly), and it reads only the sandbox's processes."""
        if self._pid_ns is None:
            return None
        procfs = f"/proc/{self._ns_pid}/root/proc"
        try:
            names = [n for n in os.listdir(procfs) if n.isdigit()]
        except OSError:
            return None
        if _pid_namespace(self._ns_pid) != self._pid_ns:  # the pid the path went through is no longer ours
            return None
        return len(names) if zombies else sum(1 for n in names if _alive(n, procfs))

    def _owned(self, pids: set[int]) -> set[int]:
        """Those of ``pids`` that are processes of this sandbox now (in its pid namespace, or found in it again)."""
        if self._pid_ns is not None:
            return {p for p in pids if _pid_namespace(p) == self._pid_ns}
        return pids & self._sandbox_pids()

    def _end_stragglers(self) -> int:
        """SIGKILL every process but the idle shell's, until none is left; how many there were."""
        stopped: set[int] = set()
        deadline = time.monotonic() + 5
        while True:
            stray = {p for p in self._sandbox_pids() - self._shell_pids if _alive(p)}
            if not stray:
                count = self._ns_processes()  # against the idle shell's count, taken when it became ready
                if count is None or count <= self._idle_processes:
                    break
            if time.monotonic() > deadline:
                logger.error("sandbox %s: processes %s survived SIGKILL", self.id, sorted(stray))
                break
            stopped |= kill_owned(stray, self._owned)
            time.sleep(0.002)
        return len(stopped)

    def _oom_kills(self) -> int | None:
        """The cgroup's count of processes killed for reaching the memory limit."""
        return self.cgroup.oom_kills() if self.cgroup is not None else None

    def _process_limit_hits(self) -> int | None:
        """The cgroup's count of forks refused at its task limit."""
        return self.cgroup.process_limit_hits() if self.cgroup is not None else None

    def _full_filesystems(self) -> list[tuple[str, int]]:
        """The capped ``/tmp``, ``/dev/shm`` and home that are (nearly) full, seen from the host."""
        inner = sorted(p for p in self._shell_pids if self._proc is not None and p != self._proc.pid)
        checks: list[tuple[str, int, str]] = []
        if inner:  # the sandbox's own tmpfs mounts, through the root of a process inside it
            root = f"/proc/{inner[0]}/root"
            checks += [("/tmp", self.limits.tmp_mb, f"{root}/tmp"), ("/dev/shm", self.limits.tmp_mb, f"{root}/dev/shm")]
        if self.host_home in self._mounts:
            checks.append((self.workdir, self._backend.home_mb, str(self.host_home)))
        full: list[tuple[str, int]] = []
        for where, mb, path in checks:
            try:
                st = os.statvfs(path)
            except OSError:
                continue
            if nearly_full(st.f_bavail * st.f_frsize, mb, st.f_favail if st.f_files else None):
                full.append((where, mb))
        return full

    def _count_processes(self) -> int | None:
        """Processes inside the sandbox's pid namespace (its init and shell included; zombies too, which
        still count against ``RLIMIT_NPROC``)."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return 0
        count = self._ns_processes(zombies=True)
        if count is not None:
            return count
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
        """Remove the cgroup, unmount the home and delete the sandbox's host directory."""
        try:
            if self.cgroup is not None:
                self.cgroup.remove()
            for target in reversed(self._mounts):
                try:
                    unmount(target)
                except OSError as exc:
                    logger.error("sandbox %s: cannot unmount %s: %s", self.id, target, exc)
            self._mounts.clear()
            shutil.rmtree(self.host_dir, ignore_errors=True)
        finally:
            self._backend._forget(self.id)


class BwrapBackend(SandboxBackend):
    """Creates :class:`BwrapSandbox` es (see the module docstring).

    bwrap: path of the binary (default: found on PATH). base_dir: where sandbox homes live on the
    host (default: a new private temporary directory, deleted on :meth:`close`). host_uid: the
    host uid sandboxes run as (default: 65534 when running as root, else the current user).
    home_mb: size of each sandbox's home (a tmpfs, where the worker may mount). cgroups: give each
    sandbox a cgroup where one can be made; cgroup_parent: the cgroup they are made under (relative
    to the root of each hierarchy; on cgroup v2 one whose controllers may be handed down). reap:
    remove the cgroups and home mounts of exited owners at start (``reaped`` lists them).
    """

    name = "bwrap"

    def __init__(self, limits: SandboxLimits | None = None, bwrap: str | None = None,
                 base_dir: str | os.PathLike[str] | None = None, host_uid: int | None = None, home_mb: int = 256,
                 cgroups: bool = True, cgroup_parent: str = "agentrl", reap: bool = True) -> None:
        """Raises :class:`SandboxUnavailableError` when bwrap is not installed."""
        super().__init__(limits)
        found = bwrap or find_bwrap()
        if not found or not os.access(found, os.X_OK):
            raise SandboxUnavailableError(
                f"bubblewrap is not installed ({bwrap or 'bwrap'} not found); {INSTALL_HINT}")
        if isinstance(home_mb, bool) or not isinstance(home_mb, int) or home_mb < 1:
            raise ValueError(f"home_mb={home_mb!r} must be a positive integer (MB)")
        self.bwrap = found
        if host_uid is None and os.geteuid() == 0:
            host_uid = NOBODY
        if host_uid is not None and os.geteuid() != 0 and host_uid != os.geteuid():
            raise ValueError(f"host_uid={host_uid} needs root; leave it unset to run sandboxes as yourself")
        self.host_uid = host_uid
        self.home_mb = home_mb
        #: this bwrap caps a tmpfs itself (``--size``)
        self.tmpfs_size = supports_size(found)
        self._own_base = base_dir is None
        self.base_dir = Path(base_dir) if base_dir is not None else Path(tempfile.mkdtemp(prefix="agentrl-bwrap-"))
        self.base_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.base_dir, 0o711)
        self._closed = threading.Event()
        #: where sandbox cgroups are made, or None (then ``cgroup_problem`` says why)
        self.cgroups: CgroupSystem | None = None
        self.cgroup_problem: str | None = "turned off (cgroups=False)"
        if cgroups:
            try:
                self.cgroups = CgroupSystem.detect(cgroup_parent)
                self.cgroup_problem = None
            except CgroupUnavailableError as exc:
                self.cgroup_problem = str(exc)
        #: why size-capped tmpfs cannot be mounted on the host (the home's cap), or None when they can
        self.mount_problem = self._probe_mount()
        self.reaped: list[str] = self.reap() if reap else []
        for warning in self.health()["warnings"]:
            _warn_once(f"bwrap sandboxes: {warning}")

    def _probe_mount(self) -> str | None:
        probe = self.base_dir / f".probe-{os.getpid()}"
        try:
            probe.mkdir(exist_ok=True)
            mount_tmpfs(probe, 1 << 20, None, f"{PREFIX}{owner_tag()}-probe")
            unmount(probe)
        except OSError as exc:
            return f"mounting a tmpfs failed ({exc.strerror}; it needs root)"
        finally:
            try:
                probe.rmdir()
            except OSError:
                pass
        return None

    def reap(self) -> list[str]:
        """Remove the sandbox cgroups and home mounts of exited owners (crashed workers); their names."""
        removed = self.cgroups.reap_leaked() if self.cgroups is not None else []
        for source, point in _owned_tmpfs_mounts():
            if not owner_is_gone(source):
                continue
            try:
                unmount(point)
            except OSError as exc:
                logger.warning("cannot unmount the leaked sandbox mount %s: %s", point, exc)
                continue
            removed.append(source)
            # the sandbox's host directory, and the base directory when nothing else is left in it
            sandbox_dir = point.parent
            if sandbox_dir.name.startswith("agentrl-bwrap-"):
                shutil.rmtree(sandbox_dir, ignore_errors=True)
                if sandbox_dir.parent.name.startswith("agentrl-bwrap-"):
                    try:
                        sandbox_dir.parent.rmdir()
                    except OSError:
                        pass
        if removed:
            logger.info("bwrap: removed %d leaked sandbox cgroup(s) and mount(s)", len(removed))
        return removed

    def health(self) -> dict[str, Any]:
        """See :meth:`SandboxBackend.health`; adds ``cgroups`` (what they enforce, or None),
        ``home_capped`` and ``tmpfs_capped``."""
        warnings: list[str] = []
        if self.cgroups is None:
            warnings.append(
                f"no cgroup per sandbox ({self.cgroup_problem}): memory_mb caps each process's address space, "
                "not the sandbox's total; cpus is not enforced; processes, file size, wall time, output and "
                "the ending of background processes (by process tree) still hold")
        elif missing := [c for c in ("memory", "pids", "cpu") if c not in self.cgroups.controllers]:
            warnings.append(f"the sandbox cgroups lack the {', '.join(missing)} controller(s); "
                            "those limits hold per process only")
        if self.mount_problem is not None:
            warnings.append(f"the home directory is not capped: {self.mount_problem}")
        if not self.tmpfs_size and self.mount_problem is not None:
            warnings.append(f"/tmp and /dev/shm are not capped: {self.bwrap} has no --size and {self.mount_problem}")
        return {
            **super().health(),
            "cgroups": self.cgroups.describe() if self.cgroups is not None else None,
            "home_capped": self.mount_problem is None,
            "tmpfs_capped": self.tmpfs_size or self.mount_problem is None,
            "warnings": warnings,
        }

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
