"""Megatron <-> Hugging Face weight mappings and converters, one mapping module per model family.

``get_mapping(hf_config)`` returns the mapping object for a transformers config (dispatch on
``model_type``); see :class:`megatron_agentrl.convert.base.GPTMapping` for the interface.
Families: ``qwen2`` (Qwen2 / Qwen2.5), ``qwen3`` (Qwen3 dense), ``llama``, ``glm4`` (GLM-4-0414), and the
mixture-of-experts ``qwen3_moe`` (Qwen3-MoE) and ``glm4_moe`` (GLM-4.5, GLM-4.5-Air).

Converters (streaming, bounded memory): :func:`megatron_agentrl.convert.hf_to_megatron.convert_hf_to_megatron`,
:func:`megatron_agentrl.convert.megatron_to_hf.convert_megatron_to_hf`; megatron-core distributed
checkpoints of a live model: :mod:`megatron_agentrl.convert.checkpoint`.

The names below are resolved lazily, so that ``megatron_agentrl.convert.cli`` (imported by the
``agentrl`` command line) does not import torch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megatron_agentrl.convert.base import ConversionError, GPTMapping

__all__ = ["ARCHITECTURES", "MAPPINGS", "MODEL_TYPES", "ConversionError", "GPTMapping", "get_mapping"]

# The transformers ``model_type`` of every family with a mapping (and so a Megatron model build).
MODEL_TYPES = ("qwen2", "qwen3", "llama", "glm4", "qwen3_moe", "glm4_moe")


def _families() -> dict[str, type]:
    from megatron_agentrl.convert.glm4 import Glm4Mapping
    from megatron_agentrl.convert.glm4_moe import Glm4MoeMapping
    from megatron_agentrl.convert.llama import LlamaMapping
    from megatron_agentrl.convert.qwen2 import Qwen2Mapping
    from megatron_agentrl.convert.qwen3 import Qwen3Mapping
    from megatron_agentrl.convert.qwen3_moe import Qwen3MoeMapping

    families = {"qwen2": Qwen2Mapping, "qwen3": Qwen3Mapping, "llama": LlamaMapping, "glm4": Glm4Mapping,
                "qwen3_moe": Qwen3MoeMapping, "glm4_moe": Glm4MoeMapping}
    assert tuple(families) == MODEL_TYPES
    return families


def get_mapping(hf_config: Any) -> "GPTMapping":
    """The weight mapping for ``hf_config`` (a transformers ``PretrainedConfig``).

    Raises ValueError (:class:`~megatron_agentrl.convert.base.ConversionError`) naming the
    unsupported ``model_type`` and the supported ones.
    """
    from megatron_agentrl.convert.base import ConversionError

    mappings = _families()
    model_type = getattr(hf_config, "model_type", None)
    cls = mappings.get(str(model_type))
    if cls is None:
        raise ConversionError(
            f"model_type={model_type!r} has no Megatron weight mapping; supported: {sorted(mappings)} "
            "(add a module under megatron_agentrl/convert/ for a new family)"
        )
    return cls(hf_config)


def __getattr__(name: str) -> Any:
    if name == "MAPPINGS":
        return _families()
    if name == "ARCHITECTURES":  # transformers architecture class -> model_type
        return {cls.architecture: mt for mt, cls in _families().items()}
    if name in ("ConversionError", "GPTMapping"):
        from megatron_agentrl.convert import base

        return getattr(base, name)
    raise AttributeError(f"module 'megatron_agentrl.convert' has no attribute {name!r}")
