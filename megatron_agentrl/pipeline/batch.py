"""From trajectories (or demonstrations) to the actor's TrainBatch: padding, GRPO advantages,
per-task normalization."""
from __future__ import annotations

from collections import defaultdict
from typing import Sequence

import torch

from megatron_agentrl.algo.advantages import grpo_group_advantages, normalize_per_task
from megatron_agentrl.config import AlgoConfig
from megatron_agentrl.megatron.actor import TrainBatch
from rollout_sglang.trajectory import Trajectory


def pad_right(rows: Sequence[Sequence[float]], dtype: torch.dtype, pad: float = 0) -> torch.Tensor:
    """Stack variable-length rows into a right-padded ``[B, max_len]`` tensor."""
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), width), pad, dtype=dtype)
    for i, r in enumerate(rows):
        if len(r):
            out[i, : len(r)] = torch.as_tensor(r, dtype=dtype)
    return out


def build_rl_batch(trajs: Sequence[Trajectory], task_names: Sequence[str], algo: AlgoConfig) -> tuple[TrainBatch, torch.Tensor]:
    """The GRPO training batch of one step.

    Sample advantages are group-relative (``grpo_group_advantages`` over ``group_id``), spread
    over each sample's generated tokens, then normalized per task over the batch when
    ``algo.normalize_per_task``. ``task_names`` fixes the task-id order. Returns the batch and
    the per-sample advantages ``[B]`` (for logging).
    """
    task_id = {name: i for i, name in enumerate(task_names)}
    rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
    groups = torch.tensor([t.group_id for t in trajs], dtype=torch.long)
    sample_adv = grpo_group_advantages(rewards, groups, std_norm=algo.group_std_norm, eps=algo.eps)
    tokens = pad_right([t.token_ids for t in trajs], torch.long)
    mask = pad_right([t.loss_mask for t in trajs], torch.float32)
    behavior = pad_right([t.behavior_logprobs for t in trajs], torch.float32)
    adv = sample_adv[:, None] * mask
    if algo.normalize_per_task:
        tids = torch.tensor([task_id[t.task] for t in trajs], dtype=torch.long)
        adv = normalize_per_task(adv, mask, tids, eps=algo.eps, num_tasks=len(task_names))
    return TrainBatch(tokens=tokens, loss_mask=mask, behavior_logprobs=behavior, advantages=adv), sample_adv


def build_sft_batch(examples: Sequence[tuple[list[int], list[int]]]) -> TrainBatch:
    """A supervised batch from ``(token_ids, loss_mask)`` pairs (loss on mask-1 tokens only)."""
    tokens = pad_right([e[0] for e in examples], torch.long)
    mask = pad_right([e[1] for e in examples], torch.float32)
    zeros = torch.zeros_like(mask)
    return TrainBatch(tokens=tokens, loss_mask=mask, behavior_logprobs=zeros, advantages=zeros.clone())


def per_task_means(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """``reward/<task>`` and ``success/<task>`` means over ``trajs``."""
    acc: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for t in trajs:
        acc[t.task].append((t.reward, float(t.metrics.get("success", t.reward >= 1.0))))
    out = {}
    for task, vals in sorted(acc.items()):
        out[f"reward/{task}"] = sum(v[0] for v in vals) / len(vals)
        out[f"success/{task}"] = sum(v[1] for v in vals) / len(vals)
    return out
