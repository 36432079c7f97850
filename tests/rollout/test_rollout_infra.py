"""Infrastructure failures are never trained: the rollout manager keeps a group's valid episodes when enough
remain, re-runs the group when too few do, and drops it (counted) once its attempts run out; the agent loop
carries the env's error text and marks our own faults as such."""
from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from env_controller.protocol import SampleStatus, TaskReply
from rollout_sglang.chat_template import ChatTemplate
from rollout_sglang.engines.protocol import GenerationOutput, SamplingParams
from rollout_sglang.episode_options import EpisodeLimits, EpisodeOptions
from rollout_sglang.rollout.manager import (
    AdmissionOptions,
    DropLimitOptions,
    PromptSampler,
    RetryOptions,
    RolloutError,
    RolloutManager,
    RolloutOptions,
)
from rollout_sglang.trajectory import INFRA_STATUSES, Trajectory

SIZE = 4


class OkEngine:
    """Answers every prompt with "ok" and the end of turn, stamped with its ``version``."""

    def __init__(self, template: ChatTemplate) -> None:
        self.ok = template.tokenizer.encode("ok", add_special_tokens=False) + [template.im_end_id]
        self.version = 0

    async def generate(self, prompts, params: SamplingParams, seeds=None):
        return [GenerationOutput(list(self.ok), [-0.5] * len(self.ok), "stop", self.version) for _ in prompts]


class FlakyEnv:
    """One turn per episode, reward = the session's number (so groups have variance). Per task index, with the
    sessions of each group started in order (one group at a time):

    - index 1: the first episode of every group ends with the worker's "task error" and its error text;
    - index 2: the first attempt of every group cannot start at all (start_sample raises), the next attempt works;
    - index 3: three episodes of every four end with "task error" (too few valid ones, ever);
    - index 0: never fails.
    """

    def __init__(self) -> None:
        self.starts: Counter = Counter()
        self.failing: set[str] = set()
        self.n = 0

    async def start_sample(self, task, index):
        k = self.starts[index]
        self.starts[index] += 1
        if index == 2 and (k // SIZE) % 2 == 0:
            raise ConnectionError("env controller unreachable")
        self.n += 1
        sid = f"{index}-{self.n}"
        if (index == 1 and k % SIZE == 0) or (index == 3 and k % SIZE != 0):
            self.failing.add(sid)
        return sid, TaskReply(messages=[{"role": "user", "content": f"task {index}: answer"}])

    async def interact(self, session_id, messages):
        await asyncio.sleep(0)
        if session_id in self.failing:
            return TaskReply(messages=[], status=SampleStatus.TASK_ERROR, finish=True,
                             error="worker http://w1 declared dead: no heartbeat for 15 s")
        return TaskReply(messages=[], status=SampleStatus.COMPLETED, finish=True, reward=float(self.n % 7) / 7)

    async def cancel(self, session_id):
        pass


def _run(template: ChatTemplate, steps: int, seed: int = 3) -> tuple[RolloutManager, FlakyEnv, list[list]]:
    sampler = PromptSampler(["t"], [1.0], {"t": [0, 1, 2, 3]}, SIZE, seed=seed)
    env = FlakyEnv()
    engine = OkEngine(template)
    mgr = RolloutManager(engine, env, template, sampler, _options(template, total_groups=steps))
    batches = []
    mgr.start()
    try:
        for version in range(steps):
            batch = mgr.get_batch(timeout_s=30)
            batches.append((batch, dict(mgr.last_batch)))
            engine.version = version + 1  # the step's weights, then the next groups
            mgr.set_version(version + 1)
    finally:
        mgr.stop(timeout_s=10)
    return mgr, env, batches


def test_infra_failures_are_never_trained(template: ChatTemplate) -> None:
    steps = 12
    mgr, env, batches = _run(template, steps)
    trained = [g for batch, _ in batches for g in batch]
    assert len(trained) == steps and all(len(batch) == 1 for batch, _ in batches)  # every batch full
    assert mgr.stats.dropped_stale == 0
    for g in trained:
        assert not any(t.infra_failed or t.status in INFRA_STATUSES for t in g.trajectories), g
        assert g.request.index != 3  # never enough valid episodes: always dropped
        assert len(g.trajectories) == (SIZE - 1 if g.request.index == 1 else SIZE)  # index 1 trains on its 3
    drawn = Counter(g.request.index for g in trained)
    assert drawn[1] and drawn[2], drawn  # the seed draws both kinds of recoverable group
    st = mgr.stats
    dropped = st.dropped_infra["t"]
    assert dropped >= 1 and env.starts[3] == dropped * 3 * SIZE  # each index-3 group: 3 attempts, then dropped
    # every failed episode counted: one per index-1 group, a whole first attempt per index-2 group, 3 of 4 per
    # attempt of an index-3 group
    assert st.infra_failed["t"] == drawn[1] + SIZE * drawn[2] + 3 * 3 * dropped
    assert st.infra_retried == drawn[2] + 2 * dropped
    # reported with the batches: what happened since the previous one, adding up to the totals so far
    assert sum(last["infra_failed"].get("t", 0) for _, last in batches) == st.infra_failed["t"]
    assert sum(last["infra_retried"] for _, last in batches) == st.infra_retried
    assert sum(last["infra_dropped"].get("t", 0) for _, last in batches) == dropped
    assert "declared dead" in mgr.last_infra_error or "start_sample failed" in mgr.last_infra_error


def _options(template: ChatTemplate, total_groups: int | None = None, min_valid_fraction: float = 0.5,
             max_dropped_in_row: int = 0) -> RolloutOptions:
    """One group per batch, two turns per episode, with the given limits."""
    return RolloutOptions(AdmissionOptions(batch_groups=1, total_groups=total_groups),
                          episode=EpisodeOptions(EpisodeLimits(max_turns=2, max_total_tokens=512), env_timeout_s=10),
                          sampling=SamplingParams(max_new_tokens=4, stop_token_ids=list(template.stop_token_ids)),
                          retry=RetryOptions(min_valid_fraction=min_valid_fraction),
                          drop_limit=DropLimitOptions(max_dropped_in_row))


def _manager_on(template: ChatTemplate, index: int, **kw) -> RolloutManager:
    """A one-group-per-batch manager drawing only ``index`` of FlakyEnv's task, with ``kw`` (e.g. limits)."""
    sampler = PromptSampler(["t"], [1.0], {"t": [index]}, SIZE, seed=0)
    return RolloutManager(OkEngine(template), FlakyEnv(), template, sampler, _options(template, **kw))


def test_a_group_never_trains_on_too_few_valid_episodes(template: ChatTemplate) -> None:
    """min_valid_fraction=1: any infrastructure failure sends the whole group back (index 1 is re-run until its
    attempts run out, then dropped, and the next draw fares the same): the trainer's wait ends in a timeout that
    says what failed, never in a batch."""
    mgr = _manager_on(template, 1, total_groups=1, min_valid_fraction=1)
    mgr.start()
    try:
        last = r"infrastructure failures so far: \d+, the last: task error: worker http://w1 declared dead"
        with pytest.raises(TimeoutError, match=last):
            mgr.get_batch(timeout_s=3)
    finally:
        mgr.stop(timeout_s=10)
    st = mgr.stats
    assert st.dropped_infra["t"] >= 1 and st.infra_retried >= 2 and st.accepted == 0
    with pytest.raises(ValueError, match="min_valid_fraction=0 must be in"):
        _manager_on(template, 1, min_valid_fraction=0)


def test_an_episode_without_tokens_is_an_infra_failure() -> None:
    """A trajectory that holds no token at all (its env never started) can never reach the trainer."""
    empty = Trajectory([], [], [], [], [], task="t", index=0, group_id=0, status="completed")
    assert empty.infra_failed
    ok = Trajectory([1, 2], [0, 1], [0.0, -0.1], [-1, 0], [(1, 2)], task="t", index=0, group_id=0, status="completed")
    assert not ok.infra_failed
    for status in ("task error", "cancelled", "internal error"):
        ok.status = status
        assert ok.infra_failed


def test_a_task_whose_groups_are_all_dropped_stops_the_run(template: ChatTemplate) -> None:
    """Every group of the task is dropped (index 3: too few valid episodes, ever): after max_dropped_in_row drops in
    a row the trainer's wait ends at once in an error naming the task and the environment's last error, not in
    get_batch's timeout."""
    mgr = _manager_on(template, 3, total_groups=10, max_dropped_in_row=2)
    mgr.start()
    try:
        with pytest.raises(RolloutError, match=r"task t: 2 groups in a row were dropped .*declared dead"):
            mgr.get_batch(timeout_s=60)
    finally:
        mgr.stop(timeout_s=10)
    assert mgr.stats.dropped_infra["t"] >= 2 and mgr.stats.accepted == 0
    with pytest.raises(ValueError, match="max_dropped_groups_in_row=-1 must be >= 0"):
        _manager_on(template, 3, max_dropped_in_row=-1)
