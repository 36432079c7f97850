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
from megatron_agentrl.convert.base import ConversionError, GPTMapping, one_line
from megatron_agentrl.convert.checkpoint import (
    HF_ASSETS_DIR,
    CheckpointInfo,
    StoredTensor,
    copy_hf_assets,
    parse_dtype,
    write_dcp_streaming,
    write_megatron_common_files,
)
from megatron_agentrl.convert.output_dir import atomic_output_dir, check_output_dir
from megatron_agentrl.convert.safetensors_io import SafetensorsReader
from megatron_agentrl.parallel_layout import ModelDims, ParallelLayout, padded_vocab_size
from rollout_sglang.dtypes import dtype_name

logger = logging.getLogger(__name__)


# Sizes every family's config.json must state (transformers would fill in a default model's sizes)
REQUIRED_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# Sizes that may be absent or null, and must be positive integers when given
OPTIONAL_SIZES = ("num_key_value_heads", "head_dim")


def config_json_path(hf_dir: str | Path) -> Path:
    """``hf_dir/config.json`` for a directory, else ``hf_dir`` itself (a config.json path)."""
    path = Path(hf_dir)
    return path / "config.json" if path.is_dir() else path


def load_hf_config_dict(hf_dir: str | Path) -> dict[str, Any]:
    """``config.json`` of ``hf_dir`` (or a config.json path) as a dict, with ``model_type``
    resolved from ``architectures`` when missing. ConversionError for an unknown architecture,
    or for model sizes that are missing or not positive integers."""
    path = Path(hf_dir)
    if path.is_dir() and (path / ".metadata").is_file() and (path / "metadata.json").is_file():
        raise ConversionError(f"'{path}' is a megatron distributed checkpoint, not a Hugging Face one; "
                              "use megatron-to-hf to convert it")
    path = config_json_path(path)
    if not path.is_file():
        raise FileNotFoundError(f"'{path}' does not exist; a Hugging Face checkpoint directory needs config.json")
    data = read_mapping_file(path, "json", f"'{path}'")
    archs = data.get("architectures") or []
    model_type = data.get("model_type")
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ConversionError(f"architectures={archs!r} in '{path}' must be a list of class names, e.g. "
                              f"[\"{next(iter(ARCHITECTURES))}\"]")
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
    lacking = [k for k in REQUIRED_SIZES if data.get(k) is None]
    if lacking:
        raise ConversionError(f"'{path}' lacks {', '.join(lacking)}; a {model_type} config.json states the model's "
                              "sizes: use the config.json the weights were saved with")
    for key in REQUIRED_SIZES + OPTIONAL_SIZES:
        value = data.get(key)
        if value is not None and (type(value) is not int or value < 1):
            raise ConversionError(f"{key}={value!r} in '{path}' must be a positive integer; use the config.json "
                                  "the weights were saved with")
    data["model_type"] = model_type
    return data


def hf_config_from_dict(data: dict[str, Any], where: str = "config.json") -> Any:
    """A transformers config object from a config.json dict (``model_type`` required); ConversionError
    naming ``where`` when transformers refuses the values."""
    from transformers import AutoConfig

    d = dict(data)
    model_type = d.pop("model_type")
    d.pop("transformers_version", None)
    try:
        return AutoConfig.for_model(model_type, **d)
    except Exception as e:  # transformers' validators raise TypeError, ValueError and their own errors
        raise ConversionError(f"{where} is not a valid {model_type} config: {one_line(e)}") from None


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
        out_dir: created; must be absent or empty unless ``overwrite`` (which replaces the old
            weights and ``hf/`` and keeps other files).
        tp, pp: target tensor / pipeline parallel sizes (TP must divide the attention and KV
            heads and the FFN width, PP the layers). The stored tensors do not depend on PP
            or on the expert-parallel size, and any other TP x PP x EP loads the result too.
        dtype: stored dtype (``float32`` | ``bfloat16`` | ``float16``); None / ``auto`` keeps
            the HF tensors' dtypes.
        make_vocab_size_divisible_by: vocab padding, to a multiple of this times ``tp``.
        progress: show a progress bar (bytes written) on stderr.

    Returns ``out_dir``. Raises ConversionError / FileNotFoundError with the bad path, name,
    size or family in the message, before anything is written. The checkpoint is written into a
    temporary directory next to ``out_dir`` and renamed to it at the end: a conversion that fails
    (or is interrupted) leaves ``out_dir`` as it was.
    """
    from tqdm import tqdm

    m = make_vocab_size_divisible_by
    if type(m) is not int or m < 1:
        raise ConversionError(f"make_vocab_size_divisible_by={m!r} must be a positive integer; "
                              "megatron's default is 128 (--make-vocab-size-divisible-by 128)")
    out_dtype = parse_dtype(dtype)
    hf_root = Path(hf_dir)
    config_dict = load_hf_config_dict(hf_root)
    hf_config = hf_config_from_dict(config_dict, f"'{config_json_path(hf_root)}'")
    mapping = get_mapping(hf_config)
    ParallelLayout(tp=tp, pp=pp).check_model(ModelDims.of(mapping))
    reader = SafetensorsReader(hf_root)
    check_hf_tensors(reader, mapping)
    out = check_output_dir(out_dir, overwrite, source=hf_root)

    padded = padded_vocab_size(mapping.vocab_size, make_vocab_size_divisible_by, tp)
    specs, key_to_names = plan_checkpoint(mapping, reader, tp, padded, out_dtype)
    total = sum(math.prod(s.global_shape) * s.dtype.itemsize for s in specs)
    logger.info("converting %s (%s, %d layers) -> %s at tp=%d pp=%d, %.2f GB", hf_root, mapping.architecture,
                mapping.num_layers, out, tp, pp, total / 1e9)
    with atomic_output_dir(out, overwrite, stale=("*.distcp", ".metadata")) as tmp:
        bar = tqdm(total=total, unit="B", unit_scale=True, desc="hf->megatron", disable=not progress)
        try:
            producer = _ChunkProducer(reader, mapping, out_dtype, key_to_names, bar)
            write_dcp_streaming(tmp, specs, producer, checkpoint_id=out)
        finally:
            bar.close()
        write_megatron_common_files(tmp)
        stored = {s.dtype for s in specs}
        CheckpointInfo(
            model_type=mapping.model_type, architecture=mapping.architecture, num_layers=mapping.num_layers,
            vocab_size=mapping.vocab_size, padded_vocab_size=padded,
            make_vocab_size_divisible_by=make_vocab_size_divisible_by,
            tie_word_embeddings=mapping.tie_word_embeddings,
            tp=tp, pp=pp, dtype=dtype_name(stored.pop()) if len(stored) == 1 else "mixed",
        ).save(tmp)
        config_dict.setdefault("architectures", [mapping.architecture])
        copied = copy_hf_assets(hf_root, tmp / HF_ASSETS_DIR, config_dict)
    logger.info("wrote %s (hf assets: %s)", out, ", ".join(copied))
    return out
