"""megatron-core's optimizer in the actor (CPU, gloo, fp32).

One GRPO step with the distributed optimizer at DP=2 (optimizer state sharded over the two
ranks), at TP=2 and at PP=2 gives the parameters of one single-process step on the whole batch
without it; weight decay leaves biases and norms alone; a non-finite gradient skips the step on
every rank instead of writing NaN into the weights.
"""
from __future__ import annotations

import math

import torch

from tests.support.dist_utils import run_distributed
from tests.support.tiny_models import reinit_parallel, tiny_model
from tests.trainer.support import hf_state, make_batch

LR, WD = 1e-2, 0.1


def _train_cfg(dist_opt: bool, **kw):
    from megatron_agentrl.config import TrainConfig

    return TrainConfig(lr=LR, weight_decay=WD, grad_clip=0.5, micro_batch_size=2, use_distributed_optimizer=dist_opt,
                       **kw)


def _one_step(rank: int, world: int, layouts: list[tuple[int, int]], dist_opt: bool) -> dict:
    """Per layout: HF-named grads before the step and parameters after it, the grad norm, the
    optimizer's state size on this rank and its step count."""
    from megatron_agentrl.megatron.actor import MegatronActor

    cfg, hf = tiny_model("qwen2", tied=True, vocab=200, layers=2)
    batch = make_batch(cfg.vocab_size)
    out = {}
    for tp, pp in layouts:
        reinit_parallel(tp, pp)
        actor = MegatronActor(cfg, _train_cfg(dist_opt))
        actor.load_hf_state_dict(hf_state(hf))
        actor.compute_grads(actor.dp_slice(batch), "grpo")
        grads = actor.export_hf_grads()
        norm = actor.optimizer_step()
        state_numel = sum(v.numel() for o in actor.optimizer.chained_optimizers for st in o.optimizer.state.values()
                          for k, v in st.items() if k != "step")
        out[tp, pp] = {"grads": grads, "params": actor.export_hf_state_dict(), "norm": norm,
                       "state_numel": state_numel, "steps": actor.optimizer_step_count}
    return out


def _decay_and_skip(rank: int, world: int) -> dict:
    """A step on zero grads (only decoupled weight decay acts) and a step on a NaN grad."""
    from megatron_agentrl.megatron.actor import MegatronActor

    cfg, hf = tiny_model("qwen2", tied=False, vocab=200, layers=2)
    reinit_parallel(1, 1)
    actor = MegatronActor(cfg, _train_cfg(True))
    actor.load_hf_state_dict(hf_state(hf))
    before = {n: p.detach().clone() for n, p in actor.named_params}
    actor.ddp.zero_grad_buffer()
    actor.optimizer_step()
    ratios = {n: float(p.detach().norm() / before[n].norm()) for n, p in actor.named_params}
    shapes = {n: p.ndim for n, p in actor.named_params}
    before = {n: p.detach().clone() for n, p in actor.named_params}
    actor.ddp.zero_grad_buffer()
    actor.named_params[0][1].main_grad[0].fill_(float("nan"))
    norm = actor.optimizer_step()
    unchanged = all(torch.equal(p.detach(), before[n]) for n, p in actor.named_params)
    return {"ratios": ratios, "ndim": shapes, "nan_norm": norm, "unchanged_after_nan": unchanged}


def test_distributed_optimizer_step_equals_single_process_step_at_dp2_tp2_pp2() -> None:
    ref = run_distributed(_one_step, 1, [(1, 1)], False, timeout_s=120)[0][1, 1]
    results = run_distributed(_one_step, 2, [(1, 1), (2, 1), (1, 2)], True, timeout_s=240)
    grads = ref["grads"]
    scale = max(float(g.abs().max()) for g in grads.values())
    assert scale > 1e-3 and ref["steps"] == 1
    start = hf_state(tiny_model("qwen2", True, 200, 2)[1])
    moved = max(float((ref["params"][k] - w).abs().max()) for k, w in start.items() if k in ref["params"])
    assert moved > 1e-3  # the step did move the weights
    for rank, per_layout in enumerate(results):
        for layout, r in per_layout.items():
            assert r["steps"] == 1, (rank, layout)
            assert abs(r["norm"] - ref["norm"]) < 1e-5 * ref["norm"], (layout, r["norm"], ref["norm"])
            for name, p in ref["params"].items():
                # Adam's first step is lr * sign(grad) where |grad| >> eps: reduction-order noise
                # flips the sign of grads near zero only
                big = grads[name].abs() > 1e-5
                diff = (r["params"][name] - p).abs()[big]
                assert diff.numel() == 0 or float(diff.max()) < 1e-5, (rank, layout, name, float(diff.max()))
    dp2 = [per_layout[1, 1]["state_numel"] for per_layout in results]
    assert max(dp2) <= 0.55 * ref["state_numel"], (dp2, ref["state_numel"])  # each DP rank holds about half


def test_weight_decay_spares_biases_and_norms_and_a_nan_grad_skips_the_step() -> None:
    r = run_distributed(_decay_and_skip, 1, timeout_s=120)[0]
    for name, ratio in r["ratios"].items():
        want = 1.0 if r["ndim"][name] == 1 else 1.0 - LR * WD
        assert abs(ratio - want) < 1e-6, (name, ratio, want)
    assert not math.isfinite(r["nan_norm"])
    assert r["unchanged_after_nan"]
