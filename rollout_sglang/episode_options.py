"""How one episode is played, by the agent loop (:mod:`rollout_sglang.agent_loop`) and through the gateway
(:mod:`rollout_sglang.gateway`) alike: its limits, and the run's choices around them.

:class:`EpisodeLimits` holds the settings a user writes (the trainer's ``rollout`` section is one, its keys
flat); :class:`EpisodeOptions` adds what the run decides for itself (the environment's time limit, whether
the engines capture routing). Light on purpose: the config imports it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from env_controller.options import Options


@dataclass
class EpisodeLimits(Options):
    """The turn and token limits of every episode."""

    KEY: ClassVar[str] = "rollout"

    #: generated turns per episode; an episode still running after that many ends with "task limit reached"
    max_turns: int = 4
    #: cap on prompt + all turns + environment replies (the context limit, >= 2); a turn is cut so the total
    #: never exceeds it, and an episode that runs out of room ends with "agent context limit"
    max_total_tokens: int = 512

    def check(self) -> None:
        """Both limits are positive integers; an episode holds at least two tokens."""
        super().check()
        self.require_positive_int("max_turns", "max_total_tokens")
        self.require(self.max_total_tokens >= 2, "max_total_tokens",
                     "must be >= 2: an episode holds its prompt and at least one generated token")


@dataclass
class EpisodeOptions(Options):
    """An episode's limits and the run's choices around them (the agent loop's and the gateway's options)."""

    #: the turn and token limits (the trainer passes its ``rollout`` section, which is one)
    limits: EpisodeLimits = field(default_factory=EpisodeLimits)
    #: limit on every environment call (start, interact, cancel), seconds; a timeout ends the episode with
    #: "task error" (the trainer's ``pipeline.env_timeout_s``, checked there)
    env_timeout_s: float = 120.0
    #: mixture-of-experts models: every turn asks its engine for the routed experts of the positions earlier
    #: turns did not cover, and the trajectory carries them (``Trajectory.routed_experts``)
    capture_routing: bool = False
