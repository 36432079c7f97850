"""Group rank 0 of one weight-sync group: buckets of (name, tensor) pairs to every engine of a slot.

Per bucket, :meth:`BucketBroadcaster.send` asks every engine of the slot to receive it (SGLang
``/update_weights_from_distributed`` with the bucket's names, dtypes and shapes) while it moves
the bucket on the slot's dedicated group through its transport
(:class:`~rollout_sglang.weight_update.transport.BucketTransport`; default SGLang's broadcasts). On the wire a
bucket is either one packed flat tensor of raw bytes (``load_format="flattened_bucket"``; packing
of bucket k+1 overlaps the transfer of bucket k, two reused buffers) or one tensor per parameter
straight from its memory (no copy); NCCL uses the first, gloo the second.

The group forms as SGLang's engines join it: with NCCL only inside their first
``/update_weights_from_distributed``, with gloo inside ``/init_weights_update_group``. So rank 0
builds its side in the background and waits for it only after the first bucket's requests are
out, under ``weight_sync_init_timeout_s``. Every group gets a fresh name: an engine keeps a group whose
destroy failed, and torch refuses a group name twice.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import replace

import torch

from rollout_sglang.weight_update.buckets import BucketMeta, iter_buckets, iter_split_buckets, pack_into
from rollout_sglang.weight_update.group import (
    WeightGroup,
    WeightSyncTimeout,
    default_backend,
    host_store,
    init_weight_group,
)
from rollout_sglang.weight_update.options import BroadcastOptions
from rollout_sglang.weight_update.outcome import SyncStats, WeightSyncError
from rollout_sglang.weight_update.transport import (
    MB,
    BucketTransport,
    BucketUpdate,
    SGLangBroadcast,
    WeightUpdateTarget,
)

logger = logging.getLogger(__name__)

def _in_thread(fn: Callable[[], WeightGroup], name: str) -> Future:
    """Run ``fn`` on a daemon thread of its own; its result (or error) in a Future. A formation that
    hangs until its own timeout then blocks nothing else."""
    fut: Future = Future()
    fut.set_running_or_notify_cancel()

    def run() -> None:
        try:
            fut.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits for the group
            fut.set_exception(e)

    threading.Thread(target=run, name=name, daemon=True).start()
    return fut


def _close_when_formed(fut: Future) -> None:
    """Done-callback for an abandoned formation: close the group if it formed after all."""
    if not fut.cancelled() and fut.exception() is None:
        fut.result().close()


class BucketBroadcaster:
    """Group rank 0 of one weight-sync group: sends buckets to every target engine of a slot.

    targets: the engines (each contributes ``num_ranks`` ranks, in list order, after rank 0).
    group_name: the base of the group's name; each group formed gets a fresh ``<base>-<8 hex>``.
    options: where the group meets, its backend and limits, the default wire format (:class:`BroadcastOptions`).
    transport: how buckets travel and what the engines are told (None: :class:`SGLangBroadcast`,
        what SGLang servers receive). Checked against the backend here, against the engines at
        :meth:`connect`.
    """

    def __init__(self, targets: Sequence[WeightUpdateTarget], group_name: str, options: BroadcastOptions | None = None,
                 *, transport: BucketTransport | None = None) -> None:
        if not targets:
            raise ValueError("BucketBroadcaster needs at least one target engine")
        o = self.options = options if options is not None else BroadcastOptions()
        self.targets = list(targets)
        self.group_base = group_name
        self.group_name = group_name  # the current group's (fresh at every connect)
        self.master_address = o.master_address
        self.backend = o.backend or default_backend()
        self.init_timeout_s = float(o.weight_sync_init_timeout_s)
        self.bucket_timeout_s = float(o.weight_sync_bucket_timeout_s)
        self.wire_format = o.wire_format or ("flattened_bucket" if self.backend == "nccl" else "per_tensor")
        self.small_tensor_bytes = o.small_tensor_bytes
        self.transport: BucketTransport = transport if transport is not None else SGLangBroadcast()
        self.transport.check(self.backend)  # the engines are asked at connect
        self._seq = 0  # tensors posted on the current group so far (the transports' message counter)
        self.world_size = 0  # 1 + the engines' ranks, known from connect() on (an engine may be asked)
        self.device = (torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl"
                       else torch.device("cpu"))
        self.group: WeightGroup | None = None
        self._forming: Future | None = None  # rank 0's side of the group while the engines join
        self._pool = ThreadPoolExecutor(max_workers=max(2, 2 * len(self.targets)), thread_name_prefix="wsync")
        # one ordered request channel per engine: a single thread, so its requests leave one by one, each
        # after the previous one was answered. Bucket k+1 can then be asked for while bucket k is on the wire
        # without ever reaching an engine before bucket k (which would cross the engines' broadcasts)
        self._channels = [ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"wsync-ch{i}")
                          for i in range(len(self.targets))]
        self._buffers: list[torch.Tensor | None] = [None, None]
        # where the last send's time went, per bucket (seconds from its start): see :meth:`send`
        self.timeline: list[dict[str, float]] = []
        self._t0 = 0.0

    # ------------------------------------------------------------------ group
    def connect(self) -> None:
        """Start forming a group: host its store, have every engine join (rank offsets in list order),
        build rank 0's side in the background. No-op while a usable group exists or is forming.

        Returns once the engines accepted ``/init_weights_update_group``; rank 0's side is awaited
        by the first bucket (:meth:`_await_group`). WeightSyncError naming the engines that failed.
        """
        if self._forming is not None or (self.group is not None and not self.group.broken):
            return
        if self.group is not None:
            self.close_group()
        self.transport.check(self.backend, self.targets)  # refuse a bad choice before any engine joins
        self._seq = 0
        self.group_name = f"{self.group_base}-{uuid.uuid4().hex[:8]}"
        try:
            ranks = [int(t.num_ranks) for t in self.targets]
        except Exception as e:
            raise WeightSyncError(f"weight-sync group {self.group_name!r}: could not learn every engine's rank count "
                                  f"(its tensor-parallel size): {e}") from e
        self.world_size = 1 + sum(ranks)
        store, port = host_store(self.master_address, self.world_size, self.init_timeout_s)
        futures, offset = [], 1
        for t, n in zip(self.targets, ranks):
            futures.append((t, self._pool.submit(
                t.init_weights_update_group, self.master_address, port, offset, self.world_size, self.group_name,
                self.backend, self.init_timeout_s)))
            offset += n
        device, name = self.device, self.group_name

        def form() -> WeightGroup:
            if device.type == "cuda":
                torch.cuda.set_device(device)
            return init_weight_group(self.master_address, port, 0, self.world_size, name, self.backend,
                                     self.init_timeout_s, store=store)

        self._forming = _in_thread(form, f"wsync-form-{name}")
        errors = self._collect(futures, timeout_s=self.init_timeout_s)
        if errors:
            self.close_group()
            raise WeightSyncError(f"weight-sync group {self.group_name!r}: engines failed to join: {errors}")

    def _await_group(self, requests: list[tuple[WeightUpdateTarget, Future]]) -> WeightGroup:
        """Rank 0's side of the group, waiting (at most ``init_timeout_s``) until every engine joined;
        ``requests`` (the first bucket's) are watched meanwhile, so an engine that refuses fails fast."""
        if self.group is not None:
            return self.group
        assert self._forming is not None, "connect() first"
        deadline = time.monotonic() + self.init_timeout_s
        while True:
            try:
                self.group = self._forming.result(timeout=0.1)
                self._forming = None
                return self.group
            except FutureTimeout:
                pass
            except Exception as e:
                errors = self._collect(requests, timeout_s=1.0)
                raise WeightSyncError(f"weight-sync group {self.group_name!r} could not be formed: {e}"
                                      + (f"; engine errors: {errors}" if errors else "")) from e
            refused = self._collect([(t, f) for t, f in requests if f.done()], timeout_s=0.0)
            if refused:
                raise WeightSyncError(f"weight-sync group {self.group_name!r}: engines refused the first bucket "
                                      f"before joining: {refused}")
            if time.monotonic() >= deadline:
                raise WeightSyncError(
                    f"weight-sync group {self.group_name!r}: not every engine joined within {self.init_timeout_s:.1f}s "
                    "of being asked for the first bucket; check that each can reach the master address "
                    f"{self.master_address} (rollout.weight_sync_master_address) and that its log shows the request")

    def close_group(self) -> None:
        """Tell the engines to leave the group (best effort) and drop ours (also one still forming)."""
        if self.group is None and self._forming is None:
            return
        for t in self.targets:
            try:
                t.destroy_weights_update_group(self.group_name, timeout_s=min(30.0, self.bucket_timeout_s))
            except Exception as e:  # noqa: BLE001 - best effort; the next group has a fresh name
                logger.warning("engine %s: destroy_weights_update_group(%s) failed: %s", t.name, self.group_name, e)
        if self.group is not None:
            self.group.close()
            self.group = None
        if self._forming is not None:
            self._forming.add_done_callback(_close_when_formed)
            self._forming = None

    def close(self) -> None:
        """Close the group and the worker threads."""
        self.close_group()
        self._pool.shutdown(wait=False, cancel_futures=True)
        for ch in self._channels:
            ch.shutdown(wait=False, cancel_futures=True)

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
        if nbytes > bucket_bytes:  # an oversize tensor: a one-off buffer
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        buf = self._buffers[slot]
        if buf is None or buf.numel() < bucket_bytes or buf.device != self.device:
            pin = self.device.type == "cpu" and torch.cuda.is_available()
            buf = torch.empty(bucket_bytes, dtype=torch.uint8, device=self.device, pin_memory=pin)
            self._buffers[slot] = buf
        return buf

    def send(self, named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, *,
             wire_format: str | None = None, transport: BucketTransport | None = None) -> SyncStats:
        """Bucket ``named`` and send every bucket to every target; returns the stats.

        wire_format: how a bucket travels (both are SGLang formats of ``/update_weights_from_distributed``):
            "flattened_bucket": packed into one flat tensor of raw bytes, one message (``load_format=
            "flattened_bucket"``); "per_tensor": one message per tensor straight from the
            tensor's memory, no packing (SGLang's default load format), except that tensors
            under ``small_tensor_bytes`` (norms, biases) travel in packed buckets of their own,
            so they do not cost one message each. None: this broadcaster's ``wire_format``
            (flattened on NCCL, where packing in GPU memory is cheap and one launch per bucket
            pays; per-tensor on gloo, where a CPU copy costs as much as the transfer).
        transport: for this call (None: :attr:`transport`); checked against the engines first.
        The version is not the broadcaster's: each engine was told it when its update opened
        (``begin_weight_update``, by the version pool); the last bucket's request is marked
        (``last_bucket``), and an SGLang client stamps that version on its server with it.
        Returns stats with version -1 (the caller knows it). Afterwards :attr:`timeline` holds one dict per
        bucket, seconds from the start of the send: ``taken`` (its tensors in hand), ``packed``, ``posted``
        (requests out, transfers posted), ``wire_done`` (rank 0's transfers ended), ``acked`` (every engine
        answered: received and loaded), plus ``mb`` and ``tensors``.
        Raises WeightSyncError naming the engine and the bucket on any failure or timeout; the
        group is closed then (the next send builds a new one).
        """
        # a format for this call is checked as the broadcaster's own is: by its options
        fmt = replace(self.options, wire_format=wire_format).wire_format if wire_format else self.wire_format
        transport = transport if transport is not None else self.transport
        transport.check(self.backend, self.targets)
        small = transport.small_tensor_bytes if self.small_tensor_bytes is None else self.small_tensor_bytes
        self.connect()
        stats = SyncStats(version=-1)
        t0 = time.perf_counter()
        self.timeline = []
        self._t0 = t0
        # the buckets on the wire: (works, acks, meta), at most two. Bucket k+1's requests go out while
        # bucket k moves, each on its engine's ordered channel (so no engine sees k+1 before it answered k),
        # and rank 0 posts k+1's transfers behind k's. Bucket k-1 must be done (transfers and every
        # engine's acknowledgement: with a broadcast tree, gloo or NCCL beyond 3 ranks, rank 0's transfer
        # ending says nothing about the ranks further down) before bucket k+1 is packed into its buffer.
        inflight: deque[tuple[list, list, BucketMeta]] = deque()
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
                while len(inflight) >= 2:
                    self._finish(inflight.popleft())
                mark = {"mb": meta.nbytes / MB, "tensors": float(len(meta.names)), "taken": time.perf_counter() - t0}
                self.timeline.append(mark)
                if packed:
                    buf = self._buffer(slot, meta.nbytes, bucket_bytes)
                    payload = [pack_into(buf, meta, tensors)]  # raw bytes; overlaps the transfer in flight
                    slot ^= 1
                else:
                    payload = [t if t.is_contiguous() else t.contiguous() for t in tensors]
                    if payload and payload[0].device != self.device:
                        payload = [t.to(self.device) for t in payload]
                # a CUDA source copied (non_blocking) into a CPU bucket, or a CUDA payload: the
                # copies must be done before the transport reads the bytes
                src_cuda = payload[0].is_cuda or any(t.is_cuda for t in tensors)
                del tensors
                if src_cuda:
                    torch.cuda.current_stream().synchronize()
                mark["packed"] = time.perf_counter() - t0
                fields = transport.request_fields(self.targets, payload, packed, self._seq)
                bucket = BucketUpdate(**meta.wire(), group_name=self.group_name,
                                      load_format="flattened_bucket" if packed else None, flush_cache=False)
                futures = [(t, ch.submit(t.update_weights_from_distributed, bucket, last_bucket=nxt is None,
                                         timeout_s=self.bucket_timeout_s, extra_fields=extra or None))
                           for t, ch, extra in zip(self.targets, self._channels, fields)]
                group = self._await_group(futures)  # the first bucket's requests let lazy engines join
                works = transport.post(group, payload, self._seq)
                self._seq += len(payload)
                mark["posted"] = time.perf_counter() - t0
                inflight.append((works, futures, meta))
                stats.buckets += 1
                stats.bytes += meta.nbytes
            while inflight:
                self._finish(inflight.popleft())
        except Exception:
            self.close_group()
            raise
        stats.seconds = time.perf_counter() - t0
        return stats

    def _finish(self, pending: tuple[list, list, BucketMeta]) -> None:
        """Wait for a bucket's transfers, then for every engine's acknowledgement; WeightSyncError naming
        the engines and the bucket on a timeout or a refusal."""
        works, futures, meta = pending
        assert self.group is not None
        deadline = time.monotonic() + self.bucket_timeout_s
        try:
            for work in reversed(works):  # the last first: one wake-up per bucket
                self.group.wait(work, max(0.001, deadline - time.monotonic()),
                                what=f"bucket {meta.index} ({meta.nbytes / MB:.1f} MB)")
        except WeightSyncTimeout as e:
            errors = self._collect(futures, timeout_s=1.0)
            raise WeightSyncError(f"{e}" + (f"; engine errors: {errors}" if errors else "")) from e
        wire_done = time.perf_counter()
        errors = self._collect(futures, timeout_s=max(0.001, deadline - time.monotonic()))
        if errors:
            raise WeightSyncError(f"bucket {meta.index} ({len(meta.names)} tensors, first {meta.names[0]!r}) "
                                  f"was not loaded: {errors}")
        if meta.index < len(self.timeline):
            self.timeline[meta.index].update(wire_done=wire_done - self._t0, acked=time.perf_counter() - self._t0)
