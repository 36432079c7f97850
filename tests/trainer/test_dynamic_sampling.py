"""Dynamic sampling (``algo.dynamic_sampling``): a group whose training rewards are all equal is never
trained (unless a whole batch had nothing else), the batch is filled with more draws, at most
``dynamic_sampling_max_groups x prompts_per_step`` per batch, and nothing hangs when that budget runs out.

1. The rollout manager alone (fake engine and env, the real agent loop, batching engine and version pool),
   synchronous and asynchronous, with rewards chosen per group.
2. The whole pipeline (tiny model, megatron actor, local engine, built-in tasks) with a ``reward_fn`` that
   makes every third group flat, and one that makes every group flat.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import random
from collections import Counter

import pytest

from env_controller.protocol import SampleStatus, TaskReply
from megatron_agentrl.config import TaskSpec
from megatron_agentrl.pipeline.rewards import RewardShaper
from rollout_sglang.chat_template import ChatTemplate
from rollout_sglang.engines.batching import BatchingEngine
from rollout_sglang.engines.protocol import GenerationOutput, SamplingParams
from rollout_sglang.engines.version_pool import VersionPool
from rollout_sglang.episode_options import EpisodeLimits, EpisodeOptions
from rollout_sglang.rollout.manager import (
    AdmissionOptions,
    DynamicSamplingOptions,
    FinishedGroup,
    PromptSampler,
    RolloutManager,
    RolloutOptions,
    zero_variance,
)
from tests.support.fake_engine import UpdatableEngine
from tests.trainer.support import TINY_RL, train_tiny


class OkEngine(UpdatableEngine):
    """Answers every prompt with "ok" + <|im_end|> after a short compute time; stamps its version."""

    def __init__(self, template: ChatTemplate) -> None:
        super().__init__()
        self.ok = template.tokenizer.encode("ok", add_special_tokens=False) + [template.im_end_id]

    async def generate(self, prompts, params: SamplingParams, seeds=None):
        await asyncio.sleep(0.002)
        return [GenerationOutput(list(self.ok), [-0.5] * len(self.ok), "stop", self.version) for _ in prompts]


class RandomRewardEnv:
    """One or two turns per episode (by index), then a reward drawn uniformly from [0, 0.9) (never a success)."""

    def __init__(self, seed: int = 0) -> None:
        self.turns: dict[str, int] = {}
        self.rng = random.Random(seed)
        self.n = 0

    async def start_sample(self, task, index):
        self.n += 1
        sid = f"{task}-{index}-{self.n}"
        self.turns[sid] = 1 + index % 2
        await asyncio.sleep(0.001 * (index % 3))
        return sid, TaskReply(messages=[{"role": "user", "content": f"task {index}: answer"}])

    async def interact(self, session_id, messages):
        self.turns[session_id] -= 1
        if self.turns[session_id] <= 0:
            return TaskReply(messages=[], status=SampleStatus.COMPLETED, finish=True, reward=0.9 * self.rng.random())
        return TaskReply(messages=[{"role": "user", "content": "go on"}])

    async def cancel(self, session_id):
        self.turns.pop(session_id, None)


def _manager(template, reward, *, B: int, eta: int, steps: int, max_groups: float, tasks=("a", "b"),
             seed: int = 0) -> tuple[RolloutManager, VersionPool, list[FinishedGroup]]:
    """A manager over a fake engine and env with dynamic sampling by ``reward``; also the pool (for the weight
    pushes) and a list that collects every finished group (dropped ones included)."""
    pool = VersionPool([[BatchingEngine(OkEngine(template))]])
    sampler = PromptSampler(list(tasks), [1.0] * len(tasks), {t: list(range(64)) for t in tasks}, 2, seed=seed)
    stop_ids = list(template.stop_token_ids)
    finished: list[FinishedGroup] = []
    options = RolloutOptions(
        AdmissionOptions(batch_groups=B, staleness=eta, cohort_groups=B if eta == 0 else 1, total_groups=steps * B),
        episode=EpisodeOptions(EpisodeLimits(max_turns=4, max_total_tokens=1024), env_timeout_s=10),
        sampling=SamplingParams(max_new_tokens=4, stop_token_ids=stop_ids),
        dynamic_sampling=DynamicSamplingOptions(max_groups))
    mgr = RolloutManager(pool, RandomRewardEnv(seed), template, sampler, options, on_group=finished.append,
                         reward=reward)
    return mgr, pool, finished


def _train(mgr: RolloutManager, pool: VersionPool, steps: int) -> list[tuple[list[FinishedGroup], dict]]:
    """Take ``steps`` batches, pushing a new weight version after each; returns (batch, last_batch) pairs."""
    out = []
    try:
        for version in range(steps):
            batch = mgr.get_batch(timeout_s=30)
            out.append((batch, dict(mgr.last_batch)))
            slot = pool.begin_update(version + 1, timeout_s=10)
            pool.end_update(slot)
            mgr.set_version(version + 1)
    finally:
        mgr.stop(timeout_s=10)
    return out


def _distinct() -> callable:
    """A reward that differs on every call (a group of it always has variance)."""
    counter = itertools.count()
    return lambda t: float(next(counter))


@pytest.mark.parametrize("eta", [0, 1])
def test_flat_groups_are_dropped_and_every_batch_is_full(template, eta):
    """Groups of indices divisible by 4 are flat: none is trained, every batch still has B groups, the drops
    are counted per task and never count as accepted (the staleness bound holds in async mode)."""
    B, steps = 4, 12
    other = _distinct()
    reward = lambda t: 0.0 if t.index % 4 == 0 else other(t)  # noqa: E731
    mgr, pool, finished = _manager(template, reward, B=B, eta=eta, steps=steps, max_groups=4)
    mgr.start()
    batches = _train(mgr, pool, steps)
    trained = [g for batch, _ in batches for g in batch]
    for version, (batch, last) in enumerate(batches):
        assert len(batch) == B and last["groups"] == B and last["fallback"] == 0.0
        assert all(g.request.index % 4 != 0 for g in batch)
        assert all(version - g.min_version <= eta for g in batch)
    assert len({g.request.group_id for g in trained}) == steps * B
    flat = Counter(g.request.task for g in finished if g.request.index % 4 == 0)
    assert sum(flat.values()) > 0 and mgr.stats.dropped_zero_var == flat
    # reported per step: the drops since the previous batch add up to those before the last batch was taken
    reported = Counter()
    for _, last in batches:
        reported.update(last["dropped"])
    assert reported == flat if eta == 0 else reported.total() <= flat.total()
    # a flat group is never accepted (a stale one was, before the staleness cap dropped it)
    assert mgr.stats.accepted == len(trained) + mgr.depth()[0] + mgr.stats.dropped_stale
    assert sum(last["drawn"] for _, last in batches) <= mgr.stats.drawn
    if eta == 0:  # in lockstep each step draws exactly its B groups plus one per flat group
        for _, last in batches:
            assert last["drawn"] == B + sum(last["dropped"].values())


def test_the_shaped_reward_decides(template):
    """The test is on the training reward: task "bin" has binary_reward (its env rewards, all below 1, differ
    within a group but shape to 0), so its groups are dropped; task "raw" keeps its varied rewards."""
    shaper = RewardShaper([TaskSpec(name="bin", binary_reward=True), TaskSpec(name="raw")])
    B, steps = 3, 6
    mgr, pool, finished = _manager(template, shaper, B=B, eta=0, steps=steps, max_groups=4, tasks=("bin", "raw"))
    mgr.start()
    batches = _train(mgr, pool, steps)
    assert all(g.request.task == "raw" for batch, _ in batches for g in batch)
    assert mgr.stats.dropped_zero_var["bin"] == sum(1 for g in finished if g.request.task == "bin") > 0
    bins = [g for g in finished if g.request.task == "bin"]
    assert any(len({t.reward for t in g.trajectories}) > 1 for g in bins)  # raw rewards did vary
    assert all(zero_variance(g, shaper) and not zero_variance(g, lambda t: t.reward) for g in bins)


@pytest.mark.parametrize("eta", [0, 1])
def test_the_budget_gives_short_batches_and_never_hangs(template, eta):
    """Most groups flat and a budget of 1.5 x B draws per batch: batches come short (fewer groups, every one
    with signal) or, with none, as zero-variance stand-ins; the budget holds and every get_batch returns."""
    B, steps, max_groups = 4, 10, 1.5
    limit = int(max_groups * B)
    other = _distinct()
    reward = lambda t: other(t) if t.index % 5 == 0 else 0.0  # noqa: E731
    mgr, pool, _ = _manager(template, reward, B=B, eta=eta, steps=steps, max_groups=max_groups, seed=3)
    mgr.start()
    batches = _train(mgr, pool, steps)
    assert len(batches) == steps
    short = 0
    for batch, last in batches:
        assert 1 <= len(batch) <= B
        if last["fallback"]:
            assert all(g.request.index % 5 != 0 for g in batch)
        else:
            assert all(g.request.index % 5 == 0 for g in batch)
            short += len(batch) < B
        if eta == 0:
            assert last["drawn"] <= limit + mgr.stats.forced_draws
            if len(batch) < B or last["fallback"]:
                assert last["drawn"] >= limit  # a batch comes short only once its budget is spent
    assert short + mgr.stats.fallback_batches > 0  # the budget did bind
    assert mgr.stats.drawn - mgr.stats.forced_draws <= limit * steps


@pytest.mark.parametrize("eta", [0, 1])
def test_all_flat_trains_on_zero_variance_groups(template, eta):
    """Every group flat: each batch is the newest zero-variance groups (advantage 0), after exactly the
    budget's draws in lockstep; nothing hangs."""
    B, steps, max_groups = 3, 6, 2.0
    mgr, pool, _ = _manager(template, lambda t: 1.0, B=B, eta=eta, steps=steps, max_groups=max_groups)
    mgr.start()
    batches = _train(mgr, pool, steps)
    assert [last["fallback"] for _, last in batches] == [1.0] * steps
    ids = [g.request.group_id for batch, _ in batches for g in batch]
    assert len(ids) == len(set(ids))  # a stand-in group is trained once
    for version, (batch, last) in enumerate(batches):
        assert 1 <= len(batch) <= B and all(version - g.min_version <= eta for g in batch)
        if eta == 0:
            assert last["drawn"] == int(max_groups * B)
    assert mgr.stats.accepted == 0 and mgr.stats.fallback_batches == steps


# ---------------------------------------------------------------------------------------------- the pipeline
def reward_every_third_group_flat(traj) -> float:
    """``tasks[].reward_fn`` of the pipeline test: groups 0, 3, 6, ... score 0 on every sample; the others
    score the sum of their sampled log-probs (distinct samples, distinct rewards)."""
    return 0.0 if traj.group_id % 3 == 0 else float(sum(traj.behavior_logprobs)) - len(traj.token_ids)


def reward_all_flat(traj) -> float:
    """``tasks[].reward_fn``: every sample of every group scores 0.5."""
    return 0.5


TINY = TINY_RL + ["rollout.max_turns=3", "rollout.prompts_per_step=2", "algo.dynamic_sampling=true",
                  "train.steps=3"]


def _tasks(fn: str) -> str:
    return f'tasks=[{{name: lookup, reward_fn: "tests.trainer.test_dynamic_sampling:{fn}"}}, ' \
           f'{{name: calc, reward_fn: "tests.trainer.test_dynamic_sampling:{fn}"}}]'


@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_pipeline_never_trains_a_flat_group(tmp_path, mode):
    from tests.support.dist_utils import run_distributed

    out = tmp_path / "run"
    overrides = TINY + [f"output_dir={out}", f"pipeline.mode={mode}", _tasks("reward_every_third_group_flat")]
    summary = run_distributed(train_tiny, 1, overrides, timeout_s=150)[0]
    rows = [json.loads(x) for x in (out / "batches.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert len(r["group_ids"]) == 2 and all(g % 3 for g in r["group_ids"])
        assert all(r["trained_version"] - v <= (1 if mode == "async" else 0) for v in r["min_versions"])
    rl = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rl = [m for m in rl if m["phase"] == "rl"]
    dropped = [m["dynamic_sampling/dropped_lookup"] + m["dynamic_sampling/dropped_calc"] for m in rl]
    assert all(m["dynamic_sampling/batch_groups"] == 2 and m["dynamic_sampling/fallback"] == 0 for m in rl)
    assert sum(dropped) == sum(summary["dropped_zero_variance"].values()) >= 1  # group 0 is always dropped
    assert summary["trained_samples"] == 3 * 2 * 2
    if mode == "sync":  # lockstep: groups 3k, 3k+1 drawn, 3k dropped, 3k+2 drawn
        assert [r["group_ids"] for r in rows] == [[1, 2], [4, 5], [7, 8]]
        assert dropped == [1, 1, 1] and [m["dynamic_sampling/groups_drawn"] for m in rl] == [3, 3, 3]


@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_pipeline_with_only_flat_groups_completes(tmp_path, mode):
    """Every group flat and a budget of 1.5 x 2 draws: every step trains on zero-variance stand-ins (no
    policy-gradient signal), the run ends with its outputs."""
    from tests.support.dist_utils import run_distributed

    out = tmp_path / "run"
    overrides = TINY + [f"output_dir={out}", f"pipeline.mode={mode}", _tasks("reward_all_flat"),
                        "algo.dynamic_sampling_max_groups=1.5"]
    summary = run_distributed(train_tiny, 1, overrides, timeout_s=150)[0]
    rl = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rl = [m for m in rl if m["phase"] == "rl"]
    assert [m["step"] for m in rl] == [1, 2, 3]
    assert all(m["dynamic_sampling/fallback"] == 1 and m["adv_abs_mean"] == 0 for m in rl)
    assert summary["fallback_batches"] == 3
    assert summary["groups_drawn"] - summary["forced_draws"] <= 3 * 3
    if mode == "sync":
        assert [m["dynamic_sampling/groups_drawn"] for m in rl] == [3, 3, 3]


@pytest.mark.parametrize("flat_every", [1, 3])
def test_a_drained_manager_resumes_the_same_next_batch(template, flat_every):
    """A checkpoint (drain, state_dict) holds what dynamic sampling needs: given-up slots, the draws charged
    and the zero-variance stand-ins; a manager restored from it takes the batch the original takes next."""
    B, steps = 3, 4
    other = _distinct()
    reward = lambda t: 0.0 if t.index % flat_every == 0 else other(t)  # noqa: E731
    mgr, pool, _ = _manager(template, reward, B=B, eta=0, steps=steps, max_groups=1.5)
    mgr.start()
    try:
        mgr.get_batch(timeout_s=30)
        slot = pool.begin_update(1, timeout_s=10)
        pool.end_update(slot)
        mgr.set_version(1)
        mgr.drain(timeout_s=30)
        mgr.stats.infra_failed["lookup"] += 2  # as if episodes had failed: the counters travel with the state
        mgr.stats.infra_retried += 1
        state = mgr.state_dict()
        counters = _counters(mgr)
        mgr.release()
        expected = [g.request.group_id for g in mgr.get_batch(timeout_s=30)]
        expected_batch = {k: v for k, v in mgr.last_batch.items() if k != "dropped_groups"}
    finally:
        mgr.stop(timeout_s=10)
    restored, pool, _ = _manager(template, reward, B=B, eta=0, steps=steps, max_groups=1.5)
    pool.end_update(pool.begin_update(1, timeout_s=10))  # the resumed run's engines get the checkpoint's weights
    restored.load_state_dict(state)
    assert _counters(restored) == counters and counters["drawn"] >= B and counters["infra_retried"] == 1
    restored.start()
    try:
        assert [g.request.group_id for g in restored.get_batch(timeout_s=30)] == expected
        # the next step's counts (drawn, dropped, infra since the last batch) are those of the uninterrupted run
        assert {k: v for k, v in restored.last_batch.items() if k != "dropped_groups"} == expected_batch
    finally:
        restored.stop(timeout_s=10)


def _counters(mgr) -> dict:
    """A manager's cumulative counters, what summary.json reports (its per-group times left out)."""
    from dataclasses import asdict

    return {k: v for k, v in asdict(mgr.stats).items() if k not in ("group_times", "wait_s")}
