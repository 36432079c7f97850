"""The stand-in's weight-update extensions as a transport: point-to-point sends and bucket checksums.

SGLang servers receive broadcasts (:class:`rollout_sglang.weight_update.SGLangBroadcast`). The
stand-in (:mod:`rollout_sglang.testing.sglang_standin`) lists two extensions in ``/server_info``
``agentrl_extensions`` that this transport uses:

* ``send_recv``: on gloo, the tensors of a bucket come as point-to-point messages numbered from
  the request's ``agentrl_send_recv_tag`` (tensor ``i`` is message ``tag + i``; a flattened bucket
  is one message), all posted at once. A gloo broadcast runs on the group's worker thread, one at a
  time, and each waits a round trip (the receiver announces its buffer, the sender starts) before
  its bytes flow; sends posted at once stream, as fast as one flat broadcast
  (``bench/gloo_transport.py``, docs/BENCHMARKS.md).
* ``bucket_checksum``: the request carries the bucket's checksum as ``agentrl_checksum``
  (:mod:`rollout_sglang.testing.checksum`); the stand-in refuses a bucket that arrived otherwise.

:class:`StandInTransport` is the trainer side (give it to ``BucketBroadcaster`` / ``WeightSender``
as ``transport``), :class:`StandInReceive` the engine side of one request.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from rollout_sglang.testing.checksum import payload_checksum, verify_checksum
from rollout_sglang.weight_update.group import WeightGroup
from rollout_sglang.weight_update.transport import BROADCAST_SMALL_TENSOR_BYTES, MB, WeightUpdateTarget

logger = logging.getLogger(__name__)

EXT_SEND_RECV = "send_recv"
EXT_CHECKSUM = "bucket_checksum"
TAG_FIELD = "agentrl_send_recv_tag"
CHECKSUM_FIELD = "agentrl_checksum"
# per_tensor wire format with sends: they cost no round trip, so only tensors far smaller than a
# broadcast's threshold pay packing. bench/weight_sync.py, bucketed/raw bandwidth with send_recv,
# threshold 2 MiB: 0.80-0.91 (4 runs), 1 MiB: 0.89, 0.90, 128 KiB: 0.88, 0.88, 256 KiB: 0.93, 0.97
# (Qwen2.5-0.5B's k/v projections, 229 KB each, still packed), 32 KiB: 0.93.
SEND_RECV_SMALL_TENSOR_BYTES = MB // 4


def has_extension(target: Any, name: str) -> bool:
    """Whether ``target`` (an SGLang client) lists extension ``name``; False for targets that cannot say."""
    ask = getattr(target, "has_extension", None)
    return bool(ask(name)) if callable(ask) else False


class StandInTransport:
    """The trainer side of the stand-in's extensions.

    send_recv: every wire tensor is a point-to-point send per engine rank, all posted at once
        (gloo only; engines must list ``send_recv``); False: SGLang's broadcasts.
    checksum: send each bucket's checksum to the engines that list ``bucket_checksum`` (the
        others get the bucket unverified, with a warning).
    small_tensor_bytes: packing threshold of the per_tensor wire format (None: 256 KiB with
        sends, 1 MiB with broadcasts).
    """

    def __init__(self, send_recv: bool = True, checksum: bool = False, small_tensor_bytes: int | None = None) -> None:
        if small_tensor_bytes is not None and small_tensor_bytes < 0:
            raise ValueError(f"small_tensor_bytes={small_tensor_bytes} must be >= 0 (0: no packing)")
        self.send_recv = bool(send_recv)
        self.checksum = bool(checksum)
        default = SEND_RECV_SMALL_TENSOR_BYTES if self.send_recv else BROADCAST_SMALL_TENSOR_BYTES
        self.small_tensor_bytes = default if small_tensor_bytes is None else int(small_tensor_bytes)
        self._explicit_small = small_tensor_bytes
        self._warned: set[str] = set()

    @property
    def name(self) -> str:
        """"send_recv" or "broadcast"."""
        return "send_recv" if self.send_recv else "broadcast"

    def with_checksum(self) -> "StandInTransport":
        """The same transport with every bucket's checksum sent for verification."""
        return StandInTransport(self.send_recv, True, self._explicit_small)

    def check(self, backend: str, targets: Sequence[WeightUpdateTarget] | None = None) -> None:
        """ValueError naming the fix for sends on a non-gloo group or to engines without ``send_recv``."""
        if self.send_recv and backend != "gloo":
            raise ValueError(f"transport 'send_recv' is for gloo groups; backend {backend!r} broadcasts "
                             "(use StandInTransport(send_recv=False) or SGLang's broadcast transport)")
        if targets is None:
            return
        if self.send_recv:
            lacking = [t.name for t in targets if not has_extension(t, EXT_SEND_RECV)]
            if lacking:
                raise ValueError(f"transport 'send_recv' needs engines with the send_recv extension (lacking it: "
                                 f"{lacking}); SGLang servers receive broadcasts: use SGLang's broadcast transport")
        if self.checksum:
            unverified = sorted({t.name for t in targets if not has_extension(t, EXT_CHECKSUM)} - self._warned)
            if unverified:
                self._warned.update(unverified)
                logger.warning("checksum verify requested but engines %s cannot verify (SGLang's API has no "
                               "checksum); their buckets go unverified", unverified)

    def request_fields(self, targets: Sequence[WeightUpdateTarget], payload: Sequence[torch.Tensor], packed: bool,
                       seq: int) -> list[dict[str, Any]]:
        """``agentrl_send_recv_tag`` (= ``seq``) with sends, ``agentrl_checksum`` to engines that verify.

        ValueError naming the engine when sends go to one that does not list ``send_recv``.
        """
        checksum = self._checksum(payload, packed) if self.checksum else None
        out = []
        for t in targets:
            fields: dict[str, Any] = {}
            if self.send_recv:
                if not has_extension(t, EXT_SEND_RECV):
                    raise ValueError(f"{t.name} does not list the send_recv extension (SGLang receives broadcasts); "
                                     "send with SGLang's broadcast transport")
                fields[TAG_FIELD] = int(seq)
            if checksum is not None and has_extension(t, EXT_CHECKSUM):
                fields[CHECKSUM_FIELD] = checksum
            out.append(fields)
        return out

    @staticmethod
    def _checksum(payload: Sequence[torch.Tensor], packed: bool) -> list[int]:
        return payload_checksum(payload, packed)

    def post(self, group: WeightGroup, payload: Sequence[torch.Tensor], seq: int) -> list:
        """Sends: tensor ``i`` as message ``seq + i`` to every engine rank; broadcasts otherwise."""
        if not self.send_recv:
            return [group.broadcast_async(x, src=0) for x in payload]
        return [group.send_async(x, r, seq + i) for i, x in enumerate(payload) for r in range(1, group.world_size)]

    def __repr__(self) -> str:
        return (f"StandInTransport(send_recv={self.send_recv}, checksum={self.checksum}, "
                f"small_tensor_bytes={self.small_tensor_bytes})")


class StandInReceive:
    """The engine side of one update request with the stand-in's fields.

    tag: ``agentrl_send_recv_tag`` (None: broadcasts, as from SGLang's transport).
    checksum: ``agentrl_checksum`` (None: unverified). names: the request's names (for messages).
    """

    def __init__(self, tag: int | None = None, checksum: Sequence[int] | None = None,
                 names: Sequence[str] = ()) -> None:
        if tag is not None and (isinstance(tag, bool) or not isinstance(tag, int) or tag < 0):
            raise ValueError(f"{TAG_FIELD}={tag!r} must be a non-negative integer (the first message number of "
                             "this bucket), or absent for broadcasts")
        if checksum is not None and (not isinstance(checksum, (list, tuple)) or len(checksum) != 2):
            raise ValueError(f"{CHECKSUM_FIELD}={checksum!r} must be a list of two integers, or absent")
        self.tag = tag
        self.checksum = None if checksum is None else [int(x) for x in checksum]
        self.names = list(names)

    @property
    def how(self) -> str:
        """"send_recv" or "broadcast"."""
        return "broadcast" if self.tag is None else "send_recv"

    def post(self, group: WeightGroup, tensors: Sequence[torch.Tensor]) -> list:
        """Receives of messages ``tag + i`` from rank 0, all posted at once; broadcasts without a tag."""
        if self.tag is None:
            return [group.broadcast_async(t, src=0) for t in tensors]
        return [group.recv_async(t, 0, self.tag + i) for i, t in enumerate(tensors)]

    def verify(self, tensors: Sequence[torch.Tensor], packed: bool) -> None:
        """ChecksumMismatch when the request carried a checksum and the tensors do not match it."""
        if self.checksum is not None:
            verify_checksum(payload_checksum(tensors, packed), self.checksum, self.names)
