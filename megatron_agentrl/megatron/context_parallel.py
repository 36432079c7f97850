"""Context parallelism (CP): megatron's load-balanced sequence layout, and the gathers it needs.

With CP of size ``cp`` every sequence (a padded row, or each sequence of a packed THD row) is cut
into ``2 * cp`` equal chunks and CP rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r``, in that
order: with causal attention the early chunks are cheap and the late ones dear, so each rank gets
one of each (megatron's ``get_batch_on_this_cp_rank``; TransformerEngine's
``thd_get_partitioned_indices`` for THD). Every sequence length must therefore be a multiple of
``2 * cp``; the actor pads them.

* :func:`shard` / :func:`unshard`: a micro-batch's fields cut to a CP rank's positions, the targets of the loss
  shifted so that each rank scores the tokens its logits predict; and per-token values of the full row back
  from every rank's shard;
* :func:`local_index`: the positions (in the full row) that a CP rank holds, in its local order;
* :func:`all_gather_sequence`: an autograd-aware all-gather of the local shards (the core attention
  gathers keys and values with it; the backward sums the gradient over the CP ranks and keeps this
  rank's part, a reduce-scatter);
* :func:`gather_full`: the full row back from the local shards of every CP rank (no gradient).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

#: the model's inputs among a micro-batch's fields: never rolled by :func:`shard`
MODEL_INPUTS = ("tokens", "position_ids", "routed_experts")


def local_index(bounds: list[int], cp: int, rank: int, device: Any = None) -> Tensor:
    """Positions of the full row held by CP rank ``rank``, in local order: ``[bounds[-1] // cp]`` long.

    bounds: sequence boundaries in the full row (``[0, w]`` for a padded row of width ``w``; the
    ``cu_seqlens`` of a packed row), each sequence length a multiple of ``2 * cp``. Per sequence the
    rank holds chunk ``rank`` then chunk ``2 * cp - 1 - rank`` of its ``2 * cp`` chunks.
    """
    parts = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        length = end - start
        if length % (2 * cp):
            raise ValueError(f"context parallelism: a sequence of {length} tokens is not a multiple of "
                             f"2 * cp = {2 * cp}; pad each sequence to a multiple of {2 * cp}")
        c = length // (2 * cp)
        for chunk in (rank, 2 * cp - 1 - rank):
            parts.append(torch.arange(start + chunk * c, start + (chunk + 1) * c, device=device))
    if not parts:
        return torch.zeros(0, dtype=torch.long, device=device)
    return torch.cat(parts)


def shard(mb: dict[str, Tensor], bounds: list[int], cp: int, rank: int) -> dict[str, Tensor]:
    """CP rank ``rank``'s shard of a micro-batch whose every sequence (``bounds``: ``[0, w]`` for padded
    rows, the ``cu_seqlens`` of a packed row) is a multiple of ``2 * cp`` long.

    Every field but ``tokens``, ``position_ids`` and ``routed_experts`` (the model's inputs) is rolled
    one position left, and ``labels`` (the tokens rolled left) added: position ``t`` then holds what the loss
    needs of token ``t + 1``, which the logits at ``t`` predict. ``seq_starts`` (the first column
    of padded rows) rolls with them: True where the target starts a sequence (or wraps around to
    column 0), whose log-prob is 0, as without CP. Then every field is cut to this rank's
    positions (:func:`local_index`)."""
    tokens = mb["tokens"]
    if "seq_starts" not in mb:
        starts = torch.zeros_like(tokens, dtype=torch.bool)
        starts[:, 0] = True
        mb = {**mb, "seq_starts": starts}
    out = {k: (v if k in MODEL_INPUTS else torch.roll(v, -1, dims=1)) for k, v in mb.items()}
    out["labels"] = torch.roll(tokens, -1, dims=1)
    index = local_index(bounds, cp, rank, tokens.device)
    return {k: v.index_select(1, index) for k, v in out.items()}


def unshard(x: Tensor, bounds: list[int], cp: int, group: Any) -> Tensor:
    """The full-row per-token values from this rank's ``x`` (positions of :func:`shard`, values of the
    shifted targets) and the other CP ranks' of ``group``: gathered over CP and rolled back one position
    right, so that column ``t`` holds token ``t``'s value. Collective over the CP group."""
    return torch.roll(gather_full(x, bounds, cp, group), 1, dims=1)


def full_order(bounds: list[int], cp: int, device: Any = None) -> Tensor:
    """For the shards of all CP ranks concatenated in rank order, the index that puts them in sequence
    order: ``gathered[full_order(...)]`` is the full row. ``[bounds[-1]]`` long."""
    held = torch.cat([local_index(bounds, cp, r, device) for r in range(cp)])
    return torch.argsort(held)


class _AllGatherSequence(torch.autograd.Function):
    """All-gather along dim 0 over a group; the backward sums the gradient over the group and returns
    this rank's slice (a reduce-scatter; all-reduce + slice on backends without reduce-scatter, gloo)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        ctx.group = group
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        group = ctx.group
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        grad = grad.contiguous()
        n = grad.shape[0] // size
        if dist.get_backend(group) == dist.Backend.NCCL:
            out = torch.empty((n, *grad.shape[1:]), dtype=grad.dtype, device=grad.device)
            dist.reduce_scatter_single(out, grad, group=group)
            return out, None
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
        return grad[rank * n:(rank + 1) * n].contiguous(), None


def all_gather_sequence(x: Tensor, group: Any) -> Tensor:
    """``x [n, ...]`` of every rank of ``group``, concatenated in rank order along dim 0 (differentiable)."""
    return _AllGatherSequence.apply(x, group)


def gather_full(local: Tensor, bounds: list[int], cp: int, group: Any) -> Tensor:
    """The full row ``[b, bounds[-1]]`` (or ``[b, bounds[-1], ...]``) from this rank's shard ``local
    [b, bounds[-1] // cp, ...]`` and those of the other CP ranks of ``group``. Collective, no gradient."""
    local = local.contiguous()
    parts = [torch.empty_like(local) for _ in range(cp)]
    dist.all_gather(parts, local, group=group)
    gathered = torch.cat(parts, dim=1)
    return gathered.index_select(1, full_order(bounds, cp, local.device))
