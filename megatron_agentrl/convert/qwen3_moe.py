"""Megatron-core <-> Hugging Face weight mapping for Qwen3-MoE (``Qwen3MoeForCausalLM``, e.g. Qwen3-30B-A3B).

Qwen3's attention (q/k norms, no QKV bias unless ``attention_bias``) with MoE MLPs
(transformers 5.23 ``modeling_qwen3_moe``; the names are those of the checkpoints on disk, which
transformers 5 fuses into 3-D expert tensors only in memory):

* ``mlp.gate.weight`` ``[num_experts, hidden]`` <-> ``mlp.router.weight``;
* ``mlp.experts.<e>.gate_proj / up_proj.weight`` <-> ``mlp.experts.local_experts.<e>.linear_fc1.weight``
  (``[gate; up]``), ``mlp.experts.<e>.down_proj.weight`` <-> ``...linear_fc2.weight``;
* layer ``i`` is a MoE layer when ``i`` is not in ``mlp_only_layers`` and
  ``(i + 1) % decoder_sparse_step == 0``; the others keep a dense MLP of ``intermediate_size``;
* a softmax router over ``num_experts``, top ``num_experts_per_tok``, renormalised over the chosen experts when
  ``norm_topk_prob`` (megatron: top-k of the logits, then a softmax over them, which is the same);
* the chat format is Qwen3's (``qwen3``).
"""
from __future__ import annotations

from typing import Any

from megatron_agentrl.convert.qwen3 import Qwen3Mapping


class Qwen3MoeMapping(Qwen3Mapping):
    """Name and layout mapping for one ``Qwen3MoeForCausalLM`` config: Qwen3's attention, q/k norms, biases and
    chat format (:class:`~megatron_agentrl.convert.qwen3.Qwen3Mapping`), with MoE MLPs."""

    model_type = "qwen3_moe"
    architecture = "Qwen3MoeForCausalLM"

    def _num_experts(self, hf_config: Any) -> int:
        return int(hf_config.num_experts)

    def _moe_layers(self, hf_config: Any) -> list[bool]:
        step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
        dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
        return [i not in dense and (i + 1) % step == 0 for i in range(self.num_layers)]

    def router_options(self, hf_config: Any) -> dict[str, Any]:
        # norm_topk_prob: softmax over the top-k logits (= renormalised); else top-k of the full softmax
        return {"moe_router_score_function": "softmax",
                "moe_router_pre_softmax": not bool(getattr(hf_config, "norm_topk_prob", False))}
