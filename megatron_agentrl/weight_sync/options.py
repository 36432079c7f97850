"""The settings of the trainer's weight sync (:class:`~megatron_agentrl.weight_sync.sender.WeightSender`),
declared and checked once; the run builds them from the ``rollout`` section (its ``weight_sync_*`` keys)."""
from __future__ import annotations

from dataclasses import dataclass

from rollout_sglang.weight_update import BroadcastOptions


@dataclass
class SenderOptions(BroadcastOptions):
    """The broadcast's settings (:class:`~rollout_sglang.weight_update.BroadcastOptions`: the bucket size and
    limits, where the group meets, its backend, how buckets travel) plus the sender's own."""

    #: have every bucket verified (``rollout.weight_sync_checksum``): the transport's ``with_checksum()`` when it
    #: offers one (the stand-in's does); SGLang's broadcasts carry no checksum, so with them the buckets go
    #: unverified, with a warning
    checksum: bool = False
