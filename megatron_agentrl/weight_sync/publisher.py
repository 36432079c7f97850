"""The weight push after each step: the actor's weights into one slot of the rollout's version pool.

:class:`WeightPublisher` exports the actor's weights (collective over all trainer ranks) and loads
them into the pool's oldest slot (every slot with ``all_slots``): the pool drains the slot, pauses
it and opens its update (``begin_update``), the weights arrive bucket by bucket, and
``end_update`` resumes the slot under the new version. A delivery that fails marks the slot failed
(``abort_update``: never sampled until a later sync succeeds) and the error ends the run. With one
slot (``rollout.max_versions=1``) generation waits between turns while the update runs, then the
trajectories in flight continue on the new weights.

Engines in this process (local PyTorch engines) get the tensors handed over directly
(``deliver_direct``); engines in other processes (SGLang servers, ``rollout.engine_urls``) get them
over a weight-sync group (``WeightSender``: NCCL on GPUs, gloo on CPU) that every trainer rank joins.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from megatron_agentrl.distributed import broadcast_object
from megatron_agentrl.weight_sync.sender import WeightSender
from rollout_sglang.engines.version_pool import Slot, VersionPool
from rollout_sglang.weight_update import deliver_direct


class WeightPublisher:
    """Pushes the actor's weights into the rollout's version pool (see the module doc).

    actor: the :class:`~megatron_agentrl.megatron.actor.MegatronActor` (every rank calls :meth:`push`: it is
        collective); typed loosely, as the actor's own export imports this package's gather.
    pool: on rank 0 the rollout's VersionPool; None elsewhere.
    bucket_mb: bucket size of the hand-over, MiB. timeout_s: limit on draining a slot (its running
        generate calls) before the update.
    remote_slots: for engines in other processes (SGLang servers), on EVERY rank, the weight-update
        targets (``SGLangEngine`` clients) of each version slot; the weights then go over a weight-sync
        group instead of in-process. ``sender_kwargs``: WeightSender options.
    """

    def __init__(self, actor: Any, pool: VersionPool | None, bucket_mb: float = 512,
                 timeout_s: float = 600.0, remote_slots: list[list[Any]] | None = None,
                 sender_kwargs: dict[str, Any] | None = None) -> None:
        self.actor = actor
        self.pool = pool
        self.bucket_bytes = max(1, int(bucket_mb * 1024 * 1024))
        self.timeout_s = float(timeout_s)
        self.remote_slots = remote_slots
        self.sender = None
        if remote_slots is not None:
            self.sender = WeightSender(actor, bucket_mb=bucket_mb, **(sender_kwargs or {}))

    def push(self, version: int, all_slots: bool = False) -> float:
        """Send ``version`` to the oldest pool slot (every slot with ``all_slots``). Collective over all
        trainer ranks. Returns seconds spent on this rank."""
        t0 = time.perf_counter()
        if self.sender is None:
            state = self.actor.export_hf_state_dict()  # collective; only rank 0 holds engines
            for idx in self._slots(all_slots):
                self._update(idx, version, lambda slot: deliver_direct(slot.engines, state.items(), self.bucket_bytes))
        else:
            for idx in broadcast_object(self._slots(all_slots)):
                self._update_remote(idx, version)
        return time.perf_counter() - t0

    def _slots(self, all_slots: bool) -> list[int]:
        """The slots to update: known on rank 0 (the pool's), [] elsewhere."""
        if self.pool is None:
            return []
        return list(range(len(self.pool.slots))) if all_slots else [self.pool.oldest_slot().index]

    def _update(self, idx: int, version: int, deliver: Callable[[Slot], Any]) -> None:
        """Rank 0: open slot ``idx``'s update, ``deliver(slot)``, close it (marked failed when delivery fails)."""
        slot = self.pool.begin_update(version, slot=idx, timeout_s=self.timeout_s)
        try:
            deliver(slot)
        except BaseException:
            self.pool.abort_update(slot)
            raise
        self.pool.end_update(slot)

    def _update_remote(self, idx: int, version: int) -> None:
        """Every rank: rank 0 opens slot ``idx``'s update, all ranks send over its group, rank 0 closes it."""
        slot, error = None, None
        if self.pool is not None:
            try:
                slot = self.pool.begin_update(version, slot=idx, timeout_s=self.timeout_s)
            except Exception as e:  # noqa: BLE001 - every rank learns of it below, then raises
                error = repr(e)
        error = broadcast_object(error)
        if error is not None:
            raise RuntimeError(f"weight update of slot {idx} to version {version} could not start: {error}")
        try:
            self.sender.sync(version, slot_key=idx, targets=self.remote_slots[idx])
        except BaseException:
            if slot is not None:
                self.pool.abort_update(slot)
            raise
        if slot is not None:
            self.pool.end_update(slot)

    def close(self) -> None:
        """Close the weight-sync groups (remote engines)."""
        if self.sender is not None:
            self.sender.close()
