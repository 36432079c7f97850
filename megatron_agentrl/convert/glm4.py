"""Megatron-core <-> Hugging Face weight mapping for GLM-4 (``Glm4ForCausalLM``, GLM-4-9B-0414).

Differences from Qwen2 (transformers 5.23 ``modeling_glm4``):

* each layer has two extra RMSNorms, ``post_self_attn_layernorm`` (on the attention output,
  before the residual add) and ``post_mlp_layernorm`` (on the MLP output, before the residual
  add); Megatron names ``decoder.layers.<i>.post_self_attn_layernorm.weight`` and
  ``decoder.layers.<i>.post_mlp_layernorm.weight`` (the layer spec is
  ``megatron_agentrl.megatron.model.glm4_layer_spec``);
* the MLP is stored fused, ``mlp.gate_up_proj.weight`` = ``[gate; up]``, which is exactly
  Megatron's ``linear_fc1`` (no reordering);
* q/k/v bias when ``attention_bias`` (True for GLM-4-9B-0414);
* partial, *interleaved* rotary embedding (pairs ``(2i, 2i+1)`` of the first
  ``head_dim * partial_rotary_factor`` dims rotate): expressed in the model config
  (``rotary_interleaved``, ``rotary_percent``), so q/k weights are copied unpermuted;
* the chat format is GLM-4-0414's (``glm4``).
"""
from __future__ import annotations

from typing import Any

from megatron_agentrl.convert.base import GPTMapping


class Glm4Mapping(GPTMapping):
    """Name and layout mapping for one ``Glm4ForCausalLM`` config (see :class:`GPTMapping`)."""

    model_type = "glm4"
    architecture = "Glm4ForCausalLM"
    hf_fused_gate_up = True
    post_norms = True
    rotary_interleaved = True
    partial_rotary = True
    default_chat_template = "glm4"

    def _qkv_bias(self, hf_config: Any) -> bool:
        return bool(getattr(hf_config, "attention_bias", True))
