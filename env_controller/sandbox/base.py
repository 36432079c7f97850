"""The sandbox interface: a per-session persistent bash with limits, behind one API per backend.

A :class:`SandboxBackend` (``bwrap`` or ``docker``) creates one :class:`Sandbox` per session::

    backend = make_backend("bwrap")
    with backend.create(SandboxLimits(timeout_s=5)) as box:
        box.copy_in({"data/a.txt": "hello\\n"})       # relative paths land in box.workdir
        box.run("cd data; export X=1")                 # cwd and variables persist
        result = box.run("cat a.txt; echo $X")         # CommandResult(output="hello\\n1\\n", exit_code=0)
    backend.close()                                    # closes every sandbox it still holds

Every :meth:`Sandbox.run` ends within the limit's wall time (plus a few seconds for a restart).
A command that breaks a limit is killed with everything it started, and the result says so in
:attr:`CommandResult.error` (one sentence the agent can read):

* ``timeout``: ran past ``timeout_s``;
* ``output_limit``: printed more than ``max_output_bytes``;
* ``process_limit``: reached ``max_processes`` processes (a fork bomb), during the command or
  in the background after it;
* ``memory_limit``: the sandbox reached its memory limit and the kernel killed a process of it
  (backends with a memory count for the whole sandbox, e.g. bwrap with a cgroup);
* ``shell_exited``: the shell itself exited (``exit``, or killed by the memory limit).

After any of these the sandbox starts a fresh shell: the working directory and variables are
reset, files in the writable directories are kept. One more kind, ``disk_full``, kills nothing:
the command ended by itself but a write failed because a size-capped directory (``/tmp``, the
home...) is full. Network access fails (no network namespace devices besides loopback), the
root filesystem is read-only, ``workdir`` and ``/tmp`` are private and writable, and memory and
file size are capped.

Unless ``background_jobs`` is set, nothing a command starts outlives it: the processes it left
running are killed when it returns, and its output ends with a note saying how many.

The shared machinery is :class:`ShellSandbox`: it drives any byte channel to a bash process with
a marker protocol (each command is sent as one line of ANSI-C-quoted text, evaluated in the
persistent shell with stdin from ``/dev/null`` and stderr merged into stdout, followed by a
random end marker carrying the exit status), so that backends only start, kill and count the
shell's processes.
"""
from __future__ import annotations

import logging
import os
import re
import secrets
import select
import signal
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from types import TracebackType
from typing import Any, ClassVar, Literal

from env_controller.options import Options

logger = logging.getLogger(__name__)

LimitKind = Literal["timeout", "output_limit", "process_limit", "memory_limit", "shell_exited", "disk_full"]


class SandboxError(RuntimeError):
    """A sandbox could not be created, or its shell could not be (re)started; the message says why."""


class SandboxUnavailableError(SandboxError):
    """The backend cannot run on this machine (a binary, a daemon or a package is missing)."""


@dataclass(frozen=True)
class SandboxLimits(Options):
    """Limits applied to every sandbox of a backend (or to one sandbox, given to ``create``).

    memory_mb: memory of the whole sandbox, swap off (bwrap: its cgroup, where one can be made, and
        ``RLIMIT_AS`` per process; docker: ``mem_limit``); files in its tmpfs directories count too.
    timeout_s: wall time of one command; the command is killed past it.
    max_processes: processes (and threads) in the sandbox at once, the shell included; a
        command that brings the sandbox near it is taken for a fork bomb and killed (bwrap: also
        its cgroup's ``pids.max``).
    max_output_bytes: output (stdout and stderr merged) of one command; the command is killed
        when it prints more, and the first ``max_output_bytes`` are returned.
    max_file_mb: size of one file written in the sandbox (``RLIMIT_FSIZE``).
    tmp_mb: size of the private ``/tmp`` (a tmpfs); bwrap caps ``/dev/shm`` at the same size.
    start_timeout_s: time allowed to start (or restart) the shell.
    cpus: CPU time of the whole sandbox, in CPUs (0.5 = half of one core; bwrap: its cgroup's quota).
    background_jobs: let processes a command starts in the background run on after it returns
        (they still count against the sandbox's memory, processes and CPUs); off, they are killed.
    """

    memory_mb: int = 1024
    timeout_s: float = 10.0
    max_processes: int = 64
    max_output_bytes: int = 64 * 1024
    max_file_mb: int = 64
    tmp_mb: int = 64
    start_timeout_s: float = 20.0
    cpus: float = 1.0
    background_jobs: bool = False

    KEY = "limits"

    def check(self) -> None:
        """See :class:`~env_controller.options.Options`."""
        super().check()
        self.require_positive_int("max_output_bytes", "max_file_mb", "tmp_mb")
        self.require_int("memory_mb", low=16, why="a sandbox's shell needs more, and Docker refuses less than 6 MB")
        self.require_int("max_processes", low=4, why="the sandbox's shell alone needs 3")
        self.require_seconds("timeout_s", "start_timeout_s")
        self.require(isinstance(self.cpus, (int, float)) and not isinstance(self.cpus, bool)
                     and 0.01 <= self.cpus < float("inf"), "cpus",
                     "must be a number of CPUs of at least 0.01, e.g. 1.0 (0.5 = half of one core)")
        self.require_bool("background_jobs")


@dataclass
class CommandResult:
    """What one :meth:`Sandbox.run` did.

    output: stdout and stderr, merged, decoded as UTF-8 (bad bytes replaced), at most
        ``max_output_bytes`` of it.
    exit_code: the command's exit status; None when it was killed or the shell exited.
    limit: which limit ended the command, or None when it ended by itself.
    error: one sentence for the agent when ``limit`` is set (what happened and what was reset).
    truncated: output was cut at ``max_output_bytes``.
    restarted: a fresh shell was started after the command (cwd and variables reset).
    duration_s: wall time of the command.
    """

    output: str
    exit_code: int | None
    limit: LimitKind | None = None
    error: str | None = None
    truncated: bool = False
    restarted: bool = False
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        """The command ended by itself with exit status 0."""
        return self.limit is None and self.exit_code == 0

    def reply(self, max_chars: int) -> str:
        """The tool reply an agent sees: the output (cut at ``max_chars`` characters, saying how many more), a
        non-zero exit code after it, "(no output)" for silent success; a limit that stopped the command and
        reset the shell comes first, with the output before it; one that stopped nothing (a full /tmp) after."""
        output = self.output
        if len(output) > max_chars:
            output = output[:max_chars] + f"\n[... {len(output) - max_chars} more characters not shown]"
        if self.limit is not None and self.restarted:
            return f"error: {self.error}" + (f"\noutput before it was stopped:\n{output}" if output.strip() else "")
        if not output:
            output = "(no output)" if self.exit_code == 0 else ""
        if self.exit_code != 0:
            output = (output + ("\n" if output and not output.endswith("\n") else "")
                      + f"[exit code {self.exit_code}]")
        if self.limit is not None:
            output += f"\nerror: {self.error}"
        return output


class Sandbox(ABC):
    """One session's sandbox: a persistent bash with private writable ``workdir`` and ``/tmp``."""

    #: the sandbox's home and initial working directory, as seen inside it
    workdir: str = "/home/user"

    def __init__(self, sandbox_id: str, limits: SandboxLimits) -> None:
        """``sandbox_id``: unique name (logs, container names); ``limits``: see :class:`SandboxLimits`."""
        self.id = sandbox_id
        self.limits = limits
        self.closed = False

    @abstractmethod
    def run(self, script: str, timeout_s: float | None = None) -> CommandResult:
        """Run bash ``script`` in the persistent shell (cwd and variables persist between calls).

        ``timeout_s`` overrides ``limits.timeout_s`` for this command. Never raises for what the
        script does (limits end in :attr:`CommandResult.limit`); raises :class:`SandboxError`
        when the shell cannot be restarted, ValueError for a script holding a NUL byte, and
        RuntimeError once the sandbox is closed.
        """

    @abstractmethod
    def copy_in(self, files: Mapping[str, bytes | str], mode: int = 0o644) -> None:
        """Write ``files`` (path -> content) into the sandbox, creating parent directories.

        A relative path is relative to :attr:`workdir`; absolute paths must lie under
        :attr:`workdir` or ``/tmp``. Files are owned by the sandbox user. Raises ValueError for a
        path outside those directories or with ``..``, SandboxError when writing fails.
        """

    @abstractmethod
    def reset(self) -> None:
        """Kill every process in the sandbox and start a fresh shell (files are kept).

        Raises :class:`SandboxError` when the shell cannot be restarted, RuntimeError once closed.
        """

    @abstractmethod
    def close(self) -> None:
        """Kill everything in the sandbox and delete its files; safe to call more than once."""

    def wipe(self) -> None:
        """Make the sandbox as new for another session: every process killed, every file in its writable
        directories deleted, a fresh shell (cwd and variables reset).

        Raises :class:`SandboxError` when it cannot be made (and shown to be) clean, RuntimeError once closed.
        """
        raise SandboxError(f"sandbox {self.id}: {type(self).__name__} cannot be wiped for reuse")

    def __enter__(self) -> "Sandbox":
        """Use as a context manager: closed on exit."""
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        """Close the sandbox."""
        self.close()

    def resolve(self, path: str) -> PurePosixPath:
        """The absolute in-sandbox path of ``path`` (relative = under workdir); ValueError if not writable."""
        p = PurePosixPath(path)
        if not p.is_absolute():
            p = PurePosixPath(self.workdir) / p
        if ".." in p.parts or path.strip() == "":
            raise ValueError(f"sandbox path {path!r} must not be empty or contain '..'")
        for root in (PurePosixPath(self.workdir), PurePosixPath("/tmp")):
            if p != root and root in p.parents:
                return p
        raise ValueError(f"sandbox path {path!r} is outside the writable directories ({self.workdir}, /tmp)")


class SandboxBackend(ABC):
    """Creates sandboxes of one kind and keeps track of those not yet closed."""

    name: ClassVar[str]

    def __init__(self, limits: SandboxLimits | None = None) -> None:
        """``limits``: the default limits of :meth:`create`."""
        self.limits = limits or SandboxLimits()
        self._live: dict[str, Sandbox] = {}
        self._lock = threading.Lock()
        self._counter = 0

    @abstractmethod
    def _create(self, sandbox_id: str, limits: SandboxLimits, labels: Mapping[str, str]) -> Sandbox:
        """Start one sandbox (the backend's part of :meth:`create`)."""

    def create(self, limits: SandboxLimits | None = None, labels: Mapping[str, str] | None = None) -> Sandbox:
        """Start a new sandbox with ``limits`` (default: the backend's) and its shell ready.

        ``labels``: free-form tags (container labels in docker; logged in bwrap).
        Raises :class:`SandboxError` when it cannot be started.
        """
        with self._lock:
            self._counter += 1
            sandbox_id = f"agentrl-{self.name}-{secrets.token_hex(4)}-{self._counter}"
        box = self._create(sandbox_id, limits or self.limits, dict(labels or {}))
        with self._lock:
            self._live[sandbox_id] = box
        return box

    def _forget(self, sandbox_id: str) -> None:
        with self._lock:
            self._live.pop(sandbox_id, None)

    def live(self) -> list[Sandbox]:
        """The sandboxes created by this backend and not closed yet."""
        with self._lock:
            return list(self._live.values())

    def health(self) -> dict[str, Any]:
        """State for a health check: ``backend``, open ``sandboxes`` and ``warnings``, one line per
        limit of :class:`SandboxLimits` that does not hold here (empty when all hold)."""
        return {"backend": self.name, "sandboxes": len(self.live()), "warnings": []}

    def close(self) -> None:
        """Close every sandbox still open; safe to call more than once."""
        for box in self.live():
            try:
                box.close()
            except Exception:  # noqa: BLE001 - closing is best effort, one failure must not stop the rest
                logger.exception("closing sandbox %s failed", box.id)

    def __enter__(self) -> "SandboxBackend":
        """Use as a context manager: every sandbox is closed on exit."""
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        """Close every sandbox."""
        self.close()


# ---------------------------------------------------------------------------------------------
# the shared persistent-shell driver


def ansi_c_quote(data: bytes) -> str:
    """``data`` as a bash ``$'...'`` word (no NUL allowed), so the shell needs no process to decode it."""
    if b"\0" in data:
        raise ValueError("a sandbox command or file sent through the shell cannot contain NUL bytes")
    out = ["$'"]
    for byte in data:
        if byte == 0x5C:
            out.append("\\\\")
        elif byte == 0x27:
            out.append("\\'")
        elif byte < 0x20 or byte == 0x7F or byte >= 0x80:
            out.append(f"\\x{byte:02x}")
        else:
            out.append(chr(byte))
    out.append("'")
    return "".join(out)


_warned_lock = threading.Lock()


def warn_once(log: logging.Logger, message: str, seen: set[str]) -> None:
    """Log ``message`` as a warning unless ``seen`` (a set the caller keeps for the process) holds it:
    backends come and go, and a missing limit is worth one line, not one per backend."""
    with _warned_lock:
        if message in seen:
            return
        seen.add(message)
    log.warning("%s", message)


def nearly_full(free_bytes: int, size_mb: int, free_inodes: int | None = None) -> bool:
    """Whether a file system capped at ``size_mb`` with ``free_bytes`` left (and ``free_inodes``, when it
    counts them) is full: a write that does not fit fails with a little room left, so within 5 % counts."""
    return free_bytes < (size_mb << 20) // 20 or free_inodes == 0


def proc_stat(pid: int | str, proc: str = "/proc") -> list[bytes] | None:
    """The fields of ``<proc>/<pid>/stat`` after the command name (state, parent pid, ...; see
    proc(5), shifted by two), or None when the process is gone; ``proc``: another pid namespace's
    procfs as the host sees it (``/proc/<pid>/root/proc``)."""
    try:
        with open(f"{proc}/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rfind(b")") + 2:].split()


class PidFds:
    """Pidfds of ``pids`` opened at once (those already gone are left out), closed on exit: a pidfd keeps naming
    its process after the pid is reused, and becomes readable when the process has exited. ``fds`` maps a pid
    to its pidfd, or to None where the kernel has no pidfds (Linux < 5.3; the pid is used as is)."""

    def __init__(self, pids: Iterable[int]) -> None:
        self.fds: dict[int, int | None] = {}
        for pid in pids:
            try:
                self.fds[pid] = os.pidfd_open(pid)
            except ProcessLookupError:
                continue
            except OSError:
                self.fds[pid] = None

    def __enter__(self) -> PidFds:
        return self

    def __exit__(self, *exc: object) -> None:
        for fd in self.fds.values():
            if fd is not None:
                os.close(fd)
        self.fds = {}

    def keep(self, pids: set[int]) -> None:
        """Close the pidfds of every process but ``pids`` (e.g. those an ownership check confirmed once the pidfds
        were open: a pid reused between a scan and the open is dropped here)."""
        for pid in [p for p in self.fds if p not in pids]:
            fd = self.fds.pop(pid)
            if fd is not None:
                os.close(fd)

    def kill(self, pid: int) -> bool:
        """SIGKILL ``pid`` through its pidfd; False when it is gone (or not ours to signal)."""
        fd = self.fds[pid]
        try:
            if fd is None:
                os.kill(pid, signal.SIGKILL)
            else:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    def wait_exited(self, timeout_s: float) -> list[int]:
        """Wait at most ``timeout_s`` for every process to exit (a zombie has); the pids still running."""
        poller = select.poll()
        waiting = {fd: pid for pid, fd in self.fds.items() if fd is not None}
        for fd in waiting:
            poller.register(fd, select.POLLIN)
        plain = [pid for pid, fd in self.fds.items() if fd is None]
        deadline = time.monotonic() + timeout_s
        while True:
            for fd, _ in poller.poll(0):
                poller.unregister(fd)
                del waiting[fd]
            plain = [pid for pid in plain if (stat := proc_stat(pid)) is not None and stat[:1] != [b"Z"]]
            remaining = deadline - time.monotonic()
            if not (waiting or plain) or remaining <= 0:
                return sorted([*waiting.values(), *plain])
            if plain:
                time.sleep(min(0.02, remaining))
            else:
                poller.poll(max(1, int(remaining * 1000)))


def kill_owned(pids: Iterable[int], owned: Callable[[set[int]], set[int]]) -> set[int]:
    """SIGKILL each of ``pids`` that ``owned`` (given the pids still alive, returns those still the caller's)
    confirms, through a pidfd opened before asking: a pid that ended after the caller's scan and was then
    given to another process (pids wrap at ``kernel.pid_max``, 32768 on many hosts: a fork bomb cycles them
    in seconds) is never signalled. Returns the pids signalled."""
    with PidFds(pids) as fds:
        fds.keep(owned(set(fds.fds)))  # without pidfds the check narrows the window of a reused pid, cannot close it
        return {pid for pid in fds.fds if fds.kill(pid)}


def read_when_ready(source: int | object, timeout_s: float, read: Callable[[], bytes]) -> bytes | None:
    """Wait at most ``timeout_s`` for ``source`` (a file descriptor or socket) to be readable, then
    ``read()`` once: ``b""`` when nothing came, None at end of stream (as :meth:`Channel.recv`)."""
    readable, _, _ = select.select([source], [], [], max(0.0, timeout_s))
    if not readable:
        return b""
    try:
        chunk = read()
    except (BlockingIOError, TimeoutError):
        return b""
    return chunk or None


class Channel(ABC):
    """A byte stream to a running shell: what it prints (stdout and stderr) and its stdin."""

    @abstractmethod
    def send(self, data: bytes) -> None:
        """Write ``data`` to the shell's stdin; raises OSError when the shell is gone."""

    @abstractmethod
    def recv(self, timeout_s: float) -> bytes | None:
        """Bytes the shell printed, waiting at most ``timeout_s``: ``b""`` when none came, None at EOF."""

    @abstractmethod
    def close(self) -> None:
        """Release the stream (does not kill the shell)."""


@dataclass
class _Shell:
    channel: Channel
    pending: bytearray = field(default_factory=bytearray)
    #: background jobs of the last command were killed: bash would print "Killed" for each of them
    #: into the next command's output unless they leave its job table first
    forget_jobs: bool = False


#: empties DIRS as the sandbox user (those it owns are opened first, the others where writable), then checks
#: with bash alone that nothing is left in them: an image without ``find`` (or ``rm``) fails the check instead
#: of passing it. Sets ``left``: a path left, or ``none``. Directories the agent made unreadable are opened
#: before find descends (``-exec ... ;`` runs first).
EMPTY_DIRS = """dirs=(DIRS); live=(); left=none; shopt -s nullglob dotglob
for d in "${dirs[@]}"; do
  [[ -d $d && -O $d ]] && chmod u+rwx -- "$d" 2>/dev/null
  [[ -d $d && -w $d ]] && live+=("$d")
done
for d in "${live[@]}"; do
  if command -v find >/dev/null 2>&1; then
    find "$d" -mindepth 1 -type d ! -perm -u=rwx -exec chmod u+rwx -- {} \\; 2>/dev/null
    find "$d" -mindepth 1 -delete 2>/dev/null
  else
    e=("$d"/*); (( ${#e[@]} )) && rm -rf -- "${e[@]}" 2>/dev/null
  fi
done
for d in "${live[@]}"; do e=("$d"/*); (( ${#e[@]} )) && { left=${e[0]}; break; }; done
"""
#: after :data:`EMPTY_DIRS`: removes the user's System V IPC objects where ``ipcrm`` exists (an image without it is
#: clean only when none was made) and prints ``wiped <a path left, or none> <IPC objects left>``
WIPE_IPC = """command -v ipcrm >/dev/null 2>&1 && ipcrm --all >/dev/null 2>&1
ipc=0
for f in /proc/sysvipc/shm /proc/sysvipc/sem /proc/sysvipc/msg; do
  [[ -r $f ]] && { mapfile -t rows < "$f"; ipc=$((ipc + ${#rows[@]} - 1)); }
done
printf 'wiped %s %d\\n' "$left" "$ipc"
"""
#: :data:`EMPTY_DIRS` (the first of DIRS is the home, mode 0700 again), then :data:`WIPE_IPC`.
WIPE_SCRIPT = EMPTY_DIRS + 'chmod 0700 -- "${dirs[0]}"\n' + WIPE_IPC


class ShellSandbox(Sandbox):
    """A sandbox driven through a persistent bash; backends implement how the shell starts and dies.

    Subclasses implement :meth:`_spawn` (start a bash whose stdout/stderr and stdin are the
    returned :class:`Channel`), :meth:`_kill` (kill the shell and every process it started) and
    may implement :meth:`_count_processes` (processes in the sandbox, for fork-bomb detection),
    :meth:`_end_stragglers` (kill what a command left running), :meth:`_oom_kills` and
    :meth:`_full_filesystems` (which limit a failure came from).
    """

    #: seconds between two process counts while a command runs
    process_poll_s: float = 0.25
    #: writable directories besides the workdir and /tmp that :meth:`wipe` empties, where they exist
    scratch_dirs: tuple[str, ...] = ("/dev/shm", "/dev/mqueue")

    def __init__(self, sandbox_id: str, limits: SandboxLimits) -> None:
        """See :class:`Sandbox`; call :meth:`_open` once the backend's resources exist."""
        super().__init__(sandbox_id, limits)
        self._shell: _Shell | None = None
        self._run_lock = threading.Lock()
        self._idle_processes = 0
        self._oom_seen: int | None = None
        self._limit_hits_seen: int | None = None

    # -- backend part -------------------------------------------------------------------------

    @abstractmethod
    def _spawn(self) -> Channel:
        """Start a fresh bash in the sandbox (no prompt, reading commands from stdin)."""

    @abstractmethod
    def _kill(self) -> None:
        """Kill the shell and every process in the sandbox started through it; wait for them."""

    def _count_processes(self) -> int | None:
        """Processes running in the sandbox now, or None when the backend cannot tell."""
        return None

    def _shell_ready(self) -> None:
        """Called once a fresh shell answers, before any command (e.g. to note the shell's processes)."""

    def _end_stragglers(self) -> int:
        """Kill every process of the sandbox but the idle shell's; how many there were (0: cannot tell)."""
        return 0

    def _oom_kills(self) -> int | None:
        """Processes killed so far for reaching the sandbox's memory limit, or None when unknown."""
        return None

    def _process_limit_hits(self) -> int | None:
        """Forks the kernel refused so far at the sandbox's process limit, or None when unknown."""
        return None

    def _at_process_limit(self, count: int | None) -> bool:
        """Whether the sandbox is at its process limit (a fork bomb?): ``count`` processes near the limit, or a fork
        refused at the limit since the last command (a bomb may settle below the count's threshold: the kernel
        also counts processes being created or torn down)."""
        if count is not None and count >= self._bomb_threshold:
            return True
        hits, seen = self._process_limit_hits(), self._limit_hits_seen
        return hits is not None and seen is not None and hits > seen

    def _full_filesystems(self) -> list[tuple[str, int]]:
        """``(directory in the sandbox, size limit in MB)`` of each size-capped file system now full."""
        return []

    def _over_disk(self, now: bool) -> str | None:
        """A sentence for the agent when the sandbox's own files are over a cap that no kernel or engine quota
        enforces (the backend checks it itself), else None. ``now``: check even if checked a moment ago (after a
        command); else the backend may answer from its last check (polled while a command runs)."""
        return None

    # -- shell lifecycle ----------------------------------------------------------------------

    def _start_shell(self) -> None:
        """Start the shell and wait until it answers; raises SandboxError past ``start_timeout_s``."""
        started = time.monotonic()
        channel = self._spawn()
        token = secrets.token_hex(16)
        init = (
            "unset HISTFILE PROMPT_COMMAND; PS1=''; PS2=''; set +o history 2>/dev/null; "
            f"cd {ansi_c_quote(self.workdir.encode())} 2>/dev/null; printf '%s\\n' '{token}:ready'\n"
        )
        shell = _Shell(channel)
        try:
            channel.send(init.encode())
            deadline = started + self.limits.start_timeout_s
            marker = f"{token}:ready\n".encode()
            while marker not in shell.pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SandboxError(
                        f"sandbox {self.id}: the shell did not start within {self.limits.start_timeout_s:g} s "
                        f"(printed {bytes(shell.pending[-300:])!r})"
                    )
                chunk = channel.recv(min(left, 0.5))
                if chunk is None:
                    printed = bytes(shell.pending[-500:]).decode(errors="replace").strip()
                    raise SandboxError(f"sandbox {self.id}: the shell exited while starting: {printed!r}")
                shell.pending += chunk
        except (OSError, SandboxError):
            channel.close()
            self._kill()
            raise
        del shell.pending[: shell.pending.index(marker) + len(marker)]
        self._shell = shell
        self._shell_ready()
        count = self._count_processes()
        self._idle_processes = count if count is not None else 0
        self._oom_seen = self._oom_kills()
        self._limit_hits_seen = self._process_limit_hits()
        logger.debug("sandbox %s: shell ready in %.2f s", self.id, time.monotonic() - started)

    def _open(self) -> None:
        """Start the first shell; when that fails, release the backend's resources and re-raise."""
        try:
            self._start_shell()
        except BaseException:
            self._cleanup()
            raise

    def _restart(self) -> None:
        """Kill the current shell and everything it started, then start a fresh one (a second try when
        the first fails: an engine under heavy load may end a new shell before it answers)."""
        self._stop_shell()
        try:
            self._start_shell()
        except SandboxError as exc:
            logger.warning("%s; trying once more", exc)
            self._stop_shell()
            self._start_shell()

    def _stop_shell(self) -> None:
        # kill first: closing the shell's stdin first would let it exit on its own, and the
        # backend could no longer see (and wait for) what it leaves behind
        self._kill()
        if self._shell is not None:
            self._shell.channel.close()
            self._shell = None

    # -- commands ------------------------------------------------------------------------------

    def run(self, script: str, timeout_s: float | None = None) -> CommandResult:
        """See :meth:`Sandbox.run`."""
        quoted = self._quote(script)
        limit_s = self.limits.timeout_s if timeout_s is None else float(timeout_s)
        with self._run_lock:
            if self.closed:
                raise RuntimeError(f"sandbox {self.id} is closed")
            if self._shell is None:
                self._start_shell()
            return self._run_locked(quoted, limit_s)

    @staticmethod
    def _quote(script: str) -> str:
        """``script`` as one bash word (TypeError unless a str, ValueError on NUL)."""
        if not isinstance(script, str):
            raise TypeError(f"script must be a str, got {type(script).__name__}")
        return ansi_c_quote(script.encode("utf-8", errors="surrogateescape"))

    def _run_locked(self, quoted: str, limit_s: float) -> CommandResult:
        assert self._shell is not None
        shell = self._shell
        token = secrets.token_hex(16).encode()
        line = (
            ("disown -a; " if shell.forget_jobs else "")
            + f"__agentrl_cmd={quoted}; {{ eval \"$__agentrl_cmd\"; }} </dev/null 2>&1; "
            f"printf '\\n%s:%d\\n' '{token.decode()}' \"$?\"\n"
        ).encode()
        shell.forget_jobs = False
        marker = re.compile(rb"\n" + token + rb":(-?\d+)\n")
        max_out = self.limits.max_output_bytes
        started = time.monotonic()
        deadline = started + limit_s
        next_count = started + self.process_poll_s
        notice = b""
        count = self._count_processes()
        oom = self._oom_kills()
        reset = "a new shell was started: the working directory and variables are reset, files are kept"
        if self._at_process_limit(count):
            # what an earlier command left in the background filled the process table since
            self._restart()
            notice = (f"[note: background processes had reached the limit of {self.limits.max_processes} "
                      f"processes and were killed; {reset}]\n").encode()
        elif oom is not None and self._oom_seen is not None and oom > self._oom_seen:
            # background processes of an earlier command reached the memory limit since
            self._restart()
            notice = (f"[note: background processes had reached the sandbox's memory limit of "
                      f"{self.limits.memory_mb} MB and were killed; {reset}]\n").encode()
        if notice:
            shell = self._shell
            assert shell is not None
            oom = self._oom_kills()
        buf = bytearray(notice + shell.pending)
        shell.pending.clear()
        searched = 0
        limit: LimitKind | None = None
        exit_code: int | None = None
        disk_error: str | None = None
        try:
            shell.channel.send(line)
        except OSError:
            limit = "shell_exited"
        while limit is None:
            m = marker.search(buf, max(0, searched - len(token) - 32))
            if m is not None:
                exit_code = int(m.group(1))
                shell.pending += buf[m.end():]
                del buf[m.start():]
                break
            searched = len(buf)
            if len(buf) > max_out:
                limit = "output_limit"
                break
            now = time.monotonic()
            if now >= deadline:
                limit = "timeout"
                break
            if now >= next_count:
                next_count = now + self.process_poll_s
                if self._at_process_limit(self._count_processes()):
                    limit = "process_limit"
                    break
                disk_error = self._over_disk(now=False)
                if disk_error is not None:
                    limit = "disk_full"
                    break
            chunk = shell.channel.recv(min(deadline - now, next_count - now, 0.25))
            if chunk is None:
                limit = "shell_exited"
                break
            buf += chunk
        duration = time.monotonic() - started
        if limit is None and self.limits.background_jobs and self._background_bomb():
            limit = "process_limit"
        oom_after = self._oom_kills()
        if limit in (None, "shell_exited") and oom is not None and oom_after is not None and oom_after > oom:
            limit = "memory_limit"
        stopped = 0
        if limit is None and not self.limits.background_jobs:
            stopped = self._end_stragglers()
            shell.forget_jobs = stopped > 0
        truncated = len(buf) > max_out
        output = bytes(buf[:max_out]).decode("utf-8", errors="replace")
        if limit is None:
            self._oom_seen = oom_after
            self._limit_hits_seen = self._process_limit_hits()
            if stopped:
                output += ("" if output.endswith("\n") or not output else "\n") + (
                    f"[note: {stopped} process{'es' if stopped > 1 else ''} left running in the background "
                    "stopped when the command returned; background jobs are not kept in this sandbox]\n")
            full = self._full_filesystems() if "No space left on device" in output else []
            if full:
                return CommandResult(output=output, exit_code=exit_code, limit="disk_full",
                                     error=self._disk_full_message(full), truncated=truncated, duration_s=duration)
            disk_error = self._over_disk(now=True)
            if disk_error is not None:
                return CommandResult(output=output, exit_code=exit_code, limit="disk_full", error=disk_error,
                                     truncated=truncated, duration_s=duration)
            return CommandResult(output=output, exit_code=exit_code, truncated=truncated, duration_s=duration)
        logger.info("sandbox %s: command ended by %s after %.2f s; restarting the shell", self.id, limit, duration)
        self._restart()
        if disk_error is not None:
            disk_error += ("; the command was stopped, and a new shell was started: the working directory and "
                           "variables are reset, files are kept")
        return CommandResult(
            output=output, exit_code=exit_code if limit == "process_limit" else None, limit=limit,
            error=disk_error or self._limit_message(limit, limit_s), truncated=truncated, restarted=True,
            duration_s=duration,
        )

    @property
    def _bomb_threshold(self) -> int:
        """Process count taken for a fork bomb: near the limit, since the kernel also counts threads
        and processes being created or torn down that ``/proc`` does not show yet."""
        limit = self.limits.max_processes
        return limit - max(2, limit // 8)

    def _background_bomb(self) -> bool:
        """After a command: do processes it left behind grow to the process limit (a fork bomb)?

        While the sandbox holds more processes than the idle shell, counts again every 0.05 s
        until the count stops growing for 4 counts in a row (or 1.5 s pass). A bomb that grows
        slower than that (a starved CPU) is caught before or during the next command instead.
        """
        count = self._count_processes()
        previous = -1
        flat = 0
        deadline = time.monotonic() + 1.5
        while count is not None and count > self._idle_processes and time.monotonic() < deadline:
            if self._at_process_limit(count):
                return True
            flat = flat + 1 if count <= previous else 0
            if flat >= 4:
                return False
            time.sleep(0.05)
            previous, count = count, self._count_processes()
        return self._at_process_limit(count)

    def _limit_message(self, limit: LimitKind, limit_s: float) -> str:
        reset = ("a new shell was started: the working directory and variables are reset, "
                 "files are kept")
        if limit == "timeout":
            return f"the command ran past the {limit_s:g} s time limit and was killed; {reset}"
        if limit == "output_limit":
            return f"the command printed more than {self.limits.max_output_bytes} bytes and was killed; {reset}"
        if limit == "process_limit":
            return (f"the command reached the limit of {self.limits.max_processes} processes (a fork bomb?); "
                    f"all its processes were killed; {reset}")
        if limit == "memory_limit":
            return (f"the command was killed because the sandbox's memory limit of {self.limits.memory_mb} MB was "
                    f"reached (its processes and in-memory files count together); all its processes were killed; "
                    f"{reset}")
        return (f"the shell exited (by 'exit', or killed for exceeding the {self.limits.memory_mb} MB memory limit); "
                f"{reset}")

    @staticmethod
    def _disk_full_message(full: list[tuple[str, int]]) -> str:
        """One sentence naming the full directories and their size limits."""
        if len(full) == 1:
            (path, mb), = full
            return f"{path} is full (its size limit is {mb} MB), so a write failed; delete files there to make room"
        names = " and ".join(path for path, _ in full)
        sizes = " and ".join(f"{mb} MB" for _, mb in full)
        return f"{names} are full (size limits {sizes}), so writes failed; delete files there to make room"

    def copy_in(self, files: Mapping[str, bytes | str], mode: int = 0o644) -> None:
        """See :meth:`Sandbox.copy_in`; this default writes through the shell (``printf`` builtin)."""
        for path, content in files.items():
            target = self.resolve(path)
            data = content.encode() if isinstance(content, str) else bytes(content)
            script = (
                f"mkdir -p -- {ansi_c_quote(str(target.parent).encode())} && "
                f"printf '%s' {ansi_c_quote(data)} > {ansi_c_quote(str(target).encode())} && "
                f"chmod {mode:o} -- {ansi_c_quote(str(target).encode())}"
            )
            result = self.run(script)
            if not result.ok:
                raise SandboxError(
                    f"sandbox {self.id}: writing {target} failed: {result.error or result.output.strip()}"
                )

    def reset(self) -> None:
        """See :meth:`Sandbox.reset`."""
        with self._run_lock:
            if self.closed:
                raise RuntimeError(f"sandbox {self.id} is closed")
            self._restart()

    def wipe(self) -> None:
        """See :meth:`Sandbox.wipe`: a :meth:`reset`, then :data:`WIPE_SCRIPT` in a subshell (so the fresh
        shell keeps its state), which must report nothing left, and no process but the idle shell's."""
        self.reset()
        dirs = " ".join(ansi_c_quote(d.encode()) for d in (self.workdir, "/tmp", *self.scratch_dirs))
        result = self.run(f"( {WIPE_SCRIPT.replace('DIRS', dirs)} )", timeout_s=max(30.0, self.limits.timeout_s))
        if not (result.ok and result.output.endswith("wiped none 0\n")):
            raise SandboxError(f"sandbox {self.id}: the wipe left something behind: "
                               f"{result.error or result.output.strip()[-300:]!r}")
        count = self._count_processes()
        if count is not None and count > self._idle_processes:
            raise SandboxError(f"sandbox {self.id}: {count - self._idle_processes} process(es) outlived the wipe")

    def close(self) -> None:
        """See :meth:`Sandbox.close`."""
        with self._run_lock:
            if self.closed:
                return
            self.closed = True
            try:
                self._stop_shell()
            finally:
                self._cleanup()

    def _cleanup(self) -> None:
        """Release the backend's resources after the shell is dead (files, containers)."""
