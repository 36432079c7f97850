"""The settings of the trainer's client of an env controller
(:class:`~env_controller.clients.http_client.HttpEnvClient`), declared and checked once: :class:`ControllerAccess`
(what a run's ``env`` section says of the client) and the rest, :class:`EnvClientOptions`."""
from __future__ import annotations

from dataclasses import dataclass, field

from env_controller.options import Options


@dataclass
class ControllerAccess(Options):
    """The trainer's credential at an env controller, and how long a start waits for the controller; the trainer's
    ``env`` section derives from it."""

    #: the controller's trainer credential, its ``--trainer-token`` or shared ``--token`` (None or "": the password
    #: of the controller URL when it holds one, else ``$AGENTRL_TRAINER_TOKEN``, else ``$AGENTRL_CONTROLLER_TOKEN``,
    #: else none)
    token: str | None = field(default=None, repr=False)
    #: how long one episode's start waits for a controller that cannot be reached or cannot serve the task yet (it
    #: answers 502/503/504: a restart, its workers re-registering), seconds; the waiting starts share one probe
    #: with backoff, and past this the episode ends as an infrastructure failure. Sessions open at a controller
    #: restart are lost either way
    unavailable_timeout_s: float = 120.0

    def check(self) -> None:
        """The wait is positive seconds."""
        super().check()
        self.require_seconds("unavailable_timeout_s")


@dataclass
class EnvClientOptions(ControllerAccess):
    """Timeouts, retries and connections of an :class:`~env_controller.clients.http_client.HttpEnvClient`
    (times in seconds; its module docstring tells which call retries what), and its :class:`ControllerAccess`."""

    KEY = "env_client"

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
    #: the longest pause between two probes of such a controller (a larger Retry-After is honoured up to
    #: :data:`~env_controller.clients.http_client.MAX_RETRY_AFTER_S`)
    max_backoff_s: float = 2.0
    #: limit on a cancel (best effort)
    cancel_timeout_s: float = 10.0

    def check(self) -> None:
        """Times positive, retries >= 0, at least one connection."""
        super().check()
        self.require_seconds("timeout_s", "connect_timeout_s", "backoff_s", "max_backoff_s", "cancel_timeout_s")
        self.require_int("retries", low=0, why="0: no retries")
        self.require_positive_int("max_connections")
