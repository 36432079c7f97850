"""Context parallelism (``parallel.cp``): megatron's load-balanced layout, the config's refusals, and the
actor at CP=2 (2 processes, gloo, fp32) against CP=1: the same log-probs, loss and gradients, with
padded rows and packed sequences, sequences whose lengths are not multiples of 2 * cp."""
from __future__ import annotations

import pytest
import torch

from megatron_agentrl.config import ConfigError, ParallelConfig, load_config
from megatron_agentrl.megatron.context_parallel import full_order, local_index
from megatron_agentrl.megatron.packing import pack, unpack
from tests.support.dist_utils import run_distributed
from tests.support.tiny_models import layout_actor, ragged_batch, reinit_parallel, tiny_qwen2_config

DEMO = "examples/configs/tiny_cpu.yaml"


def test_local_index_is_megatrons_load_balanced_layout():
    # one row of 8 at cp=2: chunks of 2, rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert local_index([0, 8], 2, 0).tolist() == [0, 1, 6, 7]
    assert local_index([0, 8], 2, 1).tolist() == [2, 3, 4, 5]
    # packed: per sequence (4 and 8 tokens)
    assert local_index([0, 4, 12], 2, 0).tolist() == [0, 3, 4, 5, 10, 11]
    assert local_index([0, 4, 12], 2, 1).tolist() == [1, 2, 6, 7, 8, 9]
    gathered = torch.cat([local_index([0, 4, 12], 2, r) for r in range(2)])
    assert gathered[full_order([0, 4, 12], 2)].tolist() == list(range(12))
    with pytest.raises(ValueError, match="6 tokens is not a multiple of 2 \\* cp = 4"):
        local_index([0, 6], 2, 0)


def test_pack_pads_each_sequence_to_a_multiple():
    batch = {"tokens": torch.arange(1, 21).reshape(2, 10)}
    p = pack(batch, [0, 1], [3, 6], pad_to=16, multiple=4)
    assert p.cu_seqlens.tolist() == [0, 4, 12, 16]
    assert p.fields["tokens"][0].tolist() == [1, 2, 3, 0, 11, 12, 13, 14, 15, 16, 0, 0, 0, 0, 0, 0]
    assert p.position_ids[0].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]
    out = torch.zeros(2, 10, dtype=torch.long)
    unpack(p.fields["tokens"], [0, 1], [3, 6], out, multiple=4)
    assert out[0, :3].tolist() == [1, 2, 3] and out[1, :6].tolist() == [11, 12, 13, 14, 15, 16]


def test_config_refuses_bad_cp_and_world_sizes():
    with pytest.raises(ConfigError, match="parallel.cp=0 must be a positive integer"):
        ParallelConfig(cp=0)
    cfg = load_config(DEMO, ["parallel.cp=2", "parallel.tp=2"])
    assert cfg.parallel.model_parallel_size == 4
    cfg.check_world_size(8, "--nproc 8")
    with pytest.raises(ConfigError, match=r"--nproc 6 = 6 trainer processes is not a multiple of parallel.tp \* "
                                          r"parallel.pp \* parallel.cp = 2 \* 1 \* 2 = 4.*parallel.cp"):
        cfg.check_world_size(6, "--nproc 6")
    with pytest.raises(ConfigError, match="ray.train_workers = 2 .* parallel.cp = 1 \\* 1 \\* 4 = 4.*"
                                          "set ray.train_workers to a multiple of 4"):
        load_config(DEMO, ["parallel.cp=4", "ray.train_workers=2"])


def test_plan_divides_activations_by_cp():
    from megatron_agentrl.launch.plan import estimate_memory, format_plan

    hf = {"model_type": "qwen2", "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8,
          "num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": 32000}
    over = ["ray.train_workers=4", "rollout.max_total_tokens=4096"]
    one, two = (estimate_memory(hf, load_config(DEMO, [*over, f"parallel.cp={cp}"])) for cp in (1, 2))
    assert two.train["activations"] == pytest.approx(one.train["activations"] / 2)
    assert two.train["logits_fp32"] == pytest.approx(one.train["logits_fp32"] / 2)
    assert two.train["weights"] == one.train["weights"]
    assert (one.layout["dp"], two.layout["dp"], two.layout["cp"]) == (4, 2, 2)
    assert "TP 1 x PP 1 x CP 2 x DP 2" in format_plan(two)


# ------------------------------------------------------------------ actor (spawned processes)
def _batch(vocab: int):
    # T and most lengths are not multiples of 2 * cp = 4
    return ragged_batch(vocab, [23, 5, 17, 9, 14, 3], [2, 1, 4, 2, 6, 1], seed=5, ref=True, lag=True)


def _cp_same_as_cp1(rank: int, world: int) -> dict:
    from megatron_agentrl.megatron.parallel import initialize_parallel

    out: dict = {}
    try:
        initialize_parallel(1, 1, seed=7, timeout_s=60, cp=3)
    except ConfigError as e:
        out["refusal"] = str(e)
    cfg = tiny_qwen2_config()
    batch = _batch(cfg.vocab_size)
    ref = state = None
    # CP=1 (DP=2) reference with padded rows, then CP=2 (DP=1): (micro_batch_tokens, sequence_packing, recompute)
    variants = {1: [(0, False, "none")],
                2: [(0, False, "none"), (40, False, "none"), (0, True, "none"), (40, True, "selective")]}
    for cp, runs in variants.items():
        reinit_parallel(1, 1, cp=cp, seed=7)
        for budget, packed, recompute in runs:
            actor, state = layout_actor(cfg, state, 2, budget, packed, recompute)
            lp = actor.compute_logprobs(batch.tokens, 0.9, 2, loss_mask=batch.loss_mask)
            lp_all = actor.compute_logprobs(batch.tokens, 0.9, 2)  # every column of every row
            stats = actor.compute_grads(actor.dp_slice(batch), "grpo", temperature=0.9)
            grads = actor.export_hf_grads()
            sft = actor.compute_grads(actor.dp_slice(batch), "sft")["loss"]
            if ref is None:
                ref = grads, stats, lp, lp_all, sft
                continue
            ref_grads, ref_stats, ref_lp, ref_lp_all, ref_sft = ref
            key = f"cp{cp}b{budget}{'packed' if packed else 'padded'}-{recompute}"
            scale = max(float(g.abs().max()) for g in ref_grads.values())
            out[key + "_grad"] = max(float((grads[k] - ref_grads[k]).abs().max()) for k in ref_grads) / scale
            out[key + "_loss"] = max(abs(stats[k] - ref_stats[k]) for k in ref_stats if k != "num_micro_batches")
            out[key + "_sft"] = abs(sft - ref_sft)
            # past a row's last policy token, packed and token-budget layouts leave 0 (as at CP=1)
            out[key + "_logprob"] = float(((lp - ref_lp) * batch.loss_mask).abs().max())
            out[key + "_logprob_all"] = float((lp_all - ref_lp_all).abs().max())
            out[key + "_keys"] = sorted(stats) == sorted(ref_stats)
            out[key + "_lp"] = lp
    return out


def test_cp2_same_logprobs_loss_and_grads_as_cp1():
    """CP=2 (padded rows and packed sequences, fixed micro-batches and token budgets, selective
    recomputation) gives the log-probs (complete, on both ranks), losses, every loss statistic
    (mismatch per lag included) and gradients of CP=1."""
    outs = run_distributed(_cp_same_as_cp1, 2, timeout_s=300)
    out = outs[0]
    assert "parallel.tp * parallel.pp * parallel.cp = 1 * 1 * 3 = 3" in out["refusal"], out["refusal"]
    keys = [k[: -len("_grad")] for k in out if k.endswith("_grad")]
    assert len(keys) == 4, keys
    for k in keys:
        assert out[k + "_keys"], k
        for m in ("_grad", "_loss", "_sft", "_logprob", "_logprob_all"):
            assert out[k + m] < 1e-5, (k + m, {x: v for x, v in out.items() if not x.endswith("_lp")})
        assert torch.equal(outs[0][k + "_lp"], outs[1][k + "_lp"]), k  # the same, whole, on both CP ranks


@pytest.mark.e2e
def test_cli_trains_two_rl_steps_at_cp2(tmp_path):
    """`agentrl train --nproc 2 parallel.cp=2` on the demo's config (packed sequences, shrunk): SFT and two RL
    steps with finite losses and grad norms, and the trainer's log-probs of the sampled tokens (CP=2) equal
    the rollout engine's (its weights synced from the trainer) to fp32 rounding."""
    from tests.support.demo_run import TINY_MODEL, train_demo, trained_rl_rows

    out = tmp_path / "run"
    proc = train_demo(out, 2, "parallel.cp=2", "train.sequence_packing=true", "checkpoint.interval=0", *TINY_MODEL)
    assert "cp=2 ep=1 dp=1" in proc.stdout + proc.stderr
    rl = trained_rl_rows(out)
    lag0 = [r["mismatch/abs_lag0"] for r in rl if "mismatch/abs_lag0" in r]
    assert lag0 and max(lag0) < 1e-4, lag0
