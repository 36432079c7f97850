"""The training step shared by the synchronous and asynchronous pipelines.

:class:`Trainer.step` runs on every rank: rank 0 passes the step's :class:`~.batch.RLBatch`
(built from the groups the rollout side delivered), it is broadcast, each data-parallel rank
takes its slice, per-task advantage normalization runs globally over the data-parallel group
(``normalize_per_task`` with ``process_group``), on-policy distillation's per-token signal joins the
advantages (``distill.coef``; the reward's part weighed by ``distill.reward_coef``), reference log-probs
are added when the KL term is on, and the actor takes one optimizer step (clipped loss with truncated or
masked importance weights, token- or sequence-level ratios, micro-batches by token budget). The per-token
weights of ``loss.agg`` are computed here, from the global batch before the data-parallel split, so that
the sequence count and lengths they hold are global.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from megatron_agentrl.algo.losses import loss_agg_weights
from megatron_agentrl.config import Config
from megatron_agentrl.distributed import broadcast_object
from megatron_agentrl.megatron.actor import MegatronActor
from megatron_agentrl.pipeline.batch import RLBatch, normalize_batch


class Trainer:
    """One GRPO optimizer step on every rank (see the module doc).

    actor: this rank's MegatronActor; cfg: the run config; task_names: the task-id order.
    """

    def __init__(self, actor: MegatronActor, cfg: Config, task_names: list[str]) -> None:
        self.actor = actor
        self.cfg = cfg
        self.task_names = list(task_names)

    def _dp_group(self) -> Any:
        if self.actor.dp == 1:
            return None
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_group()

    def step(self, rl: RLBatch | None, step: int) -> dict[str, float]:
        """Train RL step ``step`` (1-based; its learning rate is ``train.lr_at(step)``) on ``rl`` (given on
        rank 0, None elsewhere). Collective over all ranks.

        Returns the actor's stats: ``loss`` (the objective under ``loss.agg``) and per-token averages
        over the global batch (``pg_loss``, ``clip_frac``, ``approx_kl``, and as enabled ``is_weight``,
        ``is_truncated``, ``mis_masked``, ``kl_ref``, ``entropy``), ``grad_norm`` (before clipping),
        ``num_tokens`` (global policy tokens) and ``num_micro_batches`` (this rank).
        """
        rl = broadcast_object(rl, bulk=True)
        a = self.actor
        batch = rl.batch
        weights = loss_agg_weights(batch.loss_mask, self.cfg.loss.agg)  # global N_tok, N_seq, L_i
        if weights is not None:
            batch = dataclasses.replace(batch, token_weights=weights)
        local = normalize_batch(a.dp_slice(batch), a.dp_slice(rl.task_ids), self.cfg.algo, len(self.task_names),
                                self._dp_group())
        if rl.distill is not None:  # the teacher's per-token signal, after the reward's per-task normalization
            d = self.cfg.distill
            signal = a.dp_slice(rl.distill).to(local.advantages.dtype)
            if d.signal_clip > 0:
                signal = signal.clamp(-d.signal_clip, d.signal_clip)
            local = dataclasses.replace(local, advantages=d.reward_coef * local.advantages + d.coef * signal)
        temperature = self.cfg.rollout.temperature
        if self.cfg.loss.kl_coef > 0:
            local.ref_logprobs = a.compute_ref_logprobs(local.tokens, local.loss_mask, temperature,
                                                        routed_experts=local.routed_experts)
        lr = self.cfg.train.lr_at(step)
        a.set_lr(lr)
        return {**a.train_step(local, loss_type="grpo", temperature=temperature), "lr": lr}
