"""The settings of a task worker server (:class:`~env_controller.worker.server.WorkerServer`), declared and
checked once; ``agentrl worker`` builds them from its flags."""
from __future__ import annotations

from dataclasses import dataclass, field

from env_controller.http.auth import check_token, split_url_credentials
from env_controller.http.options import ServerOptions


@dataclass
class WorkerOptions(ServerOptions):
    """How a worker serves its task and heartbeats to a controller (times in seconds), plus where it listens and
    the request and connection limits of its HTTP server (:class:`~env_controller.http.options.ServerOptions`)."""

    KEY = "worker"

    #: the task's name on the wire (None: the task's own ``name``)
    name: str | None = None
    #: the controller to heartbeat to, ``http://host:port[/api]`` (None: no heartbeats); credentials in it
    #: (``http://agentrl:TOKEN@host``, as stock AgentRL workers give them) serve when no ``token`` is given
    controller_url: str | None = None
    #: the URL the controller reaches this worker at (None: ``http://<host>:<port>/api``)
    self_address: str | None = None
    #: open sessions allowed (lowered to the task's ``max_containers`` when it has a sandbox pool)
    concurrency: int = 64
    #: seconds between heartbeats
    heartbeat_interval_s: float = 2.0
    #: limit on each task call (start, interact, close); a call past it ends its episode with ``task error``
    timeout_s: float = 60.0
    #: simulated delay of each start and interact, uniform in [0.5, 1.5] x this (benchmarks and tests)
    latency_s: float = 0.0
    #: the worker's credential: sent on heartbeats, required on every request (the controller sends it back)
    token: str | None = field(default=None, repr=False)
    #: a session left idle this long (its controller gone) is closed
    session_idle_timeout_s: float = 1800.0
    #: the longest pause between heartbeats the controller refuses (the backoff doubles up to it; never below
    #: ``heartbeat_interval_s``)
    heartbeat_backoff_cap_s: float = 30.0

    def check(self) -> None:
        """Times positive (the latency >= 0), a positive concurrency, a token that fits in a header."""
        super().check()
        self.require_positive_int("concurrency")
        self.require_seconds("heartbeat_interval_s", "timeout_s", "session_idle_timeout_s", "heartbeat_backoff_cap_s")
        self.require_non_negative("latency_s", why="0: no simulated delay")
        check_token(self.token, "worker.token")
        if self.controller_url:
            check_token(split_url_credentials(self.controller_url)[1], "worker.controller_url's password")
