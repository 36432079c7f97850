"""Starting, waiting for and stopping real processes (``env_controller.servers.process``): the log gets the output,
a stop reaches what the process started, a process that ignores SIGTERM is killed after the grace, and a wait gives
up at its deadline or when the process it watches ends."""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from env_controller.servers.process import ProcessGroup, start_process, stop_process, wait_until

# a process that starts a child (its pid to stdout) and sleeps; with "ignore", it ignores SIGTERM
_PARENT = ("import signal, subprocess, sys, time\n"
           "if sys.argv[1:] == ['ignore']: signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
           "child = subprocess.Popen(['sleep', '60'])\n"
           "print(child.pid, flush=True)\n"
           "time.sleep(60)\n")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_a_stop_reaches_the_child_and_reaps(tmp_path: Path) -> None:
    with ProcessGroup(tmp_path) as procs:
        proc = procs.start("parent", [sys.executable, "-c", _PARENT])
        child = int(wait_until("the child's pid", lambda: procs.tail("parent").strip(), 30, proc))
        assert procs.alive("parent") and _alive(child)
        assert procs.stop("parent") == -signal.SIGTERM
        assert not procs.alive("parent") and proc.returncode is not None
        wait_until("the child gone", lambda: not _alive(child), 5)


def test_a_process_that_ignores_sigterm_is_killed_after_the_grace(tmp_path: Path) -> None:
    log = tmp_path / "parent.log"
    proc = start_process([sys.executable, "-c", _PARENT, "ignore"], log)
    try:
        wait_until("the child's pid", lambda: log.read_text().strip(), 30, proc)
        t0 = time.monotonic()
        assert stop_process(proc, grace_s=0.5) == -signal.SIGKILL
        assert 0.4 < time.monotonic() - t0 < 10
    finally:
        stop_process(proc, grace_s=0.0, first_signal=signal.SIGKILL)


def test_a_wait_gives_up_at_its_deadline_or_when_the_process_ends(tmp_path: Path) -> None:
    with pytest.raises(TimeoutError, match="no answer within 0.2 s"):
        wait_until("answer", lambda: None, 0.2)
    proc = start_process([sys.executable, "-c", "raise SystemExit(3)"], tmp_path / "quick.log")
    with pytest.raises(ChildProcessError, match=r"ended \(exit 3\) before the answer"):
        wait_until("the answer", lambda: None, 30, proc)
    calls = iter([OSError("not up"), ValueError("half written"), "ok"])

    def check() -> str:
        value = next(calls)
        if isinstance(value, Exception):
            raise value
        return value

    assert wait_until("answer", check, 5, poll_s=0.01) == "ok"
