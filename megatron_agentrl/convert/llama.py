"""Megatron-core <-> Hugging Face weight mapping for Llama (``LlamaForCausalLM``: Llama 2 / 3.x).

No biases anywhere; embeddings tied (Llama 3.2 1B/3B) or untied. transformers' Llama puts
``attention_bias`` on q/k/v *and* o_proj and ``mlp_bias`` on every MLP projection; megatron's
GPT layer can hold a q/k/v bias only, so both must be False. Full, non-interleaved rotary (default or
``llama3`` rope scaling, ``megatron_agentrl.megatron.model.rope_scaling_factor``). ``model.chat_template=auto``
picks ``qwen2`` (ChatML, the format of the repo's tiny tokenizers); a real Llama checkpoint names its format.
"""
from __future__ import annotations

from typing import Any

from megatron_agentrl.convert.base import ConversionError, GPTMapping


class LlamaMapping(GPTMapping):
    """Name and layout mapping for one ``LlamaForCausalLM`` config (see :class:`GPTMapping`)."""

    model_type = "llama"
    architecture = "LlamaForCausalLM"
    default_chat_template = "qwen2"

    def _qkv_bias(self, hf_config: Any) -> bool:
        for flag in ("attention_bias", "mlp_bias"):
            if getattr(hf_config, flag, False):
                raise ConversionError(
                    f"llama config has {flag}=True, which megatron's GPT layer cannot express (it holds a q/k/v "
                    "bias only, no o_proj / MLP biases); only attention_bias=False, mlp_bias=False Llama models "
                    "are supported"
                )
        return False
