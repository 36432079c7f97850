"""Starting, waiting for and stopping real processes: what the private servers, the bench scripts and the
end-to-end tests share.

:func:`start_process` starts a command with its output (stdout and stderr) appended to a log file, by default in
a process group of its own, so that stopping it reaches whatever it started.
:func:`stop_processes` sends each process a first signal (SIGTERM: a server cleans up on it), waits out a grace
period, SIGKILLs each group (helpers left behind) and always reaps. :func:`wait_until` polls a predicate until a
deadline, giving up early when a process it watches has exited. :class:`ProcessGroup` keeps the named processes
of one run, each with its log, and stops them all when closed.
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self, TypeVar

logger = logging.getLogger(__name__)

#: ``group`` of :func:`start_process`: a new process group, whose id is the process's pid
OWN_GROUP = 0
#: how long a process may take to be reaped after SIGKILL before a warning says it is stuck
REAP_S = 10.0

T = TypeVar("T")


def die_with_parent() -> None:
    """``preexec_fn``: SIGTERM the child when the process that started it dies (PR_SET_PDEATHSIG)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)


def start_process(cmd: Sequence[str], log: str | os.PathLike[str] | None = None, *,
                  env: Mapping[str, str] | None = None, cwd: str | os.PathLike[str] | None = None,
                  group: int | None = OWN_GROUP, tied_to_parent: bool = False) -> subprocess.Popen[bytes]:
    """Start ``cmd`` with stdin from /dev/null, stdout and stderr appended to ``log`` (this process's own when
    None; ``os.devnull`` discards them).

    group: :data:`OWN_GROUP` (a group of its own: :func:`stop_processes` reaches its children), None (this
    process's group) or the id of a group to join (of this session). tied_to_parent: the child gets SIGTERM
    when this process dies.
    """
    options: dict[str, Any] = {} if group is None else {"process_group": group}
    if tied_to_parent:
        options["preexec_fn"] = die_with_parent
    out = open(log, "ab") if log is not None else None  # noqa: SIM115 - the child holds its own copy
    try:
        return subprocess.Popen(list(cmd), stdin=subprocess.DEVNULL, stdout=out,
                                stderr=None if out is None else subprocess.STDOUT,
                                env=None if env is None else dict(env), cwd=cwd, **options)
    finally:
        if out is not None:
            out.close()


def signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    """Send ``sig`` to the group ``proc`` leads (what it started), if any is left."""
    try:
        os.killpg(proc.pid, sig)  # the id of a group of its own is its leader's pid
    except (ProcessLookupError, PermissionError):
        pass


def stop_processes(procs: Iterable[subprocess.Popen[bytes]], grace_s: float = 10.0,
                   first_signal: int = signal.SIGTERM) -> None:
    """Send each live process ``first_signal``, wait up to ``grace_s`` for all of them together, then SIGKILL
    each one's group (and the process itself when it leads none) and reap it; safe on processes already gone."""
    procs = list(procs)
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(first_signal)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("pid %d (%s) outlived signal %d for %g s; killing it", proc.pid, _command(proc),
                           first_signal, grace_s)
    for proc in procs:
        signal_group(proc, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
        try:
            proc.wait(REAP_S)
        except subprocess.TimeoutExpired:
            logger.warning("pid %d (%s) did not exit after SIGKILL", proc.pid, _command(proc))


def stop_process(proc: subprocess.Popen[bytes] | None, grace_s: float = 10.0,
                 first_signal: int = signal.SIGTERM) -> int | None:
    """:func:`stop_processes` for one process (None: nothing); returns its exit status."""
    if proc is None:
        return None
    stop_processes([proc], grace_s, first_signal)
    return proc.returncode


def wait_until(what: str, check: Callable[[], T], timeout_s: float, proc: subprocess.Popen[bytes] | None = None,
               poll_s: float = 0.1) -> T:
    """Poll ``check()`` until it returns something truthy and return that; an OSError or ValueError (a server not
    up yet, a half-written file) counts as not yet. TimeoutError after ``timeout_s``; ChildProcessError as soon
    as ``proc`` (what should bring it about) has exited."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = check()
        except (OSError, ValueError):
            value = None
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise ChildProcessError(f"{_command(proc)} ended (exit {proc.returncode}) before {what}")
        if time.monotonic() >= deadline:
            raise TimeoutError(f"no {what} within {timeout_s:g} s")
        time.sleep(poll_s)


def _command(proc: subprocess.Popen[bytes]) -> str:
    """A short form of the command ``proc`` runs, for messages."""
    args = [str(a) for a in proc.args] if isinstance(proc.args, (list, tuple)) else [str(proc.args)]
    return " ".join([os.path.basename(args[0]), *args[1:4]])[:120]


class ProcessGroup:
    """The named processes of one run, each logging to ``<log_dir>/<log>.log``; all stopped by :meth:`close`.

    env / cwd: of every process started. A name started again (a restart) refers to the new process; the old
    one is still stopped at close.
    """

    def __init__(self, log_dir: str | os.PathLike[str], env: Mapping[str, str] | None = None,
                 cwd: str | os.PathLike[str] | None = None) -> None:
        """Nothing starts yet."""
        self.log_dir, self.env, self.cwd = Path(log_dir), env, cwd
        self.by_name: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: dict[str, Path] = {}
        self.started: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, cmd: Sequence[str], log: str | None = None,
              group: int | None = OWN_GROUP) -> subprocess.Popen[bytes]:
        """Start ``cmd`` as ``name``, its output appended to ``<log or name>.log`` (see :func:`start_process`)."""
        path = self.log_dir / f"{log or name}.log"
        proc = start_process(cmd, path, env=self.env, cwd=self.cwd, group=group)
        self.by_name[name], self.logs[name] = proc, path
        self.started.append(proc)
        return proc

    def __getitem__(self, name: str) -> subprocess.Popen[bytes]:
        """The process last started as ``name``."""
        return self.by_name[name]

    def alive(self, name: str) -> bool:
        """``name`` was started and has not exited."""
        proc = self.by_name.get(name)
        return proc is not None and proc.poll() is None

    def exited(self) -> list[subprocess.Popen[bytes]]:
        """The processes that have ended."""
        return [p for p in self.started if p.poll() is not None]

    def stop(self, name: str, grace_s: float = 10.0, first_signal: int = signal.SIGTERM) -> int | None:
        """Stop ``name`` (see :func:`stop_processes`); its exit status, None when it was never started."""
        return stop_process(self.by_name.get(name), grace_s, first_signal)

    def tail(self, name: str, chars: int = 2500) -> str:
        """The end of ``name``'s log ("" when there is none)."""
        try:
            return self.logs[name].read_text(errors="replace")[-chars:]
        except (KeyError, OSError):
            return ""

    def close(self, grace_s: float = 10.0) -> None:
        """Stop every process started (SIGTERM, SIGKILL past ``grace_s``)."""
        stop_processes(self.started, grace_s)

    def __enter__(self) -> Self:
        """``with ProcessGroup(dir) as procs:``."""
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        """Stop every process started."""
        self.close()
