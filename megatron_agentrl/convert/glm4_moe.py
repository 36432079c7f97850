"""Megatron-core <-> Hugging Face weight mapping for GLM-4.5 MoE (``Glm4MoeForCausalLM``: GLM-4.5, GLM-4.5-Air).

Differences from GLM-4 dense (transformers 5.23 ``modeling_glm4_moe``):

* no sandwich norms: a plain pre-norm layer; q/k norms only when ``use_qk_norm``;
* rotary over the first ``head_dim * partial_rotary_factor`` dims, *not* interleaved;
* the first ``first_k_dense_replace`` layers have a dense MLP (``intermediate_size``), the rest a
  MoE MLP: ``mlp.gate.weight`` <-> ``mlp.router.weight``, the sigmoid router's score-correction bias
  ``mlp.gate.e_score_correction_bias`` (fp32) <-> ``mlp.router.expert_bias`` (a megatron buffer),
  experts as in Qwen3-MoE, and a shared expert ``mlp.shared_experts.gate_proj / up_proj /
  down_proj`` (width ``n_shared_experts * moe_intermediate_size``) <->
  ``mlp.shared_experts.linear_fc1 / linear_fc2``;
* released checkpoints also hold the multi-token-prediction layer(s) after the last decoder layer
  (``model.layers.<num_hidden_layers>.*``); they are not part of the causal LM and are skipped.

Because dense and MoE layers mix, megatron keys every layer of the checkpoint on its own.
"""
from __future__ import annotations

from typing import Any

from megatron_agentrl.convert.base import GPTMapping


class Glm4MoeMapping(GPTMapping):
    """Name and layout mapping for one ``Glm4MoeForCausalLM`` config (see :class:`GPTMapping`)."""

    model_type = "glm4_moe"
    architecture = "Glm4MoeForCausalLM"
    expert_bias = True

    def __init__(self, hf_config: Any) -> None:
        self.qk_norms = bool(getattr(hf_config, "use_qk_norm", False))
        self.extra_hf_layers = int(getattr(hf_config, "num_nextn_predict_layers", None)
                                   or getattr(hf_config, "num_mtp_layers", 0) or 0)
        super().__init__(hf_config)

    def _qkv_bias(self, hf_config: Any) -> bool:
        return bool(getattr(hf_config, "attention_bias", True))

    def _num_experts(self, hf_config: Any) -> int:
        return int(hf_config.n_routed_experts)

    def _moe_layers(self, hf_config: Any) -> list[bool]:
        first_dense = int(getattr(hf_config, "first_k_dense_replace", 0) or 0)
        return [i >= first_dense for i in range(self.num_layers)]

    def _shared_expert_size(self, hf_config: Any) -> int:
        return int(getattr(hf_config, "n_shared_experts", 0) or 0) * int(hf_config.moe_intermediate_size)
