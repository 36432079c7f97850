"""The weight push after each step: the actor's weights into one slot of the rollout's version pool.

:class:`WeightPublisher` exports the actor's weights (collective over all trainer ranks) and loads
them into the pool's oldest slot (every slot with ``all_slots``): the pool drains the slot, pauses
it and opens its update (``begin_update``), the weights arrive bucket by bucket, and
``end_update`` resumes the slot under the new version. With one slot (``rollout.max_versions=1``)
generation waits between turns while the update runs, then the trajectories in flight continue on the
new weights.

Servers come and go (the pool's health checks): a sync reaches the slot's engines in rotation, and a
slot with a server back from a restart goes first, in a fresh weight-sync group. A sync that fails
because a server died (``WeightSyncError`` on every rank) marks the slot failed (``abort_update``:
never sampled until a sync succeeds) and is sent again at once, in a fresh group, to the slot's engines
that can still be reached; ``max_failures`` failures in a row end the run. With no server reachable at
all the push is skipped (the rollout waits for one, up to the pool's unavailable timeout). In-process
engines cannot fail apart from the trainer: an error there ends the run.

Engines in this process (local PyTorch engines) get the tensors handed over directly
(``deliver_direct``); engines in other processes (SGLang servers, ``rollout.engine_urls``) get them
over a weight-sync group (``WeightSender``: NCCL on GPUs, gloo on CPU) that every trainer rank joins.

A LoRA run, once its adapters started, publishes versions as adapters (docs/rollout.md, "Versions as adapters"):
a push exports the adapters alone (megabytes) and the pool loads them beside the live ones without pausing an
engine. The base goes over the full-weight path only when it changes (the push with ``all_slots``, right after
the adapters start or a resume) or when an engine back from a restart waits for it; the adapters it held are then
loaded again by the pool. SGLang servers read an adapter from a directory (``adapter_dir``, which they must be able
to read: a shared filesystem on a cluster); the last few versions' directories are kept there.
"""
from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megatron_agentrl.distributed import broadcast_object
from megatron_agentrl.weight_sync.options import SenderOptions
from megatron_agentrl.weight_sync.sender import WeightSender
from rollout_sglang.engines.adapter import Adapter
from rollout_sglang.engines.protocol import EnginesUnavailable
from rollout_sglang.engines.version_pool import Slot, VersionPool
from rollout_sglang.weight_update import WeightSyncError, deliver_direct

logger = logging.getLogger(__name__)


class WeightPublisher:
    """Pushes the actor's weights into the rollout's version pool (see the module doc).

    actor: the :class:`~megatron_agentrl.megatron.actor.MegatronActor` (every rank calls :meth:`push`: it is
        collective); typed loosely, as the actor's own export imports this package's gather.
    pool: on rank 0 the rollout's VersionPool; None elsewhere.
    sync: the weight sync's settings (:class:`~megatron_agentrl.weight_sync.options.SenderOptions`; None: its
        defaults): the bucket size of the hand-over, and for remote slots the :class:`WeightSender`'s.
    timeout_s: limit on draining a slot (its running generate calls) before the update.
    remote_slots: for engines in other processes (SGLang servers), on EVERY rank, the weight-update
        targets (``SGLangEngine`` clients) of each version slot; the weights then go over a weight-sync
        group instead of in-process.
    max_failures: failed syncs to remote engines in a row before the error ends the run.
    adapter_dir: a LoRA run with SGLang servers: where each version's adapter is written for the servers to read
        (None: ``adapters`` under the working directory).
    Counters: ``failed_syncs`` and ``skipped_syncs`` (no engine reachable), over the run; ``last_bytes``, the
    payload bytes of the last push.
    """

    def __init__(self, actor: Any, pool: VersionPool | None, sync: SenderOptions | None = None,
                 timeout_s: float = 600.0, remote_slots: list[list[Any]] | None = None, max_failures: int = 3,
                 adapter_dir: str | Path | None = None) -> None:
        sync = sync if sync is not None else SenderOptions()
        self.actor = actor
        self.pool = pool
        self.bucket_bytes = max(1, int(sync.weight_sync_bucket_mb * 1024 * 1024))
        self.timeout_s = float(timeout_s)
        self.remote_slots = remote_slots
        self.sender = None
        self.max_failures = int(max_failures)
        self.failed_syncs = self.skipped_syncs = 0
        self.last_bytes = 0
        self._failures_in_a_row = 0
        self.adapter_dir = Path(adapter_dir) if adapter_dir is not None else Path("adapters")
        if remote_slots is not None:
            self.sender = WeightSender(actor, sync)

    def push(self, version: int, all_slots: bool = False) -> float:
        """Send ``version`` to the oldest pool slot (every slot with ``all_slots``). Collective over all
        trainer ranks. Returns seconds spent on this rank."""
        t0 = time.perf_counter()
        if getattr(self.actor, "lora", None) is not None:
            self._push_adapter(version, all_slots)
        else:
            self._push_full(version, all_slots)
        return time.perf_counter() - t0

    def _push_full(self, version: int, all_slots: bool, restore: bool = False) -> None:
        """The full weights of ``version`` to the slots due (``restore``: to the engines of a slot back from a
        restart alone, its version again; :meth:`VersionPool.begin_update`)."""
        if self.sender is None:
            state = self.actor.export_hf_state_dict()  # collective; only rank 0 holds engines
            self.last_bytes = sum(t.numel() * t.element_size() for t in state.values())
            for idx in self._slots(all_slots):
                self._update(idx, version, lambda slot: deliver_direct(
                    [self.pool.engines[e] for e in slot.targets], state.items(), self.bucket_bytes), restore)
        else:
            for idx in broadcast_object(self._slots(all_slots)):
                self._update_remote(idx, version, restore)

    def _push_adapter(self, version: int, all_slots: bool) -> None:
        """Versions as adapters: the base first when it changes or an engine waits for it, then the adapters of
        ``version`` (collective)."""
        from megatron_agentrl.lora.peft_format import adapter_config, export_adapters

        base, restore = None, False
        if self.pool is not None:
            if all_slots:
                base = version
            elif self.pool.waiting_for_weights():  # engines back from a restart: the base to them alone
                base, restore = self.pool.slots[0].version, True
        base, restore = broadcast_object((base, restore))
        if base is not None:
            with self.actor.base_weights():
                self._push_full(base, all_slots=True, restore=restore)
        tensors = export_adapters(self.actor)  # collective
        if base is None:
            self.last_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        if self.pool is None:
            return
        adapter = Adapter(version, adapter_config(self.actor.lora, tensors, None), tensors)
        if self.remote_slots is not None:
            adapter.save(self.adapter_dir / adapter.name)
        try:
            self.pool.publish_adapter(adapter, timeout_s=self.timeout_s)
        except EnginesUnavailable as e:
            self.skipped_syncs += 1
            logger.error("version %d's adapter reached no engine: %s; the rollout waits for an engine to return",
                         version, e)
        if self.remote_slots is not None:
            self._prune_adapter_dirs()

    def _prune_adapter_dirs(self) -> None:
        """Remove the directories of adapters no longer loaded (the pool's versions keep theirs)."""
        assert self.pool is not None and self.pool.adapters is not None
        keep = {v.name for v in self.pool.adapters.versions if v.name is not None}
        for d in self.adapter_dir.glob("v*"):
            if d.is_dir() and d.name not in keep:
                shutil.rmtree(d, ignore_errors=True)

    def _slots(self, all_slots: bool) -> list[int]:
        """The slots to update: known on rank 0 (the pool's), [] elsewhere (and when no engine can be reached)."""
        if self.pool is None:
            return []
        if all_slots:
            return list(range(len(self.pool.slots)))
        try:
            return [self.pool.oldest_slot().index]
        except EnginesUnavailable as e:
            self.skipped_syncs += 1
            logger.error("weight sync skipped: %s; the rollout waits for an engine to return", e)
            return []

    def _update(self, idx: int, version: int, deliver: Callable[[Slot], Any], restore: bool = False) -> None:
        """Rank 0: open slot ``idx``'s update, ``deliver(slot)``, close it (marked failed when delivery fails)."""
        slot = self.pool.begin_update(version, slot=idx, timeout_s=self.timeout_s, restore=restore)
        try:
            deliver(slot)
        except BaseException:
            self.pool.abort_update(slot)
            raise
        self.pool.end_update(slot)

    def _update_remote(self, idx: int, version: int, restore: bool = False) -> None:
        """Every rank: update slot ``idx`` (:meth:`_try_update_remote`); a send that failed is tried again at once
        with the engines still reachable (a dead one fails its pause and is left out), until it succeeds, no
        engine is left (skipped), or ``max_failures`` failures in a row end the run. Waiting for the next step's
        push instead would leave the failed slot out of rotation, and with one slot nothing could generate the
        batch of that step."""
        while not self._try_update_remote(idx, version, restore):
            pass

    def _try_update_remote(self, idx: int, version: int, restore: bool = False) -> bool:
        """Every rank: rank 0 opens slot ``idx``'s update for the engines it can reach, all ranks send over
        their group (a fresh one when those engines changed), rank 0 closes it. False when the send failed (the
        slot is marked failed); raises after ``max_failures`` failures in a row. A slot without a reachable
        engine is skipped (True)."""
        slot, plan = None, None
        if self.pool is not None:
            try:
                slot = self.pool.begin_update(version, slot=idx, timeout_s=self.timeout_s, restore=restore)
                positions = [slot.engine_ids.index(e) for e in slot.targets]
                plan = ("go", positions, self.pool.group_tag(slot))
            except EnginesUnavailable as e:
                plan = ("skip", str(e), None)
            except Exception as e:  # noqa: BLE001 - every rank learns of it below, then raises
                plan = ("error", repr(e), None)
        what, detail, tag = broadcast_object(plan)
        if what == "skip":
            self.skipped_syncs += 1
            logger.error("weight sync of slot %d to version %d skipped: %s", idx, version, detail)
            return True
        if what == "error":
            raise RuntimeError(f"weight update of slot {idx} to version {version} could not start: {detail}")
        targets = [self.remote_slots[idx][p] for p in detail]
        try:
            self.sender.sync(version, slot_key=idx, targets=targets, group_tag=tag)
        except WeightSyncError as e:
            if slot is not None:
                self.pool.abort_update(slot)
            self.failed_syncs += 1
            self._failures_in_a_row += 1
            if self._failures_in_a_row >= self.max_failures:
                raise WeightSyncError(f"{self._failures_in_a_row} weight syncs failed in a row "
                                      f"(rollout.weight_sync_max_failures={self.max_failures}); last: {e}") from e
            logger.error("weight sync of slot %d to version %d failed (%d in a row; the run stops at "
                         "rollout.weight_sync_max_failures=%d): %s; sending again to the engines still reachable",
                         idx, version, self._failures_in_a_row, self.max_failures, e)
            return False
        except BaseException:
            if slot is not None:
                self.pool.abort_update(slot)
            raise
        self._failures_in_a_row = 0
        if slot is not None:
            self.pool.end_update(slot)
        return True

    def close(self) -> None:
        """Close the weight-sync groups (remote engines)."""
        if self.sender is not None:
            self.sender.close()
