"""The limits every one of our HTTP servers puts on requests and connections (the controller, a task worker,
the agent gateway), and where the controller and a worker listen: declared and checked here once, and included in
each server's own options."""
from __future__ import annotations

from dataclasses import dataclass

from env_controller.http.fast import MAX_CONNECTIONS
from env_controller.options import Options

#: largest request body accepted (assistant messages can be long)
MAX_BODY_BYTES = 32 * 1024 * 1024
#: seconds a client may take to send a request body once its headers arrived
BODY_TIMEOUT_S = 30.0
#: seconds a connection may stay without a complete request head (from its opening, or after a
#: reply); keep it above the clients' own keep-alive (the trainer client: 30 s, the controller's
#: pool towards workers: 3 s), so that no client sends on a connection the server is closing
IDLE_TIMEOUT_S = 75.0


@dataclass
class HttpOptions(Options):
    """Limits on the requests and connections of one HTTP server
    (:class:`~env_controller.http.service.HttpService`)."""

    #: seconds a client may take to send a request body once its headers arrived (else 408, connection closed)
    body_timeout_s: float = BODY_TIMEOUT_S
    #: seconds a connection may wait for a complete request head, and stay idle between requests (keep-alive)
    idle_timeout_s: float = IDLE_TIMEOUT_S
    #: largest request body accepted, bytes (else 413)
    max_body_bytes: int = MAX_BODY_BYTES
    #: connections open at once; one more is answered 503 and closed, and reaching the cap is logged
    max_connections: int = MAX_CONNECTIONS

    def check(self) -> None:
        """Timeouts are positive seconds, sizes positive integers."""
        super().check()
        self.require_seconds("body_timeout_s", "idle_timeout_s")
        self.require_positive_int("max_body_bytes", "max_connections")


@dataclass
class ServerOptions(HttpOptions):
    """Where one of our servers (the controller, a task worker) listens, and its :class:`HttpOptions` limits."""

    #: the address to bind (loopback by default; elsewhere credentials are required)
    host: str = "127.0.0.1"
    #: the port to bind (0 picks a free one)
    port: int = 0

    def check(self) -> None:
        """See :class:`HttpOptions`; the port is 0 .. 65535."""
        super().check()
        self.require_int("port", 0, 65535, why="0 picks a free port")
