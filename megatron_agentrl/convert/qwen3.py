"""Megatron-core <-> Hugging Face weight mapping for Qwen3 dense models (``Qwen3ForCausalLM``).

Differences from Qwen2 (transformers 5.23 ``modeling_qwen3``):

* an RMSNorm over each head's query and key (``self_attn.q_norm.weight`` /
  ``self_attn.k_norm.weight``, shape ``[head_dim]``, shared by all heads) before the rotary
  embedding; Megatron names ``self_attention.q_layernorm.weight`` / ``k_layernorm.weight``
  (megatron-core's ``qk_layernorm``), replicated over TP;
* no q/k/v bias unless ``attention_bias``;
* ``head_dim`` is explicit and need not be ``hidden_size / num_attention_heads`` (Qwen3-0.6B:
  1024 hidden, 16 heads of 128);
* the chat format is Qwen3's (``qwen3``: ``<think>`` reasoning, no default system message).
"""
from __future__ import annotations

from typing import Any

from megatron_agentrl.convert.base import GPTMapping


class Qwen3Mapping(GPTMapping):
    """Name and layout mapping for one ``Qwen3ForCausalLM`` config (see :class:`GPTMapping`)."""

    model_type = "qwen3"
    architecture = "Qwen3ForCausalLM"
    qk_norms = True
    default_chat_template = "qwen3"

    def _qkv_bias(self, hf_config: Any) -> bool:
        return bool(getattr(hf_config, "attention_bias", False))
