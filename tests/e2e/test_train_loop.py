"""The synchronous GRPO loop end to end (SFT warm-up, rollouts, train steps, weight pushes,
evaluation, outputs) on 1 process and at TP=2 on 2 processes."""
from __future__ import annotations

import json
import os

import pytest

from tests.support.dist_utils import run_distributed

TINY = [
    "model.arch.hidden_size=32", "model.arch.intermediate_size=64", "model.arch.num_hidden_layers=2",
    "sft.steps=2", "sft.batch_size=4", "train.steps=2", "train.micro_batch_size=4",
    "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=16",
    "eval.samples_per_task=2",
]


def _train(rank: int, world: int, overrides: list[str]) -> dict:
    from megatron_agentrl.config import load_config
    from megatron_agentrl.pipeline.loop import run_training
    from megatron_agentrl.train_rank import setup_logging

    setup_logging(rank)
    return run_training(load_config("tests/configs/tiny_test.yaml", overrides))


@pytest.mark.parametrize("tp", [1, 2])
def test_sync_loop_writes_metrics_plot_and_export(tmp_path, tp):
    out = tmp_path / "run"
    summary = run_distributed(_train, tp, TINY + [f"output_dir={out}", f"parallel.tp={tp}"], timeout_s=150)[0]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r["phase"] == "rl"]
    assert [r["step"] for r in rl] == [1, 2]
    assert [r["step"] for r in rows if r["phase"] == "sft"] == [1, 2]
    for r in rl:
        assert any(k.startswith("reward/") for k in r)
        assert r["gen_tokens_per_s"] > 0 and r["train_tokens_per_s"] > 0 and r["step_time_s"] > 0
        # synchronous: every token was sampled by the weights being trained, and the engine's
        # log-probs are the trainer's (fp32): a slot that missed a weight update would show here
        assert r["mismatch/tokens_lag0"] == r["num_tokens"] and not any(
            k.startswith("mismatch/tokens_lag") and k != "mismatch/tokens_lag0" for k in r), r
        assert r["mismatch/abs_lag0"] < 1e-4 and r["mismatch/kl_lag0"] < 1e-6, r
    assert set(summary["before_rl"]) == set(summary["after_rl"]) == {
        f"{m}/{t}" for m in ("reward", "success", "episodes", "success_low", "success_high", "gen_tokens",
                             "gen_logprob", "infra_failed")
        for t in ("lookup", "calc", "guess")
    }
    assert (out / "reward_by_task.png").stat().st_size > 1000
    assert list((out / "tensorboard" / "rl").glob("events.out.tfevents.*"))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out / "hf_export")
    assert model.config.hidden_size == 32


def test_same_seed_gives_the_same_warm_up_and_first_evaluation(tmp_path):
    """A run is reproducible up to RL: the same ``train.seed`` (same machine, same thread count) gives
    the same warm-up losses at every step and the same evaluation before RL; another seed does not."""
    warm_up = TINY + ["sft.steps=6", "sft.short_format_steps=3", "sft.careless_fraction=0.5", "train.steps=1",
                      "eval.samples_per_task=6"]

    def run(name: str, seed: int) -> tuple[list[float], dict]:
        out = tmp_path / name
        summary = run_distributed(_train, 1, warm_up + [f"output_dir={out}", f"train.seed={seed}"], timeout_s=150)[0]
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return [r["loss"] for r in rows if r["phase"] == "sft"], summary["before_rl"]

    first, again, other = run("a", 7), run("b", 7), run("c", 8)
    assert len(first[0]) == 6
    assert first == again
    assert first[0] != other[0]


def test_cli_trains_the_demo_config_at_dp2_on_the_scale_path(tmp_path):
    """`agentrl train --nproc 2` on the demo's config with the distributed optimizer, packed sequences
    and selective recomputation (shrunk to seconds): both data-parallel ranks train, the checkpoint
    records DP=2 and the distributed optimizer, every step's loss and grad norm are finite."""
    from tests.support.demo_run import TINY_MODEL, train_demo, trained_rl_rows

    out = tmp_path / "run"
    train_demo(out, 2, "train.use_distributed_optimizer=true", "train.sequence_packing=true",
               "train.recompute=selective", "train.lr_decay_style=linear", "train.min_lr=1e-4",
               "checkpoint.interval=2", *TINY_MODEL)
    rl = trained_rl_rows(out)
    assert [r["lr"] for r in rl] == [1e-3, 1e-4]  # the demo's lr, decayed linearly to min_lr at the last step
    meta = json.loads((out / "checkpoints" / "step_000002" / "meta.json").read_text())
    assert meta["dp"] == 2 and meta["use_distributed_optimizer"] is True


def test_dp2_ranks_wait_for_rank0s_batches_longer_than_a_collectives_timeout(tmp_path):
    """At DP=2 rank 1 waits for each batch that rank 0 takes from the rollouts, and for its checkpoint drains and
    evaluations, on the rank-0 group (``parallel.rank0_timeout_s``): episodes slowed to 8 s or more by simulated env
    latency outlast a 5 s ``parallel.collective_timeout_s``, and the run trains and checkpoints every step."""
    from tests.support.demo_run import TINY_MODEL, train_demo, trained_rl_rows

    out = tmp_path / "run"
    train_demo(out, 2, "parallel.collective_timeout_s=5", "pipeline.sim_env_latency_s=4",
               "pipeline.sim_env_latency_max_s=5", "checkpoint.interval=1", *TINY_MODEL)
    rl = trained_rl_rows(out)
    assert rl[0]["wait_batch_s"] > 5.0  # rank 1 sat longer than a collective may
    assert (out / "checkpoints" / "step_000001").is_dir() and (out / "checkpoints" / "step_000002").is_dir()


def test_training_sets_mkl_strict_reproducibility_unless_the_user_chose_a_mode(monkeypatch):
    """MKL may round a product by where its operands lie in memory (two warm-ups of one seed differed by the heap's
    layout): training turns on its strict reproducible mode before torch loads, and keeps a user's own setting
    (empty: MKL's own default). That the mode makes layouts agree is checked by bench/warmup_layouts.py's smoke."""
    from megatron_agentrl.train_rank import reproducible_cpu_math

    monkeypatch.delenv("MKL_CBWR", raising=False)
    reproducible_cpu_math()
    assert os.environ["MKL_CBWR"] == "AUTO,STRICT"
    for own in ("AVX2", ""):
        monkeypatch.setenv("MKL_CBWR", own)
        reproducible_cpu_math()
        assert os.environ["MKL_CBWR"] == own
