"""Streaming, tensor-by-tensor reading and writing of Hugging Face safetensors checkpoints.

Neither side maps or holds a whole file: :class:`SafetensorsReader` reads one tensor (or a row
range of one) with plain file reads into a fresh tensor, and :class:`SafetensorsShardWriter`
writes a planned list of tensors into size-bounded shards, each header first, then the tensors
as they arrive, plus ``model.safetensors.index.json``. Format: 8-byte little-endian header
length, a JSON header ``{name: {dtype, shape, data_offsets}}`` padded with spaces to a multiple
of 8, then the raw little-endian tensor bytes, contiguous, in header-offset order.
"""
from __future__ import annotations

import json
import logging
import math
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from megatron_agentrl.config import ConfigError, read_mapping_file
from megatron_agentrl.convert.base import ConversionError
from rollout_sglang.dtypes import SAFETENSORS_CODES, SAFETENSORS_DTYPES

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def dtype_size(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return dtype.itemsize


def parse_size(size: str | int, what: str = "size") -> int:
    """Bytes in ``size``: a positive int, or a string like ``"5GB"``, ``"500MB"``, ``"2GiB"``.

    ConversionError naming ``what`` and the value for anything else (zero, negative, ``"5XB"``).
    """
    n: int | None = None
    if isinstance(size, int) and not isinstance(size, bool):
        n = size
    elif isinstance(size, str):
        s = size.strip().upper()
        units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "KB": 10**3, "MB": 10**6, "GB": 10**9,
                 "TB": 10**12, "B": 1}
        unit = next((u for u in units if s.endswith(u)), "")
        try:
            n = int(float(s[: len(s) - len(unit)]) * units[unit]) if unit else int(s)
        except (ValueError, OverflowError):  # "5XB", "nan", "infGB"
            n = None
    if n is None or n <= 0:
        raise ConversionError(f"{what} {size!r} is not a positive byte count; give one like '5GB', '500MB' "
                              "or 1000000")
    return n


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: file, dtype, shape and absolute byte range in the file."""

    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


def read_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """The tensors of one ``.safetensors`` file (name -> :class:`TensorInfo`) and its ``__metadata__``.

    ConversionError naming the file when the header is not one, or when it does not match the file:
    byte ranges that disagree with a tensor's shape and dtype, or that run past the end of the file.
    """
    damaged = "the file is damaged: copy it again"
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ConversionError(f"'{path}' is not a safetensors file (shorter than 8 bytes); {damaged}")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 * 2**20:
            raise ConversionError(f"'{path}' is not a safetensors file (header length {n}); {damaged}")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConversionError(f"'{path}' has a corrupt safetensors header: {e}; {damaged}") from None
        size = os.fstat(f.fileno()).st_size
    if not isinstance(header, dict):
        raise ConversionError(f"'{path}' has a corrupt safetensors header (a JSON {type(header).__name__}, "
                              f"not an object); {damaged}")
    base = 8 + n
    meta = header.pop("__metadata__", None) or {}
    out = {}
    for name, h in header.items():
        shape = h.get("shape") if isinstance(h, dict) else None
        offsets = h.get("data_offsets") if isinstance(h, dict) else None
        if (not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape)
                or not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)):
            raise ConversionError(f"'{path}': the header entry of tensor {name} is malformed ({h!r:.100}); "
                                  f"{damaged}")
        if h.get("dtype") not in SAFETENSORS_DTYPES:
            raise ConversionError(f"'{path}': tensor {name} has dtype {h.get('dtype')!r}, which the converter "
                                  f"cannot read; supported: {', '.join(SAFETENSORS_DTYPES)}")
        dtype = SAFETENSORS_DTYPES[h["dtype"]]
        b, e = offsets
        need = math.prod(shape) * dtype_size(dtype)
        if not 0 <= b <= e or e - b != need:
            raise ConversionError(f"'{path}': the header gives tensor {name} the bytes [{b}, {e}), its shape "
                                  f"{shape} and dtype {h['dtype']} need {need}; {damaged}")
        if base + e > size:
            raise ConversionError(f"'{path}' is truncated: {size} bytes, but its header places tensor {name} at "
                                  f"bytes [{base + b}, {base + e}); {damaged}")
        out[name] = TensorInfo(path, dtype, tuple(shape), base + b, base + e)
    return out, meta


def read_weight_files(root: Path) -> tuple[dict[str, str] | None, list[str]]:
    """The weight files of the Hugging Face checkpoint directory ``root``: with ``model.safetensors.index.json``,
    its ``weight_map`` (tensor name -> shard file) and the shards it lists (sorted); else ``(None,
    ["model.safetensors"])``. The one reader of the index, for the streaming reader and for ``hf_io``.

    Raises ConversionError (a ConfigError) naming the index when it is not JSON or has no weight_map of
    tensor name -> shard file; FileNotFoundError naming ``root`` when it holds neither file, or the shards the
    index lists that are missing.
    """
    index = root / INDEX_FILE
    if index.is_file():
        try:
            weight_map = read_mapping_file(index, "json", f"'{index}'").get("weight_map")
        except ConfigError as e:
            raise ConversionError(f"{e}; copy the checkpoint's index again") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ConversionError(f"'{index}' is not a safetensors index: it needs a weight_map object of "
                                  "tensor name -> shard file; copy the checkpoint's index again (or rewrite the "
                                  "checkpoint with transformers' save_pretrained)")
        files = sorted(set(weight_map.values()))
    elif (root / SINGLE_FILE).is_file():
        return None, [SINGLE_FILE]
    else:
        found = " (found .bin files" if any(root.glob("*.bin")) else " (convert .bin files"
        raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in '{root}'; only safetensors checkpoints are "
                                f"read{found}: re-save them with save_pretrained(safe_serialization=True))")
    missing = [f for f in files if not (root / f).is_file()]
    if missing:
        raise FileNotFoundError(f"shard(s) {missing} listed in '{index}' are missing from '{root}'; "
                                "copy the complete checkpoint")
    return weight_map, files


class SafetensorsReader:
    """Index of a Hugging Face safetensors checkpoint directory; reads tensors one at a time.

    Args:
        root: a directory with ``model.safetensors``, or ``model.safetensors.index.json`` and
            the shards it lists.

    Raises:
        FileNotFoundError: no safetensors weights in ``root``, or a shard the index lists is
            missing (named).
    """

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise FileNotFoundError(f"'{root}' is not a directory; give a Hugging Face checkpoint directory")
        weight_map, files = read_weight_files(self.root)
        self.tensors: dict[str, TensorInfo] = {}
        for fname in files:
            infos, _ = read_header(self.root / fname)
            for name, info in infos.items():
                if weight_map is None or weight_map.get(name) == fname:
                    self.tensors[name] = info
        if weight_map is not None:
            lost = sorted(set(weight_map) - set(self.tensors))
            if lost:
                raise ConversionError(f"'{self.root / INDEX_FILE}' lists tensors {lost[:5]} that their shards do "
                                      "not hold")

    def names(self) -> list[str]:
        """All tensor names, in file and offset order."""
        return sorted(self.tensors, key=lambda n: (str(self.tensors[n].path), self.tensors[n].start))

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def info(self, name: str) -> TensorInfo:
        """:class:`TensorInfo` of ``name`` (KeyError naming the directory when absent)."""
        try:
            return self.tensors[name]
        except KeyError:
            raise KeyError(f"tensor '{name}' is not in the checkpoint '{self.root}'") from None

    def read(self, name: str, rows: tuple[int, int] | None = None, out: Tensor | None = None) -> Tensor:
        """Tensor ``name`` (or its rows ``[rows[0], rows[1])`` on dim 0) read from disk into new
        memory (or into ``out``, a contiguous tensor of the right shape and dtype)."""
        info = self.info(name)
        shape = list(info.shape)
        start, end = info.start, info.end
        if rows is not None:
            a, b = rows
            if not (len(shape) >= 1 and 0 <= a <= b <= shape[0]):
                raise ValueError(f"rows {rows} out of range for '{name}' of shape {tuple(shape)}")
            row_bytes = (end - start) // shape[0] if shape[0] else 0
            start, end = start + a * row_bytes, start + b * row_bytes
            shape[0] = b - a
        if out is None:
            out = torch.empty(shape, dtype=info.dtype)
        elif tuple(out.shape) != tuple(shape) or out.dtype != info.dtype or not out.is_contiguous():
            raise ValueError(
                f"out has shape {tuple(out.shape)} {out.dtype}, '{name}' needs {tuple(shape)} {info.dtype}")
        n = end - start
        if n != out.numel() * out.element_size():
            raise ConversionError(f"'{info.path}': tensor {name} has {n} bytes, its shape {shape} needs "
                                  f"{out.numel() * out.element_size()}")
        if n:
            buf = memoryview(out.view(-1).view(torch.uint8).numpy())
            with open(info.path, "rb", buffering=0) as f:
                f.seek(start)
                got = 0
                while got < n:
                    k = f.readinto(buf[got:])
                    if not k:
                        raise ConversionError(f"'{info.path}' is truncated (tensor {name})")
                    got += k
        return out


class SafetensorsShardWriter:
    """Writes a planned sequence of tensors into safetensors shards plus an index, streaming.

    Args:
        out_dir: output directory (created).
        plan: ``(name, shape, dtype)`` in the order :meth:`write` will be called.
        max_shard_bytes: a shard is closed before it would exceed this many bytes (a single
            larger tensor gets a shard of its own).

    Shard files are ``model-0000i-of-0000n.safetensors``; ``model.safetensors.index.json`` maps
    each name to its file. Peak memory: the tensor being written.
    """

    def __init__(self, out_dir: str | Path, plan: Sequence[tuple[str, tuple[int, ...], torch.dtype]],
                 max_shard_bytes: int) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        names = [p[0] for p in plan]
        if len(set(names)) != len(names):
            raise ValueError("duplicate tensor names in the plan")
        shards: list[list[tuple[str, tuple[int, ...], torch.dtype]]] = [[]]
        size = 0
        for name, shape, dtype in plan:
            if dtype not in SAFETENSORS_CODES:
                raise ConversionError(f"{name}: dtype {dtype} cannot be written to safetensors")
            nbytes = math.prod(shape) * dtype_size(dtype)
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append((name, tuple(shape), dtype))
            size += nbytes
        n = len(shards)
        self._files = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        self._shards = shards
        self._order = [(si, entry) for si, shard in enumerate(shards) for entry in shard]
        self._pos = 0
        self._fh = None
        self._cur = -1
        self.total_size = sum(math.prod(s) * dtype_size(d) for _, s, d in plan)
        self.weight_map = {name: self._files[si] for si, (name, _, _) in self._order}

    def _open(self, si: int) -> None:
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        off = 0
        for name, shape, dtype in self._shards[si]:
            nbytes = math.prod(shape) * dtype_size(dtype)
            header[name] = {"dtype": SAFETENSORS_CODES[dtype], "shape": list(shape),
                            "data_offsets": [off, off + nbytes]}
            off += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._fh = open(self.out_dir / self._files[si], "wb")
        self._fh.write(struct.pack("<Q", len(raw)))
        self._fh.write(raw)
        self._cur = si

    def _close_current(self) -> None:
        if self._fh is not None:
            self._fh.flush()
            os.fsync(self._fh.fileno())
            self._fh.close()
            self._fh = None

    def write(self, name: str, tensor: Tensor) -> None:
        """Append ``tensor`` (must be the next planned name, with its planned shape and dtype)."""
        if self._pos >= len(self._order):
            raise ValueError(f"'{name}': every planned tensor is already written")
        si, (want, shape, dtype) = self._order[self._pos]
        if name != want:
            raise ValueError(f"expected tensor '{want}' next, got '{name}'")
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise ValueError(f"'{name}': planned {shape} {dtype}, got {tuple(tensor.shape)} {tensor.dtype}")
        if si != self._cur:
            self._close_current()
            self._open(si)
        t = tensor.detach().cpu().contiguous()
        if t.numel():
            self._fh.write(memoryview(t.view(-1).view(torch.uint8).numpy()))  # type: ignore[union-attr]
        self._pos += 1

    def abort(self) -> None:
        """Close the open shard without writing the index (the output is being thrown away)."""
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def close(self) -> Path:
        """Close the last shard and write the index; returns the index path. Raises if a planned
        tensor was never written."""
        if self._pos != len(self._order):
            raise ValueError(f"{len(self._order) - self._pos} planned tensors were not written "
                             f"(next: '{self._order[self._pos][1][0]}')")
        self._close_current()
        index = self.out_dir / INDEX_FILE
        index.write_text(json.dumps({"metadata": {"total_size": self.total_size}, "weight_map": self.weight_map},
                                    indent=2) + "\n")
        return index
