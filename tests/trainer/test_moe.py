"""Mixture-of-experts with expert parallelism (``parallel.ep``): the config's refusals, the actor at EP=2
(2 processes, gloo, fp32) against EP=1 (the same log-probs, loss and gradients; padded rows and packed
sequences), a pipeline stage without MoE layers, the routing metrics, the auxiliary loss and token
dropping, and `agentrl train --nproc 2 parallel.ep=2` on a tiny MoE."""
from __future__ import annotations

import pytest

from megatron_agentrl.config import ConfigError, LossConfig, ParallelConfig, TrainConfig, load_config
from megatron_agentrl.convert import resolve_chat_template
from tests.support.dist_utils import run_distributed
from tests.support.tiny_models import ragged_batch

DEMO = "examples/configs/tiny_cpu.yaml"
# a tiny Qwen3-MoE on the demo's tasks: 4 experts of width 32, 2 per token
TINY_MOE = ["model.arch.model_type=qwen3_moe", "model.arch.hidden_size=32", "model.arch.intermediate_size=64",
            "model.arch.num_hidden_layers=2", "model.arch.head_dim=4", "model.arch.num_experts=4",
            "model.arch.moe_intermediate_size=32", "model.arch.num_experts_per_tok=2", "model.arch.norm_topk_prob=true"]


def test_config_refuses_bad_ep():
    with pytest.raises(ConfigError, match="parallel.ep=0 must be a positive integer"):
        ParallelConfig(ep=0)
    assert ParallelConfig(tp=2, ep=4).model_parallel_size == 4
    assert ParallelConfig(tp=2, ep=3, pp=2).model_parallel_size == 12
    with pytest.raises(ConfigError, match="train.moe_capacity_factor=0.0 must be > 0"):
        TrainConfig(moe_capacity_factor=0.0)
    glm45 = load_config(DEMO, ["model.arch.model_type=glm4_moe"])  # auto: GLM-4.5's own chat format
    assert resolve_chat_template(glm45.model.chat_template, "glm4_moe") == "glm45"
    cfg = load_config(DEMO, ["parallel.ep=2"])
    with pytest.raises(ConfigError, match=r"--nproc 3 = 3 trainer processes is not a multiple of "
                                          r"lcm\(parallel.tp \* parallel.cp, parallel.ep\) \* parallel.pp"):
        cfg.check_world_size(3, "--nproc 3")


def test_moe_options_refuse_what_megatron_cannot_express():
    from megatron_agentrl.megatron.moe import moe_options
    from tests.support.tiny_models import tiny_config

    with pytest.raises(ConfigError, match="parallel.ep=2 needs a mixture-of-experts model"):
        moe_options(tiny_config("qwen2"), ep=2)
    with pytest.raises(ConfigError, match=r"parallel.ep=3 does not divide the model's 4 experts; "
                                          r"choose ep in \[1, 2, 4\]"):
        moe_options(tiny_config("qwen3_moe"), ep=3)
    glm = tiny_config("glm4_moe")
    opts = moe_options(glm, ep=2, aux_loss_coeff=0.01, capacity_factor=1.5)
    assert opts["moe_layer_freq"] == [0, 1]  # the first layer dense
    assert (opts["moe_router_score_function"], opts["moe_router_topk_scaling_factor"]) == ("sigmoid", 2.5)
    assert (opts["moe_shared_expert_intermediate_size"], opts["moe_router_bias_update_rate"]) == (32, 0.0)
    assert (opts["moe_router_load_balancing_type"], opts["moe_expert_capacity_factor"]) == ("aux_loss", 1.5)
    glm.n_group, glm.topk_group = 2, 2
    with pytest.raises(ConfigError, match="n_group=2, topk_group=2"):
        moe_options(glm, ep=1)


# ------------------------------------------------------------------ actor (spawned processes)
def _batch(vocab: int):
    return ragged_batch(vocab, [21, 5, 17, 9, 14, 3], [2, 1, 4, 2, 6, 1], seed=5)


def _ep_same_as_ep1(rank: int, world: int, family: str) -> dict:
    from megatron.core import parallel_state

    from megatron_agentrl.megatron.actor import MegatronActor
    from megatron_agentrl.megatron.parallel import initialize_parallel
    from tests.support.tiny_models import tiny_config

    cfg = tiny_config(family, vocab=150)
    batch = _batch(cfg.vocab_size)
    out: dict = {}
    refs: dict = {}
    state = None
    # EP=1 (DP=2) references with padded rows and packed sequences (the aux loss sees the padding tokens, so
    # each layout is compared with its own); then EP=2 (DP=2) padded and packed, and PP=2 (for GLM-4.5 its
    # first stage holds only the dense layer), and TP=2 (sequence parallel: each TP rank routes half the
    # tokens). Megatron's aux loss is one per micro-batch of a DP rank, so PP=2 and TP=2 (DP=1: other
    # micro-batches) are compared without it.
    layouts = ((1, 1, 1, False, 0.01), (1, 1, 1, True, 0.01), (1, 1, 1, True, 0.0), (1, 1, 2, False, 0.01),
               (1, 1, 2, True, 0.01), (1, 2, 1, True, 0.0), (2, 1, 1, True, 0.0))
    for tp, pp, ep, packed, aux in layouts:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        initialize_parallel(tp, pp, seed=7, timeout_s=60, ep=ep)
        tcfg = TrainConfig(micro_batch_size=2, sequence_packing=packed, moe_aux_loss_coeff=aux)
        actor = MegatronActor(cfg, tcfg, LossConfig(tis_cap=2.0))
        if state is None:
            state = actor.export_hf_state_dict()
        else:
            actor.load_hf_state_dict(state)
        lp = actor.compute_logprobs(batch.tokens, 1.0, 2, loss_mask=batch.loss_mask)
        stats = actor.compute_grads(actor.dp_slice(batch), "grpo")
        grads = actor.export_hf_grads()
        if (tp, pp, ep) == (1, 1, 1):
            refs[packed, aux] = grads, stats, lp
            out[f"ref_stats_{'packed' if packed else 'padded'}{aux}"] = stats
            continue
        ref_grads, ref_stats, ref_lp = refs[packed, aux]
        key = f"tp{tp}pp{pp}ep{ep}{'packed' if packed else 'padded'}{aux}"
        scale = max(float(g.abs().max()) for g in ref_grads.values())
        out[key + "_names"] = sorted(grads) == sorted(ref_grads)
        out[key + "_grad"] = max(float((grads[k] - ref_grads[k]).abs().max()) for k in ref_grads) / scale
        out[key + "_loss"] = max(abs(stats[k] - ref_stats[k]) for k in ref_stats
                                 if k != "num_micro_batches" and not k.startswith("moe/"))
        out[key + "_logprob"] = float(((lp - ref_lp) * batch.loss_mask).abs().max())
        out[key + "_moe"] = {k: v for k, v in stats.items() if k.startswith("moe/")}
    return out


@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe"])
def test_ep2_same_logprobs_loss_and_grads_as_ep1(family):
    """EP=2 (experts split over the two ranks, tokens exchanged by all-to-all; padded rows and packed
    sequences), PP=2 and TP=2 (with sequence parallelism) give the log-probs, loss statistics and gradients
    (every expert's included) of EP=1, with the auxiliary load-balancing loss on; the routing metrics and the
    aux loss are reported."""
    out = run_distributed(_ep_same_as_ep1, 2, family, timeout_s=300)[0]
    keys = [k[: -len("_grad")] for k in out if k.endswith("_grad")]
    assert len(keys) == 4, keys
    for k in keys:
        assert out[k + "_names"], k
        for m in ("_grad", "_loss", "_logprob"):
            assert out[k + m] < 1e-5, (k + m, out)
    for k in keys:
        ref = out["ref_stats_" + k.split("ep", 1)[1][1:]]
        assert ref["moe/load_imbalance"] >= 1.0 and ref["moe/dropped_frac"] == 0.0  # dropless
        if k.endswith("0.01"):
            assert 0.0 < ref["moe/load_balancing_loss"] < 10.0
        else:
            assert "moe/load_balancing_loss" not in ref
        if "tp1pp1" in k:  # the same tokens routed the same way (DP=1 layouts: other micro-batches, other padding)
            for m in ("moe/load_imbalance", "moe/expert_tokens_cv", "moe/load_balancing_loss"):
                if m in ref:
                    assert out[k + "_moe"][m] == pytest.approx(ref[m], rel=1e-5), (k, m)
        else:
            assert out[k + "_moe"]["moe/load_imbalance"] >= 1.0


def _capacity(rank: int, world: int) -> dict:
    from megatron_agentrl.megatron.actor import MegatronActor
    from megatron_agentrl.megatron.parallel import initialize_parallel
    from tests.support.tiny_models import tiny_config

    initialize_parallel(1, 1, seed=7, timeout_s=60, ep=2)
    cfg = tiny_config("qwen3_moe", vocab=150)
    stats = {}
    for factor in (None, 0.5):
        actor = MegatronActor(cfg, TrainConfig(micro_batch_size=3, moe_capacity_factor=factor))
        stats[factor] = actor.compute_grads(actor.dp_slice(_batch(cfg.vocab_size)), "grpo")
    return stats


def test_capacity_factor_drops_tokens_and_says_so():
    """With train.moe_capacity_factor=0.5 half an even share fits each expert: tokens are dropped and
    moe/dropped_frac reports it; dropless routing drops none. No aux loss is tracked when its coefficient is 0."""
    stats = run_distributed(_capacity, 2, timeout_s=180)[0]
    assert stats[None]["moe/dropped_frac"] == 0.0 and "moe/load_balancing_loss" not in stats[None]
    assert stats[0.5]["moe/dropped_frac"] >= 0.4


@pytest.mark.e2e
def test_cli_trains_two_rl_steps_at_ep2(tmp_path):
    """`agentrl train --nproc 2 parallel.ep=2 train.moe_routing_replay=true` with a tiny Qwen3-MoE on the demo's
    tasks: SFT and two RL steps with finite losses, the MoE metrics in metrics.jsonl, every trajectory carrying
    the engine's routed experts, ``routing/flip_rate`` logged, and the trainer's log-probs of the sampled tokens
    (EP=2, replaying the engine's routing) equal the rollout engine's (its fused expert weights synced from the
    trainer) to fp32 rounding."""
    from tests.support.demo_run import train_demo, trained_rl_rows

    out = tmp_path / "run"
    proc = train_demo(out, 2, "parallel.ep=2", "checkpoint.interval=0", "train.moe_routing_replay=true", *TINY_MOE)
    assert "ep=2 dp=2" in proc.stdout + proc.stderr
    rl = trained_rl_rows(out)
    assert all(r["moe/load_imbalance"] >= 1.0 for r in rl)
    assert all(r["routing/captured_frac"] == 1.0 and 0.0 <= r["routing/flip_rate"] <= 1.0 for r in rl), rl
    # tokens sampled by the weights being trained route as the trainer does (older versions may not)
    on_policy = [r["routing/flip_rate"] for r in rl if not any(k.startswith("mismatch/tokens_lag") and k != "mismatch/"
                                                               "tokens_lag0" for k in r)]
    assert on_policy and max(on_policy) < 1e-3, rl
    lag0 = [r["mismatch/abs_lag0"] for r in rl if "mismatch/abs_lag0" in r]
    assert lag0 and max(lag0) < 1e-4, lag0


@pytest.mark.e2e
def test_ep2_checkpoint_resumes_at_ep1(tmp_path):
    """A training checkpoint of a MoE model written at EP=2 (each rank holding half the experts and, with the
    distributed optimizer, its share of their Adam state) resumes at EP=1 (DP=2, every rank holding every
    expert): step 3 trains on the same samples with the loss and grad norm of the uninterrupted EP=2 run;
    meta.json records the layout."""
    import json

    from tests.trainer.support import TINY
    from tests.trainer.support import read_steps as _steps
    from tests.trainer.support import train_tiny as _train

    moe = [o for o in TINY_MOE if not o.startswith(("model.arch.hidden_size", "model.arch.intermediate_size",
                                                     "model.arch.num_hidden_layers"))]
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    run_distributed(_train, 2, TINY + moe + ["parallel.ep=2", f"output_dir={full}", "train.steps=3"], timeout_s=200)
    ckpt = full / "checkpoints" / "step_000002"
    meta = json.loads((ckpt / "meta.json").read_text())
    assert (meta["ep"], meta["cp"], meta["dp"]) == (2, 1, 2)
    run_distributed(_train, 2, TINY + moe + [f"output_dir={resumed}", "train.steps=3", f"checkpoint.resume={ckpt}"],
                    timeout_s=200)
    f, r = _steps(full), _steps(resumed)
    assert sorted(r) == [3]
    assert f[3]["sample_ids"] == r[3]["sample_ids"]
    assert abs(f[3]["loss"] - r[3]["loss"]) <= 1e-5 * max(1.0, abs(f[3]["loss"])), (f[3]["loss"], r[3]["loss"])
    assert abs(f[3]["grad_norm"] - r[3]["grad_norm"]) <= 1e-5 * max(1.0, f[3]["grad_norm"])
