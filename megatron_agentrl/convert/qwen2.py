"""Megatron-core <-> Hugging Face weight mapping for Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``).

QKV projections carry a bias, ``o_proj`` and the MLP do not; embeddings tied or untied; full, non-interleaved
rotary; the chat format is Qwen2.5's (ChatML with Hermes tool calls, ``qwen2``).
The shared machinery (names, QKV interleave, TP shards, vocab padding, checkpoint keys) is
:class:`megatron_agentrl.convert.base.GPTMapping`; the names below are re-exported from there
for existing imports.
"""
from __future__ import annotations

from typing import Any

from megatron_agentrl.convert.base import (  # noqa: F401  (re-exports)
    EMBEDDING,
    FINAL_NORM,
    HF_EMBEDDING,
    HF_FINAL_NORM,
    HF_LM_HEAD,
    OUTPUT_LAYER,
    GPTMapping,
    TPLayout,
)


class Qwen2Mapping(GPTMapping):
    """Name and layout mapping for one ``Qwen2ForCausalLM`` config (see :class:`GPTMapping`)."""

    model_type = "qwen2"
    architecture = "Qwen2ForCausalLM"
    default_chat_template = "qwen2"

    def _qkv_bias(self, hf_config: Any) -> bool:
        return True
