"""Bucket checksums of the stand-in's ``bucket_checksum`` extension (SGLang's API has none).

The sender sends each bucket's checksum as ``agentrl_checksum`` in the update request; the
stand-in computes the same over what arrived and refuses the bucket on a mismatch.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

_CHECK_PERIOD = 251  # prime: a shift of the bytes by any amount that is not a multiple of 502 bytes shows


class ChecksumMismatch(RuntimeError):
    """A received bucket's checksum differs from the sender's."""


def bucket_checksum(flat: torch.Tensor) -> list[int]:
    """Exact, device-independent checksum of a packed bucket: ``[sum(w_i), sum((i mod 251 + 1) * w_i)]``.

    The bucket's bytes are read as 16-bit words ``w_i`` (8-bit for odd byte counts) and summed in
    int64, so the same bytes give the same two numbers on CPU and GPU; the position-weighted sum
    catches swapped or shifted data that a plain sum misses. Cost: one reduction over a
    ``[n / 251, 251]`` view, no copy.
    """
    raw = flat.contiguous().view(-1).view(torch.uint8)
    words = raw.view(torch.int16) if raw.numel() % 2 == 0 else raw
    n = words.numel()
    main = n - n % _CHECK_PERIOD
    weights = torch.arange(1, _CHECK_PERIOD + 1, dtype=torch.int64, device=words.device)
    if main:
        cols = words[:main].view(-1, _CHECK_PERIOD).sum(dim=0, dtype=torch.int64)
    else:
        cols = weights.new_zeros(_CHECK_PERIOD)
    tail = words[main:].to(torch.int64)
    total = int(cols.sum()) + int(tail.sum())
    weighted = int((cols * weights).sum()) + int((tail * weights[: tail.numel()]).sum())
    return [total, weighted]


def tensors_checksum(tensors: Sequence[torch.Tensor]) -> list[int]:
    """Checksum of a bucket sent tensor by tensor: ``[sum_i c_i[0], sum_i (i + 1) * c_i[1]]`` over
    :func:`bucket_checksum` ``c_i`` of each tensor (order-sensitive)."""
    total, weighted = 0, 0
    for i, t in enumerate(tensors):
        c = bucket_checksum(t)
        total += c[0]
        weighted += (i + 1) * c[1]
    return [total, weighted]


def payload_checksum(tensors: Sequence[torch.Tensor], packed: bool) -> list[int]:
    """The checksum of a bucket as it travels: :func:`bucket_checksum` of its one flat tensor when
    ``packed``, else :func:`tensors_checksum` of its tensors."""
    return bucket_checksum(tensors[0]) if packed else tensors_checksum(tensors)


def verify_checksum(got: Sequence[int], expected: Sequence[int], names: Sequence[str]) -> None:
    """ChecksumMismatch naming the bucket when ``got`` differs from the sender's ``expected``."""
    if [int(x) for x in got] != [int(x) for x in expected]:
        first = names[0] if names else "?"
        raise ChecksumMismatch(
            f"bucket of {len(names)} tensors ({first} ...) arrived with checksum {list(got)}, "
            f"the sender's is {list(expected)}: the transfer corrupted it"
        )
