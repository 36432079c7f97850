"""The staleness cap: over runs with heavy-tailed environment latency, no trained sample has a
token sampled by weights more than eta versions older than the policy being trained.

1. The rollout manager alone (fake engine and env, real agent loop, batching engine and one-slot
   version pool), 40 fast training steps with weight updates pausing in-flight generation (partial
   rollout).
2. The whole asynchronous pipeline (tiny model, megatron actor, local engine, built-in tasks).
"""
from __future__ import annotations

import asyncio
import json
import random
import time

import pytest

from env_controller.protocol import SampleStatus, TaskReply
from rollout_sglang.chat_template import ChatTemplate
from rollout_sglang.engines.batching import BatchingEngine
from rollout_sglang.engines.protocol import GenerationOutput, SamplingParams
from rollout_sglang.engines.version_pool import VersionPool
from rollout_sglang.episode_options import EpisodeLimits, EpisodeOptions
from rollout_sglang.rollout.manager import AdmissionOptions, PromptSampler, RolloutManager, RolloutOptions
from rollout_sglang.rollout.sim_env import LatencyEnvClient
from tests.support.fake_engine import UpdatableEngine
from tests.trainer.support import TINY_RL, train_tiny


class FakeEngine(UpdatableEngine):
    """Answers every prompt with "ok" + <|im_end|> after a short compute time; stamps its version."""

    def __init__(self, template: ChatTemplate, lag: int = 0) -> None:
        super().__init__()
        self.lag = lag  # cross-policy stand-in: every other call is answered by a version `lag` older
        self.calls = 0
        self.ok = template.tokenizer.encode("ok", add_special_tokens=False) + [template.im_end_id]

    async def generate(self, prompts, params: SamplingParams, seeds=None):
        assert not self.paused, "generate ran while the engine was paused for a weight update"
        await asyncio.sleep(0.002)
        self.calls += 1
        version = max(0, self.version - self.lag) if self.calls % 2 else self.version
        return [GenerationOutput(list(self.ok), [-0.5] * len(self.ok), "stop", version) for _ in prompts]


class MultiTurnEnv:
    """Each episode asks for 2-5 turns (by index), then finishes with a random 0/1 reward."""

    def __init__(self) -> None:
        self.turns: dict[str, int] = {}
        self.rng = random.Random(0)
        self.n = 0

    async def start_sample(self, task, index):
        self.n += 1
        sid = f"{task}-{index}-{self.n}"
        self.turns[sid] = 2 + index % 4
        return sid, TaskReply(messages=[{"role": "user", "content": f"task {index}: talk to me"}])

    async def interact(self, session_id, messages):
        self.turns[session_id] -= 1
        if self.turns[session_id] <= 0:
            r = float(self.rng.random() < 0.5)
            return TaskReply(messages=[], status=SampleStatus.COMPLETED, finish=True, reward=r, metrics={"success": r})
        return TaskReply(messages=[{"role": "user", "content": "go on"}])

    async def cancel(self, session_id):
        self.turns.pop(session_id, None)


@pytest.mark.parametrize("eta, lag", [(0, 0), (1, 0), (2, 0), (2, 1)])
def test_manager_never_trains_samples_older_than_eta(template, eta, lag):
    """lag: turns may come from a version up to ``lag`` older (cross-policy sampling over lag + 1
    live versions); admission runs that much less ahead (the bound below)."""
    B, G, steps = 4, 2, 40
    engine = VersionPool([[BatchingEngine(FakeEngine(template, lag))]])
    env = LatencyEnvClient(MultiTurnEnv(), scale_s=0.002, alpha=1.1, max_s=0.25, seed=eta)  # heavy tail
    sampler = PromptSampler(["talk"], [1.0], {"talk": list(range(64))}, G, seed=eta)
    stop_ids = list(template.stop_token_ids)
    episode = EpisodeOptions(EpisodeLimits(max_turns=6, max_total_tokens=2048), env_timeout_s=10)
    options = RolloutOptions(AdmissionOptions(batch_groups=B, staleness=eta, cohort_groups=1, version_lag=lag),
                             episode=episode, sampling=SamplingParams(max_new_tokens=8, stop_token_ids=stop_ids))
    mgr = RolloutManager(engine, env, template, sampler, options)
    mgr.start()
    staleness, multi_version, bound_ok = [], 0, True
    try:
        for version in range(steps):
            batch = mgr.get_batch(timeout_s=30)
            assert len(batch) == B
            for g in batch:
                assert len(g.trajectories) == G and all(t.status == "completed" for t in g.trajectories)
                for t in g.trajectories:
                    staleness.append(version - t.oldest_version)
                    multi_version += len(set(t.sampled_versions)) > 1
            with mgr._cond:  # admission bound: accepted + running <= (version + eta - lag + 1) * B
                bound_ok &= mgr.stats.consumed + len(mgr._queue) + mgr._running <= (version + eta - lag + 1) * B
            time.sleep(0.003)  # "training"
            slot = engine.begin_update(version + 1, timeout_s=10)  # the weight push: drain, pause, open
            engine.end_update(slot)
            mgr.set_version(version + 1)
    finally:
        mgr.stop(timeout_s=10)
    assert bound_ok
    assert max(staleness) <= eta, (max(staleness), eta)
    assert len(staleness) == steps * B * G
    if eta > 0:
        # the pipeline did run ahead: some samples are stale, some episodes span a weight update
        assert sum(1 for s in staleness if s > 0) > 0 and multi_version > 0
    else:
        assert max(staleness) == 0


@pytest.mark.e2e
@pytest.mark.parametrize("engines", ["one", "pool"])
def test_async_pipeline_staleness_bound(tmp_path, engines):
    """One local engine, or a version pool of two (cross-policy sampling over the live versions)."""
    from tests.support.dist_utils import run_distributed

    out = tmp_path / "run"
    eta = 1
    overrides = TINY_RL + [f"output_dir={out}", "pipeline.mode=async", f"pipeline.staleness={eta}", "train.steps=6",
                        "rollout.prompts_per_step=3", "pipeline.sim_env_latency_s=0.01",
                        "pipeline.sim_env_latency_alpha=1.1", "pipeline.sim_env_latency_max_s=0.5"]
    if engines == "pool":
        overrides += ["rollout.max_versions=2", "rollout.cross_policy=uniform"]
    # rewards that differ within a group, so that every step changes the weights and stale tokens show it
    tasks = ",".join(f'{{name: {t}, reward_fn: "tests.trainer.support:varied_reward"}}' for t in ("lookup", "calc"))
    overrides += [f"tasks=[{tasks}]", "train.lr=1e-2"]
    summary = run_distributed(train_tiny, 1, overrides, timeout_s=120)[0]
    assert summary["mode"] == "async" and summary["trained_samples"] == 6 * 3 * 2
    rows = [json.loads(x) for x in (out / "batches.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 7))
    stale = [s for r in rows for s in r["staleness"]]
    assert len(stale) == 36 and max(stale) <= eta
    for r in rows:
        assert all(r["trained_version"] - v <= eta for v in r["min_versions"])
    ids = [i for r in rows for i in r["sample_ids"]]
    assert len(ids) == len(set(ids))  # every sample trained once
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    for m in metrics:
        assert m["staleness_max"] <= eta
        assert abs(sum(m[f"staleness/{k}"] for k in range(eta + 1)) - 1) < 1e-9
        # every policy token has a lag within the cap; at lag 0 the engine ran the trained weights, so
        # its log-probs are the trainer's (fp32), whichever version slot served the turn
        assert sum(m.get(f"mismatch/tokens_lag{k}", 0) for k in range(eta + 1)) == m["num_tokens"], m
        if "mismatch/abs_lag0" in m:
            assert m["mismatch/abs_lag0"] < 1e-4, m
        for key in ("queue_depth", "trainer_idle_frac", "engine_idle_frac", "versions_per_traj_mean",
                    "trained_tokens_per_s", "rollout_time_s", "train_time_s"):
            assert key in m
    if eta > 0:  # tokens of older weights are further from the trained ones than numerics: the mismatch grows
        lag0 = [m["mismatch/abs_lag0"] for m in metrics if "mismatch/abs_lag0" in m]
        lagged = [m[f"mismatch/abs_lag{k}"] for m in metrics for k in range(1, eta + 1) if f"mismatch/abs_lag{k}" in m]
        assert lagged and sum(lagged) / len(lagged) > 10 * max(lag0, default=0.0) + 1e-6, (lag0, lagged)
