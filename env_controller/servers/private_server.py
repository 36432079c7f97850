"""The lifecycle that the private servers (MariaDB, Docker's engine) share: one process in its own
process group, started with a parent-death signal so it cannot outlive its starter, its files in
one new temporary directory; stopped with SIGTERM, then SIGKILL to the whole group, and the
directory deleted. Subclasses implement :meth:`PrivateServer.start`.
"""
from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import subprocess
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Self

logger = logging.getLogger(__name__)


def die_with_parent() -> None:
    """``preexec_fn``: SIGTERM the child when the process that started it dies (PR_SET_PDEATHSIG)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)


class PrivateServer(ABC):
    """A server process this process owns (see the module docstring).

    name: for log lines. base_dir: where the temporary directory is made (default: the system temp dir).
    stop_timeout_s: how long :meth:`stop` waits after SIGTERM before SIGKILL.
    """

    def __init__(self, name: str, base_dir: str | os.PathLike[str] | None, stop_timeout_s: float) -> None:
        """Nothing starts yet."""
        self.name = name
        self.base_dir = base_dir
        self.stop_timeout_s = stop_timeout_s
        self.dir: Path | None = None
        self.proc: subprocess.Popen[bytes] | None = None

    @abstractmethod
    def start(self) -> Self:
        """Start the server and wait until it answers."""

    def _make_dir(self, mode: int = 0o700) -> Path:
        """The server's new temporary directory."""
        self.dir = Path(tempfile.mkdtemp(prefix=f"agentrl-{self.name}-", dir=self.base_dir))
        os.chmod(self.dir, mode)
        return self.dir

    def _spawn(self, args: Sequence[str], output: IO[bytes] | int = subprocess.DEVNULL) -> subprocess.Popen[bytes]:
        """Start ``args`` in a new process group that dies with this process; output to ``output``."""
        self.proc = subprocess.Popen(list(args), stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT,
                                     start_new_session=True, preexec_fn=die_with_parent)
        return self.proc

    def _stop_process(self) -> None:
        """SIGTERM, wait up to ``stop_timeout_s``, then SIGKILL the process group (helpers it left behind)."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("%s: pid %d ignored SIGTERM for %.0f s; killing it", self.name, proc.pid,
                               self.stop_timeout_s)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            logger.warning("%s: pid %d did not exit after SIGKILL", self.name, proc.pid)

    def _cleanup_dir(self) -> None:
        """Delete the server's directory."""
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def stop(self) -> None:
        """Stop the server and delete its directory; safe to call more than once."""
        self._stop_process()
        self._cleanup_dir()

    @property
    def running(self) -> bool:
        """The server process is alive."""
        return self.proc is not None and self.proc.poll() is None

    def __enter__(self) -> Self:
        """Start (if not started) and return the server."""
        if self.proc is None:
            self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        """Stop the server and delete its files."""
        self.stop()
