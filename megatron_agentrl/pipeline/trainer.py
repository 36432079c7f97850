"""The training step shared by the synchronous and asynchronous pipelines, and the weight push.

:class:`Trainer.step` runs on every rank: rank 0 passes the step's :class:`~.batch.RLBatch`
(built from the groups the rollout side delivered), it is broadcast, each data-parallel rank
takes its slice, per-task advantage normalization runs globally over the data-parallel group
(``normalize_per_task`` with ``process_group``), reference log-probs are added when the KL term is
on, and the actor takes one optimizer step (clipped loss with truncated importance weights,
token-level averaging, micro-batches by token budget).

:class:`WeightPublisher` exports the actor's weights (collective) and loads them on rank 0 into
the engine (paused between turns, see ``BatchingEngine``) or into the oldest slot of a version
pool (``begin_update`` / ``end_update``), bucket by bucket.
"""
from __future__ import annotations

import logging
import time
from typing import Any

import torch
import torch.distributed as dist

from megatron_agentrl.config import Config
from megatron_agentrl.megatron.actor import MegatronActor
from megatron_agentrl.pipeline.batch import RLBatch, normalize_batch
from rollout_sglang.version_pool import VersionPool

logger = logging.getLogger(__name__)


def is_rank0() -> bool:
    """Global rank 0 (or no torch.distributed)."""
    return not dist.is_initialized() or dist.get_rank() == 0


def broadcast_object(obj: Any) -> Any:
    """Send a picklable object from rank 0 to every rank (identity on one process)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def dp_rows(batch_size: int, dp: int, dp_rank: int) -> torch.Tensor:
    """Row indices of data-parallel rank ``dp_rank`` (the same split as ``MegatronActor.dp_slice``)."""
    return torch.tensor_split(torch.arange(batch_size), dp)[dp_rank]


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

    def step(self, rl: RLBatch | None) -> dict[str, float]:
        """Train on ``rl`` (given on rank 0, None elsewhere). Collective over all ranks.

        Returns the actor's stats (per-token averages over the global batch: ``loss``,
        ``pg_loss``, ``clip_frac``, ``approx_kl``, ``is_weight``..., ``grad_norm``,
        ``num_tokens``) plus ``train_tokens`` (all tokens of the global batch, padding excluded).
        """
        rl = broadcast_object(rl)
        a = self.actor
        rows = dp_rows(rl.batch.tokens.shape[0], a.dp, a.dp_rank)
        local = rl.batch.select(rows)
        local = normalize_batch(local, rl.task_ids[rows], self.cfg.algo, len(self.task_names), self._dp_group())
        temperature = self.cfg.rollout.temperature
        if self.cfg.train.kl_coef > 0:
            local.ref_logprobs = a.compute_ref_logprobs(local.tokens, local.loss_mask, temperature)
        stats = a.train_step(local, loss_type="grpo", temperature=temperature)
        return stats


class WeightPublisher:
    """Pushes the actor's weights to the rollout engines (see the module doc).

    actor: the MegatronActor (every rank calls :meth:`push`: the export is collective).
    target: on rank 0 the engine (ideally a BatchingEngine) or VersionPool; None elsewhere.
    bucket_mb: bucket size of the hand-over, MiB. timeout_s: limit on waiting for a running
    generate call to end before the update.
    """

    def __init__(self, actor: MegatronActor, target: Any, bucket_mb: float = 512, timeout_s: float = 600.0) -> None:
        self.actor = actor
        self.target = target
        self.bucket_bytes = max(1, int(bucket_mb * 1024 * 1024))
        self.timeout_s = float(timeout_s)

    def push(self, version: int, all_slots: bool = False) -> float:
        """Export (collective) and load ``version`` into the engine / the oldest pool slot (every slot
        with ``all_slots``). Returns seconds spent on this rank."""
        from megatron_agentrl.weight_sync import deliver_direct

        t0 = time.perf_counter()
        state = self.actor.export_hf_state_dict()
        target = self.target
        if target is None:
            return time.perf_counter() - t0
        if isinstance(target, VersionPool):
            slots = list(range(len(target.slots))) if all_slots else [None]
            for s in slots:
                slot = target.begin_update(version, slot=s, timeout_s=self.timeout_s)
                try:
                    deliver_direct(slot.engines, state.items(), self.bucket_bytes)
                except BaseException:
                    target.abort_update(slot)
                    raise
                target.end_update(slot)
        else:
            target.pause()
            try:
                wait_idle = getattr(target, "wait_idle", None)
                if callable(wait_idle):
                    wait_idle(self.timeout_s)
                target.begin_weight_update(version, {})
                deliver_direct([target], state.items(), self.bucket_bytes)  # a failure ends the run
                target.end_weight_update()
            finally:
                target.resume()
        return time.perf_counter() - t0
