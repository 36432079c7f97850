"""Trainer side of the weight sync: gather over TP, name in HF, bucket, send to one slot.

Per sync, on every trainer rank (:meth:`WeightSender.sync`, collective):

1. each pipeline stage's tensor-parallel group all-gathers its parameters (only data-parallel
   replica 0 takes part; with expert parallelism every rank, each expert all-gathered over the
   expert-parallel group) and converts them to Hugging Face names with the family mapping
   (:func:`~megatron_agentrl.weight_sync.gather.stage_hf_tensors`), one parameter at a time, so
   memory stays at one bucket;
2. the stage's *source* rank (tp_rank 0 of DP replica 0) groups them into single-dtype buckets of
   ``weight_sync_bucket_mb`` and sends them to every engine of the slot on the slot's dedicated group
   (:class:`~rollout_sglang.weight_update.broadcaster.BucketBroadcaster`, through the sender's
   transport: SGLang's broadcasts unless another is given). With PP > 1 the stages send in turn
   (stage 0, then 1, ...), because an engine serves one update request at a time and two engines
   serving two stages' groups in different orders would deadlock;
3. all ranks agree on success (an all-reduce of a failure flag), so a failed or timed-out sync
   raises :class:`WeightSyncError` everywhere.

Engines that live in the source's own process (the local engine of the synchronous loop) get
the buckets directly through the engine protocol (``receive_bucket``), no group needed.
Pausing the slot, telling each engine the version (once, as its update opens), the version stamp
and cache flushing are the version pool's part (``rollout_sglang.engines.version_pool.VersionPool.begin_update``
/ ``end_update``): the sender sends buckets, no version.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Hashable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_agentrl.weight_sync.gather import stage_hf_tensors
from megatron_agentrl.weight_sync.options import SenderOptions
from rollout_sglang.weight_update import (
    MB,
    BucketBroadcaster,
    BucketTransport,
    SGLangBroadcast,
    SyncStats,
    WeightSyncError,
    WeightUpdateTarget,
    deliver_direct,
)

logger = logging.getLogger(__name__)


class WeightSender:
    """The weight sync of one :class:`~megatron_agentrl.megatron.actor.MegatronActor`, on every trainer rank.

    options: bucket size, checksum, and the broadcast's group, limits and wire (:class:`SenderOptions`; None:
        its defaults).
    transport: how buckets travel (None: :class:`~rollout_sglang.weight_update.SGLangBroadcast`).
    """

    def __init__(self, actor: Any, options: SenderOptions | None = None, *,
                 transport: BucketTransport | None = None) -> None:
        self.actor = actor
        self.options = options if options is not None else SenderOptions()
        self.bucket_bytes = max(1, int(self.options.weight_sync_bucket_mb * MB))
        self.transport: BucketTransport = transport if transport is not None else SGLangBroadcast()
        if self.options.checksum:
            with_checksum = getattr(self.transport, "with_checksum", None)
            if callable(with_checksum):
                self.transport = with_checksum()
            else:
                logger.warning("checksum verify requested but transport %r cannot have buckets verified (SGLang's "
                               "API has no checksum); buckets go unverified", self.transport)
        # one sender per stage: TP rank 0 of the first DP replica's first CP rank (CP ranks hold the same weights);
        # with expert parallelism every rank of the stage gathers, as the experts are spread over DP ranks
        replica0 = actor.dp_rank == 0 and actor.cp_rank == 0
        self._gathers = replica0 or actor.ep > 1
        self.is_source = replica0 and actor.tp_rank == 0
        self._broadcasters: dict[Hashable, BucketBroadcaster] = {}
        self._tags: dict[Hashable, Hashable] = {}

    def _broadcaster(self, slot_key: Hashable, targets: Sequence[WeightUpdateTarget],
                     group_tag: Hashable = None) -> BucketBroadcaster:
        key = (slot_key, self.actor.pp_rank)
        b = self._broadcasters.get(key)
        if b is None or [t.name for t in b.targets] != [t.name for t in targets] or self._tags.get(key) != group_tag:
            if b is not None:
                b.close()
            b = BucketBroadcaster(targets, f"agentrl-slot{slot_key}-pp{self.actor.pp_rank}", self.options,
                                  transport=self.transport)
            self._broadcasters[key] = b
            self._tags[key] = group_tag
        return b

    def sync(self, version: int, slot_key: Hashable = 0, targets: Sequence[WeightUpdateTarget] | None = None,
             direct_engines: Sequence[Any] | None = None, group_tag: Hashable = None) -> SyncStats:
        """Send the actor's current weights to one slot's engines. Collective (all trainer ranks).

        version: the version the slot's update was opened for (its engines were told it then); for the
            stats and the messages.

        targets: on each stage's source rank, the slot's engines reached over a weight-sync
            group (SGLang engine clients); ignored elsewhere.
        group_tag: identifies the engines' current lives (the version pool's ``group_tag``): when it
            differs from the last sync's of this slot, a fresh group is formed (a restarted server has
            none, and one that missed a sync may have left it).
        direct_engines: on global rank 0 only (None elsewhere), the slot's in-process engines (local
            engines with an open weight update); with PP > 1 every rank joins the full-model gather
            (the ranks agree on the path first, so all run matching collectives).
        Returns this rank's stats; raises WeightSyncError on every rank when any rank failed.
        """
        t0 = time.perf_counter()
        stats = SyncStats(version=version)
        failure: BaseException | None = None
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        multi = dist.is_initialized() and dist.get_world_size() > 1
        direct = bool(direct_engines)
        if multi:  # every rank must take the same (collective) path: agree on whether any rank has them
            flag = torch.tensor([1.0 if direct else 0.0], device=self.actor.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            any_direct = float(flag) > 0
        else:
            any_direct = direct
        if direct and not rank0:
            failure = ValueError(f"direct_engines were given on global rank {dist.get_rank()}; give the in-process "
                                 "engines on global rank 0 only (other ranks pass None)")
        if any_direct and self.actor.pp > 1:
            state = self.actor.export_hf_state_dict()  # collective on every rank (TP then PP gather)
            if direct and rank0:
                try:
                    stats = deliver_direct(direct_engines, state.items(), self.bucket_bytes)
                    stats.version = version
                except Exception as e:  # noqa: BLE001 - agreed on below
                    failure = e
            del state
        else:
            # PP > 1: the stages take turns (an all-reduce between turns), so each engine of the
            # slot serves one stage's group at a time; engines handle update requests one by one,
            # and two engines taking two stages' buckets in different orders would deadlock
            for turn in range(self.actor.pp):
                if self.actor.pp_rank == turn and self._gathers:
                    failure = self._send_stage(version, slot_key, targets, direct_engines if direct and rank0 else None,
                                               stats, group_tag) or failure
                if self.actor.pp > 1:
                    dist.all_reduce(torch.zeros(1, device=self.actor.device))
        stats.per_stage[self.actor.pp_rank] = stats.bytes
        if failure is not None:
            logger.error("weight sync of version %d failed on rank %s: %s", version,
                         dist.get_rank() if dist.is_initialized() else 0, failure)
        if multi:
            flag = torch.tensor([1.0 if failure is not None else 0.0], device=self.actor.device)
            dist.all_reduce(flag)
            any_failed = float(flag) > 0
        else:
            any_failed = failure is not None
        if any_failed:
            raise WeightSyncError(f"weight sync of version {version} failed"
                                  + (f": {failure}" if failure is not None else " on another rank")) from failure
        stats.seconds = time.perf_counter() - t0
        return stats

    def _send_stage(self, version: int, slot_key: Hashable, targets: Sequence[WeightUpdateTarget] | None,
                    direct_engines: Sequence[Any] | None, stats: SyncStats,
                    group_tag: Hashable = None) -> BaseException | None:
        """This stage's part (every TP rank of DP replica 0, CP rank 0 runs it; every rank with EP): gather, and on
        the source send.
        Fills ``stats``; returns the failure instead of raising, so the ranks can agree on it."""
        named = stage_hf_tensors(self.actor)  # collective over the stage's TP group
        failure: BaseException | None = None
        try:
            if self.is_source and targets:
                s = self._broadcaster(slot_key, targets, group_tag).send(named, self.bucket_bytes)
                stats.buckets, stats.bytes = s.buckets, s.bytes
            elif self.is_source and direct_engines:
                s = deliver_direct(direct_engines, named, self.bucket_bytes)
                stats.buckets, stats.bytes = s.buckets, s.bytes
        except Exception as e:  # noqa: BLE001 - agreed on by the caller
            failure = e
        for _ in named:  # keep taking part in the TP gathers after a failure (or as a non-source rank)
            pass
        return failure

    def close(self) -> None:
        """Close every group this rank opened."""
        for b in self._broadcasters.values():
            b.close()
        self._broadcasters.clear()
