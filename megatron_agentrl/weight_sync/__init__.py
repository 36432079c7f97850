"""Trainer side of the weight sync: the actor's weights under HF names, bucketed, sent to the engines.

:mod:`.gather` (the actor's tensors under Hugging Face names), :mod:`.broadcaster` (group rank 0
sending buckets to one slot's engines), :mod:`.sender` (:class:`WeightSender`, the collective
sync of every trainer rank), :mod:`.direct` (in-process engines), :mod:`.outcome` (stats and the
error). The engine side (bucket layout, the group, transports, the receiver) is
:mod:`rollout_sglang.weight_update`.
"""
from megatron_agentrl.weight_sync.broadcaster import WIRE_FORMATS, BucketBroadcaster
from megatron_agentrl.weight_sync.direct import deliver_direct
from megatron_agentrl.weight_sync.gather import stage_hf_tensors
from megatron_agentrl.weight_sync.outcome import SyncStats, WeightSyncError
from megatron_agentrl.weight_sync.sender import WeightSender

__all__ = [
    "WIRE_FORMATS", "BucketBroadcaster", "SyncStats", "WeightSender", "WeightSyncError", "deliver_direct",
    "stage_hf_tensors",
]
