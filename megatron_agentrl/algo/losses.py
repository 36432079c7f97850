"""Per-token policy losses. Each returns a SUM over masked tokens; the caller divides by the
number of masked tokens in the whole global batch (token-level averaging across micro-batches
and data-parallel ranks)."""
from __future__ import annotations

import torch
from torch import Tensor


def clipped_policy_loss(
    logprobs: Tensor,
    behavior_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_eps_low: float,
    clip_eps_high: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO/GRPO clipped surrogate, summed over masked tokens.

    All inputs are ``[B, T]``: current-policy log-probs (with grad), the behavior log-probs the
    engine recorded when sampling, token advantages and the loss mask (1 = policy token).
    Per token, with ``r = exp(logprobs - behavior_logprobs)``:
    ``loss = -min(r * A, clip(r, 1 - clip_eps_low, 1 + clip_eps_high) * A)``.

    Returns ``(loss_sum, stats)`` where ``stats`` holds per-token SUMS over masked tokens:
    ``clip_frac`` (tokens whose clipped term was the active one) and ``approx_kl``
    (the k3 estimator ``(r - 1) - log r`` of KL(behavior || current)).
    """
    mask = mask.to(logprobs.dtype)
    log_ratio = (logprobs - behavior_logprobs) * mask
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    loss_sum = (per_token * mask).sum()
    with torch.no_grad():
        clip_frac = ((clipped < unclipped).to(mask.dtype) * mask).sum()
        approx_kl = (((ratio - 1.0) - log_ratio) * mask).sum()
    return loss_sum, {"clip_frac": clip_frac, "approx_kl": approx_kl}


def sft_loss(logprobs: Tensor, mask: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """Negative log-likelihood of the masked tokens, summed: ``-sum(logprobs * mask)``; ``[B, T]`` inputs."""
    return -(logprobs * mask.to(logprobs.dtype)).sum(), {}
