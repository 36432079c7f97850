"""Hugging Face safetensors checkpoint -> megatron-core distributed checkpoint, streaming.

``convert_hf_to_megatron(hf_dir, out_dir, tp, pp)`` (also ``tools/convert_hf_to_megatron.py``
and ``agentrl convert hf-to-megatron``) writes the checkpoint a TP=tp, PP=pp megatron model would
save (same keys, stacked layers, padded vocab, one stored chunk per TP rank), in one process
and without torch.distributed. It reads one HF tensor (or, for the embedding and output layer,
only the rows of one TP chunk) at a time and writes each chunk before producing the next, so
peak memory is about the largest chunk: the vocab chunk ``padded_vocab / tp * hidden``
elements, or one layer's MLP. The result loads at any TP x PP
(:func:`megatron_agentrl.convert.checkpoint.load_megatron_checkpoint`).
"""
from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from megatron_agentrl.config import read_mapping_file
from megatron_agentrl.convert import ARCHITECTURES, MAPPINGS, get_mapping
from megatron_agentrl.convert.base import ConversionError, GPTMapping, padded_vocab_size
from megatron_agentrl.convert.checkpoint import (
    HF_ASSETS_DIR,
    CheckpointInfo,
    StoredTensor,
    copy_hf_assets,
    dtype_name,
    parse_dtype,
    write_dcp_streaming,
    write_megatron_common_files,
)
from megatron_agentrl.convert.safetensors_io import SafetensorsReader

logger = logging.getLogger(__name__)


def load_hf_config_dict(hf_dir: str | Path) -> dict[str, Any]:
    """``config.json`` of ``hf_dir`` (or a config.json path) as a dict, with ``model_type``
    resolved from ``architectures`` when missing. ConversionError for an unknown architecture."""
    path = Path(hf_dir)
    if path.is_dir() and (path / ".metadata").is_file() and (path / "metadata.json").is_file():
        raise ConversionError(f"'{path}' is a megatron distributed checkpoint, not a Hugging Face one; "
                              "use megatron-to-hf to convert it")
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"'{path}' does not exist; a Hugging Face checkpoint directory needs config.json")
    data = read_mapping_file(path, "json", f"'{path}'")
    archs = data.get("architectures") or []
    model_type = data.get("model_type")
    if model_type not in MAPPINGS:
        known = [ARCHITECTURES[a] for a in archs if a in ARCHITECTURES]
        if not known:
            raise ConversionError(
                f"unknown architecture {archs or None} (model_type={model_type!r}) in '{path}'; supported: "
                + ", ".join(f"{a} ({m})" for a, m in ARCHITECTURES.items())
            )
        model_type = known[0]
    bad_arch = [a for a in archs if a not in ARCHITECTURES]
    if bad_arch:
        raise ConversionError(f"architecture {bad_arch} in '{path}' is not supported (model_type={model_type}); "
                              f"supported: {sorted(ARCHITECTURES)}")
    data["model_type"] = model_type
    return data


def hf_config_from_dict(data: dict[str, Any]) -> Any:
    """A transformers config object from a config.json dict (``model_type`` required)."""
    from transformers import AutoConfig

    d = dict(data)
    model_type = d.pop("model_type")
    d.pop("transformers_version", None)
    cfg = AutoConfig.for_model(model_type, **d)
    return cfg


def check_hf_tensors(reader: SafetensorsReader, mapping: GPTMapping) -> None:
    """ConversionError unless the checkpoint holds exactly the tensors (names, shapes) of
    ``mapping``'s model; a tied ``lm_head.weight`` and rotary buffers are tolerated."""
    expected: dict[str, tuple[int, ...]] = {}
    for mname in mapping.megatron_names():
        expected.update(mapping.hf_shapes(mname))
    missing = sorted(set(expected) - set(reader.tensors))
    unexpected = sorted(n for n in reader.tensors if n not in expected and not mapping.is_ignorable_hf_name(n))
    if missing or unexpected:
        raise ConversionError(
            f"'{reader.root}' does not hold the tensors of its {mapping.model_type} config "
            f"({mapping.num_layers} layers, qkv_bias={mapping.qkv_bias}, tied={mapping.tie_word_embeddings}): "
            f"missing {missing[:8]}{' ...' if len(missing) > 8 else ''}, "
            f"unexpected {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}. "
            "Are the weights of another family than config.json says?"
        )
    for name, shape in expected.items():
        got = reader.info(name).shape
        if got != shape:
            raise ConversionError(f"'{reader.root}': tensor {name} has shape {got}, config.json implies {shape}")


class _ChunkProducer:
    """Makes checkpoint chunks from HF tensors, keeping only the current full Megatron tensor."""

    def __init__(self, reader: SafetensorsReader, mapping: GPTMapping, dtype: torch.dtype | None,
                 key_to_names: dict[str, dict[tuple[int, ...], str]], progress: Any) -> None:
        self.reader = reader
        self.mapping = mapping
        self.dtype = dtype
        self.key_to_names = key_to_names
        self.progress = progress
        self._cached: tuple[str, Tensor] | None = None

    def _full(self, mname: str) -> Tensor:
        if self._cached is not None and self._cached[0] == mname:
            return self._cached[1]
        self._cached = None  # drop the previous one before reading the next
        hf = {n: self.reader.read(n) for n in self.mapping.hf_names(mname)}
        full = self.mapping.to_megatron(mname, hf)
        del hf
        if self.dtype is not None and not self.mapping.keeps_fp32(mname):
            full = full.to(self.dtype)
        self._cached = (mname, full)
        return full

    def __call__(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Tensor:
        names = self.key_to_names[key]
        depth = len(next(iter(names)))  # leading stacked axes (layer, expert), one element each per chunk
        mname = names[tuple(offsets[:depth])]
        offsets, sizes = offsets[depth:], sizes[depth:]
        if self.mapping.tp_layout(mname).vocab:
            out = self._vocab_rows(mname, offsets[0], sizes[0])
        else:
            full = self._full(mname)
            out = full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].clone()
        if self.progress is not None:
            self.progress.update(out.numel() * out.element_size())
        return out.reshape((1,) * depth + tuple(out.shape))

    def _vocab_rows(self, mname: str, start: int, rows: int) -> Tensor:
        """Rows ``[start, start + rows)`` of the padded vocab tensor, read straight from disk."""
        (hf_name,) = self.mapping.hf_names(mname)
        info = self.reader.info(hf_name)
        dtype = self.dtype or info.dtype
        real = max(0, min(start + rows, info.shape[0]) - start)
        out = torch.zeros(rows, *info.shape[1:], dtype=dtype)
        if real:
            if dtype == info.dtype:
                self.reader.read(hf_name, (start, start + real), out=out[:real])
            else:
                out[:real] = self.reader.read(hf_name, (start, start + real))
        return out


def plan_checkpoint(mapping: GPTMapping, reader: SafetensorsReader, tp: int, padded_vocab: int,
                    dtype: torch.dtype | None) -> tuple[list[StoredTensor], dict[str, dict[tuple[int, ...], str]]]:
    """The keys, global shapes and TP chunks to write, and key -> {index on its stacked axes ->
    Megatron name} (one name per layer, or per layer and expert, for stacked keys)."""
    key_to_names: dict[str, dict[tuple[int, ...], str]] = {}
    stack_of: dict[str, tuple[int, ...]] = {}
    for mname in mapping.megatron_names():
        key, index, stack = mapping.checkpoint_key(mname)
        key_to_names.setdefault(key, {})[index] = mname
        stack_of[key] = stack
    specs = []
    for key, names in key_to_names.items():
        mname = next(iter(names.values()))
        shape = list(mapping.megatron_shape(mname))
        if mapping.tp_layout(mname).vocab:
            shape[0] = padded_vocab
        chunks = mapping.checkpoint_chunks(mname, tp, padded_vocab)
        src_dtype = reader.info(mapping.hf_names(mname)[0]).dtype
        out_dtype = src_dtype if dtype is None or mapping.keeps_fp32(mname) else dtype
        ones = (1,) * len(stack_of[key])
        pieces = tuple(((*index, *c.offsets), (*ones, *c.sizes)) for index in names for c in chunks)
        specs.append(StoredTensor(key, (*stack_of[key], *shape), out_dtype, pieces))
    return specs, key_to_names


def convert_hf_to_megatron(
    hf_dir: str | Path,
    out_dir: str | Path,
    tp: int = 1,
    pp: int = 1,
    dtype: str | torch.dtype | None = None,
    make_vocab_size_divisible_by: int = 128,
    progress: bool = True,
    overwrite: bool = False,
) -> Path:
    """Convert the Hugging Face checkpoint in ``hf_dir`` to a megatron-core distributed
    checkpoint in ``out_dir``, laid out as a TP=``tp``, PP=``pp`` model saves it.

    Args:
        hf_dir: directory with config.json and safetensors weights (single file or sharded
            with an index); tokenizer / generation files are copied along into ``out_dir/hf``.
        out_dir: created; must not already hold a checkpoint unless ``overwrite``.
        tp, pp: target tensor / pipeline parallel sizes (TP must divide the attention and KV
            heads and the FFN width, PP the layers). The stored tensors do not depend on PP
            or on the expert-parallel size, and any other TP x PP x EP loads the result too.
        dtype: stored dtype (``float32`` | ``bfloat16`` | ``float16``); None / ``auto`` keeps
            the HF tensors' dtypes.
        make_vocab_size_divisible_by: vocab padding, to a multiple of this times ``tp``.
        progress: show a progress bar (bytes written) on stderr.

    Returns ``out_dir``. Raises ConversionError / FileNotFoundError with the bad path, name,
    size or family in the message, before anything is written.
    """
    from tqdm import tqdm

    hf_root = Path(hf_dir)
    config_dict = load_hf_config_dict(hf_root)
    hf_config = hf_config_from_dict(config_dict)
    mapping = get_mapping(hf_config)
    mapping.check_parallel(tp, pp)
    out_dtype = parse_dtype(dtype)
    reader = SafetensorsReader(hf_root)
    check_hf_tensors(reader, mapping)
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ConversionError(
            f"output directory '{out}' is not empty; choose a new one or pass overwrite / --overwrite")
    out.mkdir(parents=True, exist_ok=True)
    if overwrite:
        for stale in [*out.glob("*.distcp"), out / ".metadata"]:
            stale.unlink(missing_ok=True)

    padded = padded_vocab_size(mapping.vocab_size, make_vocab_size_divisible_by, tp)
    specs, key_to_names = plan_checkpoint(mapping, reader, tp, padded, out_dtype)
    total = sum(math.prod(s.global_shape) * torch.empty((), dtype=s.dtype).element_size() for s in specs)
    logger.info("converting %s (%s, %d layers) -> %s at tp=%d pp=%d, %.2f GB", hf_root, mapping.architecture,
                mapping.num_layers, out, tp, pp, total / 1e9)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="hf->megatron", disable=not progress)
    try:
        producer = _ChunkProducer(reader, mapping, out_dtype, key_to_names, bar)
        write_dcp_streaming(out, specs, producer)
    finally:
        bar.close()
    write_megatron_common_files(out)
    stored = {s.dtype for s in specs}
    CheckpointInfo(
        model_type=mapping.model_type, architecture=mapping.architecture, num_layers=mapping.num_layers,
        vocab_size=mapping.vocab_size, padded_vocab_size=padded,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by, tie_word_embeddings=mapping.tie_word_embeddings,
        tp=tp, pp=pp, dtype=dtype_name(stored.pop()) if len(stored) == 1 else "mixed",
    ).save(out)
    config_dict.setdefault("architectures", [mapping.architecture])
    copied = copy_hf_assets(hf_root, out / HF_ASSETS_DIR, config_dict)
    logger.info("wrote %s (hf assets: %s)", out, ", ".join(copied))
    return out

