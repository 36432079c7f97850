"""Hugging Face side of a run: building the model config, reading and writing safetensors weights.

Every path a user gives is checked here, with an error that names it and says what is expected.
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch

from megatron_agentrl.config import ConfigError, ModelConfig, read_mapping_file
from megatron_agentrl.convert import MODEL_TYPES as SUPPORTED_MODEL_TYPES

logger = logging.getLogger(__name__)


def check_model_paths(model: ModelConfig) -> None:
    """Fail fast, before any process starts, when a path in ``model`` does not exist or
    ``model.hf_config`` does not hold a JSON object."""
    if model.hf_config is not None:
        read_hf_config_json(model.hf_config)
    if model.checkpoint is not None and not Path(model.checkpoint).is_dir():
        raise ConfigError(
            f"model.checkpoint='{model.checkpoint}' is not a directory; point it at a Hugging Face "
            f"checkpoint directory (safetensors), or unset it for random init"
        )
    if model.megatron_checkpoint is not None and not Path(model.megatron_checkpoint).is_dir():
        raise ConfigError(
            f"model.megatron_checkpoint='{model.megatron_checkpoint}' is not a directory; write it first with "
            f"`agentrl convert hf-to-megatron --hf-dir <HF checkpoint> --out-dir {model.megatron_checkpoint}`, "
            "or unset it to load model.checkpoint"
        )
    if not Path(model.tokenizer).exists():
        raise ConfigError(
            f"model.tokenizer='{model.tokenizer}' does not exist; give a tokenizer directory or tokenizer.json "
            f"(the demo's is examples/tokenizer/tiny_agent, rebuilt by tools/build_demo_tokenizer.py)"
        )


def load_hf_config(model: ModelConfig, tokenizer: Any | None = None):
    """The ``transformers`` config of the policy, from ``model.hf_config`` or inline ``model.arch``
    (neither given: the config the converter stored with ``model.megatron_checkpoint``, ``<dir>/hf``).

    With ``arch``, ``vocab_size`` defaults to the tokenizer's size and the pad/eos ids to the
    tokenizer's. Raises ConfigError for a missing path or an unsupported ``model_type``.
    """
    from transformers import AutoConfig

    if model.hf_config is None and not model.arch and model.megatron_checkpoint:
        stored = Path(model.megatron_checkpoint) / "hf" / "config.json"
        if not stored.is_file():
            raise ConfigError(
                f"model.megatron_checkpoint='{model.megatron_checkpoint}' holds no hf/config.json (it was not "
                "written by agentrl convert); set model.hf_config to the Hugging Face config of the model"
            )
        model = dataclasses.replace(model, hf_config=str(stored))
    if model.hf_config is not None:
        data = read_hf_config_json(model.hf_config)
    else:
        data = dict(model.arch)
        if tokenizer is not None:
            data.setdefault("vocab_size", len(tokenizer))
            if tokenizer.eos_token_id is not None:
                data.setdefault("eos_token_id", tokenizer.eos_token_id)
            if tokenizer.pad_token_id is not None:
                data.setdefault("pad_token_id", tokenizer.pad_token_id)
    model_type = data.pop("model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"model_type={model_type!r} is not supported yet; supported: {', '.join(SUPPORTED_MODEL_TYPES)} "
            f"(set model.arch.model_type or use a checkpoint of a supported family)"
        )
    data.pop("transformers_version", None)
    data.pop("architectures", None)
    try:
        cfg = AutoConfig.for_model(model_type, **data)
    except (TypeError, ValueError) as e:
        where = f"model.hf_config='{model.hf_config}'" if model.hf_config is not None else "model.arch"
        detail = " ".join(str(e).split())
        raise ConfigError(f"{where}: transformers refuses the {model_type} config: {detail}") from None
    from megatron_agentrl.convert import MAPPINGS

    cfg.architectures = [MAPPINGS[model_type].architecture]
    if tokenizer is not None and cfg.vocab_size < len(tokenizer):
        raise ConfigError(
            f"model vocab_size={cfg.vocab_size} is smaller than the tokenizer's {len(tokenizer)} tokens "
            f"('{model.tokenizer}'); use the tokenizer that belongs to the model"
        )
    return cfg


def read_hf_config_json(hf_config: str) -> dict[str, Any]:
    """The JSON object of ``model.hf_config`` (a model directory holding config.json, or the file).

    Raises ConfigError naming model.hf_config for a missing file, text that is not UTF-8, bad
    JSON, or JSON that is not an object.
    """
    path = Path(hf_config)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(
            f"model.hf_config='{hf_config}' does not exist (expected a Hugging Face model "
            f"directory with config.json, or the config.json itself); fix the path or use model.arch"
        )
    return read_mapping_file(path, "json", f"model.hf_config: '{path}'")


def load_hf_weights(checkpoint: str | Path) -> dict[str, torch.Tensor]:
    """Read every tensor of a Hugging Face safetensors checkpoint directory (sharded or not).

    Raises FileNotFoundError naming the directory or the missing shards, ConversionError (a ConfigError) for
    an index that is not one (:func:`~megatron_agentrl.convert.safetensors_io.read_weight_files`).
    """
    from safetensors.torch import load_file

    from megatron_agentrl.convert.safetensors_io import read_weight_files

    root = Path(checkpoint)
    if not root.is_dir():
        raise FileNotFoundError(
            f"model.checkpoint='{checkpoint}' is not a directory; point it at a Hugging Face checkpoint "
            "directory holding model.safetensors (or model.safetensors.index.json and its shards), or unset it for "
            "random init"
        )
    _, shards = read_weight_files(root)
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        state.update(load_file(str(root / shard)))
    return state


def save_hf_checkpoint(state: dict[str, torch.Tensor], hf_config: Any, out_dir: str | Path,
                       tokenizer: Any | None = None) -> Path:
    """Write ``state`` (HF names) as ``model.safetensors`` plus config.json (and tokenizer files) to ``out_dir``."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if getattr(hf_config, "tie_word_embeddings", False):
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    hf_config.save_pretrained(str(out))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    return out
