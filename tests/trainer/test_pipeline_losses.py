"""The RL loss options against values worked by hand (truncated importance weights, k3 KL,
entropy bonus), vocab-parallel entropy at TP=2, and token-budget micro-batching: the same loss
and gradients as fixed micro-batches, at TP=1, TP=2 and PP=2, with every loss option on."""
from __future__ import annotations

import math

import pytest
import torch

from megatron_agentrl.algo.losses import LossInputs, clipped_policy_loss, kl_to_reference, policy_loss
from megatron_agentrl.config import LossConfig
from megatron_agentrl.megatron.packing import effective_lengths, plan_micro_batches
from tests.support.dist_utils import run_distributed
from tests.support.tiny_models import layout_actor, ragged_batch, reinit_parallel, tiny_qwen2_config


def test_truncated_importance_weights_by_hand():
    # behavior 0; pi_old / mu = 1, 4, 0.5, 3 (cap 2 -> 1, 2, 0.5, 2); current = old except token 4 (ratio 1.5)
    behavior = torch.zeros(1, 5)
    old = torch.tensor([[0.0, math.log(4.0), math.log(0.5), math.log(3.0), 9.0]])
    logprobs = (old + torch.tensor([[0.0, 0.0, 0.0, math.log(1.5), 0.0]])).requires_grad_(True)
    adv = torch.tensor([[1.0, -1.0, 2.0, 0.5, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    loss, stats = clipped_policy_loss(LossInputs(logprobs, behavior, adv, mask, old_logprobs=old),
                                      LossConfig(clip_eps_low=0.2, clip_eps_high=0.28, tis_cap=2.0))
    # -w * min(r A, clip(r) A): -1*1 | -2*(-1) | -0.5*2 | -2*min(.75, 1.28*.5)
    assert loss.item() == pytest.approx(-1.0 + 2.0 - 1.0 - 2.0 * 0.64, abs=1e-6)
    assert stats["is_weight"].item() == pytest.approx(1 + 2 + 0.5 + 2)
    assert stats["is_truncated"].item() == 2  # tokens 2 and 4 hit the cap
    assert stats["clip_frac"].item() == 1
    rho = [1.0, 4.0, 0.5, 4.5]  # current / behavior
    assert stats["approx_kl"].item() == pytest.approx(sum((r - 1) - math.log(r) for r in rho), abs=1e-5)
    loss.backward()
    # d/dlogp = -w * A * r where the unclipped term is active; 0 on the clipped token and the masked one
    assert torch.allclose(logprobs.grad, torch.tensor([[-1.0, 2.0, -1.0, 0.0, 0.0]]), atol=1e-6)


def test_tis_off_is_the_classic_loss():
    g = torch.Generator().manual_seed(0)
    lp, beh, adv = torch.randn(3, 6, generator=g), torch.randn(3, 6, generator=g), torch.randn(3, 6, generator=g)
    mask = (torch.rand(3, 6, generator=g) > 0.3).float()
    a, _ = clipped_policy_loss(LossInputs(lp, beh, adv, mask), LossConfig(clip_eps_low=0.2, clip_eps_high=0.28))
    b, stats = clipped_policy_loss(LossInputs(lp, beh, adv, mask, old_logprobs=None),
                                   LossConfig(clip_eps_low=0.2, clip_eps_high=0.28, tis_cap=2.0))
    assert a.item() == b.item() and "is_weight" not in stats


def test_kl_estimators_by_hand():
    lp = torch.tensor([[math.log(0.5), math.log(0.25), 3.0]], requires_grad=True)
    ref = torch.tensor([[math.log(0.25), math.log(0.5), -3.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    kl = kl_to_reference(lp, ref, mask)  # k3
    # d = ref - lp = log .5, log 2: (e^d - d - 1) = .5 + log 2 - 1, 2 - log 2 - 1 -> sum .5
    assert kl.item() == pytest.approx(0.5, abs=1e-6)
    kl.backward()
    assert torch.allclose(lp.grad, torch.tensor([[0.5, -1.0, 0.0]]), atol=1e-6)  # 1 - e^d
    lp.grad = None
    k2 = kl_to_reference(lp, ref, mask, "k2")  # d^2 / 2, gradient -d
    assert k2.item() == pytest.approx(math.log(2) ** 2, abs=1e-6)
    k2.backward()
    assert torch.allclose(lp.grad, torch.tensor([[-math.log(0.5), -math.log(2), 0.0]]), atol=1e-6)
    # a token the current policy has all but dropped (d = 12): k3's gradient explodes, k2's stays linear
    far = torch.tensor([[-14.0]], requires_grad=True)
    kl_to_reference(far, torch.tensor([[-2.0]]), torch.ones(1, 1)).backward()
    assert far.grad.item() < -1e5
    far.grad = None
    kl_to_reference(far, torch.tensor([[-2.0]]), torch.ones(1, 1), "k2").backward()
    assert far.grad.item() == pytest.approx(-12.0)
    with pytest.raises(ValueError, match="'k1' is not one of"):
        kl_to_reference(lp, ref, mask, "k1")


def test_entropy_and_combined_loss():
    from megatron_agentrl.megatron.vocab_parallel import token_logprobs

    # uniform over 4 entries (the rest padded vocab): entropy log 4, every log-prob -log 4
    flat = torch.zeros(1, 1, 8)
    pad = torch.arange(8) >= 4
    lp, ent = token_logprobs(flat, torch.tensor([[2]]), pad_mask=pad, with_entropy=True)
    assert ent.item() == pytest.approx(math.log(4), abs=1e-6) and lp.item() == pytest.approx(-math.log(4), abs=1e-6)

    lp = torch.tensor([[math.log(0.5), math.log(0.25)]])
    beh = lp.clone()
    adv = torch.tensor([[1.0, -1.0]])
    mask = torch.ones(1, 2)
    refl = torch.tensor([[math.log(0.25), math.log(0.5)]])
    entropy = torch.tensor([[2.0, 3.0]])
    loss, stats = policy_loss(LossInputs(lp, beh, adv, mask, ref_logprobs=refl, entropy=entropy),
                              LossConfig(clip_eps_low=0.2, clip_eps_high=0.2, kl_coef=0.1, entropy_coef=0.01))
    # pg: -(1) - (-1) = 0; kl .5 (see above) * .1; entropy 5 * .01
    assert loss.item() == pytest.approx(0.0 + 0.05 - 0.05, abs=1e-6)
    assert stats["kl_ref"].item() == pytest.approx(0.5, abs=1e-6) and stats["entropy"].item() == 5.0
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(LossInputs(lp, beh, adv, mask), LossConfig(clip_eps_low=0.2, clip_eps_high=0.2, kl_coef=0.1))


def test_plan_micro_batches_and_effective_lengths():
    assert plan_micro_batches([5, 3, 9, 1, 2], 2) == [[0, 1], [2, 3], [4]]
    plan = plan_micro_batches([5, 3, 9, 1, 2, 9], 2, token_budget=12)
    assert sorted(i for mb in plan for i in mb) == list(range(6))
    lengths = [5, 3, 9, 1, 2, 9]
    for mb in plan:
        assert len(mb) == 1 or len(mb) * max(lengths[i] for i in mb) <= 12
    assert plan[0] == [2] and plan[1] == [5]  # longest first, a row of 9 alone under a budget of 12
    mask = torch.tensor([[0, 1, 1, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1.0]])
    assert effective_lengths(mask).tolist() == [3, 2, 5]


# ------------------------------------------------------------------ actor (spawned processes)
def _batch(vocab: int):
    return ragged_batch(vocab, [24, 5, 17, 9, 24, 3, 12, 20], [2, 1, 4, 2, 10, 1, 3, 6], seed=3, ref=True)


def _layouts_same_grads(rank: int, world: int) -> dict[str, float]:
    cfg = tiny_qwen2_config()
    batch = _batch(cfg.vocab_size)
    out: dict[str, float] = {}
    ref = state = None
    # the reference: padded rows in fixed micro-batches at TP=1 (DP=2); then token budgets, packed
    # sequences and recomputation at TP=1, TP=2, PP=2: (micro_batch_tokens, sequence_packing, recompute)
    variants = {
        (1, 1): [(0, False, "none"), (60, False, "none"), (0, True, "none"), (40, True, "none"),
                 (40, True, "selective"), (40, True, "full"), (0, False, "full")],
        (2, 1): [(60, False, "none"), (40, True, "none"), (40, True, "selective")],
        (1, 2): [(60, False, "none"), (40, True, "none"), (40, True, "full")],
    }
    for (tp, pp), runs in variants.items():
        reinit_parallel(tp, pp, seed=7)
        for budget, packed, recompute in runs:
            actor, state = layout_actor(cfg, state, 3, budget, packed, recompute)
            lp = actor.compute_logprobs(batch.tokens, 0.9, 3, loss_mask=batch.loss_mask)  # the whole batch
            stats = actor.compute_grads(actor.dp_slice(batch), "grpo", temperature=0.9)
            grads = actor.export_hf_grads()
            if ref is None:
                ref = grads, stats, lp
                continue
            ref_grads, ref_stats, ref_lp = ref
            key = f"tp{tp}pp{pp}b{budget}{'packed' if packed else 'padded'}-{recompute}"
            # grads relative to the largest one, where they are not tiny
            scale = max(float(g.abs().max()) for g in ref_grads.values())
            out[key + "_grad"] = max(float(((grads[k] - ref_grads[k]).abs() * (ref_grads[k].abs() > 1e-5)).max())
                                     for k in ref_grads) / scale
            out[key + "_loss"] = max(abs(stats[k] - ref_stats[k]) for k in ("loss", "kl_ref", "entropy", "is_weight"))
            out[key + "_ntok"] = abs(stats["num_tokens"] - ref_stats["num_tokens"])
            out[key + "_logprob"] = float(((lp - ref_lp) * batch.loss_mask).abs().max())
            out[key + "_mb"] = stats["num_micro_batches"]
    return out


def test_packing_budget_and_recompute_same_logprobs_loss_and_grads_tp_pp():
    """Padded vs packed micro-batches, token budgets and recomputation (selective, full) give the same
    log-probs, loss and gradients as fixed padded micro-batches, at TP=1/2 and PP=2."""
    out = run_distributed(_layouts_same_grads, 2, timeout_s=240)[0]
    for k, v in out.items():
        if k.endswith("_grad"):
            assert v < 1e-5, (k, out)
        elif k.endswith("_loss") or k.endswith("_logprob"):
            assert v < 1e-5, (k, out)
        elif k.endswith("_ntok"):
            assert v == 0, (k, out)
    # packing 4 rows of this rank under a 40-token budget takes fewer micro-batches than 3 rows each
    assert out["tp1pp1b40packed-none_mb"] < out["tp1pp1b0packed-none_mb"] + 1, out
