"""The rollout manager's counters (:class:`ManagerStats`) and their form in a checkpoint."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, fields
from typing import Any


@dataclass
class ManagerStats:
    """Counters of a :class:`RolloutManager` (cumulative since it started; a resumed run's manager goes on from
    the checkpoint's, see :meth:`RolloutManager.load_state_dict`).

    consumed counts batch slots the trainer took (``batch_groups`` per batch, a short batch's given-up
    slots included); drawn: fresh prompts drawn (retries are not); dropped_zero_var: groups dropped by
    dynamic sampling, per task; short_slots: slots given up when a batch's draw budget ran out;
    fallback_batches: batches trained on zero-variance groups; forced_draws: draws beyond a budget;
    infra_failed: episodes that ended for an infrastructure reason, per task (never trained); infra_retried:
    groups re-run for them; dropped_infra: groups dropped for them once their attempts ran out, per task.
    """

    started: int = 0
    accepted: int = 0
    consumed: int = 0
    dropped_stale: int = 0
    failed: int = 0
    retried: int = 0
    wait_s: float = 0.0
    group_times: list[float] = field(default_factory=list)
    drawn: int = 0
    dropped_zero_var: Counter = field(default_factory=Counter)
    short_slots: int = 0
    fallback_batches: int = 0
    forced_draws: int = 0
    infra_failed: Counter = field(default_factory=Counter)
    infra_retried: int = 0
    dropped_infra: Counter = field(default_factory=Counter)


def stats_state(stats: ManagerStats) -> dict[str, Any]:
    """The counters of ``stats`` as plain values (Counters as dicts; ``group_times``, one float per group, left out)."""
    return {f.name: dict(v) if isinstance(v := getattr(stats, f.name), Counter) else v
            for f in fields(ManagerStats) if f.name != "group_times"}


def stats_from_state(state: dict[str, Any], consumed: int) -> ManagerStats:
    """:class:`ManagerStats` from :func:`stats_state` (``consumed`` as the state's own top-level count)."""
    stats = ManagerStats()
    for f in fields(ManagerStats):
        if f.name in state and f.name != "group_times":
            v = state[f.name]
            setattr(stats, f.name, Counter(v) if isinstance(getattr(stats, f.name), Counter) else v)
    stats.consumed = consumed
    return stats
