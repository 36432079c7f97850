"""The OpenAI-compatible gateway: an agent's Chat Completions calls become token-exact trajectories.

:class:`Gateway` (sessions, sampling through the version pool, the environment link), :class:`GatewayServer`
(its HTTP face), :class:`AgentRunner` (training with a user's agent function), :class:`GatewayOptions` and
:class:`AgentRunnerOptions` (their settings). See docs/rollout.md.

The names load on first use: the trainer's config imports :mod:`rollout_sglang.gateway.options` alone, without
the engines and the HTTP server.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollout_sglang.gateway.agent_runner import AgentRunner
    from rollout_sglang.gateway.gateway import AGENT_ERROR, Gateway
    from rollout_sglang.gateway.options import TOKEN_ENV, AgentRunnerOptions, GatewayOptions
    from rollout_sglang.gateway.server import GatewayServer

_WHERE = {"AgentRunner": "agent_runner", "AgentRunnerOptions": "options", "AGENT_ERROR": "gateway",
          "Gateway": "gateway", "GatewayOptions": "options", "GatewayServer": "server", "TOKEN_ENV": "options"}

__all__ = ["AGENT_ERROR", "AgentRunner", "AgentRunnerOptions", "Gateway", "GatewayOptions", "GatewayServer",
           "TOKEN_ENV"]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
