"""Engine side of the weight sync for engines that are not SGLang (the local engine, the stand-in).

What an SGLang server does for ``/init_weights_update_group`` and
``/update_weights_from_distributed``, in plain torch: join the group at ``rank_offset``, then per
request receive either one flattened bucket (``load_format="flattened_bucket"``, one broadcast)
or one broadcast per tensor (SGLang's default), and hand the tensors to the engine. Another
:class:`~rollout_sglang.weight_update.transport.ReceiveTransport` can replace the broadcasts
(the stand-in's point-to-point extension).
"""
from __future__ import annotations

import datetime
import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from rollout_sglang.weight_update.buckets import copy_bytes, dtype_from_name, flattened_layout, unflatten_bytes
from rollout_sglang.weight_update.group import WeightGroup, init_weight_group
from rollout_sglang.weight_update.transport import BroadcastReceive, ReceiveTransport

logger = logging.getLogger(__name__)


class BucketReceiver:
    """One engine rank's groups and receive buffers.

    lazy_join: join a group's collectives only at its first receive, as an SGLang engine on NCCL
        does (its communicator forms at the first broadcast); :meth:`init_group` then only connects
        to the rendezvous store. False: join in :meth:`init_group` (SGLang on gloo).

    Thread-safe per group (one receive at a time per group). The tensors returned by
    :meth:`receive` are views of a receive buffer that the next :meth:`receive` on the same
    group overwrites: load them into the model before receiving again.
    """

    def __init__(self, lazy_join: bool = False) -> None:
        self.lazy_join = bool(lazy_join)
        self._groups: dict[str, WeightGroup | Callable[[], WeightGroup]] = {}
        self._buffers: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()
        self._group_locks: dict[str, threading.Lock] = {}

    def init_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                   group_name: str, backend: str | None = None, timeout_s: float = 300.0) -> None:
        """Join ``group_name`` as group rank ``rank_offset`` (this engine has one rank): blocks until all
        joined, or with ``lazy_join`` until the rendezvous store answered (the rest at the first receive)."""
        with self._lock:
            if group_name in self._groups:
                raise ValueError(f"weight-sync group {group_name!r} already exists on this engine; destroy it first")
        group: WeightGroup | Callable[[], WeightGroup]
        if self.lazy_join:
            store = dist.TCPStore(master_address, int(master_port), world_size, is_master=False,
                                  timeout=datetime.timedelta(seconds=float(timeout_s)), wait_for_workers=False)
            group = functools.partial(init_weight_group, master_address, master_port, rank_offset, world_size,
                                      group_name, backend, timeout_s, store=store)
        else:
            group = init_weight_group(master_address, master_port, rank_offset, world_size, group_name, backend,
                                      timeout_s)
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
        if isinstance(group, WeightGroup):
            group.close()

    def _group(self, group_name: str) -> WeightGroup:
        """The group (formed now when it was joined lazily); call under the group's lock."""
        group = self._groups.get(group_name)
        if group is None:
            raise KeyError(
                f"weight-sync group {group_name!r} is not initialised on this engine (known: {sorted(self._groups)}); "
                "call /init_weights_update_group first"
            )
        if not isinstance(group, WeightGroup):
            group = group()
            with self._lock:
                self._groups[group_name] = group
        return group

    def receive(self, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]], group_name: str,
                load_format: str | None = None, timeout_s: float | None = None,
                into: Mapping[str, torch.Tensor] | None = None,
                transport: ReceiveTransport | None = None) -> list[tuple[str, torch.Tensor]]:
        """Receive one update request's tensors from group rank 0; returns (name, tensor) pairs to load.

        load_format "flattened_bucket": one raw-byte tensor, then split by each tensor's dtype; None:
        one tensor per name, in order (SGLang's default). ``into``: destinations to load directly
        (the engine's own parameters, when nothing can read them meanwhile): per-tensor receives
        land in them, a flattened bucket is copied into them with one memcpy each; a tensor
        loaded that way is not returned. ``transport``: how the tensors arrive and are checked
        (None: SGLang's broadcasts). ``timeout_s``: limit on the whole receive (None: the group's).
        """
        lock = self._group_locks.get(group_name)
        if lock is None:
            self._group(group_name)  # raises the message naming the known groups
        transport = transport or BroadcastReceive()
        with lock:
            group = self._group(group_name)
            deadline = time.monotonic() + (group.timeout_s if timeout_s is None else float(timeout_s))
            if load_format == "flattened_bucket":
                # raw bytes, as SGLang's FlattenedTensorBucket receives them (the sender's dtype does not
                # matter on the wire, and one bucket may mix dtypes)
                layout, nbytes = flattened_layout(names, dtypes, shapes)
                buf = self._buffers.get(group_name)
                if buf is None or buf.numel() < nbytes:
                    buf = torch.empty(nbytes, dtype=torch.uint8, device=group.device)
                    self._buffers[group_name] = buf
                flat = buf[:nbytes]
                self._wait(group, transport.post(group, [flat]), deadline, "receive of a flat bucket")
                transport.verify([flat], packed=True)
                pairs = unflatten_bytes(flat, layout)
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
            for name, d, s in zip(names, dtypes, shapes):
                shape, dtype = tuple(int(x) for x in s), dtype_from_name(d)
                dst = into.get(name) if into is not None else None
                in_place = (dst is not None and tuple(dst.shape) == shape and dst.dtype == dtype
                            and dst.device == group.device and dst.is_contiguous())
                t = dst if in_place else torch.empty(shape, dtype=dtype, device=group.device)
                received.append((str(name), t, in_place))
            tensors = [t for _, t, _ in received]
            self._wait(group, transport.post(group, tensors), deadline, f"receive of {len(names)} tensors")
            transport.verify(tensors, packed=False)
            return [(n, t) for n, t, in_place in received if not in_place]

    @staticmethod
    def _wait(group: WeightGroup, works: list, deadline: float, what: str) -> None:
        """Wait for every work until ``deadline`` (monotonic seconds); WeightSyncTimeout after it."""
        for w in reversed(works):  # the last one done, the others are too: one wake-up, not one per tensor
            group.wait(w, max(0.001, deadline - time.monotonic()), what=what)

    def close(self) -> None:
        """Leave every group."""
        for name in list(self._groups):
            try:
                self.destroy_group(name)
            except KeyError:
                pass
