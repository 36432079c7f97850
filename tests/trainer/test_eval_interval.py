"""Periodic evaluation (``eval.interval``): a row of phase ``eval`` per evaluation in metrics.jsonl (and
TensorBoard), per task, in sync and async mode; in async mode it runs beside the rollouts, on the newest live
weights, while the trainer goes on."""
from __future__ import annotations

import json

import pytest

TINY = [
    "model.arch.hidden_size=32", "model.arch.intermediate_size=64", "model.arch.num_hidden_layers=2",
    "sft.steps=0", "train.micro_batch_size=4", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=12",
    "rollout.max_turns=3", "rollout.prompts_per_step=2", "loss.tis_cap=2.0", "train.steps=3",
    "eval.samples_per_task=2", "eval.interval=1",
]
TASKS = ("lookup", "calc", "guess")


def _run(rank: int, world: int, overrides: list[str]) -> dict:
    from megatron_agentrl.config import load_config
    from megatron_agentrl.pipeline.loop import run_training
    from megatron_agentrl.train_rank import setup_logging

    setup_logging(rank)
    return run_training(load_config("tests/configs/tiny_test.yaml", overrides))


def _tensorboard_tags(folder) -> set[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags: set[str] = set()
    for events in folder.rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(events))
        acc.Reload()
        tags |= set(acc.Tags()["scalars"])
    return tags


@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_eval_row_per_step_and_task(tmp_path, mode):
    from tests.support.dist_utils import run_distributed

    out = tmp_path / "run"
    summary = run_distributed(_run, 1, TINY + [f"output_dir={out}", f"pipeline.mode={mode}"], timeout_s=180)[0]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r["phase"] == "eval"]
    rl = [r for r in rows if r["phase"] == "rl"]
    assert [r["step"] for r in rl] == [1, 2, 3]
    # before RL (step 0), after steps 1 and 2 (periodic), after RL (step 3: the final evaluation)
    assert summary["evals_skipped"] == 0
    assert sorted(r["step"] for r in evals) == [0, 1, 2, 3]
    for r in evals:
        for t in TASKS:
            assert r[f"episodes/{t}"] == 2
            assert 0 <= r[f"success/{t}"] <= 1 and f"reward/{t}" in r
            assert r[f"success_low/{t}"] <= r[f"success/{t}"] <= r[f"success_high/{t}"]
    by_step = {r["step"]: r for r in evals}
    assert {k: v for k, v in by_step[0].items() if k != "step"} == \
        {"phase": "eval", **summary["before_rl"]}
    assert {k: v for k, v in by_step[3].items() if k != "step"} == {"phase": "eval", **summary["after_rl"]}
    for step in (1, 2):
        r = by_step[step]
        # sync: it ran alone on the step's weights; async: on the newest live weights from its start on (the
        # trainer may have pushed newer ones before the rollout thread's loop started it)
        assert step <= r["version_start"] <= r["version_min"] <= r["version_max"] and r["eval_time_s"] > 0
        if mode == "sync":
            assert r["version_max"] == step
    assert all("eval_wait_s" in r for r in rl)
    tags = _tensorboard_tags(out / "tensorboard")
    assert {f"eval/success/{t}" for t in TASKS} <= tags and {f"eval/reward/{t}" for t in TASKS} <= tags


@pytest.mark.parametrize("interval, steps, due", [(0, 4, []), (1, 4, [1, 2, 3]), (2, 5, [2, 4]), (3, 3, []),
                                                    (2, 4, [2])])
def test_periodic_evaluations_follow_every_interval_steps_but_the_last(interval, steps, due):
    """The last step has the final evaluation instead (its row is at that step too)."""
    from megatron_agentrl.config import load_config
    from megatron_agentrl.pipeline.loop import eval_due

    cfg = load_config("tests/configs/tiny_test.yaml", [f"eval.interval={interval}", f"train.steps={steps}"])
    assert [s for s in range(1, steps + 1) if eval_due(cfg, s)] == due
