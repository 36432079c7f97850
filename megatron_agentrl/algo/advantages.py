"""GRPO advantages: group-relative sample advantages and per-task token normalization.

Both are vectorized segment reductions (``scatter_add``), never a Python loop over samples.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def _segment_sum(values: Tensor, segment_ids: Tensor, num_segments: int) -> Tensor:
    """Sum ``values [N, ...]`` into ``[num_segments, ...]`` by ``segment_ids [N]``."""
    out = values.new_zeros((num_segments,) + tuple(values.shape[1:]))
    index = segment_ids.view(-1, *([1] * (values.dim() - 1))).expand_as(values)
    return out.scatter_add_(0, index, values)


def grpo_group_advantages(rewards: Tensor, group_ids: Tensor, std_norm: bool = True, eps: float = 1e-6) -> Tensor:
    """Group-relative advantages: ``(r - mean_g) / (std_g + eps)`` (or ``r - mean_g`` when not std_norm).

    rewards: ``[N]`` float, one per sample; group_ids: ``[N]`` int, samples of one prompt share an id
    (any non-negative ints). Mean and population std are over the samples of each group. A group
    whose rewards are all equal gets advantage 0. Returns ``[N]`` float32.
    """
    if rewards.shape != group_ids.shape or rewards.dim() != 1:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_ids {tuple(group_ids.shape)} must both be [N]")
    r = rewards.to(torch.float64)
    _, gid = torch.unique(group_ids, return_inverse=True)
    g = int(gid.max().item()) + 1 if gid.numel() else 0
    count = _segment_sum(torch.ones_like(r), gid, g)
    mean = _segment_sum(r, gid, g) / count
    centered = r - mean[gid]
    if not std_norm:
        return centered.to(torch.float32)
    std = (_segment_sum(centered * centered, gid, g) / count).sqrt()[gid]
    out = torch.where(std > 0, centered / (std + eps), torch.zeros_like(centered))
    return out.to(torch.float32)


def normalize_per_task(
    advantages: Tensor,
    mask: Tensor,
    task_ids: Tensor,
    eps: float = 1e-6,
    process_group: dist.ProcessGroup | None = None,
    num_tasks: int | None = None,
) -> Tensor:
    """Normalize token advantages per task over the global batch (AgentRL's per-task normalization).

    advantages: ``[B, T]`` float token advantages; mask: ``[B, T]`` (1 = token counts);
    task_ids: ``[B]`` int in ``[0, num_tasks)``. Returns ``(A - mean_k) / (std_k + eps)`` for every
    masked token of a task-k sample, where mean and population std are taken over the masked
    tokens of all task-k samples in the global batch: the per-task sums are all-reduced over
    ``process_group`` (the data-parallel group) when one is given, and ``num_tasks`` (default: the
    max task id + 1, agreed across the group; this costs a device-to-host sync) sizes them.
    Masked-out tokens come back as 0. Output dtype: ``advantages.dtype``.

    How (one pass of segment sums and one all-reduce; vectorized, no Python loop over samples or
    tasks, no host sync when ``num_tasks`` is given): ``D = A * mask`` is formed once in the
    compute dtype (float32 for float32 and 16-bit inputs, float64 for float64) and shifted in
    place by its row mean ``c_r`` (``D -= mask * c_r``); per row, the token count ``n_r``, the sum
    ``s_r`` (both accumulated in float64) and the shifted square sum ``q_r`` give
    ``sum A^2 = q_r + 2 c_r s_r - n_r c_r^2`` exactly; one segment sum over tasks (float64,
    ``[B, 3] -> [3, K]``) and one all-reduce give each task's count, sum and sum of squares, hence
    mean and population variance. The row shift
    keeps the float32 part free of cancellation (for GRPO advantages, constant over a sample's
    tokens, ``q_r`` is ~0), and the variance's remaining subtraction happens in float64. Last,
    ``D += mask * (c_r - mean_k)`` and ``D *= 1 / (std_k + eps)`` in place. Memory traffic for
    float32 inputs: about 44 bytes per token; ``bench/gpu_advantages.py`` measures it against a
    device copy.
    """
    if advantages.shape != mask.shape or advantages.dim() != 2:
        raise ValueError(f"advantages {tuple(advantages.shape)} and mask {tuple(mask.shape)} must both be [B, T]")
    if task_ids.shape != advantages.shape[:1]:
        raise ValueError(f"task_ids {tuple(task_ids.shape)} must be [B] with B={advantages.shape[0]}")
    task_ids = task_ids.to(device=advantages.device, dtype=torch.long)
    use_group = process_group is not None and dist.is_available() and dist.is_initialized()
    if num_tasks is None:
        k = torch.tensor([int(task_ids.max().item()) + 1 if task_ids.numel() else 0], device=advantages.device)
        if use_group:
            dist.all_reduce(k, op=dist.ReduceOp.MAX, group=process_group)
        num_tasks = int(k.item())
    cdt = advantages.dtype if advantages.dtype in (torch.float32, torch.float64) else torch.float32
    m = mask.to(cdt)
    d = advantages.to(cdt) * m  # a fresh tensor: the rest works on it in place
    n64 = m.sum(1, dtype=torch.float64)  # [B]
    s64 = d.sum(1, dtype=torch.float64)  # accumulated in float64: the identity below needs the exact sum
    shift = (s64 / n64.clamp_min(1.0)).to(cdt)  # c_r, in the compute dtype: the one D is shifted by
    d.addcmul_(m, -shift.unsqueeze(1))  # (A - c_r) * mask
    q = torch.linalg.vector_norm(d, dim=1).double().square()
    c64 = shift.double()
    per_sample = torch.stack([n64, s64, q + c64 * (2.0 * s64 - n64 * c64)], dim=1)  # [B, 3]
    stats = _segment_sum(per_sample, task_ids, num_tasks).T.contiguous()  # [3, K]: count, sum, sum of squares
    if use_group:
        dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=process_group)
    count = stats[0].clamp_min(1.0)
    mean = stats[1] / count
    var = (stats[2] / count - mean.square()).clamp_min(0.0)
    inv_std = 1.0 / (var.sqrt() + eps)
    d.addcmul_(m, (c64 - mean[task_ids]).unsqueeze(1).to(cdt))  # (A - mean_k) * mask
    return d.mul_(inv_std[task_ids].unsqueeze(1).to(cdt)).to(advantages.dtype)
