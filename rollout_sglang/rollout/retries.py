"""Infrastructure retries: what becomes of a group whose episodes failed for a reason that is not the policy's.

An episode that ended for an infrastructure reason (``Trajectory.infra_failed``: the env or our code failed) is
never trained. A finished group keeps only its valid episodes when at least ``min_valid_fraction`` of its samples
(and at least 2, or 1 for groups of one) remain; otherwise it is re-run from scratch (a fresh attempt, up to
``max_attempts``) and then dropped, its slot free for another draw. A task whose last
``max_dropped_groups_in_row`` finished groups were all dropped fails the run: its environment is broken, and drawing
on would only wait out the trainer's timeout. A group whose agent-loop call raised is re-run the same way, up to
``max_attempts``.
"""
from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from env_controller.options import Options

if TYPE_CHECKING:  # the trainer's config imports this module: it stays free of the records' imports
    from rollout_sglang.rollout.groups import FinishedGroup
    from rollout_sglang.rollout.stats import ManagerStats

logger = logging.getLogger(__name__)

Verdict = Literal["keep", "retry", "drop"]


@dataclass
class RetryOptions(Options):
    """How groups with infrastructure failures are treated (see the module doc); the trainer's ``rollout`` section
    is one."""

    KEY: ClassVar[str] = "rollout"

    #: a group trains on its valid episodes when at least this share of its samples (and at least 2) ended without
    #: an infrastructure failure; otherwise it is re-run, then dropped (counted under ``infra/`` in metrics.jsonl)
    min_valid_fraction: float = 0.5
    #: tries of a group (the first run and its re-runs) before it is dropped (infrastructure failures) or fails
    #: the run (an agent-loop call that raised)
    max_attempts: int = 3

    def check(self) -> None:
        """The fraction is in (0, 1]; attempts are a positive integer."""
        super().check()
        self.require(0 < self.min_valid_fraction <= 1, "min_valid_fraction",
                     "must be in (0, 1]: the share of a group's samples that must end without an infrastructure "
                     "failure for it to train (0.5 is the default)")
        self.require_positive_int("max_attempts")


@dataclass
class DropLimitOptions(Options):
    """When dropped groups stop the run (see the module doc); the trainer's ``pipeline`` section is one."""

    KEY: ClassVar[str] = "pipeline"

    #: a task whose last this many finished groups were all dropped for infrastructure failures (each after its
    #: attempts) stops the run with the task's last error: its environment is broken (a wedged container engine, a
    #: task set that cannot start); 0 = never
    max_dropped_groups_in_row: int = 20

    def check(self) -> None:
        """The limit is a count, 0 for none."""
        super().check()
        self.require_non_negative("max_dropped_groups_in_row", why="0 = never stop for dropped groups")


class InfraRetries:
    """The verdicts on finished groups, the dropped-in-a-row count per task, and the counts since the last batch.

    options: the :class:`RetryOptions`; drop_limit: the :class:`DropLimitOptions`.
    """

    def __init__(self, options: RetryOptions, drop_limit: DropLimitOptions) -> None:
        self.min_valid_fraction = float(options.min_valid_fraction)
        self.max_attempts = int(options.max_attempts)
        self.max_dropped_in_row = int(drop_limit.max_dropped_groups_in_row)
        self.dropped_in_row: Counter = Counter()  # task -> groups dropped since its last kept group
        self.last_error = ""
        self.at_take: tuple[Counter, int, Counter] = (Counter(), 0, Counter())  # the counters at the last batch

    def may_retry(self, attempts: int) -> bool:
        """Whether a group tried ``attempts + 1`` times may run again."""
        return attempts + 1 < self.max_attempts

    def settle(self, g: FinishedGroup, attempts: int) -> tuple[Verdict, int]:
        """``("keep", n)`` (``g`` now holds only its valid episodes), ``("retry", n)`` or ``("drop", n)``, with
        ``n`` the episodes that failed."""
        failed = [t for t in g.trajectories if t.infra_failed]
        if g.trajectories and not failed:
            return "keep", 0
        valid = [t for t in g.trajectories if not t.infra_failed]
        size = g.request.size
        need = max(min(2, size), math.ceil(self.min_valid_fraction * size))
        verdict: Verdict = "keep" if len(valid) >= need else "retry" if self.may_retry(attempts) else "drop"
        if not failed:
            self.last_error = "no trajectory came back for the group"
        else:
            first = failed[0]
            self.last_error = f"{first.status}: {first.error}" if first.error else first.status
        logger.warning("group %d (%s #%d): %d of %d episodes ended for an infrastructure reason (%s)%s",
                       g.request.group_id, g.request.task, g.request.index, len(failed), len(g.trajectories),
                       self.last_error[:300],
                       {"keep": f"; training on the {len(valid)} valid ones",
                        "retry": f"; re-running the group (attempt {attempts + 2} of {self.max_attempts})",
                        "drop": f"; dropped after {self.max_attempts} attempts"}[verdict])
        if verdict == "keep":
            g.trajectories = valid
        return verdict, len(failed)

    def kept(self, task: str) -> None:
        """A group of ``task`` was kept: its run of drops ends."""
        self.dropped_in_row[task] = 0

    def dropped(self, task: str) -> str | None:
        """Count a dropped group of ``task``; the reason the run fails when that reaches the limit."""
        self.dropped_in_row[task] += 1
        n = self.dropped_in_row[task]
        if 0 < self.max_dropped_in_row <= n:
            return (f"task {task}: {n} groups in a row were dropped for infrastructure failures (each after "
                    f"{self.max_attempts} attempts): its environment looks broken; last error: {self.last_error} "
                    "(the limit is pipeline.max_dropped_groups_in_row)")
        return None

    def since_take(self, stats: ManagerStats) -> dict[str, Any]:
        """``infra_failed`` (task -> episodes), ``infra_retried`` (groups), ``infra_dropped`` (task -> groups) since
        the previous call."""
        failed0, retried0, dropped0 = self.at_take
        out = {"infra_failed": dict(stats.infra_failed - failed0), "infra_retried": stats.infra_retried - retried0,
               "infra_dropped": dict(stats.dropped_infra - dropped0)}
        self.at_take = (Counter(stats.infra_failed), stats.infra_retried, Counter(stats.dropped_infra))
        return out
