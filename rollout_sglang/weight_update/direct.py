"""Weights handed to engines that live in the sender's own process (no group, no copy over a wire)."""
from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from rollout_sglang.weight_update.buckets import iter_buckets
from rollout_sglang.weight_update.outcome import SyncStats


def deliver_direct(engines: Sequence[Any], named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> SyncStats:
    """Hand (name, tensor) pairs to in-process engines bucket by bucket (``engine.receive_bucket``).

    The engines' update must already be open (``begin_weight_update``, done by the version pool).
    Returns the stats (version -1: the caller knows it).
    """
    stats = SyncStats(version=-1)
    t0 = time.perf_counter()
    for meta, tensors in iter_buckets(named, bucket_bytes):
        pairs = list(zip(meta.names, tensors))
        for e in engines:
            e.receive_bucket(pairs)
        stats.buckets += 1
        stats.bytes += meta.nbytes
    stats.seconds = time.perf_counter() - t0
    return stats
