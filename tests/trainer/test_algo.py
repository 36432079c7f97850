"""GRPO advantages, per-task normalization and the clipped loss against values worked by hand."""
import math

import pytest
import torch

from megatron_agentrl.algo.advantages import grpo_group_advantages, normalize_per_task
from megatron_agentrl.algo.losses import LossInputs, clipped_policy_loss, sft_loss
from megatron_agentrl.config import LossConfig


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 3.0, 1.0])
    groups = torch.tensor([7, 7, 7, 7, 2, 2, 5, 5])
    adv = grpo_group_advantages(rewards, groups, std_norm=True, eps=0.0)
    # group 7: mean .5, std .5 -> +-1; group 2: all equal -> 0; group 5: mean 2, std 1 -> +-1
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, -1.0, 1.0, 0.0, 0.0, 1.0, -1.0]))
    centered = grpo_group_advantages(rewards, groups, std_norm=False)
    assert torch.allclose(centered, torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 1.0, -1.0]))


def test_group_advantages_shape_error():
    with pytest.raises(ValueError, match="must both be"):
        grpo_group_advantages(torch.zeros(3), torch.zeros(4, dtype=torch.long))


def test_clipped_loss_by_hand():
    # ratios 1.5, 1.5, 0.5, 0.5 (and one masked token) with advantages +1, -1, +1, -1
    behavior = torch.zeros(1, 5)
    logprobs = torch.tensor([[math.log(1.5), math.log(1.5), math.log(0.5), math.log(0.5), 3.0]], requires_grad=True)
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    loss, stats = clipped_policy_loss(LossInputs(logprobs, behavior, adv, mask),
                                      LossConfig(clip_eps_low=0.2, clip_eps_high=0.28))
    # per token: -min(1.5, 1.28) = -1.28 | -min(-1.5, -1.28) = 1.5 | -min(.5, .8) = -.5 | -min(-.5, -.8) = .8
    assert loss.item() == pytest.approx(-1.28 + 1.5 - 0.5 + 0.8, abs=1e-6)
    assert stats["clip_frac"].item() == 2
    k3 = (0.5 - math.log(1.5)) + (-0.5 - math.log(0.5))
    assert stats["approx_kl"].item() == pytest.approx(2 * k3, abs=1e-6)
    loss.backward()
    # d/dlogp of -r*A is -r*A where the unclipped term is active, 0 where the clip is active
    assert torch.allclose(logprobs.grad, torch.tensor([[0.0, 1.5, -0.5, 0.0, 0.0]]), atol=1e-6)


def test_sft_loss_by_hand():
    lp = torch.tensor([[-1.0, -2.0, -3.0]])
    loss, _ = sft_loss(lp, torch.tensor([[0.0, 1.0, 1.0]]))
    assert loss.item() == pytest.approx(5.0)


def _reference_per_task(adv, mask, task_ids, eps):
    out = torch.zeros_like(adv)
    for k in task_ids.unique().tolist():
        rows = task_ids == k
        vals = adv[rows][mask[rows] > 0].double()
        if vals.numel() == 0:
            continue
        mean, std = vals.mean(), vals.std(unbiased=False)
        out[rows] = (((adv[rows].double() - mean) / (std + eps)) * mask[rows]).float()
    return out


def test_normalize_per_task_matches_reference():
    g = torch.Generator().manual_seed(0)
    B, T = 37, 23
    adv = torch.randn(B, T, generator=g) * 3 + 1
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    task_ids = torch.tensor([0] * 20 + [1] * 3 + [3] * 14)[torch.randperm(B, generator=g)]  # uneven, task 2 absent
    out = normalize_per_task(adv, mask, task_ids, eps=1e-6)
    assert torch.allclose(out, _reference_per_task(adv, mask, task_ids, 1e-6), atol=1e-5)
    for k in (0, 1, 3):
        vals = out[task_ids == k][mask[task_ids == k] > 0]
        assert vals.mean().abs() < 1e-4 and (vals.std(unbiased=False) - 1).abs() < 1e-4
    assert (out[mask == 0] == 0).all()


def test_train_vs_rollout_mismatch_by_version_lag():
    """Per lag bucket: mean |Δ logp|, the k3 KL of behavior vs train and the token count, over policy
    tokens only; lags past the last bucket share it; the batch builder gives each generated token its
    turn's lag."""
    from megatron_agentrl.algo.mismatch import LAG_BUCKETS, lag_metrics, lag_sums

    lp = torch.tensor([[0.0, -1.0, -2.0, -0.5, -0.1]])
    beh = torch.tensor([[0.0, -1.0, -1.5, -0.5, -0.3]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.0]])
    lag = torch.tensor([[-1, 0, 1, LAG_BUCKETS + 3, 0]])
    m = lag_metrics(lag_sums(lp, beh, mask, lag))
    assert m["mismatch/tokens_lag0"] == 1 and m["mismatch/abs_lag0"] == 0 and m["mismatch/kl_lag0"] == 0
    d = -0.5  # token 2: log p_train - log p_behavior
    assert m["mismatch/abs_lag1"] == pytest.approx(0.5)
    assert m["mismatch/kl_lag1"] == pytest.approx(math.expm1(d) - d)
    assert m[f"mismatch/tokens_lag{LAG_BUCKETS - 1}plus"] == 1  # lag 11 in the last bucket
    assert not any(k.endswith("lag2") for k in m)  # empty buckets are not reported


def test_rl_batch_carries_version_lag():
    from megatron_agentrl.config import AlgoConfig
    from megatron_agentrl.pipeline.batch import build_rl_batch, normalize_batch
    from rollout_sglang.trajectory import Trajectory

    # t's first turn crossed an in-flight update (its tokens from versions 4 and 5): each token keeps its own lag
    t = Trajectory([1, 2, 3, 4, 5, 6], [0, 1, 1, 0, 1, 0], [0, -0.1, -0.2, 0, -0.3, 0], [-1, 4, 5, -1, 3, -1],
                   [(1, 3), (4, 5)], "lookup", 0, 0, reward=1.0)
    u = Trajectory([1, 2, 3], [0, 1, 0], [0, -0.5, 0], [-1, 5, -1], [(1, 2)], "lookup", 0, 1, reward=0.0)
    assert (t.oldest_version, t.tokens_after_update, t.turn_versions) == (3, 1, [4, 3])
    rl = build_rl_batch([t, u], ["lookup"], AlgoConfig(), trained_version=5)
    assert rl.batch.version_lag.tolist() == [[-1, 1, 0, -1, 2, -1], [-1, 0, -1, -1, -1, -1]]
    norm = normalize_batch(rl.batch, rl.task_ids, AlgoConfig(), 1)
    assert torch.equal(norm.version_lag, rl.batch.version_lag)
    assert build_rl_batch([t, u], ["lookup"], AlgoConfig()).batch.version_lag is None
