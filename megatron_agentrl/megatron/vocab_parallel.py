"""Token log-probs and entropy from vocab-parallel logits, without full-vocabulary fp32 copies.

The LM head gives ``[b, s, V / tp]`` logits in the model's dtype. The textbook path (cast to fp32,
divide by the temperature, mask padded vocab entries, log-softmax, keep the softmax for backward;
the same again for the entropy) holds several fp32 ``[b, s, V / tp]`` tensors per micro-batch: with
Qwen's 152k vocabulary and 8k tokens that is 5 GB each. Here the fp32 work is done in row chunks of
about ``chunk_mb`` megabytes, and autograd keeps only the logits themselves (which the LM head's
output already is) and two fp32 numbers per token; the backward recomputes each chunk's softmax.

Per token (``x`` = logits / temperature over the whole vocabulary, padded entries excluded):
``logprob = x[target] - logsumexp(x)``, ``entropy = logsumexp(x) - sum(softmax(x) * x)``.
The forward reads the logits once: per token the shard's maximum and, relative to it, the partition
sum, the target's logit and ``sum(e * x)``. Under tensor parallelism each rank holds a contiguous
shard of the vocabulary; the maxima are all-reduced (max) once, each shard's sums rebased on the
global maximum, and the sums all-reduced once, for the whole micro-batch, whatever the number of
chunks. Gradients need no communication: with the global
log-partition known, each rank's share of ``d / d x`` is local.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

DEFAULT_CHUNK_MB = 256.0


def token_logprobs(logits: Tensor, targets: Tensor, *, temperature: float = 1.0, pad_mask: Tensor | None = None,
                   vocab_start: int = 0, tp_group: Any = None, with_entropy: bool = False,
                   chunk_mb: float = DEFAULT_CHUNK_MB) -> tuple[Tensor, Tensor | None]:
    """Log-probs of ``targets`` and (``with_entropy``) the entropy, both ``[b, s]`` fp32, differentiable
    with respect to ``logits``.

    Args:
        logits: ``[b, s, V_local]`` in any float dtype; ``logits[i, j]`` scores ``targets[i, j]``
            (a view such as ``logits[:, :-1]`` is fine: each ``logits[i]`` must be contiguous).
        targets: ``[b, s]`` token ids in the full vocabulary.
        temperature: the logits are divided by it (> 0).
        pad_mask: ``[V_local]`` bool, True for padded vocabulary entries (never sampled).
        vocab_start: the first vocabulary id of this rank's shard (``tp_rank * V_local``).
        tp_group: the tensor-parallel group the vocabulary is split over (None: not split).
        chunk_mb: the size of one fp32 chunk of rows, in megabytes.
    """
    if logits.dim() != 3 or targets.shape != logits.shape[:2]:
        raise ValueError(f"logits {tuple(logits.shape)} must be [b, s, V] and targets {tuple(targets.shape)} [b, s]")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature!r} must be > 0")
    if tp_group is not None and not (torch.distributed.is_initialized()
                                     and torch.distributed.get_world_size(tp_group) > 1):
        tp_group = None
    rows = max(1, int(chunk_mb * 2**20 // (4 * max(1, logits.shape[-1]))))
    scoring = _Scoring(float(temperature), pad_mask, int(vocab_start), tp_group, bool(with_entropy), rows)
    lp, ent = _TokenLogprobs.apply(logits, targets, scoring)
    return lp, (ent if with_entropy else None)


@dataclass(frozen=True)
class _Scoring:
    """How :class:`_TokenLogprobs` reads the logits (see :func:`token_logprobs`); ``rows``: rows per fp32 chunk."""

    temperature: float
    pad_mask: Tensor | None
    vocab_start: int
    tp_group: Any
    with_entropy: bool
    rows: int


def _chunks(logits: Tensor, rows: int):
    """``(i, j0, j1)`` row ranges of ``logits[i, j0:j1]``, at most ``rows`` rows each."""
    for i in range(logits.shape[0]):
        for j0 in range(0, logits.shape[1], rows):
            yield i, j0, min(j0 + rows, logits.shape[1])


def _scaled(chunk: Tensor, temperature: float, pad_mask: Tensor | None) -> Tensor:
    """A new fp32 ``chunk / temperature`` with padded entries at fp32's minimum (exp gives 0, and 0
    times that minimum stays 0 where -inf would give NaN); callers may change it in place."""
    x = chunk.to(torch.float32, copy=True)
    if temperature != 1.0:
        x.div_(temperature)
    if pad_mask is not None:
        x.masked_fill_(pad_mask, torch.finfo(torch.float32).min)
    return x


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: Tensor, targets: Tensor, scoring: _Scoring) -> tuple[Tensor, Tensor]:
        temperature, pad_mask, vocab_start = scoring.temperature, scoring.pad_mask, scoring.vocab_start
        tp_group, with_entropy, rows = scoring.tp_group, scoring.with_entropy, scoring.rows
        b, s, v = logits.shape
        local = (targets >= vocab_start) & (targets < vocab_start + v)
        idx = torch.where(local, targets - vocab_start, torch.zeros_like(targets)).long()
        # one pass over the logits: per token this shard's max m, then relative to it sum(e) with
        # e = exp(x - m), the target's x (0 on the shards without it) and sum(e * (x - m))
        row_max = torch.empty(b, s, dtype=torch.float32, device=logits.device)
        sums = torch.zeros(3, b, s, dtype=torch.float32, device=logits.device)
        for i, j0, j1 in _chunks(logits, rows):
            x = _scaled(logits[i, j0:j1], temperature, pad_mask)
            m = x.amax(-1)
            row_max[i, j0:j1] = m
            sums[1, i, j0:j1] = x.gather(-1, idx[i, j0:j1, None])[:, 0] * local[i, j0:j1]
            z = x.sub_(m[:, None])
            e = z.exp()
            sums[0, i, j0:j1] = e.sum(-1)
            if with_entropy:
                sums[2, i, j0:j1] = e.mul_(z).sum(-1)
        if tp_group is not None:  # rebase every shard's sums on the global max, then add them up
            global_max = row_max.clone()
            torch.distributed.all_reduce(global_max, op=torch.distributed.ReduceOp.MAX, group=tp_group)
            shift = row_max - global_max  # <= 0
            scale = shift.exp()
            # (scale * shift) first: a shard of padding only has shift ~ -3e38 and scale 0, whose product is 0
            sums[2] = scale * sums[2] + (scale * shift) * sums[0]
            sums[0] *= scale
            torch.distributed.all_reduce(sums, group=tp_group)
            row_max = global_max
        log_z = sums[0].log()  # log-partition of x - max
        lse = row_max + log_z
        logprobs = sums[1] - lse
        entropy = log_z - sums[2] / sums[0]
        ctx.save_for_backward(logits, idx, local, lse, entropy)
        ctx.scoring = scoring
        ctx.set_materialize_grads(False)  # an output nobody used gets None, not a tensor of zeros
        return logprobs, entropy

    @staticmethod
    def backward(ctx: Any, g_lp: Tensor | None, g_ent: Tensor | None):
        logits, idx, local, lse, entropy = ctx.saved_tensors
        grad = torch.empty_like(logits)
        scoring = ctx.scoring
        use_ent = scoring.with_entropy and g_ent is not None
        for i, j0, j1 in _chunks(logits, scoring.rows):
            # two fp32 chunks at a time: log p (then the entropy term) and p (then the gradient)
            logp = _scaled(logits[i, j0:j1], scoring.temperature, scoring.pad_mask).sub_(lse[i, j0:j1, None])
            g = logp.exp()
            if use_ent:  # d entropy / d x = -p (log p + entropy)
                logp.add_(entropy[i, j0:j1, None]).mul_(g).mul_(-g_ent[i, j0:j1, None])
            if g_lp is not None:  # d logprob / d x = onehot(target) - p
                gl = g_lp[i, j0:j1, None]
                g.mul_(-gl).scatter_add_(-1, idx[i, j0:j1, None], gl * local[i, j0:j1, None])
            else:
                g.zero_()
            if use_ent:
                g.add_(logp)
            if scoring.temperature != 1.0:
                g.div_(scoring.temperature)
            grad[i, j0:j1] = g
        return grad, None, None
