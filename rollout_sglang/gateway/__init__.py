"""The OpenAI-compatible gateway: an agent's Chat Completions calls become token-exact trajectories.

:class:`Gateway` (sessions, sampling through the version pool, the environment link), :class:`GatewayServer`
(its HTTP face) and :class:`AgentRunner` (training with a user's agent function). See docs/rollout.md.
"""
from rollout_sglang.gateway.agent_runner import AgentRunner
from rollout_sglang.gateway.gateway import AGENT_ERROR, Gateway
from rollout_sglang.gateway.server import TOKEN_ENV, GatewayServer

__all__ = ["AGENT_ERROR", "AgentRunner", "Gateway", "GatewayServer", "TOKEN_ENV"]
