"""Megatron <-> Hugging Face weight mappings and converters, and the registry of model families.

A model family is one module here, named after its transformers ``model_type``, whose :class:`GPTMapping`
subclass declares every fact of the family (see :class:`megatron_agentrl.convert.base.GPTMapping`):

* its weight names (class flags: fused gate/up, post-norms, q/k norms, q/k/v bias, experts);
* its megatron ``TransformerConfig`` options (:meth:`~megatron_agentrl.convert.base.GPTMapping.transformer_options`:
  q/k/v bias, q/k layernorm, rotary layout, whether partial rotary is allowed, refusals such as Llama's
  ``attention_bias``; a MoE family's router in :meth:`~megatron_agentrl.convert.base.GPTMapping.router_options`);
* its default chat format (``default_chat_template``, what ``model.chat_template=auto`` picks).

:func:`_families` lists the families, in one place; :data:`MODEL_TYPES`, :data:`MAPPINGS`, :data:`ARCHITECTURES`
and the chat-format defaults derive from it. ``get_mapping(hf_config)`` returns the mapping object for a
transformers config (dispatch on ``model_type``). Families: ``qwen2`` (Qwen2 / Qwen2.5), ``qwen3`` (Qwen3 dense),
``llama``, ``glm4`` (GLM-4-0414), and the mixture-of-experts ``qwen3_moe`` (Qwen3-MoE) and ``glm4_moe``
(GLM-4.5, GLM-4.5-Air).

Converters (streaming, bounded memory): :func:`megatron_agentrl.convert.hf_to_megatron.convert_hf_to_megatron`,
:func:`megatron_agentrl.convert.megatron_to_hf.convert_megatron_to_hf`; megatron-core distributed
checkpoints of a live model: :mod:`megatron_agentrl.convert.checkpoint`.

Nothing here imports torch (the family modules import it where they move tensors), and the names below are
resolved lazily, so that ``megatron_agentrl.convert.cli`` (imported by the ``agentrl`` command line) and the
planner read the registry without torch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megatron_agentrl.convert.base import ConversionError, GPTMapping

__all__ = ["ARCHITECTURES", "MAPPINGS", "MODEL_TYPES", "ConversionError", "GPTMapping", "default_chat_template",
           "get_mapping", "resolve_chat_template"]

#: The format ``model.chat_template=auto`` picks for a model type without a family (ChatML with Hermes tool
#: calls, the format of the repo's tiny tokenizers).
FALLBACK_CHAT_TEMPLATE = "qwen2"


def _families() -> dict[str, type[GPTMapping]]:
    """The model families: transformers ``model_type`` -> its mapping class (a new family is a module here
    plus its line below)."""
    from megatron_agentrl.convert.glm4 import Glm4Mapping
    from megatron_agentrl.convert.glm4_moe import Glm4MoeMapping
    from megatron_agentrl.convert.llama import LlamaMapping
    from megatron_agentrl.convert.qwen2 import Qwen2Mapping
    from megatron_agentrl.convert.qwen3 import Qwen3Mapping
    from megatron_agentrl.convert.qwen3_moe import Qwen3MoeMapping

    families = (Qwen2Mapping, Qwen3Mapping, LlamaMapping, Glm4Mapping, Qwen3MoeMapping, Glm4MoeMapping)
    return {cls.model_type: cls for cls in families}


def get_mapping(hf_config: Any) -> GPTMapping:
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


def default_chat_template(model_type: str | None) -> str:
    """The chat format ``model.chat_template=auto`` picks for ``model_type``: the one its family declares
    (``default_chat_template``), :data:`FALLBACK_CHAT_TEMPLATE` for a model type without a family."""
    cls = _families().get(model_type or "")
    return cls.default_chat_template if cls is not None else FALLBACK_CHAT_TEMPLATE


def resolve_chat_template(name: str, model_type: str | None = None) -> str:
    """The chat format for ``model.chat_template=name``: one of ``rollout_sglang.chat_template.CHAT_TEMPLATES``
    as given, "auto" the default of ``model_type``'s family (:func:`default_chat_template`). Raises ValueError
    naming an unknown ``name``."""
    from rollout_sglang.chat_template import CHAT_TEMPLATES

    if name == "auto":
        return default_chat_template(model_type)
    if name not in CHAT_TEMPLATES:
        raise ValueError(f"chat template {name!r} is not one of auto, {', '.join(CHAT_TEMPLATES)}")
    return name


def __getattr__(name: str) -> Any:
    if name == "MODEL_TYPES":  # the transformers model_type of every family, in registry order
        return tuple(_families())
    if name == "MAPPINGS":
        return _families()
    if name == "ARCHITECTURES":  # transformers architecture class -> model_type
        return {cls.architecture: mt for mt, cls in _families().items()}
    if name in ("ConversionError", "GPTMapping"):
        from megatron_agentrl.convert import base

        return getattr(base, name)
    raise AttributeError(f"module 'megatron_agentrl.convert' has no attribute {name!r}")
