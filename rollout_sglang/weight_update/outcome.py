"""What a weight sync reports: its stats when it worked, :class:`WeightSyncError` when it did not."""
from __future__ import annotations

from dataclasses import dataclass, field


class WeightSyncError(RuntimeError):
    """A weight sync failed (an engine refused a bucket, a timeout, a checksum mismatch)."""


@dataclass
class SyncStats:
    """What one sync moved: ``buckets``, ``bytes`` and ``seconds`` (wall time on this rank).

    version: the weight version sent (-1 when the caller keeps it); per_stage: bytes by PP stage.
    """

    version: int
    buckets: int = 0
    bytes: int = 0
    seconds: float = 0.0
    per_stage: dict[int, int] = field(default_factory=dict)

    @property
    def gb_per_s(self) -> float:
        """Throughput in GB/s (1e9 bytes)."""
        return self.bytes / max(self.seconds, 1e-9) / 1e9
