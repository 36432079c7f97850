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

        Returns the actor's stats: per-token averages over the global batch (``loss``,
        ``pg_loss``, ``clip_frac``, ``approx_kl``, and as enabled ``is_weight``, ``is_truncated``,
        ``kl_ref``, ``entropy``), ``grad_norm`` (before clipping), ``num_tokens`` (global policy
        tokens) and ``num_micro_batches`` (this rank).
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

    actor: the MegatronActor (every rank calls :meth:`push`: it is collective).
    target: on rank 0 the engine (ideally a BatchingEngine) or VersionPool; None elsewhere.
    bucket_mb: bucket size of the hand-over, MiB. timeout_s: limit on waiting for a running
    generate call to end (or a pool slot to drain) before the update.
    remote_slots: for engines in other processes (SGLang servers), on EVERY rank, the
        weight-update targets (``SGLangEngine`` clients) of each version slot; the weights then
        go over a weight-sync group (``megatron_agentrl.weight_sync.WeightSender``, NCCL on GPUs,
        gloo on CPU) instead of in-process. ``sender_kwargs``: WeightSender options.
    """

    def __init__(self, actor: MegatronActor, target: Any, bucket_mb: float = 512, timeout_s: float = 600.0,
                 remote_slots: list[list[Any]] | None = None, sender_kwargs: dict[str, Any] | None = None) -> None:
        self.actor = actor
        self.target = target
        self.bucket_bytes = max(1, int(bucket_mb * 1024 * 1024))
        self.timeout_s = float(timeout_s)
        self.remote_slots = remote_slots
        self.sender = None
        if remote_slots is not None:
            from megatron_agentrl.weight_sync import WeightSender

            self.sender = WeightSender(actor, bucket_mb=bucket_mb, **(sender_kwargs or {}))

    def push(self, version: int, all_slots: bool = False) -> float:
        """Send ``version`` to the engine / the oldest pool slot (every slot with ``all_slots``).
        Collective over all trainer ranks. Returns seconds spent on this rank."""
        t0 = time.perf_counter()
        if self.sender is not None:
            self._push_remote(version, all_slots)
        else:
            self._push_local(version, all_slots)
        return time.perf_counter() - t0

    def _push_local(self, version: int, all_slots: bool) -> None:
        from megatron_agentrl.weight_sync import deliver_direct

        state = self.actor.export_hf_state_dict()
        target = self.target
        if target is None:
            return
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
            return
        self._pause(target)
        try:
            target.begin_weight_update(version, {})
            deliver_direct([target], state.items(), self.bucket_bytes)  # a failure ends the run
            target.end_weight_update()
        finally:
            target.resume()

    def _pause(self, engine: Any) -> None:
        engine.pause()
        wait_idle = getattr(engine, "wait_idle", None)
        if callable(wait_idle):
            wait_idle(self.timeout_s)

    def _push_remote(self, version: int, all_slots: bool) -> None:
        target = self.target
        n = len(self.remote_slots)
        if is_rank0():
            slots = list(range(n)) if all_slots or not isinstance(target, VersionPool) else [target.oldest_slot().index]
        else:
            slots = None
        slots = broadcast_object(slots)
        for idx in slots:
            opened, error = None, None
            if target is not None:
                try:
                    if isinstance(target, VersionPool):
                        opened = target.begin_update(version, slot=idx, timeout_s=self.timeout_s)
                    else:
                        self._pause(target)
                        target.begin_weight_update(version, {})
                        opened = target
                except Exception as e:  # noqa: BLE001 - agreed on below, then raised
                    error = e
            failed = broadcast_object(error is not None)
            if failed:
                if opened is None and target is not None and not isinstance(target, VersionPool):
                    target.resume()
                raise RuntimeError(f"weight update of slot {idx} to version {version} could not start: {error!r}")
            try:
                self.sender.sync(version, slot_key=idx, targets=self.remote_slots[idx])
            except BaseException:
                if isinstance(target, VersionPool):
                    target.abort_update(opened)
                elif target is not None:
                    getattr(target.engine if hasattr(target, "engine") else target, "abort_weight_update", lambda: None)()
                    target.resume()
                raise
            if isinstance(target, VersionPool):
                target.end_update(opened)
            elif target is not None:
                target.end_weight_update()
                target.resume()

    def close(self) -> None:
        """Close the weight-sync groups (remote engines)."""
        if self.sender is not None:
            self.sender.close()
