"""The reward the trainer uses for a finished trajectory: the task's own (or a user's reward function's),
made binary, minus the timeout penalty and DAPO's overlong penalty, per the run's config."""
from __future__ import annotations

import logging
import math
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from megatron_agentrl.config import AlgoConfig, TaskSpec, load_reward_fn
from rollout_sglang.trajectory import Trajectory

logger = logging.getLogger(__name__)

# Statuses that mean "ran out of turns, context or time" (the timeout penalty applies).
TIMEOUT_STATUSES = ("task limit reached", "agent context limit")


def is_success(traj: Trajectory) -> bool:
    """The task's ``success`` metric when it reports one, else ``reward >= 1``."""
    return bool(traj.metrics.get("success", traj.reward >= 1.0))


def is_timeout(traj: Trajectory) -> bool:
    """Whether the episode ran out of turns or context, or an env call timed out."""
    return traj.status in TIMEOUT_STATUSES or (traj.status == "task error" and "timed out" in traj.error)


def overlong_penalty(length: int, max_tokens: int, buffer: int, penalty: float) -> float:
    """DAPO's soft overlong penalty of an episode of ``length`` tokens under a budget of ``max_tokens``:
    0 up to ``max_tokens - buffer``, then growing linearly to ``penalty`` at the budget (and past it)."""
    if buffer <= 0 or penalty == 0:
        return 0.0
    over = length - (max_tokens - buffer)
    return penalty * min(1.0, over / buffer) if over > 0 else 0.0


class RewardShaper:
    """``shaper(traj) -> float``: the training reward of ``traj`` (see :meth:`__call__`), computed once per
    trajectory (dynamic sampling on the rollout thread and the batch on the trainer's ask for the same one: a
    costly or random ``reward_fn`` is paid, and decides, once). Thread-safe.

    specs: the run's tasks; algo: the overlong-shaping settings; max_total_tokens: the episode token budget
    (``rollout.max_total_tokens``).
    """

    def __init__(self, specs: Sequence[TaskSpec] = (), algo: AlgoConfig | None = None,
                 max_total_tokens: int = 0) -> None:
        self.specs = {s.name: s for s in specs}
        self.reward_fns: dict[str, Callable[[Trajectory], Any]] = {
            s.name: load_reward_fn(s.reward_fn, f"tasks[{s.name}].reward_fn") for s in specs if s.reward_fn}
        self.algo = algo or AlgoConfig()
        self.max_total_tokens = int(max_total_tokens)
        self.reward_fn_errors = 0
        self._lock = threading.Lock()
        self._shaped: dict[int, float] = {}  # id(traj) -> reward, dropped when the trajectory is collected

    def base_reward(self, traj: Trajectory) -> float:
        """The task's reward, or its ``reward_fn``'s (a failing or non-finite one falls back to the task's,
        with a warning, and counts in :attr:`reward_fn_errors`)."""
        fn = self.reward_fns.get(traj.task)
        if fn is None:
            return float(traj.reward)
        try:
            value = float(fn(traj))
            if not math.isfinite(value):
                raise ValueError(f"returned {value}")
            return value
        except Exception as e:  # noqa: BLE001 - a judge's failure must not end the run
            with self._lock:
                self.reward_fn_errors += 1
            logger.warning("reward_fn of task %s failed on a trajectory (%s: %s); using the task's reward %s",
                           traj.task, type(e).__name__, e, traj.reward)
            return float(traj.reward)

    def __call__(self, traj: Trajectory) -> float:
        """The base reward (:meth:`base_reward`); 1.0 / 0.0 by :func:`is_success` when the task has
        ``binary_reward``; minus ``timeout_penalty`` when :func:`is_timeout`; minus the overlong penalty
        (``algo.overlong_buffer`` / ``overlong_penalty``) of its token count."""
        key = id(traj)
        with self._lock:
            cached = self._shaped.get(key)
        if cached is not None:
            return cached
        r = self._shape(traj)
        with self._lock:
            if key not in self._shaped:
                self._shaped[key] = r
                weakref.finalize(traj, self._forget, key)
        return r

    def _forget(self, key: int) -> None:
        with self._lock:
            self._shaped.pop(key, None)

    def _shape(self, traj: Trajectory) -> float:
        spec = self.specs.get(traj.task)
        r = self.base_reward(traj)
        if spec is not None:
            if spec.binary_reward:
                r = 1.0 if is_success(traj) else 0.0
            if spec.timeout_penalty and is_timeout(traj):
                r -= float(spec.timeout_penalty)
        if self.max_total_tokens:
            r -= overlong_penalty(len(traj.token_ids), self.max_total_tokens, self.algo.overlong_buffer,
                                  self.algo.overlong_penalty)
        return r
