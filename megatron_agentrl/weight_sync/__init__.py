"""Bucketed weight sync from the Megatron trainer to rollout engines over a dedicated group.

See :mod:`.sender` (trainer side), :mod:`.receiver` (engine side for non-SGLang engines),
:mod:`.buckets` (packing) and :mod:`.group` (the process group with timeouts).
"""
from megatron_agentrl.weight_sync.buckets import BucketMeta, bucket_checksum, iter_buckets, pack, plan_buckets, unpack
from megatron_agentrl.weight_sync.group import WeightGroup, WeightSyncTimeout, free_port, init_weight_group
from megatron_agentrl.weight_sync.receiver import BucketReceiver, ChecksumMismatch
from megatron_agentrl.weight_sync.sender import (
    BucketBroadcaster,
    SyncStats,
    WeightSender,
    WeightSyncError,
    WeightUpdateTarget,
    deliver_direct,
    stage_hf_tensors,
)

__all__ = [
    "BucketBroadcaster", "BucketMeta", "BucketReceiver", "ChecksumMismatch", "SyncStats", "WeightGroup",
    "WeightSender", "WeightSyncError", "WeightSyncTimeout", "WeightUpdateTarget", "bucket_checksum",
    "deliver_direct", "free_port", "init_weight_group", "iter_buckets", "pack", "plan_buckets",
    "stage_hf_tensors", "unpack",
]
