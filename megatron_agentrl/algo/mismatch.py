"""Train-vs-rollout mismatch: how far the trainer's log-probs are from the engines' that sampled each token.

With asynchronous training and cross-policy sampling a token may come from a weight version up to
``pipeline.staleness`` steps older than the one being trained (its *version lag*). At lag 0 the
engine ran the very weights the trainer holds, so any mismatch there is numerics (or a bug: a weight
slot that did not take the update, a batching engine that disagrees with the trainer); at lag k it
adds what k optimizer steps changed. Per lag bucket, over the policy tokens of the global batch:

* ``mismatch/abs_lag<k>``: mean ``|log p_train - log p_behavior|``;
* ``mismatch/kl_lag<k>``: the k3 estimate of KL(behavior || train), ``(ρ - 1) - log ρ`` with
  ``ρ = p_train / p_behavior`` (tokens are drawn from the behavior policy);
* ``mismatch/tokens_lag<k>``: the number of tokens.

Lags of ``LAG_BUCKETS - 1`` or more share the last bucket.
"""
from __future__ import annotations

import torch
from torch import Tensor

from megatron_agentrl.algo.losses import k3

#: lag buckets 0, 1, ..., LAG_BUCKETS - 2, and "LAG_BUCKETS - 1 or more"
LAG_BUCKETS = 8


def lag_sums(logprobs: Tensor, behavior_logprobs: Tensor, mask: Tensor, lag: Tensor) -> Tensor:
    """Per lag bucket, ``[LAG_BUCKETS, 3]`` float64: the sums of ``|Δ|`` and of the k3 KL term, and the
    token count, over tokens with ``mask > 0`` and ``lag >= 0`` (``Δ = logprobs - behavior_logprobs``;
    all inputs ``[B, T]``, ``lag`` an integer tensor, -1 where unknown)."""
    keep = (mask > 0) & (lag >= 0)
    delta = (logprobs.detach() - behavior_logprobs).double()[keep]
    bucket = lag[keep].long().clamp(max=LAG_BUCKETS - 1)
    out = torch.zeros(LAG_BUCKETS, 3, dtype=torch.float64, device=logprobs.device)
    out[:, 0].index_add_(0, bucket, delta.abs())
    out[:, 1].index_add_(0, bucket, k3(delta))
    out[:, 2].index_add_(0, bucket, torch.ones_like(delta))
    return out


def lag_metrics(sums: Tensor) -> dict[str, float]:
    """The ``mismatch/*`` metrics of the buckets that hold tokens, from summed :func:`lag_sums`."""
    out: dict[str, float] = {}
    for k in range(LAG_BUCKETS):
        n = float(sums[k, 2])
        if n == 0:
            continue
        name = f"lag{k}" if k < LAG_BUCKETS - 1 else f"lag{k}plus"
        out[f"mismatch/abs_{name}"] = float(sums[k, 0]) / n
        out[f"mismatch/kl_{name}"] = float(sums[k, 1]) / n
        out[f"mismatch/tokens_{name}"] = n
    return out

