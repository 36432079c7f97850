"""The settings of group rank 0 of a weight-sync group
(:class:`~rollout_sglang.weight_update.broadcaster.BucketBroadcaster`), declared and checked once."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from rollout_sglang.weight_sync_limits import WeightSyncLimits

#: how a bucket travels: one packed flat tensor of raw bytes, or one tensor per parameter
WIRE_FORMATS = ("flattened_bucket", "per_tensor")
#: the process-group backends a weight-sync group runs on
BACKENDS = ("nccl", "gloo")


@dataclass
class BroadcastOptions(WeightSyncLimits):
    """The limits of a weight sync (:class:`~rollout_sglang.weight_sync_limits.WeightSyncLimits`: the bucket size,
    ``weight_sync_init_timeout_s`` and ``weight_sync_bucket_timeout_s``), where the group meets, its backend, and
    how buckets travel."""

    KEY: ClassVar[str] = ""

    #: an address of the sending host that every engine can reach (the group's TCPStore lives there)
    master_address: str = "127.0.0.1"
    #: "nccl" or "gloo" (None: NCCL when CUDA is available)
    backend: str | None = None
    #: "flattened_bucket" or "per_tensor" (None: flattened on NCCL, per-tensor on gloo)
    wire_format: str | None = None
    #: with "per_tensor", tensors under this many bytes travel packed together (None: the transport's own)
    small_tensor_bytes: int | None = None

    def check(self) -> None:
        """See :class:`WeightSyncLimits`; a known backend and wire format, a non-negative packing threshold."""
        super().check()
        self.require(self.backend is None or self.backend in BACKENDS, "backend",
                     f"is not one of {', '.join(BACKENDS)} (or None: NCCL when CUDA is available)")
        self.require(self.wire_format is None or self.wire_format in WIRE_FORMATS, "wire_format",
                     f"is not one of {', '.join(WIRE_FORMATS)} (or None: flattened on NCCL, per-tensor on gloo)")
        if self.small_tensor_bytes is not None:
            self.require_int("small_tensor_bytes", low=0, why="0: no packing")
