"""Exact resume: stop after step k, resume from the checkpoint, and step k+1 trains on the same
sample ids with the same loss (fp32, CPU) as the uninterrupted run.

Sync mode: three separate runs (uninterrupted; stopped after step 2; resumed from that stop).
Async mode (TP=2 on 2 processes, heavy-tailed env latency, KL and entropy on): the checkpoint
holds the drained queue, so the resumed step 3 equals the uninterrupted run's step 3. A checkpoint
of 2 data-parallel ranks resumes on one process.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.dist_utils import run_distributed
from tests.trainer.support import TINY
from tests.trainer.support import read_steps as _steps
from tests.trainer.support import train_tiny as _train


def _same(a: dict, b: dict) -> None:
    assert a["sample_ids"] == b["sample_ids"]
    assert a["min_versions"] == b["min_versions"]
    assert abs(a["loss"] - b["loss"]) <= 1e-7 * max(1.0, abs(a["loss"])), (a["loss"], b["loss"])
    ga, gb = a["grad_norm"], b["grad_norm"]
    assert abs(ga - gb) <= 1e-6 * max(1.0, abs(ga)), (ga, gb)


@pytest.mark.e2e
@pytest.mark.slow  # the async TP=2 resume below covers the same contract in the default run
def test_sync_stop_resume_matches_uninterrupted(tmp_path):
    full, stop, resumed = tmp_path / "full", tmp_path / "stop", tmp_path / "resumed"
    run_distributed(_train, 1, TINY + [f"output_dir={full}", "train.steps=3"], timeout_s=120)
    run_distributed(_train, 1, TINY + [f"output_dir={stop}", "train.steps=2"], timeout_s=120)
    ckpt = stop / "checkpoints" / "step_000002"
    assert (stop / "checkpoints" / "latest").read_text().strip() == "step_000002"
    run_distributed(_train, 1, TINY + [f"output_dir={resumed}", "train.steps=3", f"checkpoint.resume={ckpt}"],
                    timeout_s=120)
    f, s, r = _steps(full), _steps(stop), _steps(resumed)
    assert sorted(s) == [1, 2] and sorted(r) == [3]
    _same(f[1], s[1])
    _same(f[2], s[2])
    _same(f[3], r[3])
    assert f[3]["loss"] != f[2]["loss"]  # the loss does depend on the state


@pytest.mark.e2e
def test_async_tp2_resume_matches_uninterrupted(tmp_path):
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    common = TINY + ["parallel.tp=2", "pipeline.mode=async", "pipeline.staleness=1", "pipeline.sim_env_latency_s=0.01",
                     "pipeline.sim_env_latency_alpha=1.1", "pipeline.sim_env_latency_max_s=0.3"]
    run_distributed(_train, 2, common + [f"output_dir={full}", "train.steps=4"], timeout_s=150)
    ckpt = full / "checkpoints" / "step_000002"
    pipeline_state = ckpt / "pipeline.pt"
    assert pipeline_state.is_file() and (ckpt / "rng" / "rank_1.pt").is_file()
    run_distributed(_train, 2, common + [f"output_dir={resumed}", "train.steps=3", f"checkpoint.resume={ckpt}"],
                    timeout_s=150)
    f, r = _steps(full), _steps(resumed)
    assert sorted(r) == [3]
    _same(f[3], r[3])


@pytest.mark.e2e
def test_rl_from_the_warm_up_checkpoint_is_the_rl_of_the_run_that_saved_it(tmp_path):
    """``checkpoint.after_warmup``: ``step_000000`` holds the policy, Adam state and reference right after the SFT
    warm-up and the evaluation before RL; RL resumed from it trains the same batches with the same losses as the run
    that saved it (sync mode), reports that run's evaluation before RL, and the checkpoint outlives ``keep``."""
    import torch

    common = TINY + ["sft.steps=3", "sft.batch_size=4", "eval.samples_per_task=2", "train.steps=3"]
    full, again = tmp_path / "full", tmp_path / "again"
    whole = run_distributed(_train, 1, common + [f"output_dir={full}", "checkpoint.after_warmup=true",
                                                 "checkpoint.keep=1"], timeout_s=120)[0]
    warm = full / "checkpoints" / "step_000000"
    assert sorted(p.name for p in (full / "checkpoints").glob("step_*")) == ["step_000000", "step_000003"]
    assert torch.load(warm / "pipeline.pt", weights_only=False)["manager"] is None
    assert json.loads((warm / "meta.json").read_text())["has_reference"]
    resumed = run_distributed(_train, 1, common + [f"output_dir={again}", f"checkpoint.resume={warm}"],
                              timeout_s=120)[0]
    f, r = _steps(full), _steps(again)
    assert sorted(r) == [1, 2, 3]
    for step in (1, 2, 3):
        _same(f[step], r[step])
    assert resumed["before_rl"] == whole["before_rl"] and whole["before_rl"]
    assert (resumed["resumes"], resumed["resumed_from_step"]) == (1, 0)
    rows = [json.loads(x) for x in (again / "metrics.jsonl").read_text().splitlines()]
    assert not [m for m in rows if m["phase"] == "sft"]  # no warm-up again


def _adam_steps(ckpt: Path) -> set[float]:
    """The Adam step count(s) a checkpoint stores (megatron keeps it with the param groups)."""
    import torch

    common = torch.load(ckpt / "model_optim" / "common.pt", weights_only=False)
    found: set[float] = set()

    def walk(x) -> None:
        if isinstance(x, dict):
            if "step" in x and not isinstance(x["step"], (dict, list)):
                found.add(float(x["step"]))
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(common.get("optimizer", common))
    return found


@pytest.mark.e2e
@pytest.mark.slow  # a layout change on resume stays in the default run through test_moe's EP=2 -> EP=1
def test_dp2_checkpoint_resumes_at_dp1(tmp_path):
    """Saved by 2 data-parallel ranks with the distributed optimizer (each holding half the Adam
    state), resumed on one process: step 3 trains on the same samples with the loss of the
    uninterrupted DP=2 run, and the Adam step count goes on from 2 to 3. Resuming it without the
    distributed optimizer is refused with the key to set."""
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    run_distributed(_train, 2, TINY + [f"output_dir={full}", "train.steps=3"], timeout_s=150)
    ckpt = full / "checkpoints" / "step_000002"
    assert json.loads((ckpt / "meta.json").read_text())["dp"] == 2
    run_distributed(_train, 1, TINY + [f"output_dir={resumed}", "train.steps=3", f"checkpoint.resume={ckpt}"],
                    timeout_s=120)
    f, r = _steps(full), _steps(resumed)
    assert sorted(r) == [3]
    assert f[3]["sample_ids"] == r[3]["sample_ids"]
    assert abs(f[3]["loss"] - r[3]["loss"]) <= 1e-5 * max(1.0, abs(f[3]["loss"])), (f[3]["loss"], r[3]["loss"])
    assert abs(f[3]["grad_norm"] - r[3]["grad_norm"]) <= 1e-5 * max(1.0, f[3]["grad_norm"])
    assert f[3]["grad_norm"] != f[2]["grad_norm"]  # the step does depend on the state
    assert _adam_steps(ckpt) == {2.0}
    with pytest.raises(AssertionError, match=r"resume with train.use_distributed_optimizer=true"):
        run_distributed(_train, 1, TINY + [f"output_dir={tmp_path / 'other'}", "train.steps=3",
                                           f"checkpoint.resume={ckpt}", "train.use_distributed_optimizer=false"],
                        timeout_s=120)
    assert _adam_steps(resumed / "checkpoints" / "step_000003") == {3.0}


def _tb_steps(folder: Path, tag: str) -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return [e.step for e in acc.Scalars(tag)]


def reward_every_third_group_flat(traj) -> float:
    """``tasks[].reward_fn``: groups 0, 3, 6, ... score 0 on every sample (dynamic sampling drops them); the others
    score by their sampled log-probs (distinct samples, distinct rewards)."""
    return 0.0 if traj.group_id % 3 == 0 else float(sum(traj.behavior_logprobs)) - len(traj.token_ids)


@pytest.mark.e2e
def test_resume_in_the_same_output_dir_records_each_step_once_and_totals_the_whole_run(tmp_path):
    """A run that went on past its checkpoint (to step 4, checkpoints at 2 and 4; its last line torn, as a killed
    trainer leaves it), resumed from step 2 in the same output_dir: steps 3 and 4 are redone, each RL step is
    recorded once in metrics.jsonl, batches.jsonl and TensorBoard, the records up to the checkpoint stay, and
    summary.json's totals equal the uninterrupted run's (sync mode and dynamic sampling are deterministic):
    trained samples and tokens, prompts drawn, zero-variance groups dropped; its RL time includes the first part's."""
    import torch

    fn = "tests.trainer.test_pipeline_resume:reward_every_third_group_flat"
    common = TINY + ["algo.dynamic_sampling=true", "rollout.max_turns=3", "train.steps=4",
                     f'tasks=[{{name: lookup, reward_fn: "{fn}"}}, {{name: calc, reward_fn: "{fn}"}}]']
    out = tmp_path / "run"
    whole = run_distributed(_train, 1, common + [f"output_dir={out}"], timeout_s=120)[0]  # uninterrupted
    first = _steps(out)
    (out / "batches.jsonl").open("a").write('{"step": 5, "torn')  # a line cut by a killed trainer
    ckpt = out / "checkpoints" / "step_000002"
    run_distributed(_train, 1, common + [f"output_dir={out}", f"checkpoint.resume={ckpt}"], timeout_s=120)
    rows = [json.loads(x) for x in (out / "batches.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[0] == first[1] and rows[1] == first[2]
    _same(first[3], rows[2])
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if m["phase"] == "rl"] == [1, 2, 3, 4]
    assert _tb_steps(out / "tensorboard" / "rl", "rl/loss") == [1, 2, 3, 4]
    summary = json.loads((out / "summary.json").read_text())
    for key in ("trained_samples", "trained_tokens", "groups_drawn", "dropped_zero_variance", "short_slots",
                "fallback_batches", "forced_draws", "dropped_stale", "infra"):
        assert summary[key] == whole[key], (key, summary[key], whole[key])
    saved = torch.load(ckpt / "pipeline.pt", weights_only=False)["totals"]
    assert summary["trained_samples"] == 4 * 2 * 2 and saved["trained_samples"] == 2 * 2 * 2
    assert sum(whole["dropped_zero_variance"].values()) >= 1
    assert (summary["resumes"], summary["resumed_from_step"]) == (1, 2)
    assert (whole["resumes"], whole["resumed_from_step"]) == (0, None)
    assert summary["rl_wall_s"] > saved["rl_wall_s"] > 0


def test_engine_counters_of_a_resumed_run_cover_the_whole_run():
    """The servers' failures, returns and re-routed prompts before the checkpoint count in the resumed run's
    metrics and summary; how many are out of rotation is the present state, not a count."""
    import time as _time
    from types import SimpleNamespace

    from megatron_agentrl.pipeline.loop import TrainingRun
    from rollout_sglang.engines.version_pool import VersionPool

    class Engine:
        version = 0
        name = "http://engine"

    def part(failures: int, rerouted: int, out: int, sync_failed: int, before: dict) -> TrainingRun:
        pool = VersionPool([[Engine()], [Engine()]])
        pool.stats.update(engine_failures=failures, rerouted=rerouted)
        for e in range(out):
            pool.mark_down(e, "killed")
        run = TrainingRun.__new__(TrainingRun)  # the counters only: no model, no engines
        run.rollout_side = SimpleNamespace(pool=pool)
        run.publisher = SimpleNamespace(failed_syncs=sync_failed, skipped_syncs=0)
        run.trained_samples = run.trained_tokens = run.evals_skipped = run.resumes = 0
        run.rl_wall_before, run.t_rl, run.engines_before = 0.0, _time.perf_counter(), {}
        if before:
            run._restore_totals({"engines": before})
        return run

    first = part(failures=2, rerouted=5, out=1, sync_failed=1, before={})
    saved = first._totals()["engines"]
    assert saved["engines/failures"] == 3 and saved["engines/out_of_rotation"] == 1  # 2 given + the mark_down
    second = part(failures=0, rerouted=4, out=0, sync_failed=0, before=saved)
    counts = second._engine_counts()
    assert counts["engines/failures"] == 3 and counts["engines/rerouted_prompts"] == 9
    assert counts["weight_sync/failed"] == 1 and counts["engines/out_of_rotation"] == 0
