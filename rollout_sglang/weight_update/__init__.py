"""Both sides of the wire of a weight update: bucket layout, the group, transports, sending and receiving.

:mod:`.buckets` (packing tensors into flat raw-byte buckets, dtype names), :mod:`.group` (the
dedicated trainer -> engines process group, its rendezvous and timeouts), :mod:`.transport` (how a
bucket travels; SGLang's broadcasts), :mod:`.broadcaster` (group rank 0 sending buckets to one
slot's engines), :mod:`.direct` (buckets handed to engines in the sender's own process),
:mod:`.receiver` (receiving buckets in plain torch, for engines that are not SGLang),
:mod:`.outcome` (a sync's stats and its error), :mod:`.options` (the broadcaster's settings). Needs only
torch, no Megatron: the trainer's :mod:`megatron_agentrl.weight_sync` reads the actor's weights and feeds them in
here.
"""
from rollout_sglang.weight_update.broadcaster import BucketBroadcaster
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
from rollout_sglang.weight_update.direct import deliver_direct
from rollout_sglang.weight_update.group import (
    WeightGroup,
    WeightSyncTimeout,
    default_backend,
    host_store,
    init_weight_group,
)
from rollout_sglang.weight_update.options import WIRE_FORMATS, BroadcastOptions
from rollout_sglang.weight_update.outcome import SyncStats, WeightSyncError
from rollout_sglang.weight_update.receiver import BucketReceiver
from rollout_sglang.weight_update.transport import (
    MB,
    BroadcastReceive,
    BucketTransport,
    BucketUpdate,
    ReceiveTransport,
    SGLangBroadcast,
    WeightUpdateTarget,
)

__all__ = [
    "DTYPES", "DTYPE_ALIASES", "MB", "WIRE_FORMATS", "BroadcastOptions", "BroadcastReceive", "BucketBroadcaster",
    "BucketMeta", "BucketReceiver", "BucketTransport", "BucketUpdate", "ReceiveTransport", "SGLangBroadcast",
    "SyncStats", "WeightGroup",
    "WeightSyncError", "WeightSyncTimeout", "WeightUpdateTarget", "copy_bytes", "default_backend", "deliver_direct",
    "dtype_from_name", "dtype_name", "flattened_layout", "host_store", "init_weight_group", "iter_buckets",
    "iter_split_buckets", "pack", "pack_into", "plan_buckets", "unflatten_bytes",
]
