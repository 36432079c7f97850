"""The engine side of a weight update: bucket layout, the weight-sync group, transports, the receiver.

:mod:`.buckets` (packing tensors into flat raw-byte buckets, dtype names), :mod:`.group` (the
dedicated trainer -> engines process group, its rendezvous and timeouts), :mod:`.transport` (how a
bucket travels; SGLang's broadcasts), :mod:`.receiver` (receiving buckets in plain torch, for
engines that are not SGLang). Needs only torch; the trainer's sender builds on it.
"""
from rollout_sglang.weight_update.buckets import (
    DTYPE_ALIASES,
    DTYPES,
    BucketMeta,
    copy_bytes,
    dtype_from_name,
    dtype_name,
    flattened_layout,
    iter_buckets,
    iter_split_buckets,
    pack,
    pack_into,
    plan_buckets,
    unflatten_bytes,
)
from rollout_sglang.weight_update.group import (
    WeightGroup,
    WeightSyncTimeout,
    default_backend,
    host_store,
    init_weight_group,
)
from rollout_sglang.weight_update.receiver import BucketReceiver
from rollout_sglang.weight_update.transport import (
    BroadcastReceive,
    BucketTransport,
    ReceiveTransport,
    SGLangBroadcast,
    WeightUpdateTarget,
)

__all__ = [
    "DTYPES", "DTYPE_ALIASES", "BroadcastReceive", "BucketMeta", "BucketReceiver", "BucketTransport",
    "ReceiveTransport", "SGLangBroadcast", "WeightGroup", "WeightSyncTimeout", "WeightUpdateTarget", "copy_bytes",
    "default_backend", "dtype_from_name", "dtype_name", "flattened_layout", "host_store", "init_weight_group",
    "iter_buckets", "iter_split_buckets", "pack", "pack_into", "plan_buckets", "unflatten_bytes",
]
