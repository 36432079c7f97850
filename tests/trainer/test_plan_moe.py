"""``agentrl plan`` for mixture-of-experts models: parameter counts, per-GPU memory and the EP checks,
worked by hand on two small configs (a Qwen3-MoE one and a GLM-4.5 one with a dense first layer and a
shared expert). All in bytes, before the division by GiB.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from megatron_agentrl.config import Config, ConfigError, load_config
from megatron_agentrl.launch.plan import GiB, ModelShape, estimate_memory, format_plan

# h 64, 4 heads of 16 (q 64), 2 KV heads (kv 32), 8 experts of width 32, top 2, vocab 1000, untied
QWEN3_MOE: dict[str, Any] = {
    "model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1000,
    "num_experts": 8, "num_experts_per_tok": 2, "tie_word_embeddings": False,
}
# the same sizes as GLM-4.5: QKV bias, no q/k norms, layer 0 dense, a shared expert of 1 x 32
GLM4_MOE: dict[str, Any] = {
    "model_type": "glm4_moe", "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1000,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1,
    "attention_bias": True, "use_qk_norm": False, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
    "routed_scaling_factor": 1.0, "partial_rotary_factor": 0.5, "tie_word_embeddings": False,
}


def _config(tmp_path: Path, arch: dict[str, Any], *overrides: str) -> Config:
    """A bf16 run of ``arch``: TP 1 x PP 2, EP 2 on 8 ranks (DP 4, expert DP 2); micro-batches of one
    256-token sequence, 8 samples a step."""
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({
        "output_dir": str(tmp_path / "out"),
        "model": {"dtype": "bfloat16", "arch": arch, "chat_template": "qwen2"},
        "parallel": {"tp": 1, "pp": 2, "ep": 2},
        "train": {"micro_batch_size": 1},
        "rollout": {"prompts_per_step": 4, "samples_per_prompt": 2, "max_total_tokens": 256, "max_new_tokens": 64},
        "ray": {"train_workers": 8},
        "tasks": [{"name": "lookup"}],
    }))
    return load_config(str(path), list(overrides))


def _bytes(plan_part: dict[str, float]) -> dict[str, float]:
    return {k: v * GiB for k, v in plan_part.items()}


def test_qwen3_moe_parameters_by_hand() -> None:
    shape = ModelShape.from_hf(QWEN3_MOE)
    assert shape.moe_layers == (True,) * 4 and shape.experts_per_token == 2
    # q, k, v: 64 x (64 + 2 x 32); o: 64 x 64; 2 norms of 64; q/k norms of 16 each
    assert shape.attention_params() == 8192 + 4096 + 128 + 32 == 12448
    assert shape.router_params() == 8 * 64
    assert shape.expert_params() == 8 * 3 * 64 * 32 == 49152
    assert shape.layer_params(0) == 12448 + 512 + 49152
    assert shape.total_params() == 4 * 62112 + 2 * 64000 + 64 == 376512
    # a token passes 2 of the 8 experts: 6 x 3 x 64 x 32 unused per layer
    assert shape.active_params() == 376512 - 4 * 6 * 6144


def test_qwen3_moe_train_memory_by_hand(tmp_path: Path) -> None:
    plan = estimate_memory(QWEN3_MOE, _config(tmp_path, QWEN3_MOE))
    lay = plan.layout
    assert (lay["dp"], lay["ep"], lay["expert_dp"], lay["experts_per_rank"]) == (4, 2, 2, 4)
    # a stage: 2 layers' attention + routers + the embedding (or the output layer), TP 1: 2 x 12448 + 2 x 512 +
    # 64000 = 89920; its experts over EP 2: 2 x 49152 / 2 = 49152
    dense, experts = 89920, 49152
    got = _bytes(plan.train)
    assert got["weights"] == pytest.approx((dense + experts) * 2)
    assert got["grads_fp32"] == pytest.approx((dense + experts) * 4)
    # dense master weights and moments over DP 4; the experts' over expert DP 8 / (2 x 2) = 2
    assert got["master_weights_fp32"] == pytest.approx((dense / 4 + experts / 2) * 4) == 188224
    assert got["adam_states_fp32"] == pytest.approx((dense / 4 + experts / 2) * 8)
    # a MoE layer per token: 15 x 64 (attention, norms) + 12 x 8 (router) + 2 x (4 x 64 + 8 x 32) (two routed
    # copies) = 2080 bytes; 256 tokens, 2 layers, 2 micro-batches in flight (8 x 256 tokens / DP 4 / 256)
    assert lay["micro_batches_per_step"] == 2
    assert got["activations"] == pytest.approx(2080 * 256 * 2 * 2) == 2129920
    assert got["logits_fp32"] == pytest.approx(256 * 1000 * 4 * 2)
    text = format_plan(plan)
    assert "TP 1 x PP 2 x CP 1 x DP 4, EP 2 (4 of 8 experts per rank, expert DP 2)" in text
    assert "top-2 of 8 experts" in text


def test_moe_activation_options(tmp_path: Path) -> None:
    base = estimate_memory(QWEN3_MOE, _config(tmp_path, QWEN3_MOE))
    # a capacity factor of 1.5 bounds each expert's share: the routed part, 2 x 512 of 2080 bytes, grows by half
    capped = estimate_memory(QWEN3_MOE, _config(tmp_path, QWEN3_MOE, "train.moe_capacity_factor=1.5"))
    assert capped.train["activations"] * GiB == pytest.approx((2080 + 512) * 256 * 2 * 2)
    assert "capacity factor of 1.5" in format_plan(capped)
    # full recomputation: each layer's input (256 x 64 bf16) per micro-batch in flight, plus one layer's activations
    full = estimate_memory(QWEN3_MOE, _config(tmp_path, QWEN3_MOE, "train.recompute=full"))
    assert full.train["activations"] * GiB == pytest.approx(2 * 256 * 64 * 2 * 2 + 2080 * 256)
    # TP 2 with sequence parallelism (MoE under TP): every rank holds half the tokens, 2080 / 2
    tp2 = estimate_memory(QWEN3_MOE, _config(tmp_path, QWEN3_MOE, "parallel.tp=2"))
    assert tp2.train["activations"] * GiB == pytest.approx(1040 * 256 * 2 * 2)
    assert tp2.train["weights"] < base.train["weights"]


def test_glm45_dense_first_layer_and_shared_expert_by_hand(tmp_path: Path) -> None:
    shape = ModelShape.from_hf(GLM4_MOE)
    assert shape.moe_layers == (False, True, True, True) and shape.shared_expert_size == 32
    attention = 8192 + 4096 + 128 + 128  # with QKV bias (64 + 2 x 32), 2 norms, no q/k norms
    assert shape.attention_params() == attention
    assert shape.layer_params(0) == attention + 3 * 64 * 128  # the dense first layer
    assert shape.layer_params(1) == attention + 3 * 64 * 32 + 512 + 49152  # shared expert, router, experts
    assert shape.total_params() == 37120 + 3 * 68352 + 2 * 64000 + 64

    plan = estimate_memory(GLM4_MOE, _config(tmp_path, GLM4_MOE, "ray.train_workers=4"))
    assert (plan.layout["dp"], plan.layout["expert_dp"]) == (2, 1)
    # stage 0 (dense layer 0, MoE layer 1, embedding) holds less than stage 1 (MoE layers 2, 3, output layer):
    # 2 x 12544 + 2 x 6144 (shared experts) + 64000 + 2 x 512 (routers) = 102400; experts 2 x 49152 / 2
    dense, experts = 102400, 49152
    got = _bytes(plan.train)
    assert got["weights"] == pytest.approx((dense + experts) * 2)
    assert got["master_weights_fp32"] == pytest.approx((dense / 2 + experts) * 4)
    assert got["adam_states_fp32"] == pytest.approx((dense / 2 + experts) * 8)
    # stage 1's two MoE layers: (15 x 64 + 8 x 32) + 12 x 8 + 2 x (4 x 64 + 8 x 32) = 2336 bytes a token each
    # (stage 0: 34 x 64 + 2336); 4 micro-batches per DP rank, 2 in flight
    assert got["activations"] == pytest.approx(2 * 2336 * 256 * 2)


def test_rollout_engines_hold_all_experts_over_their_tp(tmp_path: Path) -> None:
    cfg = _config(tmp_path, QWEN3_MOE, "ray.rollout_gpus_per_engine=2", "ray.train_gpus_per_worker=1")
    plan = estimate_memory(QWEN3_MOE, cfg, total_gpus=10)
    assert plan.rollout["weights"] * GiB == pytest.approx(376512 * 2 / 2)
    # KV: 2 x 4 layers x 2 heads x 16 x 2 bytes, split over TP 2; 8 sequences of 256 tokens on the one engine
    assert plan.rollout["kv_cache"] * GiB == pytest.approx(512 / 2 * 8 * 256)
    assert any("tensor parallelism only" in n and "1/2 of all 8 experts" in n for n in plan.notes)
    assert not plan.problems()


def test_optimizer_without_the_distributed_optimizer_keeps_all_expert_states(tmp_path: Path) -> None:
    plan = estimate_memory(QWEN3_MOE, _config(tmp_path, QWEN3_MOE, "train.use_distributed_optimizer=false"))
    assert plan.train["adam_states_fp32"] * GiB == pytest.approx((89920 + 49152) * 8)


@pytest.mark.parametrize("arch, overrides, message", [
    (QWEN3_MOE, ["parallel.ep=3", "ray.train_workers=6", "parallel.pp=1"],
     r"parallel.ep=3 does not divide the model's 8 experts; choose ep in \[1, 2, 4, 8\]"),
    ({**QWEN3_MOE, "model_type": "qwen3", "num_experts": 0}, [],
     "parallel.ep=2 needs a mixture-of-experts model; model_type='qwen3' has no MoE layer: set parallel.ep=1"),
    ({**QWEN3_MOE, "num_experts_per_tok": 9}, [], r"num_experts_per_tok=9; .* in \[1, 8\]"),
])
def test_expert_layouts_that_cannot_work_are_refused(tmp_path: Path, arch: dict[str, Any], overrides: list[str],
                                                     message: str) -> None:
    cfg = _config(tmp_path, arch, *overrides)
    with pytest.raises(ConfigError, match=message):
        estimate_memory(arch, cfg)


def test_a_moe_config_missing_its_expert_fields_is_named() -> None:
    hf = {k: v for k, v in QWEN3_MOE.items() if k != "moe_intermediate_size"}
    with pytest.raises(ConfigError, match="qwen3_moe model config lacks moe_intermediate_size"):
        ModelShape.from_hf(hf)


def test_lora_memory_by_hand(tmp_path: Path) -> None:
    """With LoRA the base is frozen: gradients, master weights and Adam moments are the adapters' alone. Rank 8 on
    every linear layer of a MoE model adapts attention only (experts are not adapted): per layer 8 x ((64 + 64 +
    2 x 32) + (64 + 64)) = 2560, two layers a stage = 5120."""
    plan = estimate_memory(QWEN3_MOE, _config(tmp_path, QWEN3_MOE, "lora.rank=8", "checkpoint.interval=0"))
    got = _bytes(plan.train)
    adapters = 5120
    assert got["weights"] == pytest.approx((89920 + 49152 + adapters) * 2)
    assert got["grads_fp32"] == pytest.approx(adapters * 4)
    assert got["master_weights_fp32"] == pytest.approx(adapters / 4 * 4)  # over DP 4
    assert got["adam_states_fp32"] == pytest.approx(adapters / 4 * 8)
