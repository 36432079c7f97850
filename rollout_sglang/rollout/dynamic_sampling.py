"""Dynamic sampling (DAPO): a finished group whose training rewards are all equal carries no GRPO signal.

Such a group is dropped (counted per task in ``dropped_zero_var``, never accepted) and the slot it held is free
again, so admission draws another prompt. Slots are counted per batch: with ``batch_groups`` groups per batch,
batch ``k`` holds slots ``k * batch_groups .. (k + 1) * batch_groups - 1`` of the sequence ``consumed + queued +
running + short``, and a fresh draw is charged to the batch its slot falls in. Once
``int(dynamic_sampling_max_groups * batch_groups)`` draws were charged to a batch, its remaining free slots are given
up (``short``: they count as covered for admission and the staleness accounting, like accepted groups, but hold no
group), and the trainer takes that batch with fewer groups. A batch left with no group at all trains
on the newest zero-variance groups instead (advantage 0: the policy-gradient term is 0, the pipeline advances);
if none of those is fresh enough for the staleness cap, one slot is reopened for a draw beyond the budget, so a
batch always comes and nothing hangs.
"""
from __future__ import annotations

import copy
import logging
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from env_controller.options import Options
from rollout_sglang.rollout.groups import FinishedGroup
from rollout_sglang.rollout.stats import ManagerStats
from rollout_sglang.trajectory import Trajectory

logger = logging.getLogger(__name__)


def zero_variance(group: FinishedGroup, reward: Callable[[Trajectory], float]) -> bool:
    """Whether every trajectory of ``group`` has the same ``reward`` (exactly: GRPO's advantages are then 0)."""
    values = [float(reward(t)) for t in group.trajectories]
    return max(values) == min(values)


@dataclass
class DynamicSamplingOptions(Options):
    """Dynamic sampling's draw budget (the sampling is on when the manager is given a training reward); the
    trainer's ``algo`` section is one."""

    KEY: ClassVar[str] = "algo"

    #: most prompts drawn per batch, in units of the batch's groups (``rollout.prompts_per_step`` in a run):
    #: ``int(dynamic_sampling_max_groups * batch_groups)``
    dynamic_sampling_max_groups: float = 4.0

    def check(self) -> None:
        """The budget holds at least one batch."""
        super().check()
        self.require(self.dynamic_sampling_max_groups >= 1, "dynamic_sampling_max_groups",
                     "must be >= 1 (groups drawn per batch, in units of the batch's groups: "
                     "rollout.prompts_per_step in a run)")


class DynamicSampling:
    """The zero-variance test, the per-batch draw budget and the groups that may stand in for an empty batch.

    reward: the training reward (e.g. the run's RewardShaper), None: dynamic sampling off (every draw is free,
    no group is dropped).
    """

    def __init__(self, options: DynamicSamplingOptions, batch_groups: int,
                 reward: Callable[[Trajectory], float] | None) -> None:
        self.reward = reward
        self.batch_groups = int(batch_groups)
        self.limit = max(self.batch_groups, int(options.dynamic_sampling_max_groups * self.batch_groups))
        self.short = 0  # slots given up and not yet consumed by a batch
        self.draws: dict[int, int] = {}  # batch index -> fresh draws charged to it
        self.forced = 0  # draws allowed beyond a batch's budget (an empty batch without a usable stand-in)
        self.fallback: deque[FinishedGroup] = deque(maxlen=self.batch_groups)  # newest zero-variance groups
        self.dropped_since: list[FinishedGroup] = []
        self.drawn_at_take = 0
        self._warned_batch = -1

    @property
    def enabled(self) -> bool:
        """Whether dynamic sampling is on."""
        return self.reward is not None

    def charge_draw(self, batch: int, stats: ManagerStats) -> bool:
        """Charge a fresh draw to batch ``batch``; False when its budget is spent (the slot is then given up)."""
        if self.reward is None:
            return True
        drawn = self.draws.get(batch, 0)
        if drawn >= self.limit:
            if self.forced <= 0:
                if self._warned_batch != batch:
                    self._warned_batch = batch
                    logger.warning("dynamic sampling: batch %d drew its %d groups (algo.dynamic_sampling_max_groups "
                                   "x rollout.prompts_per_step) and the rest had zero reward variance; it trains on "
                                   "fewer groups", batch + 1, self.limit)
                self.short += 1
                stats.short_slots += 1
                return False
            self.forced -= 1
            stats.forced_draws += 1
        self.draws[batch] = drawn + 1
        return True

    def is_flat(self, g: FinishedGroup) -> bool:
        """Whether ``g`` carries no signal and is dropped; a reward that raises keeps the group (and says so)."""
        if self.reward is None:
            return False
        try:
            return zero_variance(g, self.reward)
        except Exception as e:  # noqa: BLE001 - a failing reward must not stall the rollout thread
            logger.warning("dynamic sampling: the reward of group %d (%s #%d) failed (%r); keeping the group",
                           g.request.group_id, g.request.task, g.request.index, e)
            return False

    def drop(self, g: FinishedGroup, stats: ManagerStats) -> None:
        """Drop the flat group ``g``: never accepted, kept as a possible stand-in, its slot free for another draw."""
        stats.dropped_zero_var[g.request.task] += 1
        self.fallback.append(g)
        self.dropped_since.append(g)

    def stand_in(self, oldest: int) -> list[FinishedGroup]:
        """The newest zero-variance groups no older than version ``oldest`` (at most a batch), taken; [] if none."""
        usable = [g for g in self.fallback if g.min_version >= oldest][-self.batch_groups:]
        ids = {id(g) for g in usable}
        self.fallback = deque((g for g in self.fallback if id(g) not in ids), maxlen=self.batch_groups)
        return usable

    def reopen_slot(self) -> bool:
        """Reopen one given-up slot for a draw beyond the budget, unless one is open already; whether it did."""
        if self.forced != 0:
            return False
        self.short -= 1
        self.forced += 1
        return True

    def taken(self, short_used: int, consumed_batches: int) -> None:
        """A batch was taken with ``short_used`` given-up slots; ``consumed_batches`` are now consumed."""
        self.short -= short_used
        self.forced = 0
        first = consumed_batches - 1
        self.draws = {k: v for k, v in self.draws.items() if k > first}

    def since_take(self, stats: ManagerStats) -> dict[str, Any]:
        """``drawn`` (fresh prompts), ``dropped`` (task -> flat groups) and ``dropped_groups`` since the previous
        call."""
        out = {"drawn": stats.drawn - self.drawn_at_take,
               "dropped": dict(Counter(g.request.task for g in self.dropped_since)),
               "dropped_groups": self.dropped_since}
        self.dropped_since, self.drawn_at_take = [], stats.drawn
        return out

    def state_dict(self) -> dict[str, Any]:
        """The given-up slots, draws, forced draws and stand-ins (a checkpoint's ``short``, ``draws``, ``forced``,
        ``fallback``)."""
        return {"short": self.short, "draws": dict(self.draws), "forced": self.forced,
                "fallback": copy.deepcopy(list(self.fallback))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (the keys may be missing: a checkpoint of a run without them)."""
        self.short = int(state.get("short", 0))
        self.draws = {int(k): int(v) for k, v in state.get("draws", {}).items()}
        self.forced = int(state.get("forced", 0))
        self.fallback = deque(state.get("fallback", []), maxlen=self.batch_groups)
