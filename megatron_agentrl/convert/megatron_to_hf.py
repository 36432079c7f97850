"""megatron-core distributed checkpoint -> Hugging Face safetensors checkpoint, streaming.

``convert_megatron_to_hf(megatron_dir, out_dir)`` (also ``tools/convert_megatron_to_hf.py`` and
``agentrl convert megatron-to-hf``) reads a ``torch_dist`` checkpoint written at any TP x PP (by
:func:`~megatron_agentrl.convert.hf_to_megatron.convert_hf_to_megatron`, by
:func:`~megatron_agentrl.convert.checkpoint.save_megatron_checkpoint`, or by megatron code that
saved ``GPTModel.sharded_state_dict()``), one layer at a time, strips the vocab padding and
writes safetensors shards with an index, config.json and the tokenizer files the checkpoint
carries. Peak memory: one layer (a MoE layer in pieces of about ``GROUP_BYTES``, its experts a few at
a time), or the embedding / output layer (twice: the stored chunk and the assembled tensor).
A LoRA run's checkpoint is written merged into its base, or (``peft_adapter``) as its adapters in PEFT's format
(:mod:`~megatron_agentrl.convert.lora_checkpoint`).
"""
from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from megatron_agentrl.convert import get_mapping
from megatron_agentrl.convert.base import ConversionError
from megatron_agentrl.convert.checkpoint import (
    HF_ASSETS_DIR,
    TRAINING_MODEL_DIR,
    DistCheckpointReader,
    _check_family,
    check_checkpoint_matches,
    copy_hf_assets,
    parse_dtype,
)
from megatron_agentrl.convert.hf_to_megatron import config_json_path, hf_config_from_dict, load_hf_config_dict
from megatron_agentrl.convert.lora_checkpoint import LoraCheckpoint
from megatron_agentrl.convert.output_dir import atomic_output_dir, check_output_dir
from megatron_agentrl.convert.safetensors_io import INDEX_FILE, SafetensorsShardWriter, dtype_size, parse_size
from megatron_agentrl.lora.adapters import is_adapter
from rollout_sglang.dtypes import dtype_name
from rollout_sglang.engines.adapter import CONFIG_FILE, WEIGHTS_FILE

logger = logging.getLogger(__name__)

# Tensors read in one go: a layer, or pieces of a layer of about this many bytes (MoE layers: ~1 GB each in
# a 30B model would add up with the reader's buffers).
GROUP_BYTES = 256 * 1024**2


def _layer_groups(mapping: Any, layer: int, dtype_bytes: int) -> list[list[str]]:
    """Layer ``layer``'s Megatron names in read groups of about ``GROUP_BYTES`` (at least one name each)."""
    groups: list[list[str]] = [[]]
    size = 0
    for mname in mapping.layer_megatron_names(layer):
        nbytes = math.prod(mapping.megatron_shape(mname)) * dtype_bytes
        if groups[-1] and size + nbytes > GROUP_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(mname)
        size += nbytes
    return groups


def convert_megatron_to_hf(
    megatron_dir: str | Path,
    out_dir: str | Path,
    hf_config: str | Path | None = None,
    dtype: str | torch.dtype | None = None,
    max_shard_size: str | int = "5GB",
    progress: bool = True,
    overwrite: bool = False,
    peft_adapter: bool = False,
) -> Path:
    """Convert the megatron distributed checkpoint ``megatron_dir`` to a Hugging Face directory.

    Args:
        megatron_dir: a megatron-core ``torch_dist`` checkpoint directory, or a run's ``step_<k>/`` (its model is in
            ``model_optim/``; optimizer state and KL reference are left out).
        out_dir: output directory (created; must be absent or empty unless ``overwrite``, which
            replaces the old shards and keeps other files): gets
            ``model-0000i-of-0000n.safetensors``, ``model.safetensors.index.json``,
            ``config.json`` and the tokenizer / generation files found with the config.
        hf_config: a HF directory or config.json describing the model; default: the copy the
            checkpoint carries in ``megatron_dir/hf`` (required for checkpoints without one).
        dtype: output dtype (``float32`` | ``bfloat16`` | ``float16``); None / ``auto``: as stored.
        max_shard_size: bytes per safetensors shard, e.g. ``"5GB"``.
        progress: show a progress bar (layers) on stderr.
        peft_adapter: a LoRA run's checkpoint only: write its adapters in PEFT's format (``adapter_config.json``,
            ``adapter_model.safetensors``, ``base_model_name_or_path`` the base the checkpoint names) instead of the
            base with the adapters merged in; ``max_shard_size`` does not apply.

    Raises ConversionError naming the mismatch when the checkpoint is not a model of the
    config's family and sizes (e.g. a Llama config on a GLM-4 checkpoint), FileNotFoundError
    for a missing directory, config or data file; before anything is written. The output is
    written into a temporary directory next to ``out_dir`` and renamed to it at the end: a
    conversion that fails (or is interrupted) leaves ``out_dir`` as it was.
    """
    from tqdm import tqdm

    out_dtype = parse_dtype(dtype)
    shard_bytes = parse_size(max_shard_size, "max_shard_size / --max-shard-size")
    root = Path(megatron_dir)
    if (root / TRAINING_MODEL_DIR / "metadata.json").is_file() and not (root / "metadata.json").is_file():
        root = root / TRAINING_MODEL_DIR  # a run's step_<k>/: its model (with the optimizer state) is in there
    reader = DistCheckpointReader(root)
    cfg_src = Path(hf_config) if hf_config is not None else root / HF_ASSETS_DIR
    if hf_config is None and not (cfg_src / "config.json").is_file():
        raise FileNotFoundError(f"'{root}' carries no Hugging Face config ({cfg_src / 'config.json'}); "
                                "pass hf_config / --hf-config with the model's config.json")
    config_dict = load_hf_config_dict(cfg_src)
    cfg = hf_config_from_dict(config_dict, f"'{config_json_path(cfg_src)}'")
    _check_family(root, cfg)
    mapping = get_mapping(cfg)
    if any(is_adapter(k) for k in reader.keys()):  # a LoRA run's checkpoint: merged into the base it names
        source: Any = LoraCheckpoint(reader, mapping)
    elif peft_adapter:
        raise ConversionError(f"'{root}' holds no LoRA adapter (a full-parameter checkpoint), so it has none to write "
                              "in PEFT's format; drop peft_adapter / --peft-adapter to write its model")
    else:
        check_checkpoint_matches(reader, mapping, f"checkpoint '{root}'")
        source = _StoredModel(reader, mapping)
    out = check_output_dir(out_dir, overwrite, source=root)
    if peft_adapter:
        return _write_peft_adapter(source, out, out_dtype, overwrite)

    # Plan every output tensor (name, shape, dtype) in the order they will be produced.
    groups: list[list[str]] = [[n] for n in mapping.megatron_names() if not n.startswith("decoder.layers.")]
    itemsize = (max(dtype_size(source.dtype(m)) for m in mapping.megatron_names()) if out_dtype is None
                else dtype_size(out_dtype))
    layer_groups = [g for i in range(mapping.num_layers) for g in _layer_groups(mapping, i, itemsize)]
    groups = groups[:1] + layer_groups + groups[1:]
    plan = []
    for group in groups:
        for mname in group:
            for hf_name, shape in mapping.hf_shapes(mname).items():
                plan.append((hf_name, shape, out_dtype or source.dtype(mname)))
    with atomic_output_dir(out, overwrite, stale=("*.safetensors", INDEX_FILE)) as tmp:
        writer = SafetensorsShardWriter(tmp, plan, shard_bytes)
        logger.info("converting %s (%s, %d layers) -> %s, %.2f GB", root, mapping.architecture, mapping.num_layers,
                    out, writer.total_size / 1e9)
        bar = tqdm(total=writer.total_size, unit="B", unit_scale=True, desc="megatron->hf", disable=not progress)
        try:
            _write_groups(source, mapping, groups, out_dtype, writer, bar)
        except BaseException:
            writer.abort()
            raise
        finally:
            bar.close()
        writer.close()
        config_dict["architectures"] = [mapping.architecture]
        stored = {d for _, _, d in plan}
        if len(stored) == 1:
            config_dict["dtype"] = dtype_name(stored.pop())
            config_dict.pop("torch_dtype", None)
        assets_dir = cfg_src if cfg_src.is_dir() else cfg_src.parent
        copied = copy_hf_assets(assets_dir, tmp, config_dict)
    logger.info("wrote %s (%d tensors, %s)", out, len(plan), ", ".join(copied))
    return out


def _write_peft_adapter(checkpoint: LoraCheckpoint, out: Path, dtype: torch.dtype | None, overwrite: bool) -> Path:
    """Write ``checkpoint``'s adapters to ``out`` in PEFT's format (written whole or not at all)."""
    adapter = checkpoint.peft_adapter(dtype)
    with atomic_output_dir(out, overwrite, stale=(WEIGHTS_FILE, CONFIG_FILE)) as tmp:
        adapter.save(tmp)
    logger.info("wrote %s: %d adapted layers of rank %d in PEFT's format, base %s", out, len(checkpoint.adapted),
                checkpoint.options.rank, checkpoint.base_dir)
    return out


class _StoredModel:
    """The model stored in a megatron checkpoint, read a group of megatron tensors at a time."""

    def __init__(self, reader: DistCheckpointReader, mapping: Any) -> None:
        self.reader, self.mapping = reader, mapping

    def dtype(self, mname: str) -> torch.dtype:
        return self.reader.dtype(self.mapping.checkpoint_key(mname)[0])

    def read_group(self, group: list[str], dtype: torch.dtype | None) -> dict[str, Tensor]:
        requests = {}
        for mname in group:
            key, index, _ = self.mapping.checkpoint_key(mname)
            shape = self.mapping.megatron_shape(mname)  # unpadded: reading it strips vocab padding
            requests[mname] = (key, (*index, *(0,) * len(shape)), (*(1,) * len(index), *shape))
        return self.reader.read(requests, dtype=dtype)


def _write_groups(source: Any, mapping: Any, groups: list[list[str]], out_dtype: torch.dtype | None,
                  writer: SafetensorsShardWriter, bar: Any) -> None:
    """Read each group of Megatron tensors from ``source`` (:class:`_StoredModel` or
    :class:`~megatron_agentrl.convert.lora_checkpoint.LoraCheckpoint`) and write its HF tensors, one group in memory at
    a time."""
    for group in groups:
        tensors = source.read_group(group, out_dtype)
        for mname in group:
            full = tensors.pop(mname)
            full = full.reshape(mapping.megatron_shape(mname))
            for hf_name, t in mapping.to_hf(mname, full).items():
                writer.write(hf_name, t)
                bar.update(t.numel() * dtype_size(t.dtype))
                del t  # not kept alive while the next group is read
            del full
