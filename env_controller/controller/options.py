"""The settings of the env controller (:class:`~env_controller.controller.server.Controller`), declared and
checked once; ``agentrl controller`` builds them from its flags."""
from __future__ import annotations

from dataclasses import dataclass, field

from env_controller.http.auth import ANY_TASK, TRAINER_TOKEN_ENV, Credentials, check_token
from env_controller.http.options import MAX_BODY_BYTES, ServerOptions
from env_controller.options import OptionError


@dataclass
class ControllerConfig(ServerOptions):
    """Settings of a :class:`~env_controller.controller.server.Controller` (times in seconds), plus where it
    listens and the request and connection limits of its HTTP server
    (:class:`~env_controller.http.options.ServerOptions`; keep its ``idle_timeout_s`` above the trainer client's
    keep-alive, 30 s).

    Credentials: with none at all (the loopback default) anyone may do anything; with some, both roles must have
    one. The controller's calls to a worker carry the token that worker registered with.
    """

    KEY = "controller"

    #: the port to listen on (0 picks a free one)
    port: int = 5020
    #: the shared token: the trainer credential when ``trainer_token`` is not set, and a worker credential for
    #: every task when ``worker_tokens`` is empty (stock AgentRL workers know one token only)
    token: str | None = field(default=None, repr=False)
    #: the trainer's credential (start, interact, cancel, the views, metrics)
    trainer_token: str | None = field(default=None, repr=False)
    #: workers' credentials, task name (or ``*`` for every task) to token: a worker may register only for the
    #: task names its token is listed under
    worker_tokens: dict[str, str] = field(default_factory=dict, repr=False)
    #: a worker silent this long gets no new sessions
    suspect_after_s: float = 9.0
    #: a worker silent this long is dead; its sessions end with ``task error``
    heartbeat_timeout_s: float = 15.0
    #: for this long after the controller starts, a start of a task no worker has registered gets 503 with
    #: ``Retry-After`` (its workers come back with their next heartbeat after a controller restart), not 404;
    #: None: ``heartbeat_timeout_s``, 0: off
    registration_window_s: float | None = None
    #: a session with no interact for this long is closed (``task error``)
    session_idle_timeout_s: float = 600.0
    #: limit on each start_sample call to a worker
    start_timeout_s: float = 240.0
    #: limit on each interact call to a worker
    interact_timeout_s: float = 240.0
    #: limit on each cancel (and sessions list) call to a worker
    cancel_timeout_s: float = 30.0
    #: limit on opening a connection to a worker
    connect_timeout_s: float = 5.0
    #: how long a dead worker stays listed
    forget_dead_after_s: float = 300.0
    #: how often alive workers are asked for their sessions (orphans get cancelled)
    sync_interval_s: float = 60.0
    #: calls to workers in flight at once, all together (so also the most open connections to workers)
    max_worker_connections: int = 2048
    #: idle pooled connections to workers are closed after this long; keep it below the workers' own keep-alive
    #: timeout (uvicorn, which AgentRL workers use: 5 s) so that the controller never sends a request on a
    #: connection the worker is closing
    worker_keepalive_s: float = 3.0
    #: largest body sent to a worker (our workers' request limit); a larger one gets 413 and nothing is sent
    max_forward_bytes: int = MAX_BODY_BYTES
    #: ended sessions remembered for error messages and late final replies
    remember_ended: int = 50_000
    #: serve plain requests through the fast front (:mod:`env_controller.http.fast`); False has aiohttp serve
    #: every request (the same replies, at a higher CPU cost per request: docs/BENCHMARKS.md)
    fast_front: bool = True

    def check(self) -> None:
        """Every value in range, and credentials that serve both roles (errors never hold a token's value)."""
        super().check()
        self._check_credentials()
        self.require_seconds("suspect_after_s", "heartbeat_timeout_s", "session_idle_timeout_s", "start_timeout_s",
                             "interact_timeout_s", "cancel_timeout_s", "connect_timeout_s", "forget_dead_after_s",
                             "sync_interval_s", "worker_keepalive_s")
        if self.registration_window_s is not None:
            self.require_non_negative("registration_window_s", why="seconds; 0 = off, unset = heartbeat_timeout_s")
        self.require(self.suspect_after_s < self.heartbeat_timeout_s, "suspect_after_s",
                     f"must be below heartbeat_timeout_s={self.heartbeat_timeout_s} (a worker is suspect before it "
                     "is dead)")
        self.require_positive_int("max_worker_connections", "remember_ended", "max_forward_bytes")

    def _check_credentials(self) -> None:
        for name in ("token", "trainer_token"):
            check_token(getattr(self, name), f"controller.{name}")
        if not isinstance(self.worker_tokens, dict):
            raise OptionError("controller.worker_tokens must be a mapping of task name (or '*') to token")
        for task, tok in self.worker_tokens.items():
            if not isinstance(task, str) or not task or tok is None:
                raise OptionError(f"controller.worker_tokens entry for {task!r:.100} must map a task name "
                                  "(or '*') to a token of printable ASCII without spaces")
            check_token(tok, f"controller.worker_tokens entry for {task!r:.100}")
        creds = self.credentials()
        if self.worker_tokens and creds.trainer in self.worker_tokens.values():
            raise OptionError("controller: the trainer token equals a worker token; give each role its own "
                              "(or use --token alone for both)")
        if creds.enabled and not (creds.trainer and creds.workers):
            missing = "no worker could register (add --worker-token NAME=TOKEN)" if creds.trainer else (
                f"no trainer could start sessions (add --trainer-token or ${TRAINER_TOKEN_ENV})")
            raise OptionError(f"controller: credentials for one role only: {missing}; or use --token for both")

    def credentials(self) -> Credentials:
        """The credentials the controller accepts (see the class docstring)."""
        workers = dict(self.worker_tokens) or ({ANY_TASK: self.token} if self.token else {})
        return Credentials(self.trainer_token or self.token, workers)
