"""Simulated environment latency: an EnvClient wrapper that sleeps a heavy-tailed time per call.

Real agent environments (containers, databases, web pages) answer in times with a long tail;
the CPU tasks answer at once. :class:`LatencyEnvClient` puts a Pareto-distributed delay in front
of every ``start_sample`` and ``interact`` of the wrapped client, so that tests and benchmarks
see what the asynchronous pipeline is for (``pipeline.sim_env_latency_s``).
"""
from __future__ import annotations

import asyncio
import random
from typing import Any

from env_controller.protocol import TaskReply


def pareto_delay(rng: random.Random, scale_s: float, alpha: float, max_s: float) -> float:
    """One Pareto(alpha) draw with minimum ``scale_s``, capped at ``max_s`` (seconds)."""
    u = rng.random()
    return min(scale_s * (1.0 - u) ** (-1.0 / alpha), max_s)


class LatencyEnvClient:
    """Wraps an EnvClient; every start/interact first sleeps ``pareto_delay(scale_s, alpha, max_s)``.

    scale_s: the minimum (and scale) of the delay, seconds; alpha: the Pareto shape (1.5: mean
    3 x scale, infinite variance); max_s: cap (0 = 100 x scale); seed: the delay sequence.
    ``total_delay_s`` and ``calls`` count what was simulated. Other attributes are the wrapped
    client's.
    """

    def __init__(self, inner: Any, scale_s: float, alpha: float = 1.5, max_s: float = 0.0, seed: int = 0) -> None:
        if scale_s <= 0 or alpha <= 0:
            raise ValueError(f"scale_s={scale_s} and alpha={alpha} must be > 0")
        self.inner = inner
        self.scale_s = float(scale_s)
        self.alpha = float(alpha)
        self.max_s = float(max_s) if max_s > 0 else 100.0 * self.scale_s
        self._rng = random.Random(seed)
        self.total_delay_s = 0.0
        self.calls = 0

    async def _delay(self) -> None:
        d = pareto_delay(self._rng, self.scale_s, self.alpha, self.max_s)
        self.total_delay_s += d
        self.calls += 1
        await asyncio.sleep(d)

    async def start_sample(self, task: str, index: int) -> tuple[str, TaskReply]:
        """Delay, then the wrapped ``start_sample``."""
        await self._delay()
        return await self.inner.start_sample(task, index)

    async def interact(self, session_id: str, messages: list[dict]) -> TaskReply:
        """Delay, then the wrapped ``interact``."""
        await self._delay()
        return await self.inner.interact(session_id, messages)

    async def cancel(self, session_id: str) -> None:
        """The wrapped ``cancel`` (no delay)."""
        await self.inner.cancel(session_id)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
