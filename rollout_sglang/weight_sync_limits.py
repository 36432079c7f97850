"""The bucket size and time limits of a weight sync, declared and checked once.

The trainer's ``rollout`` section holds them as its flat ``weight_sync_*`` keys (it is a :class:`WeightSyncLimits`);
the broadcaster (:class:`~rollout_sglang.weight_update.options.BroadcastOptions`) and the trainer's sender build on
them. Outside the ``weight_update`` package, which imports torch: the config loads without it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from env_controller.options import Options


@dataclass
class WeightSyncLimits(Options):
    """How large a weight sync's buckets are and how long its steps may take (times in seconds)."""

    KEY: ClassVar[str] = "rollout"

    #: bucket size of the weight broadcast, MiB (fractions allowed); the sender packs buckets of this size
    weight_sync_bucket_mb: float = 512
    #: limit on the group rendezvous (which may end inside the first bucket's receive)
    weight_sync_init_timeout_s: float = 300.0
    #: limit on each bucket: its transfer plus the engines' acknowledgement
    weight_sync_bucket_timeout_s: float = 120.0

    def check(self) -> None:
        """A positive bucket size, positive limits."""
        super().check()
        self.require_above_zero("weight_sync_bucket_mb", unit="MiB")
        self.require_seconds("weight_sync_init_timeout_s", "weight_sync_bucket_timeout_s")

    def weight_sync_limits(self) -> dict[str, float]:
        """The fields declared here, by name: to hand them on to a larger options class."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(WeightSyncLimits)}
