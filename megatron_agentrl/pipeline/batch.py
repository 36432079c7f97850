"""From trajectories (or demonstrations) to the actor's TrainBatch: padding, sample advantages of the shaped
rewards (``rewards.py``) by ``algo.estimator``, per-task normalization."""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from megatron_agentrl.algo.advantages import group_advantages, normalize_per_task, segment_sum
from megatron_agentrl.config import AlgoConfig
from megatron_agentrl.megatron.actor import TrainBatch
from megatron_agentrl.pipeline.rewards import RewardShaper, is_success
from rollout_sglang.trajectory import NOT_SAMPLED, Trajectory


def pad_right(rows: Sequence[Sequence[float]], dtype: torch.dtype, pad: float = 0) -> torch.Tensor:
    """Stack variable-length rows into a right-padded ``[B, max_len]`` tensor."""
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), width), pad, dtype=dtype)
    for i, r in enumerate(rows):
        if len(r):
            out[i, : len(r)] = torch.as_tensor(r, dtype=dtype)
    return out


@dataclass
class RLBatch:
    """A step's batch before per-task normalization (built on the rollout rank, sent to all).

    batch: the TrainBatch with *raw* token advantages (group advantage on every policy token).
    task_ids: ``[B]`` long, index into the run's task list.
    sample_adv: ``[B]`` sample advantages of ``algo.estimator`` (for logging).
    rewards: ``[B]`` shaped rewards.
    distill: on-policy distillation: ``[B, T]`` float, ``log p_teacher - log p_behavior`` on every policy token,
        0 elsewhere; joins the advantages after their per-task normalization (``Trainer.step``). None without.
    """

    batch: TrainBatch
    task_ids: torch.Tensor
    sample_adv: torch.Tensor
    rewards: torch.Tensor
    distill: torch.Tensor | None = None


def build_rl_batch(trajs: Sequence[Trajectory], task_names: Sequence[str], algo: AlgoConfig,
                   shaper: RewardShaper | None = None, trained_version: int | None = None,
                   distill: bool = False) -> RLBatch:
    """Pad ``trajs`` and give every policy token its sample's advantage.

    Rewards are shaped by ``shaper`` (default: the trajectories' own rewards); sample advantages
    come from the rewards of each ``group_id`` by ``algo.estimator`` (``group_advantages``: grpo, rloo,
    reinforce_pp, whose batch normalization runs over this whole batch's policy tokens). Per-task normalization is
    left to :func:`normalize_batch` (run after the data-parallel split, globally over DP).
    ``task_names`` fixes the task-id order. With ``trained_version`` (the weight version this batch
    trains), every generated token gets its version lag (``TrainBatch.version_lag``). With ``distill``, every
    trajectory with policy tokens must carry its teacher's log-probs (ValueError otherwise: nothing is trained as
    distilled without a teacher's score), and :attr:`RLBatch.distill` holds the per-token signal.
    """
    task_id = {name: i for i, name in enumerate(task_names)}
    unknown = sorted({t.task for t in trajs} - set(task_id))
    if unknown:
        raise ValueError(f"trajectories of tasks {unknown} that are not in the run's task list {list(task_names)}")
    shaper = shaper or RewardShaper()
    rewards = torch.tensor([shaper(t) for t in trajs], dtype=torch.float32)
    groups = torch.tensor([t.group_id for t in trajs], dtype=torch.long)
    tokens = pad_right([t.token_ids for t in trajs], torch.long)
    mask = pad_right([t.loss_mask for t in trajs], torch.float32)
    sample_adv = group_advantages(algo.estimator, rewards, groups, (mask > 0).sum(1), std_norm=algo.group_std_norm,
                                  eps=algo.eps)
    behavior = pad_right([t.behavior_logprobs for t in trajs], torch.float32)
    adv = sample_adv[:, None] * mask
    tids = torch.tensor([task_id[t.task] for t in trajs], dtype=torch.long)
    lag = None
    if trained_version is not None:
        versions = pad_right([t.versions for t in trajs], torch.long, pad=NOT_SAMPLED)
        lag = torch.where(versions >= 0, trained_version - versions, versions)
    signal = None
    if distill:
        unscored = [t for t in trajs if t.teacher_logprobs is None and t.num_generated]
        if unscored:
            first = unscored[0]
            raise ValueError(f"{len(unscored)} trajectories (e.g. task {first.task!r} #{first.index}) carry no teacher "
                             "log-probs; a distillation batch trains only scored episodes")
        teacher = pad_right([t.teacher_logprobs or [0.0] * len(t.token_ids) for t in trajs], torch.float32)
        signal = (teacher - behavior) * mask
    return RLBatch(TrainBatch(tokens=tokens, loss_mask=mask, behavior_logprobs=behavior, advantages=adv,
                              version_lag=lag, routed_experts=routed_experts_tensor(trajs, tokens.shape[1])),
                   tids, sample_adv, rewards, signal)


def routed_experts_tensor(trajs: Sequence[Trajectory], width: int) -> torch.Tensor | None:
    """``TrainBatch.routed_experts`` of ``trajs`` (``[B, width, M, K]`` int16, -1 where a trajectory's record
    ends or it has none); None when none of them carries routing."""
    shapes = {t.routed_experts.shape[1:] for t in trajs if t.routed_experts is not None}
    if not shapes:
        return None
    if len(shapes) > 1:
        raise ValueError(f"trajectories carry routed experts of different layouts {sorted(shapes)} "
                         "(MoE layers x top-k): they come from different models")
    out = torch.full((len(trajs), width, *shapes.pop()), -1, dtype=torch.int16)
    for i, t in enumerate(trajs):
        if t.routed_experts is not None and len(t.routed_experts):
            n = min(len(t.routed_experts), width)
            out[i, :n] = torch.from_numpy(t.routed_experts[:n].astype("int16"))
    return out


def normalize_batch(batch: TrainBatch, task_ids: torch.Tensor, algo: AlgoConfig, num_tasks: int,
                    process_group: dist.ProcessGroup | None = None) -> TrainBatch:
    """Per-task normalization of ``batch.advantages`` (``algo.normalize_per_task``), global over
    ``process_group`` (the data-parallel group: every DP rank passes its own slice)."""
    if not algo.normalize_per_task:
        return batch
    adv = normalize_per_task(batch.advantages, batch.loss_mask, task_ids, eps=algo.eps,
                             process_group=process_group, num_tasks=num_tasks)
    return dataclasses.replace(batch, advantages=adv)


def build_sft_batch(examples: Sequence[tuple[list[int], list[int]]]) -> TrainBatch:
    """A supervised batch from ``(token_ids, loss_mask)`` pairs (loss on mask-1 tokens only)."""
    tokens = pad_right([e[0] for e in examples], torch.long)
    mask = pad_right([e[1] for e in examples], torch.float32)
    zeros = torch.zeros_like(mask)
    return TrainBatch(tokens=tokens, loss_mask=mask, behavior_logprobs=zeros, advantages=zeros.clone())


def distill_metrics(rl: RLBatch, task_names: Sequence[str], trajs: Sequence[Trajectory]) -> dict[str, float]:
    """On-policy distillation's figures of a step's batch ``rl`` (its ``trajs``, in batch order):
    ``distill/reverse_kl/<task>``, the mean over the task's sampled tokens of ``log p_behavior - log p_teacher`` (an
    estimate of KL(student || teacher) per token), and ``distill/score_s``, the teacher's mean scoring seconds per
    episode; {} without distillation."""
    if rl.distill is None:
        return {}
    k = len(task_names)
    kl = segment_sum(-rl.distill.sum(1).double(), rl.task_ids, k)
    tokens = segment_sum(rl.batch.loss_mask.sum(1).double(), rl.task_ids, k)
    rows = segment_sum(torch.ones_like(kl[rl.task_ids]), rl.task_ids, k)
    out = {f"distill/reverse_kl/{task}": float(kl[i] / tokens[i].clamp_min(1.0))
           for i, task in enumerate(task_names) if rows[i] > 0}
    seconds = [t.timings.get("teacher_score_s", 0.0) for t in trajs if t.teacher_logprobs is not None]
    out["distill/score_s"] = sum(seconds) / max(len(seconds), 1)
    return out


def per_task_means(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """``reward/<task>`` and ``success/<task>`` means over ``trajs`` (the env's own reward)."""
    acc: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for t in trajs:
        acc[t.task].append((t.reward, float(is_success(t))))
    out = {}
    for task, vals in sorted(acc.items()):
        out[f"reward/{task}"] = sum(v[0] for v in vals) / len(vals)
        out[f"success/{task}"] = sum(v[1] for v in vals) / len(vals)
    return out
