"""Engine side of the weight sync for engines that are not SGLang (the local engine, the stand-in).

What an SGLang server does for ``/init_weights_update_group`` and
``/update_weights_from_distributed``, in plain torch: join the group at ``rank_offset``, then per
request receive either one flattened bucket (``load_format="flattened_bucket"``, one broadcast)
or one broadcast per tensor (SGLang's default), and hand the tensors to the engine. With the
stand-in's ``send_recv`` extension the same tensors arrive as point-to-point messages instead.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence

import torch

from megatron_agentrl.weight_sync.buckets import (
    BucketMeta,
    bucket_checksum,
    copy_bytes,
    dtype_from_name,
    tensors_checksum,
    unpack,
)
from megatron_agentrl.weight_sync.group import WeightGroup, init_weight_group

logger = logging.getLogger(__name__)


class ChecksumMismatch(RuntimeError):
    """A received bucket's checksum differs from the sender's."""


class BucketReceiver:
    """One engine rank's groups and receive buffers.

    Thread-safe per group (one receive at a time per group). The tensors returned by
    :meth:`receive` are views of a receive buffer that the next :meth:`receive` on the same
    group overwrites: load them into the model before receiving again.
    """

    def __init__(self) -> None:
        self._groups: dict[str, WeightGroup] = {}
        self._buffers: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()
        self._group_locks: dict[str, threading.Lock] = {}

    def init_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                   group_name: str, backend: str | None = None, timeout_s: float = 300.0) -> None:
        """Join ``group_name`` as group rank ``rank_offset`` (this engine has one rank). Blocks until all joined."""
        with self._lock:
            if group_name in self._groups:
                raise ValueError(f"weight-sync group {group_name!r} already exists on this engine; destroy it first")
        group = init_weight_group(master_address, master_port, rank_offset, world_size, group_name, backend, timeout_s)
        with self._lock:
            self._groups[group_name] = group
            self._group_locks[group_name] = threading.Lock()

    def destroy_group(self, group_name: str) -> None:
        """Leave ``group_name``; KeyError naming the known groups when it does not exist."""
        with self._lock:
            group = self._groups.pop(group_name, None)
            self._buffers.pop(group_name, None)
            self._group_locks.pop(group_name, None)
        if group is None:
            raise KeyError(f"no weight-sync group {group_name!r} on this engine (known: {sorted(self._groups)})")
        group.close()

    def has_group(self, group_name: str) -> bool:
        """Whether ``group_name`` was initialised here."""
        return group_name in self._groups

    def _group(self, group_name: str) -> WeightGroup:
        group = self._groups.get(group_name)
        if group is None:
            raise KeyError(
                f"weight-sync group {group_name!r} is not initialised on this engine (known: {sorted(self._groups)}); "
                "call /init_weights_update_group first"
            )
        return group

    def receive(self, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]], group_name: str,
                load_format: str | None = None, timeout_s: float | None = None,
                checksum: Sequence[int] | None = None,
                into: Mapping[str, torch.Tensor] | None = None,
                send_recv_tag: int | None = None) -> list[tuple[str, torch.Tensor]]:
        """Receive one update request's tensors from group rank 0; returns (name, tensor) pairs to load.

        load_format "flattened_bucket": one broadcast of a flat tensor of the (single) dtype, then
        split; None: one broadcast per tensor, in order (SGLang's default). ``into``:
        destinations to load directly (the engine's own parameters, when nothing can read them
        meanwhile): per-tensor broadcasts land in them, a flattened bucket is copied into them
        with one memcpy each; a tensor loaded that way is not returned.
        ``checksum``: the sender's checksum of the bucket; a mismatch raises ChecksumMismatch.
        ``send_recv_tag``: the sender sends point-to-point instead of broadcasting (the stand-in's
        ``send_recv`` extension): the flat bucket is message ``send_recv_tag``, per-tensor
        tensor ``i`` is message ``send_recv_tag + i``; all receives are posted at once.
        """
        group = self._group(group_name)
        with self._group_locks[group_name]:
            if load_format == "flattened_bucket":
                meta = BucketMeta.from_wire(names, dtypes, shapes)
                buf = self._buffers.get(group_name)
                if buf is None or buf.numel() < meta.nbytes:
                    buf = torch.empty(meta.nbytes, dtype=torch.uint8, device=group.device)
                    self._buffers[group_name] = buf
                flat = buf[: meta.nbytes].view(meta.dtype)
                if send_recv_tag is None:
                    group.broadcast(flat, src=0, timeout_s=timeout_s)
                else:
                    group.wait(group.recv_async(flat, 0, send_recv_tag), timeout_s, what="receive of a flat bucket")
                if checksum is not None:
                    self._verify(bucket_checksum(flat), checksum, names)
                pairs = unpack(flat, meta)
                if into is None:
                    return pairs
                rest = []
                for name, t in pairs:
                    dst = into.get(name)
                    if (dst is not None and dst.shape == t.shape and dst.dtype == t.dtype and dst.device == t.device
                            and dst.is_contiguous()):
                        copy_bytes(dst, t)
                    else:
                        rest.append((name, t))
                return rest
            if load_format not in (None, "", "auto"):
                raise ValueError(f"load_format={load_format!r} is not supported here; use 'flattened_bucket' or none")
            received: list[tuple[str, torch.Tensor, bool]] = []
            works = []
            for i, (name, d, s) in enumerate(zip(names, dtypes, shapes)):
                shape, dtype = tuple(int(x) for x in s), dtype_from_name(d)
                dst = into.get(name) if into is not None else None
                in_place = (dst is not None and tuple(dst.shape) == shape and dst.dtype == dtype
                            and dst.device == group.device and dst.is_contiguous())
                t = dst if in_place else torch.empty(shape, dtype=dtype, device=group.device)
                works.append(group.broadcast_async(t, src=0) if send_recv_tag is None
                             else group.recv_async(t, 0, send_recv_tag + i))
                received.append((str(name), t, in_place))
            deadline = time.monotonic() + (group.timeout_s if timeout_s is None else float(timeout_s))
            for w in reversed(works):  # the last one done, the others are too: one wake-up, not one per tensor
                group.wait(w, max(0.001, deadline - time.monotonic()), what=f"receive of {len(names)} tensors")
            if checksum is not None:
                self._verify(tensors_checksum([t for _, t, _ in received]), checksum, names)
            return [(n, t) for n, t, in_place in received if not in_place]

    @staticmethod
    def _verify(got: list[int], expected: Sequence[int], names: Sequence[str]) -> None:
        if list(got) != [int(x) for x in expected]:
            raise ChecksumMismatch(
                f"bucket of {len(names)} tensors ({names[0]} ...) arrived with checksum {got}, "
                f"the sender's is {list(expected)}: the transfer corrupted it"
            )

    def raw_receive(self, nbytes: int, group_name: str, timeout_s: float | None = None) -> float:
        """Receive one raw flat uint8 broadcast of ``nbytes`` (the benchmark's baseline); returns a byte sum probe."""
        group = self._group(group_name)
        with self._group_locks[group_name]:
            buf = self._buffers.get(group_name)
            if buf is None or buf.numel() < nbytes:
                buf = torch.empty(nbytes, dtype=torch.uint8, device=group.device)
                self._buffers[group_name] = buf
            group.broadcast(buf[:nbytes], src=0, timeout_s=timeout_s)
            return float(buf[: min(nbytes, 1024)].sum())

    def close(self) -> None:
        """Leave every group."""
        for name in list(self._groups):
            try:
                self.destroy_group(name)
            except KeyError:
                pass
