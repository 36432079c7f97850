"""Megatron <-> Hugging Face weight mappings, one module per model family.

``get_mapping(hf_config)`` returns the mapping object for a transformers config (dispatch on
``model_type``); see :class:`megatron_agentrl.convert.qwen2.Qwen2Mapping` for the interface.
"""
from __future__ import annotations

from typing import Any

from megatron_agentrl.convert.qwen2 import Qwen2Mapping

_MAPPINGS: dict[str, type[Qwen2Mapping]] = {
    "qwen2": Qwen2Mapping,
}


def get_mapping(hf_config: Any) -> Qwen2Mapping:
    """The weight mapping for ``hf_config`` (a transformers ``PretrainedConfig``).

    Raises ValueError naming the unsupported ``model_type`` and the supported ones.
    """
    model_type = getattr(hf_config, "model_type", None)
    cls = _MAPPINGS.get(str(model_type))
    if cls is None:
        raise ValueError(
            f"model_type={model_type!r} has no Megatron weight mapping; supported: {sorted(_MAPPINGS)} "
            "(add a module under megatron_agentrl/convert/ for a new family)"
        )
    return cls(hf_config)
