"""Group rank 0 of one weight-sync group: buckets of (name, tensor) pairs to every engine of a slot.

Per bucket, :meth:`BucketBroadcaster.send` asks every engine of the slot to receive it (SGLang
``/update_weights_from_distributed`` with the bucket's names, dtypes and shapes) while it moves
the bucket on the slot's dedicated group through its transport
(:class:`rollout_sglang.weight_update.BucketTransport`; default SGLang's broadcasts). On the wire a
bucket is either one packed flat tensor (``load_format="flattened_bucket"``; packing of bucket k+1
overlaps the transfer of bucket k, two reused buffers) or one tensor per parameter straight from
its memory (no copy); NCCL uses the first, gloo the second.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from megatron_agentrl.weight_sync.outcome import SyncStats, WeightSyncError
from rollout_sglang.weight_update.buckets import BucketMeta, iter_buckets, iter_split_buckets, pack_into
from rollout_sglang.weight_update.group import (
    WeightGroup,
    WeightSyncTimeout,
    default_backend,
    host_store,
    init_weight_group,
)
from rollout_sglang.weight_update.transport import BucketTransport, SGLangBroadcast, WeightUpdateTarget

logger = logging.getLogger(__name__)

MB = 1024 * 1024
WIRE_FORMATS = ("flattened_bucket", "per_tensor")


class BucketBroadcaster:
    """Group rank 0 of one weight-sync group: sends buckets to every target engine of a slot.

    targets: the engines (each contributes ``num_ranks`` ranks, in list order, after rank 0).
    group_name: the group's name (engines key their groups by it).
    master_address: an address of this host that every engine can reach (the TCPStore lives here).
    backend: "nccl" / "gloo" (None: NCCL when CUDA is available).
    init_timeout_s: limit on the group rendezvous; bucket_timeout_s: limit on each bucket
        (transfer plus the engines' acknowledgement).
    wire_format: default of :meth:`send` ("flattened_bucket" | "per_tensor"; None: flattened on
        NCCL, per-tensor on gloo).
    small_tensor_bytes: with "per_tensor", tensors under this size travel packed together (None:
        the transport's ``small_tensor_bytes``).
    transport: how buckets travel and what the engines are told (None: :class:`SGLangBroadcast`,
        what SGLang servers receive). Checked against the backend here, against the engines at
        :meth:`connect`.
    """

    def __init__(self, targets: Sequence[WeightUpdateTarget], group_name: str, *, master_address: str = "127.0.0.1",
                 backend: str | None = None, init_timeout_s: float = 300.0, bucket_timeout_s: float = 120.0,
                 wire_format: str | None = None, small_tensor_bytes: int | None = None,
                 transport: BucketTransport | None = None) -> None:
        if not targets:
            raise ValueError("BucketBroadcaster needs at least one target engine")
        self.targets = list(targets)
        self.group_name = group_name
        self.master_address = master_address
        self.backend = backend or default_backend()
        self.init_timeout_s = float(init_timeout_s)
        self.bucket_timeout_s = float(bucket_timeout_s)
        self.wire_format = wire_format or ("flattened_bucket" if self.backend == "nccl" else "per_tensor")
        self.small_tensor_bytes = None if small_tensor_bytes is None else int(small_tensor_bytes)
        if self.wire_format not in WIRE_FORMATS:
            raise ValueError(f"wire_format={wire_format!r} is not one of {WIRE_FORMATS}")
        self.transport: BucketTransport = transport if transport is not None else SGLangBroadcast()
        self.transport.check(self.backend)  # the engines are asked at connect
        self._seq = 0  # tensors posted on the current group so far (the transports' message counter)
        self.world_size = 1 + sum(int(t.num_ranks) for t in self.targets)
        self.group: WeightGroup | None = None
        self._pool = ThreadPoolExecutor(max_workers=max(2, 2 * len(self.targets)), thread_name_prefix="wsync")
        self._buffers: list[torch.Tensor | None] = [None, None]

    # ------------------------------------------------------------------ group
    def connect(self) -> None:
        """Create the group (rank 0 here, engines at their rank offsets); no-op when connected."""
        if self.group is not None and not self.group.broken:
            return
        if self.group is not None:
            self.close_group()
        self.transport.check(self.backend, self.targets)  # refuse a bad choice before any engine joins
        self._seq = 0
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
             transport: BucketTransport | None = None) -> SyncStats:
        """Bucket ``named`` and send every bucket to every target; returns the stats.

        wire_format: how a bucket travels (both are SGLang formats of ``/update_weights_from_distributed``):
            "flattened_bucket": packed into one flat tensor, one message (``load_format=
            "flattened_bucket"``); "per_tensor": one message per tensor straight from the
            tensor's memory, no packing (SGLang's default load format), except that tensors
            under ``small_tensor_bytes`` (norms, biases) travel in packed buckets of their own,
            so they do not cost one message each. None: this broadcaster's ``wire_format``
            (flattened on NCCL, where packing in GPU memory is cheap and one launch per bucket
            pays; per-tensor on gloo, where a CPU copy costs as much as the transfer).
        transport: for this call (None: :attr:`transport`); checked against the engines first.
        weight_version: sent with the last bucket (SGLang stamps it on the server).
        Raises WeightSyncError naming the engine and the bucket on any failure or timeout; the
        group is closed then (the next send builds a new one).
        """
        fmt = wire_format or self.wire_format
        if fmt not in WIRE_FORMATS:
            raise ValueError(f"wire_format={fmt!r} is not one of {WIRE_FORMATS}")
        transport = transport if transport is not None else self.transport
        transport.check(self.backend, self.targets)
        small = transport.small_tensor_bytes if self.small_tensor_bytes is None else self.small_tensor_bytes
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
                    payload = [pack_into(buf, meta, tensors)]  # overlaps the transfer in flight
                    slot ^= 1
                else:
                    payload = [t if t.is_contiguous() else t.contiguous() for t in tensors]
                    if payload and payload[0].device != self.group.device:
                        payload = [t.to(self.group.device) for t in payload]
                # a CUDA source copied (non_blocking) into a CPU bucket, or a CUDA payload: the
                # copies must be done before the transport reads the bytes
                src_cuda = payload[0].is_cuda or any(t.is_cuda for t in tensors)
                del tensors
                if src_cuda:
                    torch.cuda.current_stream().synchronize()
                fields = transport.request_fields(self.targets, payload, packed, self._seq)
                if inflight:
                    # the engines must be inside the previous bucket's request before this one is
                    # posted (they serve update requests in arrival order): its first transfer done
                    self._finish(inflight[-1], first_only=True)
                self._check_acks(done, wait=False)
                wire = meta.wire()
                futures = [(t, self._pool.submit(
                    t.update_weights_from_distributed, wire["names"], wire["dtypes"], wire["shapes"], self.group_name,
                    load_format="flattened_bucket" if packed else None, flush_cache=False,
                    weight_version=weight_version if nxt is None else None, timeout_s=self.bucket_timeout_s,
                    extra_fields=extra or None))
                    for t, extra in zip(self.targets, fields)]
                works, first = transport.post(self.group, payload, self._seq)
                self._seq += len(payload)
                inflight.append((works, futures, meta, first))
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
