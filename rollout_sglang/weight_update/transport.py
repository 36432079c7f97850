"""How a bucket travels on a weight-sync group, and what the engines are told about it.

The trainer's sender (group rank 0) moves each bucket through a :class:`BucketTransport`; an
engine that receives with :class:`~rollout_sglang.weight_update.receiver.BucketReceiver` uses the
matching :class:`ReceiveTransport`. The production pair speaks SGLang's API only
(:class:`SGLangBroadcast`, :class:`BroadcastReceive`): every tensor of a request (or the one flat
tensor of a ``load_format="flattened_bucket"`` request) is one broadcast from rank 0, in ``names``
order, on NCCL or gloo, and the update request carries SGLang's fields alone. Transports that need
more from the engine (extra request fields, another way to move bytes) implement the same two
protocols; the SGLang stand-in's live in :mod:`rollout_sglang.testing.transport`.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from rollout_sglang.weight_update.group import WeightGroup

MB = 1024 * 1024
# per_tensor wire format: tensors under this travel packed together. A gloo broadcast waits a round
# trip for its receiver, which packing saves; packing costs a copy on the trainer and one on the engine that,
# with the next bucket already on the wire, compete with it for the CPU. 1 MiB (Qwen2.5-0.5B's k/v, biases
# and norms packed) beat 2 MiB (its q/o projections packed too) in bench/weight_sync.py (docs/BENCHMARKS.md).
BROADCAST_SMALL_TENSOR_BYTES = MB


@dataclass
class BucketUpdate:
    """One bucket's ``/update_weights_from_distributed`` request, as SGLang defines it
    (``UpdateWeightsFromDistributedReqInput`` in its ``io_struct.py``), less ``weight_version``: an engine's client
    adds that to the update's last bucket.

    names / dtypes / shapes: the tensors, in the order they travel (dtype names as SGLang spells them).
    group_name: the weight-sync group they travel on.
    load_format: "flattened_bucket": one flat tensor of raw bytes; None: one tensor per name.
    flush_cache: whether the server flushes its prefix cache after loading (the version pool flushes once, at the
        end of the update, so the broadcaster sends False).
    """

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    load_format: str | None = None
    flush_cache: bool = True

    def body(self) -> dict[str, Any]:
        """The request's JSON body (``load_format`` only when set)."""
        body: dict[str, Any] = {"names": list(self.names), "dtypes": list(self.dtypes),
                                "shapes": [list(s) for s in self.shapes], "group_name": self.group_name,
                                "flush_cache": bool(self.flush_cache)}
        if self.load_format is not None:
            body["load_format"] = self.load_format
        return body


@runtime_checkable
class WeightUpdateTarget(Protocol):
    """An engine that receives weights over a weight-sync group (an SGLang server's client).

    name: for messages (e.g. the server URL). num_ranks: ranks the engine contributes to the group
    (an SGLang server: its TP size).
    """

    name: str
    num_ranks: int

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str, timeout_s: float) -> None:
        """Join the group (blocks until every rank joined); raises with the engine's message on failure."""
        ...

    def update_weights_from_distributed(self, bucket: BucketUpdate, *, last_bucket: bool, timeout_s: float,
                                        extra_fields: Mapping[str, Any] | None = None) -> None:
        """Receive ``bucket`` from group rank 0 and load it; raises with the engine's message on failure.

        last_bucket: the sender's last bucket of this update; the engine may stamp the version its
            open update was given (``begin_weight_update``) with it. The sender knows no version.
        extra_fields: request fields beyond SGLang's, from the transport (none for SGLang servers).
        """
        ...

    def destroy_weights_update_group(self, group_name: str, timeout_s: float) -> None:
        """Leave the group."""
        ...


class BucketTransport(Protocol):
    """The trainer side of a transport: how group rank 0 moves a bucket and what each engine is told.

    name: for logs and results ("broadcast", ...).
    small_tensor_bytes: with the per_tensor wire format, tensors under this many bytes travel
        packed into buckets of their own (one message for many norms and biases).
    Per bucket the sender calls :meth:`request_fields` (the engines' requests go out), then
    :meth:`post`. ``seq`` is the number of tensors posted on this group before the bucket
    (a message counter for transports that number their messages).

    Optional: ``with_checksum()``, a transport that also has every bucket verified by the engines;
    only transports whose engines can verify offer it (SGLang's API has no checksum).
    """

    name: str
    small_tensor_bytes: int

    def check(self, backend: str, targets: Sequence[WeightUpdateTarget] | None = None) -> None:
        """ValueError naming the fix when this transport cannot run on ``backend`` (or reach ``targets``)."""
        ...

    def request_fields(self, targets: Sequence[WeightUpdateTarget], payload: Sequence[torch.Tensor], packed: bool,
                       seq: int) -> list[dict[str, Any]]:
        """The extra fields of this bucket's update request, one dict per target (in ``targets`` order).

        payload: the tensors as they go on the wire (one flat tensor when ``packed``).
        """
        ...

    def post(self, group: WeightGroup, payload: Sequence[torch.Tensor], seq: int) -> list:
        """Start moving ``payload`` to every engine rank; returns the work handles."""
        ...


class ReceiveTransport(Protocol):
    """The engine side of a transport, for one update request."""

    def post(self, group: WeightGroup, tensors: Sequence[torch.Tensor]) -> list:
        """Start receiving ``tensors`` (one flat tensor for a flattened bucket) from group rank 0; the works."""
        ...

    def verify(self, tensors: Sequence[torch.Tensor], packed: bool) -> None:
        """Once every tensor arrived: raise when they are not what the sender sent."""
        ...


class SGLangBroadcast:
    """SGLang's transport: one broadcast per wire tensor from rank 0, no extra request fields.

    small_tensor_bytes: the packing threshold of the per_tensor wire format (default
    :data:`BROADCAST_SMALL_TENSOR_BYTES`).
    """

    name = "broadcast"

    def __init__(self, small_tensor_bytes: int = BROADCAST_SMALL_TENSOR_BYTES) -> None:
        if small_tensor_bytes < 0:
            raise ValueError(f"small_tensor_bytes={small_tensor_bytes} must be >= 0 (0: no packing)")
        self.small_tensor_bytes = int(small_tensor_bytes)

    def check(self, backend: str, targets: Sequence[WeightUpdateTarget] | None = None) -> None:
        """Broadcasts run on NCCL and gloo and every SGLang server receives them: nothing to refuse."""

    def request_fields(self, targets: Sequence[WeightUpdateTarget], payload: Sequence[torch.Tensor], packed: bool,
                       seq: int) -> list[dict[str, Any]]:
        """No fields beyond SGLang's."""
        return [{} for _ in targets]

    def post(self, group: WeightGroup, payload: Sequence[torch.Tensor], seq: int) -> list:
        """One broadcast per tensor, in order."""
        return [group.broadcast_async(x, src=0) for x in payload]

    def __repr__(self) -> str:
        return f"SGLangBroadcast(small_tensor_bytes={self.small_tensor_bytes})"


class BroadcastReceive:
    """The engine side of :class:`SGLangBroadcast` (what SGLang's model runner does): one broadcast per tensor."""

    def post(self, group: WeightGroup, tensors: Sequence[torch.Tensor]) -> list:
        """Join one broadcast from rank 0 per tensor, in order."""
        return [group.broadcast_async(t, src=0) for t in tensors]

    def verify(self, tensors: Sequence[torch.Tensor], packed: bool) -> None:
        """Nothing to check: SGLang's requests carry no checksum."""
