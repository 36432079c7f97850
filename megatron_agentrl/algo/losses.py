"""Per-token policy losses. Each returns a (weighted) SUM over masked tokens; the caller divides by the
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

On top of the token-level surrogate (see :func:`policy_loss`):

* GSPO (``loss.ratio_level: sequence``, arXiv 2507.18071): one ratio per sequence, the geometric mean
  ``s_i = exp(mean_t (log π_θ - log base))`` over its policy tokens, clipped as one; in the paper's token
  form ``s_i,t = sg(s_i) * π_θ(y_t) / sg(π_θ(y_t))``, whose value is ``s_i`` and whose gradient flows
  through every token of the sequence;
* masked importance sampling (``loss.mis_cap``, "ICEPOP"): tokens, or whole sequences (by the geometric
  mean), whose ``ρ = π_old / μ`` lies outside ``[1 / mis_cap, mis_cap]`` get no gradient from any term
  of the loss; a mask only (the ratio and the TIS weights stay as ``tis_cap`` says); they stay in the
  token count that divides the loss (as in the IcePop objective and slime's per-token loss);
* loss aggregation (``loss.agg``, :func:`loss_agg_weights`): per-token weights that turn the
  global token mean into a mean over sequences.

Sequence-level quantities come from per-sequence sums (:class:`Sequences`): one sequence per row of
padded rows, or the ids a packed row carries; under context parallelism a sequence is split over the
CP ranks and its (detached) sums are all-reduced over the CP group.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

if TYPE_CHECKING:
    from megatron_agentrl.config import LossConfig

MIS_LEVELS = ("token", "sequence")
LOSS_AGGS = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean")


class Sequences:
    """Which sequence each token belongs to, for detached per-sequence sums.

    ids: ``[B, T]`` long in ``[0, count)``; count: the number of sequences; group: the process group
    that holds the other tokens of the same sequences (context parallelism: the CP group), over which
    the per-sequence sums are all-reduced (None: this process holds whole sequences).
    """

    def __init__(self, ids: Tensor, count: int, group: Any = None) -> None:
        self.ids = ids.long()
        self.count = int(count)
        self.group = group

    @classmethod
    def rows(cls, like: Tensor) -> "Sequences":
        """One sequence per row of ``like [B, T]`` (padded rows, whole sequences on this process)."""
        B, T = like.shape
        return cls(torch.arange(B, device=like.device).unsqueeze(1).expand(B, T), B)

    def mean(self, values: Tensor, mask: Tensor) -> Tensor:
        """Per token ``[B, T]``, the mean of ``values`` over the masked tokens of its sequence (0 for a
        sequence without any); detached, summed in float64, returned in ``values.dtype``."""
        with torch.no_grad():
            m = mask.double()
            ids = self.ids.reshape(-1)
            sums = torch.zeros(2, self.count, dtype=torch.float64, device=values.device)
            sums[0].index_add_(0, ids, (values.double() * m).reshape(-1))
            sums[1].index_add_(0, ids, m.reshape(-1))
            if self.group is not None and dist.is_initialized() and dist.get_world_size(self.group) > 1:
                dist.all_reduce(sums, group=self.group)
            per_seq = sums[0] / sums[1].clamp_min(1.0)
            return per_seq[self.ids].to(values.dtype)


def _check_level(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of {choices}")


def importance_keep(old_logprobs: Tensor, behavior_logprobs: Tensor, mask: Tensor, mis_cap: float,
                    level: str = "token", sequences: Sequences | None = None) -> Tensor:
    """Masked importance sampling: ``[B, T]`` float, 1 for tokens kept, 0 for tokens dropped.

    ``log ρ = log π_old - log μ`` per token (``level`` "token"), or its mean over the sequence's masked
    tokens (``level`` "sequence": the log of the geometric mean of the token ratios; ``sequences``, default
    one per row); a token is dropped when ``ρ`` lies outside ``[1 / mis_cap, mis_cap]`` (bounds kept).
    ``[B, T]`` inputs; ``mis_cap > 1``. No gradient.
    """
    if not mis_cap > 1:
        raise ValueError(f"mis_cap={mis_cap!r} must be > 1 (loss.mis_cap: 0 = off, else e.g. 2.0)")
    _check_level("mis_level", level, MIS_LEVELS)
    with torch.no_grad():
        log_rho = (old_logprobs.detach() - behavior_logprobs) * mask
        if level == "sequence":
            log_rho = (sequences or Sequences.rows(mask)).mean(log_rho, mask)
        return (log_rho.abs() <= math.log(mis_cap)).to(mask.dtype)


def loss_agg_weights(mask: Tensor, mode: str) -> Tensor | None:
    """Per-token weights ``w [B, T]`` for ``loss.agg``, given the loss mask of the GLOBAL batch.

    The actor divides ``sum_t w_t l_t`` by the global policy-token count ``N_tok``; with ``N_seq`` the
    sequences that hold a policy token and ``L_i`` the policy tokens of sequence ``i``:
    "token_mean": None (``w = 1``); "seq_mean_token_sum": ``w = N_tok / N_seq``, the loss is
    ``(1 / N_seq) sum_i sum_t l_it``; "seq_mean_token_mean": ``w = N_tok / (N_seq L_i)``, the loss is
    ``(1 / N_seq) sum_i (1 / L_i) sum_t l_it``. 0 where the mask is 0; float32.
    """
    _check_level("loss.agg", mode, LOSS_AGGS)
    if mode == "token_mean":
        return None
    m = mask.to(torch.float64)
    lengths = m.sum(1, keepdim=True)  # L_i
    n_tok = lengths.sum()
    n_seq = (lengths > 0).sum().clamp_min(1)
    if mode == "seq_mean_token_sum":
        w = m * (n_tok / n_seq)
    else:
        w = m * n_tok / (n_seq * lengths.clamp_min(1.0))
    return w.to(torch.float32)


@dataclass(frozen=True)
class LossInputs:
    """The per-token inputs of a policy loss for one micro-batch, all ``[B, T]``.

    logprobs: current-policy log-probs (with grad); behavior_logprobs: those the engine recorded when
    sampling; advantages: token advantages; mask: the loss mask (1 = policy token).
    old_logprobs: the trainer policy at the start of the step (no grad); ref_logprobs: the reference
    policy's; entropy: the current policy's entropy per position; token_weights: per-token weights of the
    loss (:func:`loss_agg_weights`); sequences: the sequence of each token (default one per row). Each
    optional input is None when not given; which ones a loss needs, it says.
    """

    logprobs: Tensor
    behavior_logprobs: Tensor
    advantages: Tensor
    mask: Tensor
    old_logprobs: Tensor | None = None
    ref_logprobs: Tensor | None = None
    entropy: Tensor | None = None
    token_weights: Tensor | None = None
    sequences: Sequences | None = None


def _clipped_per_token(x: LossInputs, cfg: LossConfig, old_logprobs: Tensor | None) -> tuple[Tensor, dict[str, Tensor]]:
    """The clipped surrogate per token ``[B, T]`` (not yet masked) and the per-token-sum stats of
    :func:`clipped_policy_loss`, with ``old_logprobs`` (or None) as the base of the ratio."""
    logprobs, behavior_logprobs, advantages = x.logprobs, x.behavior_logprobs, x.advantages
    mask = x.mask.to(logprobs.dtype)
    tis_cap = cfg.tis_cap
    base = behavior_logprobs if old_logprobs is None else old_logprobs.detach()
    if cfg.ratio_level == "token":
        log_ratio = (logprobs - base) * mask
    else:
        # GSPO-token: value log s_i (the sequence's mean log ratio), gradient that of log π_θ of each token
        seq_log_ratio = (x.sequences or Sequences.rows(mask)).mean(logprobs.detach() - base, mask)
        log_ratio = (seq_log_ratio + logprobs - logprobs.detach()) * mask
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    stats: dict[str, Tensor] = {}
    if old_logprobs is not None and tis_cap > 0:
        with torch.no_grad():
            raw_w = torch.exp((old_logprobs.detach() - behavior_logprobs) * mask)
            weight = raw_w.clamp(max=float(tis_cap))
            stats["is_weight"] = (weight * mask).sum()
            stats["is_truncated"] = ((raw_w > tis_cap).to(mask.dtype) * mask).sum()
        per_token = per_token * weight
    with torch.no_grad():
        stats["clip_frac"] = ((clipped < unclipped).to(mask.dtype) * mask).sum()
        behav_log_ratio = (logprobs.detach() - behavior_logprobs) * mask
        stats["approx_kl"] = (k3(behav_log_ratio) * mask).sum()
    return per_token, stats


def clipped_policy_loss(x: LossInputs, cfg: LossConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO/GRPO clipped surrogate, summed over masked tokens.

    Reads of ``x`` the current-policy log-probs (with grad), the behavior log-probs the engine recorded
    when sampling, the token advantages, the loss mask and, when given, ``old_logprobs`` (no grad: the
    trainer policy at the start of the step) and ``sequences``; of ``cfg`` (the ``loss`` section)
    ``clip_eps_low`` / ``clip_eps_high``, ``tis_cap`` and ``ratio_level``.

    Per token, with ``base = old_logprobs`` when given else ``behavior_logprobs``,
    ``r = exp(logprobs - base)`` and ``w = min(exp(old_logprobs - behavior_logprobs), tis_cap)``
    when ``old_logprobs`` is given and ``tis_cap > 0`` (else ``w = 1``; ``w`` carries no gradient):
    ``loss = -w * min(r * A, clip(r, 1 - clip_eps_low, 1 + clip_eps_high) * A)``.
    ``ratio_level`` "sequence" (GSPO) replaces every token's ``r`` by ``s_i,t = sg(s_i) * π_θ / sg(π_θ)``,
    ``s_i = exp(mean of (logprobs - base) over the masked tokens of the token's sequence)``
    (``sequences``; default one per row).

    Returns ``(loss_sum, stats)`` where ``stats`` holds per-token SUMS over masked tokens:
    ``clip_frac`` (tokens whose clipped term was the active one), ``approx_kl`` (the k3
    estimator ``(ρ - 1) - log ρ`` of KL(behavior || current), ``ρ = exp(logprobs - behavior)``),
    and with importance weights ``is_weight`` (sum of ``w``) and ``is_truncated`` (tokens whose
    weight hit the cap).
    """
    per_token, stats = _clipped_per_token(x, cfg, x.old_logprobs)
    return (per_token * x.mask.to(x.logprobs.dtype)).sum(), stats


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
    mask = mask.to(logprobs.dtype)
    return (_kl_per_token(logprobs, ref_logprobs, mask, estimator) * mask).sum()


def _kl_per_token(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, estimator: str) -> Tensor:
    """The KL term of :func:`kl_to_reference` per token ``[B, T]`` (0 where the mask is 0)."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"KL estimator {estimator!r} is not one of {KL_ESTIMATORS}")
    d = (ref_logprobs.detach() - logprobs) * mask
    return k3(d) if estimator == "k3" else 0.5 * d * d


def policy_loss(x: LossInputs, cfg: LossConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """The RL training loss of one micro-batch under the ``loss`` config section: a weighted sum over masked
    tokens.

    Per token ``l_t = pg_t + kl_coef * kl_t - entropy_coef * entropy_t`` with ``pg_t`` the clipped surrogate
    of :func:`clipped_policy_loss` (``cfg.clip_eps_low/high``, ``cfg.ratio_level``; the decoupled form with
    truncated weights when ``cfg.tis_cap > 0``, whose base is ``old_logprobs``), ``kl_t`` that of
    :func:`kl_to_reference` (``cfg.kl_estimator``) and ``entropy`` per position; then
    ``loss = sum_t mask_t * keep_t * w_t * l_t`` where ``keep`` is 0 for the tokens that masked importance
    sampling drops (``cfg.mis_cap > 0``, :func:`importance_keep` of ``old_logprobs`` at ``cfg.mis_level``), and
    ``w = token_weights`` (:func:`loss_agg_weights` of ``cfg.agg`` over the global batch; 1 when None).
    ``[B, T]`` inputs (``x``); ``sequences`` (default one per row) groups the tokens for ``ratio_level`` /
    ``mis_level`` "sequence".

    Needs ``ref_logprobs`` when ``kl_coef > 0``, ``entropy`` when ``entropy_coef > 0`` and ``old_logprobs``
    when ``tis_cap > 0`` or ``mis_cap > 0`` (unused otherwise). Stats, per-token sums over ALL masked tokens
    (MIS and the weights change only ``loss``): those of :func:`clipped_policy_loss`, ``pg_loss``, ``kl_ref``
    (when a reference is given), ``entropy`` (when given) and ``mis_masked`` (tokens dropped, when
    ``mis_cap > 0``).
    """
    logprobs, behavior_logprobs, mask = x.logprobs, x.behavior_logprobs, x.mask
    old_logprobs, ref_logprobs, entropy, token_weights = x.old_logprobs, x.ref_logprobs, x.entropy, x.token_weights
    if cfg.needs_old_logprobs and old_logprobs is None:
        raise ValueError("loss.tis_cap > 0 and loss.mis_cap > 0 need old_logprobs (the policy's log-probs at the "
                         "step start)")
    if cfg.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("loss.kl_coef > 0 needs ref_logprobs (the reference policy's log-probs of the batch)")
    if cfg.entropy_coef > 0 and entropy is None:
        raise ValueError("loss.entropy_coef > 0 needs the per-token entropy")
    if token_weights is not None and token_weights.shape != mask.shape:
        raise ValueError(f"token_weights {tuple(token_weights.shape)} must be [B, T] like mask {tuple(mask.shape)}")
    maskf = mask.to(logprobs.dtype)
    per_token, stats = _clipped_per_token(x, cfg, old_logprobs if cfg.tis_cap > 0 else None)
    stats["pg_loss"] = (per_token * maskf).sum().detach()
    if ref_logprobs is not None:
        kl = _kl_per_token(logprobs, ref_logprobs, maskf, cfg.kl_estimator)
        stats["kl_ref"] = (kl * maskf).sum().detach()
        if cfg.kl_coef > 0:
            per_token = per_token + cfg.kl_coef * kl
    if entropy is not None:
        stats["entropy"] = (entropy * maskf).sum().detach()
        if cfg.entropy_coef > 0:
            per_token = per_token - cfg.entropy_coef * entropy
    scale = maskf
    if cfg.mis_cap > 0:
        keep = importance_keep(old_logprobs, behavior_logprobs, maskf, cfg.mis_cap, cfg.mis_level, x.sequences)
        stats["mis_masked"] = (maskf * (1.0 - keep)).sum()
        scale = scale * keep
    if token_weights is not None:
        scale = scale * token_weights.to(logprobs.dtype)
    return (per_token * scale).sum(), stats


def policy_loss_stat_keys(cfg: LossConfig, with_ref: bool, with_entropy: bool) -> list[str]:
    """The stats :func:`policy_loss` returns under ``cfg`` (``loss`` first, the objective the caller adds):
    ``with_ref`` when it is given ``ref_logprobs``, ``with_entropy`` when it is given the entropy."""
    keys = ["loss", "pg_loss", "clip_frac", "approx_kl"]
    if cfg.tis_cap > 0:
        keys += ["is_weight", "is_truncated"]
    if cfg.mis_cap > 0:
        keys.append("mis_masked")
    if with_ref:
        keys.append("kl_ref")
    if with_entropy:
        keys.append("entropy")
    return keys


def sft_loss(logprobs: Tensor, mask: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """Negative log-likelihood of the masked tokens, summed: ``-sum(logprobs * mask)``; ``[B, T]`` inputs."""
    return -(logprobs * mask.to(logprobs.dtype)).sum(), {}
