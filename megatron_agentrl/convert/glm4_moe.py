"""Megatron-core <-> Hugging Face weight mapping for GLM-4.5 MoE (``Glm4MoeForCausalLM``: GLM-4.5, GLM-4.5-Air).

Differences from GLM-4 dense (transformers 5.23 ``modeling_glm4_moe``):

* no sandwich norms: a plain pre-norm layer; q/k norms only when ``use_qk_norm``;
* rotary over the first ``head_dim * partial_rotary_factor`` dims, *not* interleaved;
* a sigmoid router with a per-expert score-correction bias that chooses the experts but not their weights
  (megatron's ``expert_bias``, kept fixed during RL), group-limited top-k (``n_group`` / ``topk_group``),
  weights renormalised and scaled by ``routed_scaling_factor``;
* the first ``first_k_dense_replace`` layers have a dense MLP (``intermediate_size``), the rest a
  MoE MLP: ``mlp.gate.weight`` <-> ``mlp.router.weight``, the sigmoid router's score-correction bias
  ``mlp.gate.e_score_correction_bias`` (fp32) <-> ``mlp.router.expert_bias`` (a megatron buffer),
  experts as in Qwen3-MoE, and a shared expert ``mlp.shared_experts.gate_proj / up_proj /
  down_proj`` (width ``n_shared_experts * moe_intermediate_size``) <->
  ``mlp.shared_experts.linear_fc1 / linear_fc2``;
* released checkpoints also hold the multi-token-prediction layer(s) after the last decoder layer
  (``model.layers.<num_hidden_layers>.*``); they are not part of the causal LM and are skipped.

Because dense and MoE layers mix, megatron keys every layer of the checkpoint on its own. The chat format is
GLM-4.5's (``glm45``).
"""
from __future__ import annotations

from typing import Any

from megatron_agentrl.config import ConfigError
from megatron_agentrl.convert.base import GPTMapping


class Glm4MoeMapping(GPTMapping):
    """Name and layout mapping for one ``Glm4MoeForCausalLM`` config (see :class:`GPTMapping`)."""

    model_type = "glm4_moe"
    architecture = "Glm4MoeForCausalLM"
    expert_bias = True
    partial_rotary = True
    default_chat_template = "glm45"

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

    def router_options(self, hf_config: Any) -> dict[str, Any]:
        topk = int(hf_config.num_experts_per_tok)
        if not getattr(hf_config, "norm_topk_prob", True) and topk > 1:
            raise ConfigError("glm4_moe with norm_topk_prob=False is not supported (megatron renormalises "
                              "sigmoid router weights over the chosen experts)")
        opts: dict[str, Any] = {}
        groups = int(getattr(hf_config, "n_group", 1) or 1)
        group_topk = int(getattr(hf_config, "topk_group", 1) or 1)
        if groups > 1:
            if self.num_experts % groups or topk % group_topk or topk // group_topk != 2:
                raise ConfigError(
                    f"glm4_moe n_group={groups}, topk_group={group_topk}, num_experts_per_tok={topk}: megatron "
                    "scores a group by its top num_experts_per_tok / topk_group experts, transformers by its top 2; "
                    "only settings where both agree are supported")
            opts.update(moe_router_num_groups=groups, moe_router_group_topk=group_topk)
        opts.update(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                    moe_router_bias_update_rate=0.0,
                    moe_router_topk_scaling_factor=float(getattr(hf_config, "routed_scaling_factor", 1.0)))
        if self.shared_expert_size:
            opts["moe_shared_expert_intermediate_size"] = self.shared_expert_size
        return opts
