"""Trainer side of the weight sync: gather over TP, name in HF, bucket, broadcast to one slot.

Per sync, on every trainer rank (:meth:`WeightSender.sync`, collective):

1. each pipeline stage's tensor-parallel group all-gathers its parameters (only data-parallel
   replica 0 takes part) and converts them to Hugging Face names with the family mapping
   (:func:`stage_hf_tensors`), one parameter at a time, so memory stays at one bucket;
2. the stage's *source* rank (tp_rank 0 of DP replica 0) groups them into single-dtype buckets of
   ``bucket_mb`` (:mod:`.buckets`) and, per bucket, asks every engine of the slot to receive it
   (SGLang ``/update_weights_from_distributed`` with the bucket's names, dtypes and shapes) while
   it broadcasts the bucket on the slot's dedicated group (:class:`BucketBroadcaster`). On the
   wire a bucket is either one packed flat tensor (``load_format="flattened_bucket"``; packing of
   bucket k+1 overlaps the broadcast of bucket k, two reused buffers) or one broadcast per tensor
   straight from its memory (no copy); NCCL uses the first, gloo the second. On gloo, engines
   that offer it (the stand-in's ``send_recv`` extension) get point-to-point sends instead of
   broadcasts, all of a bucket posted at once (a gloo broadcast waits a round trip before each
   tensor; SGLang itself receives broadcasts, and gets them). With PP > 1 the
   stages send in turn (stage 0, then 1, ...), because an engine serves one update request at a
   time and two engines serving two stages' groups in different orders would deadlock;
3. all ranks agree on success (an all-reduce of a failure flag), so a failed or timed-out sync
   raises :class:`WeightSyncError` everywhere.

Engines that live in the source's own process (the local engine of the synchronous loop) get
the buckets directly through the engine protocol (``receive_bucket``), no group needed.
Pausing the slot, the version stamp and cache flushing are the version pool's part
(``rollout_sglang.version_pool.VersionPool.begin_update`` / ``end_update``).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Hashable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from megatron_agentrl.weight_sync.buckets import (
    BucketMeta,
    bucket_checksum,
    iter_buckets,
    iter_split_buckets,
    pack_into,
    tensors_checksum,
)
from megatron_agentrl.weight_sync.group import WeightGroup, WeightSyncTimeout, default_backend, host_store, init_weight_group

logger = logging.getLogger(__name__)

MB = 1024 * 1024
WIRE_FORMATS = ("flattened_bucket", "per_tensor")
TRANSPORTS = ("broadcast", "send_recv")
# per_tensor format: smaller tensors are packed together, the threshold by transport. A gloo
# broadcast costs ~0.5 ms of CPU on each side and a round trip, a packing copy (sender) plus a load
# copy (engine) ~0.27 ms per MB: packing pays below ~2 MB (Qwen2.5-0.5B: 72 collectives instead of
# 121). Point-to-point sends posted at once cost no round trip, so only tensors far smaller pay
# packing: bench/weight_sync.py, bucketed/raw bandwidth with send_recv, 2 MiB: 0.80-0.91 (4 runs),
# 1 MiB: 0.89, 0.90, 128 KiB: 0.88, 0.88, 256 KiB: 0.93, 0.97 (Qwen2.5-0.5B's k/v projections,
# 229 KB each, still packed), 32 KiB: 0.93.
SMALL_TENSOR_BYTES = {"broadcast": 2 * MB, "send_recv": MB // 4}
OUTPUT_LAYER = "output_layer.weight"


class WeightSyncError(RuntimeError):
    """A weight sync failed (an engine refused a bucket, a timeout, a checksum mismatch)."""


@runtime_checkable
class WeightUpdateTarget(Protocol):
    """An engine that receives weights over a weight-sync group (SGLang's HTTP API, or the stand-in).

    num_ranks: ranks the engine contributes to the group (an SGLang server: its TP size).
    name: for messages (e.g. the server URL).
    supports_checksum: whether :meth:`update_weights_from_distributed` can verify a checksum.
    supports_send_recv: whether it can receive a bucket as point-to-point messages
        (``send_recv_tag``) instead of broadcasts (the stand-in's extension; SGLang: no).
    """

    name: str
    num_ranks: int
    supports_checksum: bool
    supports_send_recv: bool

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str, timeout_s: float) -> None:
        """Join the group (blocks until every rank joined); raises with the engine's message on failure."""
        ...

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str, *, load_format: str | None, flush_cache: bool,
                                        weight_version: str | None, checksum: list[int] | None,
                                        timeout_s: float, send_recv_tag: int | None = None) -> None:
        """Receive one bucket from group rank 0 and load it; raises with the engine's message on failure.

        send_recv_tag: None: the bucket arrives by broadcast; else as point-to-point messages
        numbered from it (one per tensor, or one for a flattened bucket).
        """
        ...

    def destroy_weights_update_group(self, group_name: str, timeout_s: float) -> None:
        """Leave the group."""
        ...


@dataclass
class SyncStats:
    """What one sync moved: ``buckets``, ``bytes`` and ``seconds`` (wall time on this rank)."""

    version: int
    buckets: int = 0
    bytes: int = 0
    seconds: float = 0.0
    per_stage: dict[int, int] = field(default_factory=dict)

    @property
    def gb_per_s(self) -> float:
        """Throughput in GB/s (1e9 bytes)."""
        return self.bytes / max(self.seconds, 1e-9) / 1e9


def stage_hf_tensors(actor: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """This PP stage's parameters as full (TP-gathered, vocab-unpadded) Hugging Face tensors.

    Yields ``(hf_name, tensor)`` in model order, on the actor's device, in the model's dtype.
    Collective over the tensor-parallel group: every TP rank of the stage must run the iterator
    to the end. The last stage's copy of a tied embedding is skipped (stage 0 sends it).
    """
    from megatron.core import parallel_state

    tp_group = parallel_state.get_tensor_model_parallel_group()
    tied = bool(getattr(actor.hf_config, "tie_word_embeddings", False))
    for name, p in actor.named_params:
        if tied and name == OUTPUT_LAYER:
            continue
        t = p.detach().contiguous()
        if actor.tp > 1 and actor.mapping.tp_layout(name).partition_dim is not None:
            shards = [torch.empty_like(t) for _ in range(actor.tp)]
            dist.all_gather(shards, t, group=tp_group)
        else:
            shards = [t]
        full = actor.mapping.unshard(name, shards, strip_vocab=True)
        for hf_name, x in actor.mapping.to_hf(name, full).items():
            yield hf_name, x.contiguous()


def deliver_direct(engines: Sequence[Any], named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> SyncStats:
    """Hand (name, tensor) pairs to in-process engines bucket by bucket (``engine.receive_bucket``).

    The engines' update must already be open (``begin_weight_update``, done by the version pool).
    Returns the stats (version -1: the caller knows it).
    """
    stats = SyncStats(version=-1)
    t0 = time.perf_counter()
    for meta, tensors in iter_buckets(named, bucket_bytes):
        pairs = list(zip(meta.names, tensors))
        for e in engines:
            e.receive_bucket(pairs)
        stats.buckets += 1
        stats.bytes += meta.nbytes
    stats.seconds = time.perf_counter() - t0
    return stats


class BucketBroadcaster:
    """Group rank 0 of one weight-sync group: sends buckets to every target engine of a slot.

    targets: the engines (each contributes ``num_ranks`` ranks, in list order, after rank 0).
    group_name: the group's name (engines key their groups by it).
    master_address: an address of this host that every engine can reach (the TCPStore lives here).
    backend: "nccl" / "gloo" (None: NCCL when CUDA is available).
    init_timeout_s: limit on the group rendezvous; bucket_timeout_s: limit on each bucket
        (broadcast plus the engines' acknowledgement).
    checksum: send each bucket's checksum to targets that can verify it.
    wire_format: default of :meth:`send` ("flattened_bucket" | "per_tensor"; None: flattened on
        NCCL, per-tensor on gloo).
    small_tensor_bytes: with "per_tensor", tensors under this size travel packed together (None:
        :data:`SMALL_TENSOR_BYTES` of the transport).
    transport: "broadcast" (what SGLang receives) or "send_recv" (one point-to-point send per
        tensor and engine rank, all posted at once; gloo only, engines with the ``send_recv``
        extension); None: "send_recv" on gloo when every target supports it, else "broadcast".
    """

    def __init__(self, targets: Sequence[WeightUpdateTarget], group_name: str, *, master_address: str = "127.0.0.1",
                 backend: str | None = None, init_timeout_s: float = 300.0, bucket_timeout_s: float = 120.0,
                 checksum: bool = False, wire_format: str | None = None,
                 small_tensor_bytes: int | None = None, transport: str | None = None) -> None:
        if not targets:
            raise ValueError("BucketBroadcaster needs at least one target engine")
        self.targets = list(targets)
        self.group_name = group_name
        self.master_address = master_address
        self.backend = backend or default_backend()
        self.init_timeout_s = float(init_timeout_s)
        self.bucket_timeout_s = float(bucket_timeout_s)
        self.checksum = bool(checksum)
        self.wire_format = wire_format or ("flattened_bucket" if self.backend == "nccl" else "per_tensor")
        self.small_tensor_bytes = None if small_tensor_bytes is None else int(small_tensor_bytes)
        if self.wire_format not in WIRE_FORMATS:
            raise ValueError(f"wire_format={wire_format!r} is not one of {WIRE_FORMATS}")
        if transport is not None:
            self._checked_transport(transport, ask_engines=False)  # the engines are asked at connect
        self._transport = transport  # None: resolved on first use (asks the engines)
        self._tag = 0  # the next point-to-point message number on the current group
        self.world_size = 1 + sum(int(t.num_ranks) for t in self.targets)
        self.group: WeightGroup | None = None
        self._pool = ThreadPoolExecutor(max_workers=max(2, 2 * len(self.targets)), thread_name_prefix="wsync")
        self._buffers: list[torch.Tensor | None] = [None, None]
        if checksum and not all(t.supports_checksum for t in self.targets):
            names = [t.name for t in self.targets if not t.supports_checksum]
            logger.warning("checksum verify requested but engines %s cannot verify (SGLang's API has no checksum); "
                           "their buckets go unverified", names)

    @property
    def transport(self) -> str:
        """How :meth:`send` moves tensors by default: "broadcast" or "send_recv" (resolved on first use)."""
        if self._transport is None:
            able = self.backend == "gloo" and all(getattr(t, "supports_send_recv", False) for t in self.targets)
            self._transport = "send_recv" if able else "broadcast"
        return self._transport

    def _checked_transport(self, transport: str, ask_engines: bool = True) -> str:
        """``transport`` when this group's backend (and, with ``ask_engines``, its engines) can use it;
        ValueError naming the fix otherwise."""
        if transport not in TRANSPORTS:
            raise ValueError(f"transport={transport!r} is not one of {TRANSPORTS} (or None: chosen per backend)")
        if transport == "send_recv" and self.backend != "gloo":
            raise ValueError(f"transport='send_recv' is for gloo groups; backend {self.backend!r} broadcasts "
                             "(use transport=None or 'broadcast')")
        if transport == "send_recv" and ask_engines:
            lacking = [t.name for t in self.targets if not getattr(t, "supports_send_recv", False)]
            if lacking:
                raise ValueError(f"transport='send_recv' needs engines with the send_recv extension (lacking it: "
                                 f"{lacking}); SGLang servers receive broadcasts: use transport='broadcast'")
        return transport

    # ------------------------------------------------------------------ group
    def connect(self) -> None:
        """Create the group (rank 0 here, engines at their rank offsets); no-op when connected."""
        if self.group is not None and not self.group.broken:
            return
        if self.group is not None:
            self.close_group()
        self._checked_transport(self.transport)  # refuse a bad choice before any engine joins
        self._tag = 0
        store, port = host_store(self.master_address, self.world_size, self.init_timeout_s)
        futures, offset = [], 1
        for t in self.targets:
            futures.append((t, self._pool.submit(
                t.init_weights_update_group, self.master_address, port, offset, self.world_size, self.group_name,
                self.backend, self.init_timeout_s)))
            offset += int(t.num_ranks)
        try:
            self.group = init_weight_group(self.master_address, port, 0, self.world_size, self.group_name,
                                           self.backend, self.init_timeout_s, store=store)
        except Exception as e:
            errors = self._collect(futures, timeout_s=1.0)
            raise WeightSyncError(f"weight-sync group {self.group_name!r} could not be formed: {e}"
                                  + (f"; engine errors: {errors}" if errors else "")) from e
        errors = self._collect(futures, timeout_s=self.init_timeout_s)
        if errors:
            self.close_group()
            raise WeightSyncError(f"weight-sync group {self.group_name!r}: engines failed to join: {errors}")

    def close_group(self) -> None:
        """Tell the engines to leave the group (best effort) and drop ours."""
        if self.group is None:
            return
        for t in self.targets:
            try:
                t.destroy_weights_update_group(self.group_name, timeout_s=min(30.0, self.bucket_timeout_s))
            except Exception as e:  # noqa: BLE001 - best effort
                logger.warning("engine %s: destroy_weights_update_group(%s) failed: %s", t.name, self.group_name, e)
        self.group.close()
        self.group = None

    def close(self) -> None:
        """Close the group and the worker threads."""
        self.close_group()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _collect(self, futures: list[tuple[WeightUpdateTarget, Future]], timeout_s: float) -> list[str]:
        """Wait for target calls; returns one message per failed/timed-out target."""
        errors = []
        deadline = time.monotonic() + timeout_s
        for t, f in futures:
            try:
                f.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                errors.append(f"{t.name}: no answer within {timeout_s:.1f}s")
            except Exception as e:  # noqa: BLE001 - reported as a message
                errors.append(f"{t.name}: {e}")
        return errors

    # ----------------------------------------------------------------- buckets
    def _buffer(self, slot: int, nbytes: int, bucket_bytes: int) -> torch.Tensor:
        assert self.group is not None
        if nbytes > bucket_bytes:  # an oversize tensor: a one-off buffer
            return torch.empty(nbytes, dtype=torch.uint8, device=self.group.device)
        buf = self._buffers[slot]
        if buf is None or buf.numel() < bucket_bytes or buf.device != self.group.device:
            pin = self.group.device.type == "cpu" and torch.cuda.is_available()
            buf = torch.empty(bucket_bytes, dtype=torch.uint8, device=self.group.device, pin_memory=pin)
            self._buffers[slot] = buf
        return buf

    def send(self, named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, *,
             weight_version: str | None = None, wire_format: str | None = None,
             transport: str | None = None) -> SyncStats:
        """Bucket ``named`` and send every bucket to every target; returns the stats.

        wire_format: how a bucket travels (both are SGLang formats of ``/update_weights_from_distributed``):
            "flattened_bucket": packed into one flat tensor, one broadcast (``load_format=
            "flattened_bucket"``); "per_tensor": one broadcast per tensor straight from the
            tensor's memory, no packing (SGLang's default load format), except that tensors
            under ``small_tensor_bytes`` (norms, biases) travel in packed buckets of their own,
            so they do not cost one message each. With transport "send_recv" each broadcast
            is a point-to-point send per engine rank instead. None: this
            broadcaster's ``wire_format`` (flattened on NCCL, where packing in GPU memory is
            cheap and one launch per bucket pays; per-tensor on gloo, where a CPU copy costs as
            much as the transfer).
        transport: "broadcast" | "send_recv" for this call (None: :attr:`transport`).
        weight_version: sent with the last bucket (SGLang stamps it on the server).
        Raises WeightSyncError naming the engine and the bucket on any failure or timeout; the
        group is closed then (the next send builds a new one).
        """
        fmt = wire_format or self.wire_format
        if fmt not in WIRE_FORMATS:
            raise ValueError(f"wire_format={fmt!r} is not one of {WIRE_FORMATS}")
        transport = self._checked_transport(transport or self.transport)
        p2p = transport == "send_recv"
        small = SMALL_TENSOR_BYTES[transport] if self.small_tensor_bytes is None else self.small_tensor_bytes
        self.connect()
        assert self.group is not None
        stats = SyncStats(version=int(weight_version) if weight_version and weight_version.isdigit() else -1)
        t0 = time.perf_counter()
        # (works, acks, meta, works of the first tensor), oldest first, at most 2
        inflight: list[tuple[list, list, BucketMeta, int]] = []
        done: list[tuple[list, BucketMeta]] = []
        try:
            if fmt == "flattened_bucket":
                it = ((m, ts, True) for m, ts in iter_buckets(named, bucket_bytes))
            else:
                it = iter_split_buckets(named, bucket_bytes, min(small, bucket_bytes))
            nxt = next(it, None)
            slot = 0
            while nxt is not None:
                meta, tensors, packed = nxt
                nxt = next(it, None)
                while len(inflight) >= 2:  # the bucket two back must be done (its buffer is reused next)
                    self._finish(inflight[0])
                    done.append((inflight[0][1], inflight[0][2]))
                    inflight.pop(0)
                if packed:
                    buf = self._buffer(slot, meta.nbytes, bucket_bytes)
                    payload = [pack_into(buf, meta, tensors)]  # overlaps the broadcast in flight
                    slot ^= 1
                else:
                    payload = [t if t.is_contiguous() else t.contiguous() for t in tensors]
                    if payload and payload[0].device != self.group.device:
                        payload = [t.to(self.group.device) for t in payload]
                # a CUDA source copied (non_blocking) into a CPU bucket, or a CUDA payload: the
                # copies must be done before the checksum and the broadcast read the bytes
                src_cuda = payload[0].is_cuda or any(t.is_cuda for t in tensors)
                del tensors
                if src_cuda:
                    torch.cuda.current_stream().synchronize()
                if self.checksum:
                    meta.checksum = bucket_checksum(payload[0]) if packed else tensors_checksum(payload)
                if inflight:
                    # the engines must be inside the previous bucket's request before this one is
                    # posted (they serve update requests in arrival order): its first broadcast done
                    self._finish(inflight[-1], first_only=True)
                self._check_acks(done, wait=False)
                wire = meta.wire()
                tag = self._tag if p2p else None
                self._tag += len(payload) if p2p else 0
                futures = [(t, self._pool.submit(
                    t.update_weights_from_distributed, wire["names"], wire["dtypes"], wire["shapes"], self.group_name,
                    load_format="flattened_bucket" if packed else None, flush_cache=False,
                    weight_version=weight_version if nxt is None else None,
                    checksum=meta.checksum if self.checksum and t.supports_checksum else None,
                    timeout_s=self.bucket_timeout_s, send_recv_tag=tag))
                    for t in self.targets]
                inflight.append((self._post(payload, tag), futures, meta, self.world_size - 1 if p2p else 1))
                stats.buckets += 1
                stats.bytes += meta.nbytes
            for pending in inflight:
                self._finish(pending)
                done.append((pending[1], pending[2]))
            self._check_acks(done, wait=True)
        except Exception:
            self.close_group()
            raise
        stats.seconds = time.perf_counter() - t0
        return stats

    def _post(self, payload: list[torch.Tensor], tag: int | None) -> list:
        """Start moving a bucket's tensors to every engine rank; returns the works, the first tensor's first.

        tag None: one broadcast per tensor; else tensor ``i`` goes as message ``tag + i`` to each rank.
        """
        assert self.group is not None
        if tag is None:
            return [self.group.broadcast_async(x, src=0) for x in payload]
        return [self.group.send_async(x, r, tag + i) for i, x in enumerate(payload) for r in range(1, self.world_size)]

    def _finish(self, pending: tuple[list, list, BucketMeta, int], first_only: bool = False) -> None:
        """Wait for a bucket's transfers (``first_only``: the first tensor's); WeightSyncError on timeout."""
        works, futures, meta, first = pending
        assert self.group is not None
        deadline = time.monotonic() + self.bucket_timeout_s
        todo = works[:first] if first_only else works[::-1]  # the last first: one wake-up per bucket
        del works[:len(todo)]  # a point-to-point work can be waited for only once
        try:
            for work in todo:
                self.group.wait(work, max(0.001, deadline - time.monotonic()),
                                what=f"bucket {meta.index} ({meta.nbytes / MB:.1f} MB)")
        except WeightSyncTimeout as e:
            errors = self._collect(futures, timeout_s=1.0)
            raise WeightSyncError(f"{e}" + (f"; engine errors: {errors}" if errors else "")) from e

    def _check_acks(self, done: list[tuple[list, BucketMeta]], wait: bool) -> None:
        """Raise for any engine that refused a bucket; with ``wait``, wait for every acknowledgement."""
        remaining = []
        for futures, meta in done:
            if not wait and not all(f.done() for _, f in futures):
                remaining.append((futures, meta))
                continue
            errors = self._collect(futures, timeout_s=self.bucket_timeout_s)
            if errors:
                raise WeightSyncError(f"bucket {meta.index} ({len(meta.names)} tensors, first {meta.names[0]!r}) "
                                      f"was not loaded: {errors}")
        done[:] = remaining


class WeightSender:
    """The weight sync of one :class:`~megatron_agentrl.megatron.actor.MegatronActor`, on every trainer rank.

    bucket_mb: bucket size in MiB (``rollout.weight_sync_bucket_mb``; fractions allowed).
    init_timeout_s / bucket_timeout_s: group rendezvous and per-bucket limits, seconds.
    checksum: verify every bucket on engines that support it.
    master_address: an address of the source ranks' host that the engines can reach.
    backend: "nccl" / "gloo" (None: NCCL when CUDA is available).
    wire_format: "flattened_bucket" | "per_tensor" (None: by backend, see :meth:`BucketBroadcaster.send`).
    small_tensor_bytes: with "per_tensor", tensors under this size travel packed together (None: by transport).
    transport: "broadcast" | "send_recv" (None: by backend and engines, see :class:`BucketBroadcaster`).
    """

    def __init__(self, actor: Any, *, bucket_mb: float = 512, init_timeout_s: float = 300.0,
                 bucket_timeout_s: float = 120.0, checksum: bool = False, master_address: str = "127.0.0.1",
                 backend: str | None = None, wire_format: str | None = None,
                 small_tensor_bytes: int | None = None, transport: str | None = None) -> None:
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb={bucket_mb} must be > 0")
        self.actor = actor
        self.bucket_bytes = max(1, int(bucket_mb * MB))
        self.init_timeout_s = float(init_timeout_s)
        self.bucket_timeout_s = float(bucket_timeout_s)
        self.checksum = bool(checksum)
        self.master_address = master_address
        self.backend = backend
        self.wire_format = wire_format
        self.small_tensor_bytes = small_tensor_bytes
        self.transport = transport
        self.is_source = actor.dp_rank == 0 and actor.tp_rank == 0
        self._broadcasters: dict[Hashable, BucketBroadcaster] = {}

    def _broadcaster(self, slot_key: Hashable, targets: Sequence[WeightUpdateTarget]) -> BucketBroadcaster:
        key = (slot_key, self.actor.pp_rank)
        b = self._broadcasters.get(key)
        if b is None or [t.name for t in b.targets] != [t.name for t in targets]:
            if b is not None:
                b.close()
            b = BucketBroadcaster(targets, f"agentrl-slot{slot_key}-pp{self.actor.pp_rank}",
                                  master_address=self.master_address, backend=self.backend,
                                  init_timeout_s=self.init_timeout_s, bucket_timeout_s=self.bucket_timeout_s,
                                  checksum=self.checksum, wire_format=self.wire_format,
                                  small_tensor_bytes=self.small_tensor_bytes, transport=self.transport)
            self._broadcasters[key] = b
        return b

    def sync(self, version: int, slot_key: Hashable = 0, targets: Sequence[WeightUpdateTarget] | None = None,
             direct_engines: Sequence[Any] | None = None) -> SyncStats:
        """Send the actor's current weights as ``version`` to one slot's engines. Collective (all trainer ranks).

        targets: on each stage's source rank, the slot's engines reached over a weight-sync
            group (SGLang engine clients); ignored elsewhere.
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
                if self.actor.pp_rank == turn and self.actor.dp_rank == 0:
                    failure = self._send_stage(version, slot_key, targets, direct_engines if direct and rank0 else None,
                                               stats) or failure
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
                    direct_engines: Sequence[Any] | None, stats: SyncStats) -> BaseException | None:
        """This stage's part (every TP rank of DP replica 0 runs it): gather, and on the source send.
        Fills ``stats``; returns the failure instead of raising, so the ranks can agree on it."""
        named = stage_hf_tensors(self.actor)  # collective over the stage's TP group
        failure: BaseException | None = None
        try:
            if self.is_source and targets:
                s = self._broadcaster(slot_key, targets).send(named, self.bucket_bytes, weight_version=str(version))
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
