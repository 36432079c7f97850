"""Per-token policy losses. Each returns a SUM over masked tokens; the caller divides by the
number of masked tokens in the whole global batch (token-level averaging across micro-batches
and data-parallel ranks).

Three policies take part in the RL loss of one token (all log-probs of the sampled token):

* ``behavior`` (μ): the engine that sampled it; with asynchronous training or cross-policy
  sampling that may be a weight version several steps old;
* ``old`` (π_old): the trainer's weights at the start of this optimizer step (no gradient);
* ``current`` (π_θ): the weights being optimized (with gradient).

:func:`clipped_policy_loss` without ``old_logprobs`` is the classic PPO/GRPO surrogate with the
ratio taken against μ. With ``old_logprobs`` and ``tis_cap`` it is the decoupled form: the ratio
``π_θ / π_old`` is clipped, and every token is weighted by the truncated importance weight
``min(π_old / μ, tis_cap)``, which corrects for tokens sampled by stale or other-version engines
without letting one token's weight explode.
"""
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
    *,
    old_logprobs: Tensor | None = None,
    tis_cap: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO/GRPO clipped surrogate, summed over masked tokens.

    All tensor inputs are ``[B, T]``: current-policy log-probs (with grad), the behavior
    log-probs the engine recorded when sampling, token advantages and the loss mask (1 = policy
    token). ``old_logprobs`` (optional, no grad): the trainer policy at the start of the step.

    Per token, with ``base = old_logprobs`` when given else ``behavior_logprobs``,
    ``r = exp(logprobs - base)`` and ``w = min(exp(old_logprobs - behavior_logprobs), tis_cap)``
    when ``old_logprobs`` is given and ``tis_cap > 0`` (else ``w = 1``; ``w`` carries no gradient):
    ``loss = -w * min(r * A, clip(r, 1 - clip_eps_low, 1 + clip_eps_high) * A)``.

    Returns ``(loss_sum, stats)`` where ``stats`` holds per-token SUMS over masked tokens:
    ``clip_frac`` (tokens whose clipped term was the active one), ``approx_kl`` (the k3
    estimator ``(ρ - 1) - log ρ`` of KL(behavior || current), ``ρ = exp(logprobs - behavior)``),
    and with importance weights ``is_weight`` (sum of ``w``) and ``is_truncated`` (tokens whose
    weight hit the cap).
    """
    mask = mask.to(logprobs.dtype)
    base = behavior_logprobs if old_logprobs is None else old_logprobs.detach()
    log_ratio = (logprobs - base) * mask
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    stats: dict[str, Tensor] = {}
    if old_logprobs is not None and tis_cap > 0:
        with torch.no_grad():
            raw_w = torch.exp((old_logprobs.detach() - behavior_logprobs) * mask)
            weight = raw_w.clamp(max=float(tis_cap))
            stats["is_weight"] = (weight * mask).sum()
            stats["is_truncated"] = ((raw_w > tis_cap).to(mask.dtype) * mask).sum()
        per_token = per_token * weight
    loss_sum = (per_token * mask).sum()
    with torch.no_grad():
        stats["clip_frac"] = ((clipped < unclipped).to(mask.dtype) * mask).sum()
        behav_log_ratio = (logprobs.detach() - behavior_logprobs) * mask
        stats["approx_kl"] = (k3(behav_log_ratio) * mask).sum()
    return loss_sum, stats


KL_ESTIMATORS = ("k3", "k2")


def k3(log_ratio: Tensor) -> Tensor:
    """Schulman's k3 term per token, ``(r - 1) - log r`` with ``log r = log_ratio`` (>= 0): with tokens
    drawn from q and ``r = p / q``, its mean estimates KL(q || p)."""
    return torch.expm1(log_ratio) - log_ratio


def kl_to_reference(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, estimator: str = "k3") -> Tensor:
    """A per-token estimate of KL(current || reference), summed over masked tokens; ``[B, T]`` inputs,
    differentiable in ``logprobs``. With ``d = ref_logprobs - logprobs`` per token:

    * ``k3``: ``exp(d) - d - 1`` (>= 0; Schulman's low-variance estimator, GRPO's KL term). As a loss
      its gradient on a token is ``-(exp(d) - 1)``, which grows exponentially when the current policy
      gives a sampled token far less probability than the reference (stale and cross-policy tokens
      can be such tokens), so one token can dominate a clipped step;
    * ``k2``: ``d ** 2 / 2`` (>= 0): its gradient ``-d`` grows linearly and, on tokens sampled from
      the current policy, is the exact gradient of the KL; the same as k3's to first order in ``d``.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"KL estimator {estimator!r} is not one of {KL_ESTIMATORS}")
    mask = mask.to(logprobs.dtype)
    d = (ref_logprobs.detach() - logprobs) * mask
    per_token = k3(d) if estimator == "k3" else 0.5 * d * d
    return (per_token * mask).sum()


def vocab_parallel_entropy(logits: Tensor, tp_group=None) -> Tensor:
    """Entropy (nats) of ``softmax(logits)`` per position; logits ``[..., V_local]`` may be a TP shard.

    With ``tp_group`` (the tensor-parallel group, vocab split across its ranks) the max and the
    two partition sums are all-reduced over it (differentiable: the backward of a sum all-reduce
    is the identity on each shard). Masked (padding) vocab entries must already be ``-inf`` or
    the dtype's minimum. Returns ``[...]`` in the logits' dtype.
    """
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    use_tp = (tp_group is not None and torch.distributed.is_initialized()
              and torch.distributed.get_world_size(tp_group) > 1)
    m = logits.detach().amax(dim=-1, keepdim=True)
    if use_tp:
        torch.distributed.all_reduce(m, op=torch.distributed.ReduceOp.MAX, group=tp_group)
    z = logits - m
    e = torch.exp(z)
    s = e.sum(-1)
    sz = (e * z).sum(-1)
    if use_tp:
        s = reduce_from_tensor_model_parallel_region(s)
        sz = reduce_from_tensor_model_parallel_region(sz)
    # H = log s - sum(p z) with p = e / s (z shifted by the max: the shift cancels)
    return torch.log(s) - sz / s


def policy_loss(
    logprobs: Tensor,
    behavior_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_eps_low: float,
    clip_eps_high: float,
    old_logprobs: Tensor | None = None,
    tis_cap: float = 0.0,
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The GRPO training loss of one micro-batch, summed over masked tokens.

    ``loss = clipped_policy_loss(...) + kl_coef * kl_to_reference(logprobs, ref_logprobs, kl_estimator)
    - entropy_coef * sum(entropy)``
    (all sums over masked tokens; ``[B, T]`` inputs, ``entropy`` per position ``[B, T]``).
    The KL term needs ``ref_logprobs`` when ``kl_coef > 0``; the entropy bonus needs ``entropy``
    when ``entropy_coef > 0``. Stats (per-token sums): those of :func:`clipped_policy_loss`,
    plus ``pg_loss``, ``kl_ref`` (when a reference is given) and ``entropy`` (when given).
    """
    pg, stats = clipped_policy_loss(logprobs, behavior_logprobs, advantages, mask, clip_eps_low, clip_eps_high,
                                    old_logprobs=old_logprobs, tis_cap=tis_cap)
    loss = pg
    stats["pg_loss"] = pg.detach()
    maskf = mask.to(logprobs.dtype)
    if kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs (the reference policy's log-probs of the batch)")
    if ref_logprobs is not None:
        kl = kl_to_reference(logprobs, ref_logprobs, maskf, kl_estimator)
        stats["kl_ref"] = kl.detach()
        if kl_coef > 0:
            loss = loss + kl_coef * kl
    if entropy_coef > 0 and entropy is None:
        raise ValueError("entropy_coef > 0 needs the per-token entropy")
    if entropy is not None:
        ent = (entropy * maskf).sum()
        stats["entropy"] = ent.detach()
        if entropy_coef > 0:
            loss = loss - entropy_coef * ent
    return loss, stats


def sft_loss(logprobs: Tensor, mask: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """Negative log-likelihood of the masked tokens, summed: ``-sum(logprobs * mask)``; ``[B, T]`` inputs."""
    return -(logprobs * mask.to(logprobs.dtype)).sum(), {}
