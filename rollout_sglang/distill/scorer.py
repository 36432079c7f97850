"""Teacher scoring on the rollout side: each finished episode's sampled tokens get its task's teacher's log-probs,
before its group is queued for training.

:class:`TeacherScorer` is the rollout manager's ``score`` step: the episodes of a cohort, grouped by teacher, go
to one of that teacher's engines in one ``score`` call (a local engine, or an SGLang server:
:meth:`~rollout_sglang.engines.protocol.Engine.score`), the other cohorts meanwhile generating. A call that fails
or outlasts ``score_timeout_s`` is tried on the teacher's next engine, ``max_attempts`` times in all; then its
episodes end as :data:`~rollout_sglang.trajectory.TEACHER_ERROR`, an infrastructure failure that the manager
re-runs or leaves out, never trained without a teacher's score.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

from rollout_sglang.distill.options import DistillOptions
from rollout_sglang.trajectory import TEACHER_ERROR, Trajectory

logger = logging.getLogger(__name__)


class TeacherScorer:
    """Scores episodes with their task's teacher (see the module doc).

    teachers: per teacher, its engines (objects with ``async score(sequences, starts)``); task_teacher: task ->
    index into ``teachers`` (:meth:`DistillOptions.teacher_of`); options: the ``distill`` section.
    """

    def __init__(self, teachers: Sequence[Sequence[Any]], task_teacher: Mapping[str, int],
                 options: DistillOptions) -> None:
        if any(not engines for engines in teachers):
            raise ValueError("every teacher needs at least one engine")
        self.teachers = [list(e) for e in teachers]
        self.task_teacher = dict(task_teacher)
        self.options = options
        self._next = [0] * len(self.teachers)  # each teacher's engine to try first, in turn
        #: counts over the run: ``calls``, ``failures`` (calls that failed or timed out), ``unscored`` (episodes
        #: left without a score), ``seconds`` (spent in successful calls), ``episodes`` (scored)
        self.stats = {"calls": 0, "failures": 0, "unscored": 0, "seconds": 0.0, "episodes": 0}

    async def __call__(self, trajs: list[Trajectory]) -> None:
        """Attach ``teacher_logprobs`` to every episode of ``trajs`` that is not already an infrastructure failure;
        an episode no engine of its teacher could score becomes one (:data:`TEACHER_ERROR`)."""
        by_teacher: dict[int, list[Trajectory]] = {}
        for t in trajs:
            if t.infra_failed or not t.num_generated:
                continue
            if t.task not in self.task_teacher:
                raise ValueError(f"an episode of task {t.task!r}, which no teacher scores (distill.teachers)")
            by_teacher.setdefault(self.task_teacher[t.task], []).append(t)
        await asyncio.gather(*(self._score(i, group) for i, group in by_teacher.items()))

    async def _score(self, teacher: int, trajs: list[Trajectory]) -> None:
        engines = self.teachers[teacher]
        sequences = [t.token_ids for t in trajs]
        starts = [t.loss_mask.index(1) for t in trajs]  # the context before the first sampled token is not scored
        errors = []
        for attempt in range(self.options.max_attempts):
            k = self._next[teacher] % len(engines)
            self._next[teacher] = k + 1
            t0 = time.monotonic()
            self.stats["calls"] += 1
            try:
                scored = await asyncio.wait_for(engines[k].score(sequences, starts), self.options.score_timeout_s)
                _check_scores(scored, sequences)
            except Exception as e:  # noqa: BLE001 - another engine of the teacher, then an infrastructure failure
                self.stats["failures"] += 1
                what = "timed out" if isinstance(e, asyncio.TimeoutError) else repr(e)
                errors.append(f"engine {k}: {what}")
                logger.warning("teacher %d, engine %d: scoring %d episodes failed (attempt %d of %d): %s", teacher,
                               k, len(trajs), attempt + 1, self.options.max_attempts, what[:300])
                continue
            seconds = time.monotonic() - t0
            self.stats["seconds"] += seconds
            self.stats["episodes"] += len(trajs)
            for t, lps in zip(trajs, scored):
                t.teacher_logprobs = [float(lp) if m else 0.0 for lp, m in zip(lps, t.loss_mask)]
                t.timings["teacher_score_s"] = seconds / len(trajs)
            return
        self.stats["unscored"] += len(trajs)
        for t in trajs:
            t.status = TEACHER_ERROR
            t.error = (f"teacher {teacher} could not score the episode in {self.options.max_attempts} attempts: "
                       + "; ".join(errors))[:2000]


def _check_scores(scored: Any, sequences: list[list[int]]) -> None:
    """ValueError unless ``scored`` holds one finite log-prob per token of each sequence (a teacher's answer is
    checked like any other input)."""
    if not isinstance(scored, list) or len(scored) != len(sequences):
        raise ValueError(f"the teacher answered {type(scored).__name__} of length "
                         f"{len(scored) if hasattr(scored, '__len__') else '?'} for {len(sequences)} sequences")
    for i, (lps, seq) in enumerate(zip(scored, sequences)):
        if len(lps) != len(seq):
            raise ValueError(f"the teacher scored {len(lps)} positions of sequence {i}, which has {len(seq)} tokens")
        bad = next((lp for lp in lps if not (isinstance(lp, (int, float)) and math.isfinite(lp) and lp <= 0)), None)
        if bad is not None:
            raise ValueError(f"the teacher gave sequence {i} a log-prob of {bad!r}; log-probs are finite and <= 0")
