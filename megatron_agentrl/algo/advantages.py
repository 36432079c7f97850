"""Sample advantages from the rewards of groups of samples (one group = the samples of one prompt), and
per-task token normalization.

Estimators (``algo.estimator``, :func:`group_advantages`), ``r`` a sample's reward, ``g`` its group of
``n_g`` samples:

* ``grpo``: ``(r - mean_g) / (std_g + eps)``, or ``r - mean_g`` without the std (Dr. GRPO);
* ``rloo``: ``r - (sum_g - r) / (n_g - 1)``, the mean of the other samples (leave-one-out);
* ``reinforce_pp``: REINFORCE++ with a group baseline: ``a = r - mean_g``, then whitened over the
  batch's policy tokens, ``(a - mean_tok) / (std_tok + eps)`` (each sample counts once per token, as
  verl's ``compute_reinforce_plus_plus_baseline_outcome_advantage`` and OpenRLHF do).

All are vectorized segment reductions (``scatter_add``), never a Python loop over samples.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def segment_sum(values: Tensor, segment_ids: Tensor, num_segments: int) -> Tensor:
    """Sum ``values [N, ...]`` into ``[num_segments, ...]`` by ``segment_ids [N]``."""
    out = values.new_zeros((num_segments,) + tuple(values.shape[1:]))
    index = segment_ids.view(-1, *([1] * (values.dim() - 1))).expand_as(values)
    return out.scatter_add_(0, index, values)


def _groups(rewards: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor, int]:
    """``rewards`` as float64, each sample's dense group index ``[N]``, the group sizes ``[G]`` and ``G``."""
    if rewards.shape != group_ids.shape or rewards.dim() != 1:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_ids {tuple(group_ids.shape)} must both be [N]")
    r = rewards.to(torch.float64)
    _, gid = torch.unique(group_ids, return_inverse=True)
    g = int(gid.max().item()) + 1 if gid.numel() else 0
    return r, gid, segment_sum(torch.ones_like(r), gid, g), g


def grpo_group_advantages(rewards: Tensor, group_ids: Tensor, std_norm: bool = True, eps: float = 1e-6) -> Tensor:
    """Group-relative advantages: ``(r - mean_g) / (std_g + eps)`` (or ``r - mean_g`` when not std_norm).

    rewards: ``[N]`` float, one per sample; group_ids: ``[N]`` int, samples of one prompt share an id
    (any non-negative ints). Mean and population std are over the samples of each group. A group
    whose rewards are all equal gets advantage 0. Returns ``[N]`` float32.
    """
    r, gid, count, g = _groups(rewards, group_ids)
    mean = segment_sum(r, gid, g) / count
    centered = r - mean[gid]
    if not std_norm:
        return centered.to(torch.float32)
    std = (segment_sum(centered * centered, gid, g) / count).sqrt()[gid]
    out = torch.where(std > 0, centered / (std + eps), torch.zeros_like(centered))
    return out.to(torch.float32)


def rloo_advantages(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """Leave-one-out advantages: ``r_i - (sum_g - r_i) / (n_g - 1)`` (RLOO, arXiv 2402.14740).

    rewards, group_ids: ``[N]`` as in :func:`grpo_group_advantages`. Equal to ``n_g / (n_g - 1) * (r_i -
    mean_g)``. A group of one sample has no other sample to compare with: its advantage is 0. Returns
    ``[N]`` float32.
    """
    r, gid, count, g = _groups(rewards, group_ids)
    total = segment_sum(r, gid, g)[gid]
    n = count[gid]
    others = (total - r) / (n - 1).clamp_min(1.0)
    return torch.where(n > 1, r - others, torch.zeros_like(r)).to(torch.float32)


def reinforce_pp_advantages(rewards: Tensor, group_ids: Tensor, num_tokens: Tensor, eps: float = 1e-6) -> Tensor:
    """REINFORCE++ (baseline variant, arXiv 2501.03262): ``a_i = r_i - mean_g``, then normalised over the batch's
    tokens: ``(a_i - m) / (s + eps)`` with ``m = sum_i n_i a_i / sum_i n_i`` and ``s`` the population std of
    the same token-weighted distribution.

    rewards, group_ids: ``[N]``; num_tokens: ``[N]`` policy tokens of each sample (a sample without any
    counts for nothing). Pass the whole global batch: the mean and std are taken over what is given.
    Returns ``[N]`` float32; all 0 when every token has the same ``a``.
    """
    r, gid, count, g = _groups(rewards, group_ids)
    if num_tokens.shape != rewards.shape:
        raise ValueError(f"num_tokens {tuple(num_tokens.shape)} must be [N] like rewards {tuple(rewards.shape)}")
    a = r - (segment_sum(r, gid, g) / count)[gid]
    n = num_tokens.to(torch.float64)
    total = n.sum().clamp_min(1.0)
    mean = (n * a).sum() / total
    std = ((n * (a - mean).square()).sum() / total).sqrt()
    if not std > 0:
        return torch.zeros_like(a, dtype=torch.float32)
    return ((a - mean) / (std + eps)).to(torch.float32)


ESTIMATORS = ("grpo", "rloo", "reinforce_pp")


def group_advantages(estimator: str, rewards: Tensor, group_ids: Tensor, num_tokens: Tensor,
                     std_norm: bool = True, eps: float = 1e-6) -> Tensor:
    """The sample advantages ``[N]`` (float32) of ``algo.estimator`` (see the module doc).

    rewards, group_ids, num_tokens: ``[N]``; ``std_norm`` applies to "grpo" only (``algo.group_std_norm``).
    """
    if estimator == "grpo":
        return grpo_group_advantages(rewards, group_ids, std_norm=std_norm, eps=eps)
    if estimator == "rloo":
        return rloo_advantages(rewards, group_ids)
    if estimator == "reinforce_pp":
        return reinforce_pp_advantages(rewards, group_ids, num_tokens, eps=eps)
    raise ValueError(f"algo.estimator={estimator!r} is not one of {ESTIMATORS}")


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
    stats = segment_sum(per_sample, task_ids, num_tasks).T.contiguous()  # [3, K]: count, sum, sum of squares
    if use_group:
        dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=process_group)
    count = stats[0].clamp_min(1.0)
    mean = stats[1] / count
    var = (stats[2] / count - mean.square()).clamp_min(0.0)
    inv_std = 1.0 / (var.sqrt() + eps)
    d.addcmul_(m, (c64 - mean[task_ids]).unsqueeze(1).to(cdt))  # (A - mean_k) * mask
    return d.mul_(inv_std[task_ids].unsqueeze(1).to(cdt)).to(advantages.dtype)
