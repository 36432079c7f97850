"""The settings of the trainer's weight sync (:class:`~megatron_agentrl.weight_sync.sender.WeightSender`),
declared and checked once; the run builds them from the ``rollout.weight_sync_*`` keys."""
from __future__ import annotations

from dataclasses import dataclass

from rollout_sglang.weight_update import BroadcastOptions


@dataclass
class SenderOptions(BroadcastOptions):
    """The broadcast's settings (:class:`~rollout_sglang.weight_update.BroadcastOptions`: where the group
    meets, its backend and limits, how buckets travel) plus the sender's own."""

    #: bucket size in MiB (``rollout.weight_sync_bucket_mb``; fractions allowed)
    bucket_mb: float = 512
    #: have every bucket verified (``rollout.weight_sync_checksum``): the transport's ``with_checksum()`` when it
    #: offers one (the stand-in's does); SGLang's broadcasts carry no checksum, so with them the buckets go
    #: unverified, with a warning
    checksum: bool = False

    def check(self) -> None:
        """See :class:`BroadcastOptions`; a positive bucket size."""
        super().check()
        self.require_above_zero("bucket_mb", unit="MiB")
