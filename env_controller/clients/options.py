"""The settings of the trainer's client of an env controller
(:class:`~env_controller.clients.http_client.HttpEnvClient`), declared and checked once."""
from __future__ import annotations

from dataclasses import dataclass, field

from env_controller.options import Options


@dataclass
class EnvClientOptions(Options):
    """Timeouts, retries and connections of an :class:`~env_controller.clients.http_client.HttpEnvClient`
    (times in seconds; its module docstring tells which call retries what)."""

    KEY = "env_client"

    #: the trainer credential (None: the password of the controller URL when it holds one, else
    #: ``$AGENTRL_TRAINER_TOKEN``, else ``$AGENTRL_CONTROLLER_TOKEN``)
    token: str | None = field(default=None, repr=False)
    #: limit per call; keep it above the controller's interact timeout so that the controller answers first
    timeout_s: float = 300.0
    #: limit on opening a connection to the controller
    connect_timeout_s: float = 5.0
    #: extra attempts on 5xx replies and on connections that could not be opened (0: none)
    retries: int = 3
    #: the first wait between attempts (doubled each retry, jittered), and of a start's wait for an unavailable
    #: controller
    backoff_s: float = 0.25
    #: pooled connections to the controller
    max_connections: int = 256
    #: how long one start waits for a controller that cannot be reached or answers 502/503/504
    #: (``env.unavailable_timeout_s`` of a run)
    unavailable_timeout_s: float = 120.0
    #: the longest pause between two probes of such a controller (a larger Retry-After is honoured up to
    #: :data:`~env_controller.clients.http_client.MAX_RETRY_AFTER_S`)
    max_backoff_s: float = 2.0
    #: limit on a cancel (best effort)
    cancel_timeout_s: float = 10.0

    def check(self) -> None:
        """Times positive, retries >= 0, at least one connection."""
        super().check()
        self.require_seconds("timeout_s", "connect_timeout_s", "backoff_s", "unavailable_timeout_s", "max_backoff_s",
                             "cancel_timeout_s")
        self.require_int("retries", low=0, why="0: no retries")
        self.require_positive_int("max_connections")
