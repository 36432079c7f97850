"""A private, disposable Docker engine: ``dockerd`` on its own socket, data root and exec root.

For nodes without a system Docker daemon, for the tests and for the container benchmark. The
daemon runs with no bridge network and no iptables changes (containers use ``network_mode=none``),
overlay2 storage (``vfs`` when the data root's filesystem cannot carry overlay2), and dies with the
process that started it. :meth:`DockerEngine.stop` stops it, unmounts what it left mounted and
deletes its directory. Needs root and Debian's ``docker.io`` package (dockerd, containerd, runc).
"""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from env_controller.servers.private_server import PrivateServer

logger = logging.getLogger(__name__)

INSTALL_HINT = "install Docker's engine (Debian/Ubuntu: apt-get install docker.io) and run as root"


class DockerUnavailableError(RuntimeError):
    """``dockerd`` (or what it needs: root, containerd, runc) is not on this machine."""


class DockerStartError(RuntimeError):
    """``dockerd`` did not come up; the message ends with its log."""


def find_dockerd() -> str:
    """The path of ``dockerd``; DockerUnavailableError saying how to install it."""
    # root's PATH has /usr/sbin; another user's may not
    path = shutil.which("dockerd", path=os.environ.get("PATH", "") + ":/usr/sbin:/usr/bin")
    if path is None:
        raise DockerUnavailableError(f"dockerd not found; {INSTALL_HINT}")
    for tool in ("containerd", "runc"):
        if shutil.which(tool, path=os.environ.get("PATH", "") + ":/usr/sbin:/usr/bin") is None:
            raise DockerUnavailableError(f"{tool} not found (dockerd needs it); {INSTALL_HINT}")
    if os.geteuid() != 0:
        raise DockerUnavailableError(f"a private dockerd needs root (this process runs as uid {os.geteuid()}); "
                                     "run as root, or point the backend at an existing daemon (DOCKER_HOST)")
    return path


def _mounts_under(root: Path) -> list[str]:
    """Mount points at or below ``root`` (deepest first), from /proc/self/mountinfo."""
    prefix = str(root)
    found = []
    try:
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            point = line.split()[4].replace("\\040", " ")
            if point == prefix or point.startswith(prefix + "/"):
                found.append(point)
    except OSError:
        return []
    return sorted(found, key=len, reverse=True)


class DockerEngine(PrivateServer):
    """A private ``dockerd`` (see the module docstring); ``with DockerEngine() as engine:``.

    base_dir: where its directory is made (default: the system temp dir). storage_driver:
    "overlay2" (falls back to "vfs" when overlay2 cannot start there) or "vfs".
    start_timeout_s / stop_timeout_s: limits of :meth:`start` / :meth:`stop`.
    """

    def __init__(self, base_dir: str | os.PathLike[str] | None = None, storage_driver: str = "overlay2",
                 start_timeout_s: float = 60.0, stop_timeout_s: float = 30.0) -> None:
        """Find dockerd (DockerUnavailableError when missing); nothing starts yet."""
        if storage_driver not in ("overlay2", "vfs"):
            raise ValueError(f"storage_driver={storage_driver!r}: use 'overlay2' or 'vfs'")
        super().__init__("dockerd", base_dir, stop_timeout_s)
        self.dockerd = find_dockerd()
        self.storage_driver = storage_driver
        self.start_timeout_s = start_timeout_s

    @property
    def socket_path(self) -> str:
        """The daemon's unix socket."""
        assert self.dir is not None, "the engine is not started"
        return str(self.dir / "docker.sock")

    @property
    def url(self) -> str:
        """``unix://<socket>``: the ``base_url`` of ``docker.DockerClient`` and the value of ``DOCKER_HOST``."""
        return "unix://" + self.socket_path

    @property
    def log_path(self) -> Path:
        """The daemon's log."""
        assert self.dir is not None, "the engine is not started"
        return self.dir / "dockerd.log"

    def client(self, timeout_s: float = 60.0) -> Any:
        """A ``docker.DockerClient`` on this engine."""
        import docker

        return docker.DockerClient(base_url=self.url, timeout=int(timeout_s))

    def _log_tail(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return "(no log)"

    def start(self) -> "DockerEngine":
        """Start the daemon and wait until it answers; DockerStartError (with its log's end) when it does not.

        Everything started is stopped and deleted on failure.
        """
        if self.proc is not None:
            raise RuntimeError("this DockerEngine is already started")
        # a short path: the exec root holds unix sockets, whose paths may not exceed 108 bytes
        self._make_dir(0o711)
        drivers = [self.storage_driver] + (["vfs"] if self.storage_driver == "overlay2" else [])
        last = ""
        for driver in drivers:
            try:
                self._start_with(driver)
                self.storage_driver = driver
                return self
            except DockerStartError as e:
                last = str(e)
                self._stop_process()
                if driver != drivers[-1]:
                    logger.warning("dockerd: storage driver %s did not start under %s; trying %s", driver, self.dir,
                                   drivers[-1])
        self._cleanup_dir()
        raise DockerStartError(last)

    def _start_with(self, driver: str) -> None:
        assert self.dir is not None
        data = self.dir / f"data-{driver}"
        execroot = self.dir / "exec"
        data.mkdir(exist_ok=True)
        execroot.mkdir(exist_ok=True)
        args = [self.dockerd, "--data-root", str(data), "--exec-root", str(execroot), "-H", self.url,
                "--pidfile", str(self.dir / "dockerd.pid"), "--storage-driver", driver, "--bridge=none",
                "--iptables=false", "--ip6tables=false", "--ip-forward=false", "--ip-masq=false",
                "--userland-proxy=false", "--log-level=warn"]
        self._spawn(args, self.log_path)
        assert self.proc is not None
        logger.info("dockerd: started (pid %d, %s) on %s", self.proc.pid, driver, self.socket_path)
        deadline = time.monotonic() + self.start_timeout_s
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise DockerStartError(f"{self.dockerd} exited with code {self.proc.returncode} while starting "
                                       f"(storage driver {driver}); its log:\n{self._log_tail()}")
            if os.path.exists(self.socket_path):
                try:
                    client = self.client(timeout_s=5)
                    try:
                        client.ping()
                        return
                    finally:
                        client.close()
                except Exception as e:  # noqa: BLE001 - not up yet; the loop's deadline bounds it
                    last = e
            time.sleep(0.2)
        raise DockerStartError(f"{self.dockerd} was not ready within {self.start_timeout_s:g} s (last error: {last});"
                               f" its log:\n{self._log_tail()}")

    def _cleanup_dir(self) -> None:
        if self.dir is None:
            return
        # overlay2 and the containers' tmpfs may still be mounted after a SIGKILL
        for point in _mounts_under(self.dir):
            subprocess.run(["umount", "-l", point], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           timeout=30, check=False)
        super()._cleanup_dir()
