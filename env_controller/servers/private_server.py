"""The lifecycle that the private servers (MariaDB, Docker's engine) share: one process in its own
process group, started with a parent-death signal so it cannot outlive its starter, its files in
one new temporary directory; stopped with SIGTERM, then SIGKILL to the whole group, and the
directory deleted. Subclasses implement :meth:`PrivateServer.start`.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

from env_controller.servers.process import start_process, stop_process


class PrivateServer(ABC):
    """A server process this process owns (see the module docstring).

    name: in its directory's name. base_dir: where the temporary directory is made (default: the system temp dir).
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

    def _spawn(self, args: Sequence[str], log: str | os.PathLike[str] = os.devnull) -> subprocess.Popen[bytes]:
        """Start ``args`` in a new process group that dies with this process; output appended to ``log``."""
        self.proc = start_process(args, log, tied_to_parent=True)
        return self.proc

    def _stop_process(self) -> None:
        """SIGTERM, wait up to ``stop_timeout_s``, then SIGKILL the process group (helpers it left behind)."""
        proc, self.proc = self.proc, None
        stop_process(proc, self.stop_timeout_s)

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
