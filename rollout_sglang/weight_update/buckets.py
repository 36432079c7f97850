"""Bucket layout of a weight update: Hugging Face-named tensors in flat, single-dtype buckets.

A bucket is one contiguous 1-D tensor of a single dtype holding several parameters back to
back (row-major, no padding), in the layout of SGLang's ``FlattenedTensorBucket``
(``load_format="flattened_bucket"`` of ``/update_weights_from_distributed``): it travels as raw
bytes, tensor ``i`` at elements ``[offset_i, offset_i + numel_i)`` of the bucket's dtype. The
receiving side rebuilds the tensors from the request's ``names``, ``dtypes`` and ``shapes`` alone
(:func:`flattened_layout`; SGLang's receiver also takes buckets that mix dtypes).

Buckets are planned greedily in the order the tensors arrive: a bucket closes when the next
tensor would push it past ``bucket_bytes`` or has another dtype; a tensor larger than
``bucket_bytes`` gets a bucket of its own.

Dtypes travel by name (SGLang's spelling), that of the project's one dtype map, ``rollout_sglang.dtypes``.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

# DTYPES and DTYPE_ALIASES: re-exported by rollout_sglang.weight_update
from rollout_sglang.dtypes import DTYPE_ALIASES, DTYPES, dtype_from_name, dtype_name  # noqa: F401


@dataclass
class BucketMeta:
    """Everything a receiver needs to rebuild one bucket.

    index: position of the bucket in its sync (0-based, per PP stage).
    dtype: the single dtype of every tensor in the bucket.
    names / shapes: the tensors, in packing order (Hugging Face names).
    numel: total elements; nbytes: total bytes (= numel * element size).
    """

    index: int
    dtype: torch.dtype
    names: list[str] = field(default_factory=list)
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    numel: int = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the packed bucket."""
        return self.numel * self.dtype.itemsize

    def offsets(self) -> list[tuple[int, int]]:
        """``[start, end)`` element range of each tensor in the flat bucket."""
        out, off = [], 0
        for s in self.shapes:
            n = math.prod(s)
            out.append((off, off + n))
            off += n
        return out

    def wire(self) -> dict:
        """The SGLang request fields: ``{"names", "dtypes", "shapes"}`` (one dtype string per tensor)."""
        d = dtype_name(self.dtype)
        return {"names": list(self.names), "dtypes": [d] * len(self.names), "shapes": [list(s) for s in self.shapes]}


def plan_buckets(specs: Iterable[tuple[str, Sequence[int], torch.dtype]], bucket_bytes: int) -> list[BucketMeta]:
    """Group ``(name, shape, dtype)`` specs into buckets of at most ``bucket_bytes`` each (see module doc)."""
    return list(_plan(((n, tuple(s), d) for n, s, d in specs), bucket_bytes))


def _plan(specs: Iterable[tuple[str, tuple[int, ...], torch.dtype]], bucket_bytes: int) -> Iterator[BucketMeta]:
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be positive")
    cur: BucketMeta | None = None
    index = 0
    for name, shape, dtype in specs:
        n = math.prod(shape)
        size = n * dtype.itemsize
        if cur is not None and (cur.dtype != dtype or cur.nbytes + size > bucket_bytes):
            yield cur
            index += 1
            cur = None
        if cur is None:
            cur = BucketMeta(index=index, dtype=dtype)
        cur.names.append(name)
        cur.shapes.append(shape)
        cur.numel += n
    if cur is not None:
        yield cur


def iter_buckets(
    named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[tuple[BucketMeta, list[torch.Tensor]]]:
    """Stream ``(meta, tensors)`` buckets from a stream of (name, tensor) pairs (greedy, as planned)."""
    cur: BucketMeta | None = None
    tensors: list[torch.Tensor] = []
    index = 0
    for name, t in named:
        size = t.numel() * t.element_size()
        if cur is not None and (cur.dtype != t.dtype or cur.nbytes + size > bucket_bytes):
            yield cur, tensors
            index += 1
            cur, tensors = None, []
        if cur is None:
            cur = BucketMeta(index=index, dtype=t.dtype)
        cur.names.append(name)
        cur.shapes.append(tuple(t.shape))
        cur.numel += t.numel()
        tensors.append(t)
    if cur is not None:
        yield cur, tensors


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for same-dtype, same-numel tensors; on CPU a plain single-threaded memcpy.

    torch's CPU copy splits tensors of more than 32K elements over its OpenMP threads, whose
    spin-wait after every such copy steals the cores that the gloo transfer needs
    (docs/BENCHMARKS.md); numpy's copy is one memcpy without the GIL. Other devices (and dtype
    changes) go through ``copy_``.
    """
    if (dst.device.type == "cpu" and src.device.type == "cpu" and dst.dtype == src.dtype
            and dst.is_contiguous() and src.is_contiguous() and dst.numel() == src.numel()):
        d, s = dst.reshape(-1).view(torch.uint8), src.reshape(-1).view(torch.uint8)
        if d.numel():
            np.copyto(d.numpy(), s.numpy())
        return
    dst.copy_(src.reshape(dst.shape), non_blocking=True)


def pack_into(buffer: torch.Tensor, meta: BucketMeta, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Copy ``tensors`` into the first ``meta.nbytes`` of ``buffer`` (a uint8 tensor); returns those bytes.

    The returned uint8 slice is the bucket as it goes on the wire: SGLang receives a flattened
    bucket as raw bytes, and NCCL matches a broadcast by element count and type.

    ``buffer`` must be a contiguous uint8 tensor with at least ``meta.nbytes`` elements on the
    device the bucket is sent from; a too-small buffer raises ValueError. One copy per tensor
    (:func:`copy_bytes`), none when a tensor already has the bucket's dtype and layout.
    """
    if buffer.dtype != torch.uint8 or buffer.ndim != 1:
        raise ValueError("pack_into needs a 1-D uint8 buffer")
    if buffer.numel() < meta.nbytes:
        raise ValueError(f"buffer of {buffer.numel()} bytes is too small for bucket {meta.index} ({meta.nbytes} bytes)")
    flat = buffer[: meta.nbytes].view(meta.dtype)
    for (start, end), t in zip(meta.offsets(), tensors):
        if t.dtype == meta.dtype and t.device == flat.device:
            copy_bytes(flat[start:end], t.contiguous())
        else:
            flat[start:end].view(t.shape).copy_(t, non_blocking=True)
    return buffer[: meta.nbytes]


def pack(meta: BucketMeta, tensors: Sequence[torch.Tensor], device: torch.device | str | None = None) -> torch.Tensor:
    """A new raw-byte (uint8, 1-D) bucket holding ``tensors`` back to back (see :func:`pack_into`)."""
    dev = torch.device(device) if device is not None else (tensors[0].device if tensors else torch.device("cpu"))
    buf = torch.empty(meta.nbytes, dtype=torch.uint8, device=dev)
    return pack_into(buf, meta, tensors)


# one tensor of a received flattened bucket: (name, dtype, shape, first byte)
TensorSpan = tuple[str, torch.dtype, tuple[int, ...], int]


def flattened_layout(names: Sequence[str], dtypes: Sequence[str],
                     shapes: Sequence[Sequence[int]]) -> tuple[list[TensorSpan], int]:
    """The byte layout of a received ``load_format="flattened_bucket"`` request, as SGLang reads it.

    The bucket travels as raw bytes (one uint8 tensor); tensor ``i`` starts at byte ``start_i``, right
    after tensor ``i-1``, in its own dtype (a bucket may mix dtypes). Returns
    ``([(name, dtype, shape, start_byte), ...], total_bytes)``. ValueError, naming the tensor, for
    lengths that differ, an empty bucket, a negative dimension or a tensor whose start is not a
    multiple of its element size (SGLang refuses those too).
    """
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError(f"names ({len(names)}), dtypes ({len(dtypes)}) and shapes ({len(shapes)}) "
                         "must have the same length")
    if not names:
        raise ValueError("a weight bucket needs at least one tensor (names is empty)")
    layout, offset = [], 0
    for name, d, s in zip(names, dtypes, shapes):
        dtype, shape = dtype_from_name(d), tuple(int(x) for x in s)
        if any(x < 0 for x in shape):
            raise ValueError(f"negative dimension in the shape {list(shape)} of {name!r}")
        size = dtype.itemsize
        if offset % size:
            raise ValueError(f"{name!r} ({d}) would start at byte {offset} of the flattened bucket, not a multiple "
                             f"of its element size {size}; order a bucket's tensors so each one is aligned")
        layout.append((str(name), dtype, shape, offset))
        offset += math.prod(shape) * size
    return layout, offset


def unflatten_bytes(flat: torch.Tensor, layout: Sequence[TensorSpan]) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) views into the raw-byte bucket ``flat`` (uint8, 1-D) per :func:`flattened_layout`."""
    out = []
    for name, dtype, shape, start in layout:
        nbytes = math.prod(shape) * dtype.itemsize
        out.append((name, flat[start:start + nbytes].view(dtype).view(shape)))
    return out


def iter_split_buckets(
    named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, small_bytes: int
) -> Iterator[tuple[BucketMeta, list[torch.Tensor], bool]]:
    """Stream buckets in two kinds: ``(meta, tensors, packed)``.

    Tensors of at least ``small_bytes`` go to per-tensor buckets (``packed`` False: each is sent
    as it is, no copy); smaller ones (norms, biases) are gathered into their own buckets that are
    sent packed (``packed`` True), so that they do not cost one collective each. Both kinds close
    at ``bucket_bytes`` or on a dtype change; indices count the emitted buckets.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be positive")
    open_: dict[bool, tuple[BucketMeta, list[torch.Tensor]] | None] = {True: None, False: None}
    index = 0

    def close(packed: bool) -> tuple[BucketMeta, list[torch.Tensor], bool] | None:
        nonlocal index
        cur = open_[packed]
        open_[packed] = None
        if cur is None:
            return None
        cur[0].index = index
        index += 1
        return cur[0], cur[1], packed

    for name, t in named:
        size = t.numel() * t.element_size()
        packed = size < small_bytes
        cur = open_[packed]
        if cur is not None and (cur[0].dtype != t.dtype or cur[0].nbytes + size > bucket_bytes):
            out = close(packed)
            assert out is not None
            yield out
            cur = None
        if cur is None:
            cur = open_[packed] = (BucketMeta(index=-1, dtype=t.dtype), [])
        cur[0].names.append(name)
        cur[0].shapes.append(tuple(t.shape))
        cur[0].numel += t.numel()
        cur[1].append(t)
    for packed in (False, True):
        out = close(packed)
        if out is not None:
            yield out
