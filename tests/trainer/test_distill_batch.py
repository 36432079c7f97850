"""The trainer's side of on-policy distillation: the per-token signal of a batch, its refusal of an unscored
episode, and the reverse-KL figures per task."""
from __future__ import annotations

import pytest
import torch

from megatron_agentrl.config import AlgoConfig
from megatron_agentrl.pipeline.batch import build_rl_batch, distill_metrics
from rollout_sglang.trajectory import Trajectory


def _traj(task: str, group: int, mask: list[int], behavior: float, teacher: float | None, reward: float):
    n = len(mask)
    return Trajectory(token_ids=list(range(1, n + 1)), loss_mask=mask, behavior_logprobs=[behavior * m for m in mask],
                      versions=[0 if m else -1 for m in mask], turn_spans=[], task=task, index=0, group_id=group,
                      reward=reward, status="completed", timings={"teacher_score_s": 0.5},
                      teacher_logprobs=None if teacher is None else [teacher * m for m in mask])


def test_the_signal_is_teacher_minus_behavior_on_sampled_tokens_and_unscored_episodes_are_refused():
    trajs = [_traj("calc", 0, [0, 1, 1, 0, 1], -1.0, -3.0, 1.0), _traj("calc", 0, [0, 1, 1], -0.5, -0.25, 0.0),
             _traj("guess", 1, [0, 0, 1, 1], -2.0, -1.0, 1.0), _traj("guess", 1, [0, 1], -1.0, -1.0, 0.0)]
    rl = build_rl_batch(trajs, ["calc", "guess"], AlgoConfig(), distill=True)
    expected = torch.tensor([[0, -2, -2, 0, -2], [0, 0.25, 0.25, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 0, 0]])
    torch.testing.assert_close(rl.distill, expected)
    metrics = distill_metrics(rl, ["calc", "guess"], trajs)
    assert metrics["distill/reverse_kl/calc"] == pytest.approx((2 * 3 - 0.25 * 2) / 5)
    assert metrics["distill/reverse_kl/guess"] == pytest.approx(-2 / 3)
    assert metrics["distill/score_s"] == pytest.approx(0.5)
    assert build_rl_batch(trajs, ["calc", "guess"], AlgoConfig()).distill is None
    with pytest.raises(ValueError, match="carry no teacher log-probs"):
        build_rl_batch([*trajs, _traj("calc", 2, [0, 1], -1.0, None, 1.0)], ["calc", "guess"], AlgoConfig(),
                       distill=True)
