"""A private MariaDB server for tests and the demo: its own data directory, socket and port.

::

    with MariaDBServer() as server:          # mariadb-install-db + mariadbd, ready when entered
        conn = pymysql.connect(**server.connect_args())
        ...                                   # stopped and deleted on exit

The server keeps everything under a new temporary directory (data, unix socket, pid file, error
log), listens on the socket and on ``127.0.0.1:<port>`` (a free port unless given), runs
without reading any option file (``--no-defaults``), and gets a random root password right
after start, so nothing else on the machine can log in without it. Tuned for small, fast,
disposable use (small buffer pool, no binary log, no performance schema, no fsync: a crash
loses data, which a test server does not mind).
It is started with a parent-death signal, so it cannot outlive the process that started it.
When MariaDB (or MySQL) is not installed, :class:`MariaDBUnavailableError` says what to install.
"""
from __future__ import annotations

import logging
import os
import secrets
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from env_controller.http.net import free_port
from env_controller.servers.private_server import PrivateServer

logger = logging.getLogger(__name__)

INSTALL_HINT = "install it with `apt-get install mariadb-server` (Debian/Ubuntu)"
_SEARCH = ("/usr/sbin", "/usr/bin", "/usr/libexec", "/usr/local/sbin", "/usr/local/bin", "/usr/local/mysql/bin",
           "/opt/mariadb/bin")


class MariaDBUnavailableError(RuntimeError):
    """MariaDB is not installed (or its bootstrap tool is missing); the message says what to install."""


class MariaDBStartError(RuntimeError):
    """The server did not start; the message holds the end of its error log."""


def _which(names: tuple[str, ...]) -> str | None:
    for name in names:
        found = shutil.which(name)
        if found:
            return found
    for directory in _SEARCH:
        for name in names:
            path = os.path.join(directory, name)
            if os.access(path, os.X_OK):
                return path
    return None


def find_mariadb() -> tuple[str, str]:
    """``(server, install_db)``: paths of ``mariadbd``/``mysqld`` and ``mariadb-install-db``/``mysql_install_db``.

    Raises :class:`MariaDBUnavailableError` naming what is missing and how to install it.
    """
    server = _which(("mariadbd", "mysqld"))
    install = _which(("mariadb-install-db", "mysql_install_db"))
    if server is None:
        raise MariaDBUnavailableError(f"MariaDB is not installed (no mariadbd or mysqld found); {INSTALL_HINT}")
    if install is None:
        raise MariaDBUnavailableError(
            f"found {server} but not mariadb-install-db / mysql_install_db to create a data directory; {INSTALL_HINT}")
    return server, install


class MariaDBServer(PrivateServer):
    """A private, disposable MariaDB server (see the module docstring).

    base_dir: where its directory is created (default: the system temp dir). port: TCP port on
    127.0.0.1 (default: a free one). start_timeout_s / stop_timeout_s: limits of
    :meth:`start` / :meth:`stop`. extra_args: more ``mariadbd`` options.
    """

    def __init__(self, base_dir: str | os.PathLike[str] | None = None, port: int | None = None,
                 start_timeout_s: float = 120.0, stop_timeout_s: float = 30.0,
                 extra_args: tuple[str, ...] = ()) -> None:
        """Find the binaries (MariaDBUnavailableError when missing); nothing starts yet."""
        super().__init__("mariadb", base_dir, stop_timeout_s)
        self.server_bin, self.install_bin = find_mariadb()
        self.port = port
        self.start_timeout_s = start_timeout_s
        self.extra_args = tuple(extra_args)
        self.user = "root"
        self.password = secrets.token_urlsafe(18)
        self.host = "127.0.0.1"

    # -- paths ---------------------------------------------------------------------------------

    @property
    def socket_path(self) -> str:
        """The server's unix socket."""
        assert self.dir is not None, "the server is not started"
        return str(self.dir / "mysqld.sock")

    @property
    def error_log(self) -> Path:
        """The server's error log."""
        assert self.dir is not None, "the server is not started"
        return self.dir / "error.log"

    def connect_args(self, tcp: bool = False) -> dict[str, Any]:
        """Keyword arguments of ``pymysql.connect`` for the root user (unix socket, or TCP when ``tcp``)."""
        where: dict[str, Any] = {"host": self.host, "port": self.port} if tcp else {"unix_socket": self.socket_path}
        return {**where, "user": self.user, "password": self.password}

    def _log_tail(self, n: int = 2000) -> str:
        try:
            return self.error_log.read_text(errors="replace")[-n:]
        except OSError:
            return "(no error log)"

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> "MariaDBServer":
        """Create the data directory, start the server, wait until it answers, set the root password.

        Raises :class:`MariaDBStartError` (with the error log's end) when it fails or is not ready
        within ``start_timeout_s``; everything started is stopped and deleted then.
        """
        if self.proc is not None:
            raise RuntimeError("this MariaDBServer is already started")
        deadline = time.monotonic() + self.start_timeout_s
        self._make_dir()
        assert self.dir is not None
        data = self.dir / "data"
        tmp = self.dir / "tmp"
        tmp.mkdir()
        as_root = ["--user=root"] if os.geteuid() == 0 else []
        try:
            install = subprocess.run(
                [self.install_bin, "--no-defaults", f"--datadir={data}", "--auth-root-authentication-method=normal",
                 "--skip-test-db", "--skip-name-resolve", *as_root],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=max(1.0, deadline - time.monotonic()),
            )
        except subprocess.TimeoutExpired:
            self._cleanup_dir()
            raise MariaDBStartError(f"{self.install_bin} did not finish within {self.start_timeout_s:g} s") from None
        if install.returncode != 0:
            out = install.stdout.decode(errors="replace")[-2000:]
            self._cleanup_dir()
            raise MariaDBStartError(f"{self.install_bin} failed (exit {install.returncode}):\n{out}")
        if self.port is None:
            self.port = free_port()
        args = [
            self.server_bin, "--no-defaults", f"--datadir={data}", f"--socket={self.socket_path}",
            f"--port={self.port}", "--bind-address=127.0.0.1", f"--pid-file={self.dir / 'mysqld.pid'}",
            f"--log-error={self.error_log}", f"--tmpdir={tmp}", "--skip-name-resolve", "--skip-log-bin",
            "--performance-schema=OFF", "--innodb-buffer-pool-size=32M", "--innodb-log-file-size=16M",
            "--innodb-flush-log-at-trx-commit=0", "--innodb-flush-method=nosync", "--skip-innodb-doublewrite",
            "--max-connections=500",
            "--max-user-connections=0", *as_root, *self.extra_args,
        ]
        self._spawn(args)
        assert self.proc is not None
        logger.info("mariadb: started %s (pid %d) on %s and 127.0.0.1:%d", self.server_bin, self.proc.pid,
                    self.socket_path, self.port)
        try:
            self._wait_ready(deadline)
            self._secure()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, deadline: float) -> None:
        import pymysql

        assert self.proc is not None
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise MariaDBStartError(
                    f"{self.server_bin} exited with code {self.proc.returncode} while starting; "
                    f"error log:\n{self._log_tail()}"
                )
            if os.path.exists(self.socket_path):
                try:
                    pymysql.connect(unix_socket=self.socket_path, user="root", password="", connect_timeout=5).close()
                    return
                except pymysql.MySQLError as exc:
                    last = exc
            time.sleep(0.1)
        raise MariaDBStartError(
            f"{self.server_bin} was not ready within {self.start_timeout_s:g} s (last error: {last}); "
            f"error log:\n{self._log_tail()}")

    def _secure(self) -> None:
        """Give every root account the random password (the install leaves them empty)."""
        import pymysql

        conn = pymysql.connect(unix_socket=self.socket_path, user="root", password="", connect_timeout=10,
                               autocommit=True)
        try:
            with conn.cursor() as cur:
                # accounts by host name (unusable with --skip-name-resolve) and anonymous ones go
                cur.execute("DELETE FROM mysql.global_priv WHERE user = '' OR "
                            "(user = 'root' AND host NOT IN ('localhost', '127.0.0.1', '::1'))")
                cur.execute("FLUSH PRIVILEGES")
                cur.execute("SELECT user, host FROM mysql.user WHERE user = 'root'")
                for user, host in cur.fetchall():
                    cur.execute("ALTER USER %s@%s IDENTIFIED BY %s", (user, host, self.password))
        finally:
            conn.close()
