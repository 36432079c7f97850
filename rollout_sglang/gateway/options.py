"""The gateway's settings: where it listens, how many sessions and connections it holds, when it pushes back; and
how long the agent runner gives an agent.

:class:`GatewayOptions` is what :class:`~rollout_sglang.gateway.Gateway` and its
:class:`~rollout_sglang.gateway.GatewayServer` are configured with, and the trainer's ``gateway`` section as it is
(``agentrl gateway``, and ``agentrl train`` with ``rollout.agent: gateway``). :class:`AgentRunnerOptions` is the
:class:`~rollout_sglang.gateway.AgentRunner`'s, part of the trainer's ``rollout`` section.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from env_controller.http.net import is_host
from env_controller.options import Options

#: environment variable of the gateway's bearer token
TOKEN_ENV = "AGENTRL_GATEWAY_TOKEN"


@dataclass
class GatewayOptions(Options):
    """The OpenAI-compatible gateway's settings (docs/rollout.md)."""

    KEY: ClassVar[str] = "gateway"

    #: address to bind; anything but loopback needs a bearer token
    host: str = "127.0.0.1"
    #: port to bind (0: a free one)
    port: int = 0
    #: the environment variable holding the bearer token (unset or empty: no token, loopback only); clients send
    #: it as their OpenAI api key
    token_env: str = TOKEN_ENV
    #: sessions open at once (one more is a 429)
    max_sessions: int = 4096
    #: a session nobody used for that long is cancelled (not those of a training run's agents), seconds
    session_idle_timeout_s: float = 900.0
    #: turns waiting for the engines at once beyond which a new turn of an outside agent gets 429 (0: no bound)
    max_queued_turns: int = 0
    #: the ``Retry-After`` of a 429, seconds (docs/rollout.md, Backpressure)
    retry_after_s: float = 1.0
    #: HTTP connections open at once; one more is answered 503 and closed (logged once). The default is the
    #: HTTP servers' own (``env_controller.http.fast.MAX_CONNECTIONS``), written out: importing the server here
    #: would load aiohttp wherever the config is read
    max_connections: int = 4096

    def check(self) -> None:
        """See the fields."""
        super().check()
        self.require_positive_int("max_connections")
        self.require(bool(self.host) and is_host(self.host), "host",
                     "must be a host name or IP address such as 127.0.0.1 (no scheme, port or path)")
        self.require(0 <= self.port < 65536, "port", "must be a TCP port (1-65535) or 0 (a free port)")
        self.require(bool(self.token_env), "token_env", "is empty; name the environment variable of the token, "
                     "e.g. AGENTRL_GATEWAY_TOKEN")
        self.require_positive_int("max_sessions")
        self.require_above_zero("session_idle_timeout_s", unit="seconds")
        self.require(self.max_queued_turns >= 0, "max_queued_turns", "must be >= 0 (0: no bound)")
        self.require_above_zero("retry_after_s", unit="seconds")


@dataclass
class AgentRunnerOptions(Options):
    """How long the :class:`~rollout_sglang.gateway.AgentRunner` gives an agent; the trainer's ``rollout`` section is
    one."""

    KEY: ClassVar[str] = "rollout"

    #: limit on one call of ``agent_fn`` (one episode), seconds; an agent that runs past it is cancelled and its
    #: episode ends as an agent error
    agent_timeout_s: float = 600.0

    def check(self) -> None:
        """A positive limit."""
        super().check()
        self.require_above_zero("agent_timeout_s", unit="seconds")
