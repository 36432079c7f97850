"""The advantage estimators (RLOO, REINFORCE++), the loss aggregation modes, GSPO's sequence-level ratio and
masked importance sampling: against values worked by hand; the actor's loss and gradients the same whatever
the micro-batching (one or several, padded or packed) and at CP=2 as at CP=1; an on-policy step with no
train-vs-rollout mismatch; and short CLI runs with every setting."""
from __future__ import annotations

import json
import math

import pytest
import torch

from megatron_agentrl.algo.advantages import group_advantages, reinforce_pp_advantages, rloo_advantages
from megatron_agentrl.algo.losses import (
    LossInputs,
    Sequences,
    clipped_policy_loss,
    importance_keep,
    loss_agg_weights,
    policy_loss,
)
from megatron_agentrl.config import LossConfig, TrainConfig
from tests.support.dist_utils import run_distributed

LN = math.log


# ------------------------------------------------------------------ estimators
def test_rloo_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 5.0, 3.0, 0.0, 6.0])
    groups = torch.tensor([4, 4, 4, 4, 9, 9, 1, 0, 0, 0])
    adv = rloo_advantages(rewards, groups)
    # group 4: the others' mean is 1/3 for a 1 and 2/3 for a 0; group 9: equal rewards; group 1: one sample
    # has nobody to compare with; group 0: 3 - (0+6)/2, 0 - (3+6)/2, 6 - (3+0)/2
    expected = [1 - 1 / 3, 0 - 2 / 3, 0 - 2 / 3, 1 - 1 / 3, 0.0, 0.0, 0.0, 3 - 3.0, 0 - 4.5, 6 - 1.5]
    assert adv.tolist() == pytest.approx(expected, abs=1e-6)
    assert adv.dtype == torch.float32


def test_reinforce_pp_by_hand():
    rewards = torch.tensor([1.0, 0.0, 3.0, 1.0, 2.0])
    groups = torch.tensor([0, 0, 1, 1, 1])
    tokens = torch.tensor([2, 1, 1, 3, 0])  # policy tokens per sample: the last one counts for nothing
    adv = reinforce_pp_advantages(rewards, groups, tokens, eps=0.0)
    a = [0.5, -0.5, 1.0, -1.0, 0.0]  # reward minus the group mean (0.5 and 2)
    n = [2, 1, 1, 3, 0]
    mean = (2 * 0.5 + 1 * -0.5 + 1 * 1.0 + 3 * -1.0 + 0) / 7  # over the batch's 7 tokens
    var = (2 * (0.5 - mean) ** 2 + 1 * (-0.5 - mean) ** 2 + 1 * (1.0 - mean) ** 2 + 3 * (-1.0 - mean) ** 2) / 7
    assert adv.tolist() == pytest.approx([(x - mean) / math.sqrt(var) for x in a], abs=1e-6)
    # per token, the whitened advantages have mean 0 and std 1
    per_token = torch.repeat_interleave(adv.double(), torch.tensor(n))
    assert per_token.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert per_token.std(unbiased=False).item() == pytest.approx(1.0, abs=1e-6)
    # no spread at all: 0, not a division by zero
    assert reinforce_pp_advantages(torch.ones(4), torch.tensor([0, 0, 1, 1]), torch.ones(4)).tolist() == [0.0] * 4
    with pytest.raises(ValueError, match="num_tokens \\(3,\\) must be \\[N\\]"):
        reinforce_pp_advantages(rewards, groups, torch.ones(3))


def test_estimator_dispatch_and_batch_builder():
    from megatron_agentrl.config import AlgoConfig
    from megatron_agentrl.pipeline.batch import build_rl_batch
    from rollout_sglang.trajectory import Trajectory

    rewards, groups, n = torch.tensor([1.0, 0.0, 0.0]), torch.tensor([0, 0, 0]), torch.tensor([1, 1, 1])
    dr_grpo = group_advantages("grpo", rewards, groups, n, std_norm=False)
    assert dr_grpo.tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3])
    assert group_advantages("rloo", rewards, groups, n).tolist() == pytest.approx([1.0, -0.5, -0.5])
    with pytest.raises(ValueError, match="algo.estimator='ppo' is not one of"):
        group_advantages("ppo", rewards, groups, n)

    def traj(mask: list[int], group: int, reward: float) -> Trajectory:
        return Trajectory(list(range(1, len(mask) + 1)), mask, [-0.1 * m for m in mask], [0 if m else -1 for m in mask],
                          [(0, len(mask))],
                          "lookup", 0, group, reward=reward)

    trajs = [traj([0, 1, 1], 0, 1.0), traj([0, 1, 0], 0, 0.0), traj([0, 1, 1, 1], 0, 2.0)]
    rl = build_rl_batch(trajs, ["lookup"], AlgoConfig(estimator="rloo"))
    # 1 - (0+2)/2 = 0, 0 - (1+2)/2 = -1.5, 2 - (1+0)/2 = 1.5 on every policy token
    assert rl.sample_adv.tolist() == pytest.approx([0.0, -1.5, 1.5])
    assert torch.allclose(rl.batch.advantages, torch.tensor([[0, 0, 0, 0], [0, -1.5, 0, 0], [0, 1.5, 1.5, 1.5]]))
    rl = build_rl_batch(trajs, ["lookup"], AlgoConfig(estimator="reinforce_pp"))
    a, n = [0.0, -1.0, 1.0], [2, 1, 3]  # reward - mean 1; token counts
    mean = (0 * 2 - 1 * 1 + 1 * 3) / 6
    std = math.sqrt((2 * (0 - mean) ** 2 + 1 * (-1 - mean) ** 2 + 3 * (1 - mean) ** 2) / 6)
    assert rl.sample_adv.tolist() == pytest.approx([(x - mean) / (std + 1e-6) for x in a], abs=1e-6)


# ------------------------------------------------------------------ loss aggregation
def test_loss_agg_weights_by_hand():
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 1.0, 0.0]])
    losses = torch.tensor([[1.0, 2.0, 3.0, 9.0], [9.0, 4.0, 9.0, 9.0], [9.0, 9.0, 9.0, 9.0], [5.0, 9.0, 7.0, 9.0]])
    # 6 policy tokens in 3 sequences (row 2 has none) of 3, 1 and 2 tokens
    assert loss_agg_weights(mask, "token_mean") is None
    w_sum = loss_agg_weights(mask, "seq_mean_token_sum")
    assert w_sum.tolist() == (mask * 2.0).tolist()  # 6 / 3
    w_mean = loss_agg_weights(mask, "seq_mean_token_mean")
    expected = [[2 / 3] * 3 + [0], [0, 2, 0, 0], [0] * 4, [1, 0, 1, 0]]  # 6 / (3 * L_i)
    assert torch.allclose(w_mean, torch.tensor(expected))
    # the actor's normalisation (sum over masked tokens / 6) then gives each mode's mean
    assert ((losses * mask).sum() / 6).item() == pytest.approx((1 + 2 + 3 + 4 + 5 + 7) / 6)
    assert ((w_sum * losses).sum() / 6).item() == pytest.approx(((1 + 2 + 3) + 4 + (5 + 7)) / 3)
    assert ((w_mean * losses).sum() / 6).item() == pytest.approx(((1 + 2 + 3) / 3 + 4 / 1 + (5 + 7) / 2) / 3)
    with pytest.raises(ValueError, match="loss.agg='seq_sum' is not one of"):
        loss_agg_weights(mask, "seq_sum")


# ------------------------------------------------------------------ GSPO
def _gspo_inputs():
    behavior = torch.zeros(3, 4)
    logprobs = torch.tensor([
        [LN(1.5) + 0.2, LN(1.5) - 0.2, LN(1.5), 5.0],  # s = 1.5, A = +1: clipped at 1.28
        [LN(0.9) + 0.1, LN(0.9) - 0.1, 3.0, 3.0],  # s = 0.9, A = -1: inside [0.8, 1.28]
        [7.0, LN(1.1) + 0.3, LN(1.1) - 0.3, 2.0],  # s = 1.1, A = +1: inside
    ])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0], [0.0, 1.0, 1.0, 0.0]])
    adv = torch.tensor([[1.0] * 4, [-1.0] * 4, [1.0] * 4]) * mask
    return logprobs, behavior, adv, mask


def test_gspo_sequence_ratio_by_hand():
    logprobs, behavior, adv, mask = _gspo_inputs()
    lp = logprobs.clone().requires_grad_(True)
    loss, stats = clipped_policy_loss(LossInputs(lp, behavior, adv, mask), LossConfig(ratio_level="sequence"))
    # per token -min(s A, clip(s) A): -1.28 (x3) | -(-0.9) (x2) | -1.1 (x2)
    assert loss.item() == pytest.approx(3 * -1.28 + 2 * 0.9 + 2 * -1.1, abs=1e-6)
    assert stats["clip_frac"].item() == 3  # every token of the clipped sequence
    loss.backward()
    # gradient s_i * (-A) on every token of an unclipped sequence, whatever the token's own ratio
    expected = [[0, 0, 0, 0], [0.9, 0.9, 0, 0], [0, -1.1, -1.1, 0]]
    assert torch.allclose(lp.grad, torch.tensor(expected), atol=1e-6)
    # token-level: row 0's second token (ratio 1.5 e^-0.2 = 1.228 < 1.28) is not clipped there
    lp.grad = None
    clipped_policy_loss(LossInputs(lp, behavior, adv, mask), LossConfig())[0].backward()
    assert lp.grad[0, 1].item() == pytest.approx(-1.5 * math.exp(-0.2), abs=1e-6)

    # the same sequences packed into one row (ids per token) give the same loss and gradients
    keep = mask > 0
    packed = [x[keep].unsqueeze(0) for x in (logprobs, behavior, adv, mask)]
    ids = torch.arange(3).unsqueeze(1).expand(3, 4)[keep].unsqueeze(0)
    plp = packed[0].clone().requires_grad_(True)
    ploss, _ = clipped_policy_loss(LossInputs(plp, packed[1], packed[2], packed[3], sequences=Sequences(ids, 3)),
                                   LossConfig(ratio_level="sequence"))
    assert ploss.item() == pytest.approx(loss.item(), abs=1e-6)
    ploss.backward()
    assert torch.allclose(plp.grad, torch.tensor(expected)[keep].unsqueeze(0), atol=1e-6)
    with pytest.raises(ValueError, match="ratio_level='seq' is not one of"):
        clipped_policy_loss(LossInputs(lp, behavior, adv, mask), LossConfig(ratio_level="seq"))


# ------------------------------------------------------------------ masked importance sampling
def test_mis_token_level_by_hand():
    behavior = torch.zeros(1, 5)
    lp = torch.tensor([[LN(3.0), LN(1.5), LN(0.4), LN(0.6), 9.0]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    # rho = pi_old / mu = 3, 1.5, 0.4, 0.6: outside [1/2, 2] are 3 and 0.4
    keep = importance_keep(lp, behavior, mask, 2.0)
    assert (keep * mask).tolist() == [[0.0, 1.0, 0.0, 1.0, 0.0]]
    loss, stats = policy_loss(LossInputs(lp, behavior, adv, mask, old_logprobs=lp.detach()),
                              LossConfig(clip_eps_low=0.2, clip_eps_high=0.28, mis_cap=2.0))
    # classic ratio against mu (tis_cap 0): kept tokens -min(1.5, 1.28) and -min(0.6, 0.8)
    assert loss.item() == pytest.approx(-1.28 - 0.6, abs=1e-6)
    assert stats["mis_masked"].item() == 2
    assert stats["pg_loss"].item() == pytest.approx(-1.28 - 1.28 - 0.4 - 0.6, abs=1e-6)  # over every token
    loss.backward()
    # the dropped token 2 (ratio 0.4, unclipped) would have had gradient -0.4
    assert torch.allclose(lp.grad, torch.tensor([[0.0, 0.0, 0.0, -0.6, 0.0]]), atol=1e-6)
    with pytest.raises(ValueError, match="mis_cap=1.0 must be > 1"):
        importance_keep(lp, behavior, mask, 1.0)
    with pytest.raises(ValueError, match="need old_logprobs"):
        policy_loss(LossInputs(lp, behavior, adv, mask), LossConfig(clip_eps_low=0.2, clip_eps_high=0.2, mis_cap=2.0))


def test_mis_sequence_level_by_hand():
    behavior = torch.zeros(4, 3)
    old = torch.tensor([
        [LN(3.0), 0.0, 0.0],  # geometric mean sqrt(3) = 1.73: kept
        [LN(3.0), LN(1.9), 0.0],  # sqrt(5.7) = 2.39: dropped
        [LN(0.3), LN(1.2), 5.0],  # sqrt(0.36) = 0.6 (the masked 5.0 does not count): kept
        [LN(0.2), 0.0, 0.0],  # 0.2: dropped
    ])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    keep = importance_keep(old, behavior, mask, 2.0, "sequence")
    assert (keep * mask).tolist() == [[1, 1, 0], [0, 0, 0], [1, 1, 0], [0, 0, 0]]
    # token level drops the single tokens instead: 3, 0.2 (and 0.3) are outside [1/2, 2]
    assert (importance_keep(old, behavior, mask, 2.0) * mask).tolist() == [[0, 1, 0], [0, 1, 0], [0, 1, 0], [0, 0, 0]]
    # rows packed into one sequence-id row: the same
    ids = torch.tensor([[0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]])
    flat = importance_keep(old.reshape(1, -1), behavior.reshape(1, -1), mask.reshape(1, -1), 2.0, "sequence",
                           Sequences(ids, 4))
    assert torch.equal(flat.reshape(4, 3) * mask, keep * mask)


def test_mis_with_tis_kl_entropy_and_weights_by_hand():
    behavior = torch.zeros(1, 3)
    lp = torch.tensor([[LN(1.5), LN(3.0), LN(0.8)]], requires_grad=True)
    ref = lp.detach() + torch.tensor([[0.0, 0.5, LN(2.0)]])  # d = ref - lp
    adv = torch.tensor([[1.0, -1.0, 2.0]])
    mask = torch.ones(1, 3)
    entropy = torch.tensor([[2.0, 3.0, 4.0]])
    weights = torch.tensor([[2.0, 5.0, 0.5]])
    cfg = LossConfig(clip_eps_low=0.2, clip_eps_high=0.28, tis_cap=1.2, mis_cap=2.0, kl_coef=0.1, entropy_coef=0.01)
    kw = dict(old_logprobs=lp.detach(), ref_logprobs=ref, entropy=entropy)
    loss, stats = policy_loss(LossInputs(lp, behavior, adv, mask, **kw, token_weights=weights), cfg)
    # decoupled ratio 1; truncated weights min(rho, 1.2) = 1.2, 1.2, 0.8; token 1 (rho 3) is dropped
    k3_0, k3_2 = 0.0, (2.0 - LN(2.0) - 1.0)
    tok0 = -1.2 * 1.0 + 0.1 * k3_0 - 0.01 * 2.0
    tok2 = -0.8 * 2.0 + 0.1 * k3_2 - 0.01 * 4.0
    assert loss.item() == pytest.approx(2.0 * tok0 + 0.5 * tok2, abs=1e-6)
    # stats over every token, unweighted
    assert stats["pg_loss"].item() == pytest.approx(-1.2 + 1.2 - 1.6, abs=1e-6)
    assert stats["kl_ref"].item() == pytest.approx(k3_0 + (math.exp(0.5) - 0.5 - 1.0) + k3_2, abs=1e-6)
    assert stats["entropy"].item() == 9.0 and stats["mis_masked"].item() == 1
    assert stats["is_weight"].item() == pytest.approx(3.2) and stats["is_truncated"].item() == 2
    loss.backward()
    # token 0: -1.2 (k3's gradient -(e^d - 1) = 0 at d = 0); token 2: -0.8*2 - 0.1*(2 - 1); times the weights
    assert torch.allclose(lp.grad, torch.tensor([[2.0 * -1.2, 0.0, 0.5 * (-1.6 - 0.1)]]), atol=1e-6)
    with pytest.raises(ValueError, match="token_weights \\(1, 2\\) must be \\[B, T\\]"):
        policy_loss(LossInputs(lp, behavior, adv, mask, **kw, token_weights=torch.ones(1, 2)), cfg)


# ------------------------------------------------------------------ actor (spawned processes)
def _tiny():
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=150, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 5000.0})


def _batch_parts(vocab: int):
    """tokens, loss mask, advantages, reference log-probs ``[8, 24]`` and per-token log-ratio offsets (the
    behavior log-probs are the policy's minus these)."""
    g = torch.Generator().manual_seed(3)
    B, T = 8, 24
    tokens = torch.randint(1, vocab, (B, T), generator=g)
    lengths = torch.tensor([24, 5, 17, 9, 24, 3, 12, 20])
    start = torch.tensor([2, 1, 4, 2, 10, 1, 3, 6])
    pos = torch.arange(T)[None]
    mask = ((pos >= start[:, None]) & (pos < lengths[:, None])).float()
    tokens = tokens * (pos < lengths[:, None])
    adv = torch.randn(B, 1, generator=g) * mask
    ref = -torch.rand(B, T, generator=g) * mask * 6
    row = torch.tensor([0.0, 0.1, 0.9, -0.1, -1.1, 0.3, 0.02, -0.5])
    noise = torch.tensor([-0.25, 0.0, 0.15, 0.35])[torch.randint(0, 4, (B, T), generator=g)]
    offset = (row[:, None] + noise) * mask
    return tokens, mask, adv, ref, offset


# (name, loss config fields but agg, loss.agg): every feature on in one of them
CONFIGS = [
    ("gspo_mis_seq", dict(ratio_level="sequence", mis_cap=2.0, mis_level="sequence", kl_coef=0.1),
     "seq_mean_token_mean"),
    ("tis_mis_token", dict(tis_cap=2.0, mis_cap=1.5, mis_level="token"), "seq_mean_token_sum"),
    # GSPO's ratio against the behavior log-probs (with tis_cap > 0 its base is this step's policy: 1)
    ("gspo_mis_token_entropy", dict(ratio_level="sequence", mis_cap=1.5, entropy_coef=0.01), "token_mean"),
]


# the ones with per-sequence sums (the second's weights are covered by the first's)
CP_CONFIGS = [CONFIGS[0], CONFIGS[2]]


def _expected_loss(name: str, lp, beh, adv, mask, ref) -> tuple[float, float]:
    """The objective and the dropped-token fraction of the first two configs, from the policy's log-probs."""
    d = (lp - beh) * mask  # log(pi_old / mu) = the ratio's log against mu at the step start
    n_tok = mask.sum()
    lengths = mask.sum(1, keepdim=True)
    n_seq = (lengths > 0).sum()
    if name == "gspo_mis_seq":
        seq = d.sum(1, keepdim=True) / lengths.clamp_min(1)
        s = torch.exp(seq)
        pg = -torch.minimum(s * adv, s.clamp(0.8, 1.28) * adv)
        dr = (ref - lp) * mask
        per_token = pg + 0.1 * (torch.exp(dr) - dr - 1)
        keep = (seq.abs() <= LN(2.0)).float()
        w = n_tok / (n_seq * lengths.clamp_min(1))
    else:
        per_token = -adv * torch.exp(d).clamp(max=2.0)
        keep = (d.abs() <= LN(1.5)).float()
        w = n_tok / n_seq
    kept = mask * keep
    loss = float((per_token * kept * w).sum() / n_tok)
    return loss, float((mask - kept).sum() / n_tok)


def _margins(offset: torch.Tensor, mask: torch.Tensor) -> float:
    """How far the test data's log-ratios stay from the MIS band edges (float noise must not flip a token)."""
    seq = offset.sum(1) / mask.sum(1)
    edges = torch.tensor([LN(2.0), LN(1.5)])
    tok = offset[mask > 0].abs()
    return float(min((seq.abs()[:, None] - edges).abs().min(), (tok[:, None] - edges).abs().min()))


def _layouts_and_on_policy(rank: int, world: int) -> dict:
    import asyncio
    import dataclasses

    from megatron_agentrl.megatron.actor import MegatronActor, TrainBatch
    from megatron_agentrl.megatron.parallel import initialize_parallel
    from rollout_sglang.engines.local import LocalEngine
    from rollout_sglang.engines.protocol import SamplingParams

    initialize_parallel(1, 1, seed=7, timeout_s=60)
    cfg = _tiny()
    base = TrainConfig(micro_batch_size=8, sequence_packing=False)
    torch.manual_seed(11)
    actor = MegatronActor(cfg, base)
    tokens, mask, adv, ref, offset = _batch_parts(cfg.vocab_size)
    lp = actor.compute_logprobs(tokens, 1.0, 8, loss_mask=mask)
    beh = (lp - offset) * mask
    out: dict = {"margin": _margins(offset, mask)}
    # (micro_batch_size, micro_batch_tokens, sequence_packing): the first, one padded micro-batch, is the reference
    layouts = [(8, 0, False), (3, 0, False), (8, 60, False), (3, 0, True), (8, 40, True), (1, 0, True)]
    for name, fields, agg in CONFIGS:
        batch = TrainBatch(tokens, mask, beh, adv, ref, None, loss_agg_weights(mask, agg))
        first = None
        for mbs, budget, packed in layouts:
            actor.train_cfg = dataclasses.replace(base, micro_batch_size=mbs, micro_batch_tokens=budget,
                                                  sequence_packing=packed)
            actor.loss_cfg = LossConfig(**fields, agg=agg)
            stats = actor.compute_grads(batch, "grpo")
            grads = actor.export_hf_grads()
            if first is None:
                first = stats, grads
                out[name] = stats
                if name != "gspo_mis_token_entropy":
                    out[name + "_expected"] = _expected_loss(name, lp, beh, adv, mask, ref)
                continue
            key = f"{name}/mbs{mbs}b{budget}{'packed' if packed else 'padded'}"
            scale = max(float(g.abs().max()) for g in first[1].values())
            out[key + "_grad"] = max(float((grads[k] - first[1][k]).abs().max()) for k in grads) / scale
            out[key + "_loss"] = max(abs(stats[k] - first[0][k]) for k in first[0] if k != "num_micro_batches")
            out[key + "_mb"] = stats["num_micro_batches"]

    # on-policy: the engine samples with the actor's weights; the actor scores the same tokens
    engine = LocalEngine(cfg)
    engine.load_state_dict(1, actor.export_hf_state_dict())
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, cfg.vocab_size, (n,), generator=g).tolist() for n in (3, 7, 5, 9)]
    gen = asyncio.run(engine.generate(prompts, SamplingParams(max_new_tokens=10, temperature=1.0, seed=3)))
    from megatron_agentrl.pipeline.batch import pad_right

    toks = pad_right([p + o.token_ids for p, o in zip(prompts, gen)], torch.long)
    omask = pad_right([[0] * len(p) + [1] * len(o.token_ids) for p, o in zip(prompts, gen)], torch.float32)
    obeh = pad_right([[0.0] * len(p) + o.logprobs for p, o in zip(prompts, gen)], torch.float32)
    lag = torch.where(omask > 0, 0, -1).long()
    oadv = torch.tensor([[1.0], [-0.5], [2.0], [-1.0]]) * omask
    actor.train_cfg = dataclasses.replace(base, micro_batch_size=2)
    actor.loss_cfg = LossConfig(ratio_level="sequence", tis_cap=2.0, mis_cap=1.01, mis_level="token",
                                agg="seq_mean_token_mean")
    batch = TrainBatch(toks, omask, obeh, oadv, None, lag, loss_agg_weights(omask, "seq_mean_token_mean"))
    out["on_policy"] = actor.compute_grads(batch, "grpo")
    out["on_policy_tokens"] = float(omask.sum())
    return out


def test_actor_loss_same_for_every_micro_batching_and_on_policy_has_no_mismatch():
    """GSPO, MIS (token and sequence level), TIS, KL, entropy and each loss_agg mode: the loss the actor reports
    is the one worked out from its log-probs, and the loss and gradients are the same with one padded
    micro-batch, several, token budgets and packed sequences. On policy (the engine sampled with the actor's
    weights) the mismatch metrics are 0, MIS drops nothing even with a band of 1%, nothing is clipped."""
    out = run_distributed(_layouts_and_on_policy, 1, timeout_s=180)[0]
    assert out["margin"] > 0.01, out["margin"]
    for name, _, _ in CONFIGS:
        stats = out[name]
        assert all(math.isfinite(v) for v in stats.values()), stats
        assert stats["num_tokens"] == 85  # the normaliser: every policy token, dropped ones too
        if name + "_expected" in out:
            loss, dropped = out[name + "_expected"]
            assert stats["loss"] == pytest.approx(loss, abs=1e-5), (name, stats, loss)
            assert stats["mis_masked"] == pytest.approx(dropped, abs=1e-6)
            assert 0 < dropped < 1, (name, dropped)  # the band drops some tokens, not all
    for k, v in out.items():
        if k.endswith("_grad") or k.endswith("_loss"):
            assert v < 1e-5, (k, v)
    assert out["gspo_mis_seq/mbs1b0packed_mb"] == 8 and out["gspo_mis_seq/mbs8b40packed_mb"] > 1
    on = out["on_policy"]
    assert on["mismatch/tokens_lag0"] == on["num_tokens"] == out["on_policy_tokens"] == 40
    assert on["mismatch/abs_lag0"] < 1e-4 and on["mismatch/kl_lag0"] < 1e-6, on
    assert on["mis_masked"] == 0 and on["clip_frac"] == 0 and on["is_truncated"] == 0, on
    assert on["approx_kl"] < 1e-6, on
    # ratio 1, weights 1: -(1/4) * sum of the four advantages (one sequence each, seq_mean_token_mean)
    assert on["loss"] == pytest.approx(-(1.0 - 0.5 + 2.0 - 1.0) / 4, abs=1e-4), on


def _cp_same_as_cp1(rank: int, world: int) -> dict:
    from megatron.core import parallel_state

    from megatron_agentrl.megatron.actor import MegatronActor, TrainBatch
    from megatron_agentrl.megatron.parallel import initialize_parallel

    cfg = _tiny()
    tokens, mask, adv, ref, offset = _batch_parts(cfg.vocab_size)
    out: dict = {}
    refs: dict = {}
    state = beh = None
    # CP=1 (DP=2: the weights of loss_agg come from the global batch) against CP=2 (DP=1), padded and packed
    for cp, layouts in ((1, [(2, 0, False)]), (2, [(2, 0, False), (8, 40, True)])):
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        initialize_parallel(1, 1, seed=7, timeout_s=60, cp=cp)
        torch.manual_seed(11)
        actor = MegatronActor(cfg, TrainConfig())
        if state is None:
            state = actor.export_hf_state_dict()
            beh = (actor.compute_logprobs(tokens, 1.0, 8, loss_mask=mask) - offset) * mask
        else:
            actor.load_hf_state_dict(state)
        for name, fields, agg in CP_CONFIGS:
            batch = TrainBatch(tokens, mask, beh, adv, ref, None, loss_agg_weights(mask, agg))
            for mbs, budget, packed in layouts:
                actor.train_cfg = TrainConfig(micro_batch_size=mbs, micro_batch_tokens=budget, sequence_packing=packed)
                actor.loss_cfg = LossConfig(**fields, agg=agg)
                stats = actor.compute_grads(actor.dp_slice(batch), "grpo")
                grads = actor.export_hf_grads()
                if name not in refs:
                    refs[name] = stats, grads
                    continue
                ref_stats, ref_grads = refs[name]
                key = f"{name}/cp{cp}mbs{mbs}b{budget}{'packed' if packed else 'padded'}"
                scale = max(float(g.abs().max()) for g in ref_grads.values())
                out[key + "_grad"] = max(float((grads[k] - ref_grads[k]).abs().max()) for k in grads) / scale
                out[key + "_loss"] = max(abs(stats[k] - ref_stats[k]) for k in ref_stats if k != "num_micro_batches")
    return out


def test_sequence_level_terms_at_cp2_match_cp1():
    """Per-sequence sums under context parallelism (a sequence split over 2 ranks, its sums all-reduced): GSPO,
    sequence-level MIS and every loss_agg mode give the CP=1 loss, stats and gradients."""
    out = run_distributed(_cp_same_as_cp1, 2, timeout_s=240)[0]
    assert len(out) == 2 * 2 * len(CP_CONFIGS)
    for k, v in out.items():
        assert v < 1e-5, (k, v, out)


# ------------------------------------------------------------------ CLI runs
@pytest.mark.parametrize("settings", [
    ["algo.estimator=grpo", "loss.agg=token_mean", "loss.ratio_level=token", "loss.mis_cap=2.0"],
    ["algo.estimator=rloo", "loss.agg=seq_mean_token_sum", "loss.ratio_level=sequence", "loss.tis_cap=2.0",
     "loss.clip_eps_low=3e-4", "loss.clip_eps_high=4e-4"],
    ["algo.estimator=reinforce_pp", "loss.agg=seq_mean_token_mean", "loss.ratio_level=sequence",
     "loss.mis_cap=2.0", "loss.mis_level=sequence", "loss.tis_cap=2.0", "algo.normalize_per_task=false"],
], ids=["grpo-token_mean-mis_token", "rloo-seq_sum-gspo-tis", "reinforce_pp-seq_mean-gspo-mis_seq"])
@pytest.mark.e2e
def test_cli_runs_each_estimator_and_loss_setting(tmp_path, settings):
    import os
    import subprocess
    import sys

    out = tmp_path / "run"
    tasks = ",".join(f'{{name: {t}, reward_fn: "tests.trainer.support:varied_reward"}}' for t in ("lookup", "calc"))
    cmd = [sys.executable, "-m", "megatron_agentrl.cli", "train", "--config", "tests/configs/tiny_test.yaml",
           f"output_dir={out}", "model.arch.hidden_size=32", "model.arch.intermediate_size=64",
           "model.arch.num_hidden_layers=2", "sft.steps=0", "train.steps=2", "train.micro_batch_size=4",
           "rollout.prompts_per_step=2", "rollout.samples_per_prompt=3", "rollout.max_turns=2",
           "rollout.max_new_tokens=8", "eval.samples_per_task=0", f"tasks=[{tasks}]", *settings]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([".", os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rl = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["phase"] == "rl"]
    assert [r["step"] for r in rl] == [1, 2]
    for r in rl:
        for k in ("loss", "pg_loss", "grad_norm", "approx_kl"):
            assert math.isfinite(r[k]), (k, r)
        # synchronous fp32: every token sampled by the trained weights, engine and trainer agree
        assert r["mismatch/tokens_lag0"] == r["num_tokens"] > 0, r
        assert r["mismatch/abs_lag0"] < 1e-4 and r["mismatch/kl_lag0"] < 1e-6, r
        if "loss.mis_cap=2.0" in settings:
            assert r["mis_masked"] == 0, r
    # the rewards differ, so advantages and the gradient are non-zero: a real update. Not the loss: with
    # whitened advantages at ratio 1 it is analytically -mean(A) = 0, and its sign bit is the machine's rounding
    assert any(r["adv_abs_mean"] > 0 and r["grad_norm"] > 0 for r in rl), rl
