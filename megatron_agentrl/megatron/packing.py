"""Micro-batch planning and sequence packing for the actor's forward/backward passes.

A training batch is ``[B, T]`` right-padded rows. The actor splits it into micro-batches
(:func:`plan_micro_batches`) and either keeps each as padded rows cut to their longest row, or,
with ``train.sequence_packing``, concatenates the rows of a micro-batch into one THD row
(:func:`pack`): ``[1, sum(len_i)]`` tokens with ``cu_seqlens`` marking the sequences, positions
restarting at 0 in each, so that no token is computed for padding. :func:`unpack` puts a packed
per-token result back into the ``[B, T]`` layout.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor


def effective_lengths(loss_mask: Tensor) -> Tensor:
    """Per row, the length that matters for the loss: last masked position + 1 (at least 2, at most T).

    Tokens after the last policy token never influence the loss (causal attention), so a
    micro-batch can be cut to its rows' longest effective length. ``loss_mask [B, T]`` -> ``[B]`` long.
    """
    B, T = loss_mask.shape
    pos = torch.arange(1, T + 1, dtype=torch.long).expand(B, T)
    last = (pos * (loss_mask.detach().cpu() > 0).long()).amax(dim=1) if T else torch.zeros(B, dtype=torch.long)
    return last.clamp(min=min(2, T), max=T)


def plan_micro_batches(lengths: list[int], micro_batch_size: int, token_budget: int = 0,
                       packed: bool = False) -> list[list[int]]:
    """Group row indices into micro-batches; every row appears in exactly one.

    token_budget 0: consecutive chunks of ``micro_batch_size`` rows (the order of the batch).
    token_budget > 0, padded rows (``packed`` False): rows sorted longest first, cut greedily so that
        each micro-batch's rows x longest row <= token_budget.
    token_budget > 0, packed: rows sorted longest first, each placed in the first micro-batch whose
        summed length stays <= token_budget (first-fit decreasing).
    A row longer than the budget gets a micro-batch of its own. Returns lists of row indices.
    """
    n = len(lengths)
    if n == 0:
        return []
    if token_budget <= 0:
        return [list(range(i, min(i + micro_batch_size, n))) for i in range(0, n, micro_batch_size)]
    order = sorted(range(n), key=lambda i: (-lengths[i], i))
    plan: list[list[int]] = []
    if packed:
        used: list[int] = []
        for i in order:
            slot = next((j for j, u in enumerate(used) if u + lengths[i] <= token_budget), None)
            if slot is None:
                plan.append([i])
                used.append(lengths[i])
            else:
                plan[slot].append(i)
                used[slot] += lengths[i]
        return plan
    cur: list[int] = []
    for i in order:
        width = lengths[cur[0]] if cur else lengths[i]
        if cur and (len(cur) + 1) * width > token_budget:
            plan.append(cur)
            cur = []
        cur.append(i)
    if cur:
        plan.append(cur)
    return plan


@dataclass
class PackedRows:
    """Rows of one micro-batch packed into a single THD row.

    fields: each input field as ``[1, t]`` (the rows' first ``len_i`` tokens, each followed by zeros up
        to a multiple of ``multiple``, concatenated, then ``pad`` zeros); position_ids: ``[1, t]``,
        restarting at 0 in every sequence;
    seq_starts: ``[1, t]`` bool, True at the first token of each sequence (whose prediction would
        come from the previous sequence, so log-probs and entropy there are defined as 0, as in
        column 0 of a padded row); cu_seqlens: ``[n + 1]`` int32 boundaries of the (padded) sequences
        (the padding, if any, is a last sequence of its own); max_seqlen: the longest sequence.
    """

    fields: dict[str, Tensor]
    position_ids: Tensor
    seq_starts: Tensor
    cu_seqlens: Tensor
    max_seqlen: int


def padded_length(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple`` (a packed sequence's length with its padding)."""
    return -(-int(n) // multiple) * multiple


def pack(batch: dict[str, Tensor], rows: list[int], lengths: list[int], pad_to: int = 0,
         multiple: int = 1, fill: Mapping[str, int | float] | None = None) -> PackedRows:
    """Pack ``batch`` rows ``rows`` (each cut to ``lengths[row]``, then zero-padded to a multiple of
    ``multiple``: context parallelism needs every sequence a multiple of ``2 * cp``) into one row,
    padded to ``pad_to`` tokens (0 = no padding; the pipeline needs equal shapes when PP > 1).
    A field may have trailing dims (``[B, T, ...]`` -> ``[1, t, ...]``); ``fill``: the padding value of
    a field other than 0 (``routed_experts``: -1)."""
    lens = [int(lengths[i]) for i in rows]
    seqs = [padded_length(n, multiple) for n in lens]
    total = sum(seqs)
    pad = max(0, pad_to - total)
    index = torch.tensor(rows, dtype=torch.long)
    fields = {}
    for k, v in batch.items():
        picked = v.index_select(0, index)
        value = (fill or {}).get(k, 0)
        parts = []
        for j, (n, m) in enumerate(zip(lens, seqs)):
            parts.append(picked[j, :n])
            if m > n:
                parts.append(v.new_full((m - n, *v.shape[2:]), value))
        if pad:
            parts.append(v.new_full((pad, *v.shape[2:]), value))
        fields[k] = torch.cat(parts).unsqueeze(0)
    seg = seqs + ([pad] if pad else [])
    cu = torch.zeros(len(seg) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(seg, dtype=torch.int32), 0)
    position_ids = torch.cat([torch.arange(n, dtype=torch.long) for n in seg]).unsqueeze(0)
    starts = torch.zeros(1, total + pad, dtype=torch.bool)
    starts[0, cu[:-1].long()] = True
    return PackedRows(fields, position_ids, starts, cu, max(seg))


def unpack(x: Tensor, rows: list[int], lengths: list[int], out: Tensor, multiple: int = 1) -> None:
    """Write packed per-token values ``x [1, t]`` (or ``[t]``) of ``rows`` back into ``out [B, T]``
    (row ``r`` gets its first ``lengths[r]`` columns; ``multiple`` as given to :func:`pack`)."""
    x = x.reshape(-1)
    off = 0
    for r in rows:
        n = int(lengths[r])
        out[r, :n] = x[off: off + n].to(out.dtype)
        off += padded_length(n, multiple)
