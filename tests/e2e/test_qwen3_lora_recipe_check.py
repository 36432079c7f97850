"""The Qwen3-30B-A3B LoRA recipe: ``run_qwen3_30b_a3b_lora.sh --check`` on this machine. The same model as the
multitask recipe on one node instead of two: the plan has no gradient or optimizer state of the base, one engine
slot serves both live versions as adapters, and the engines get SGLang's LoRA flags."""
from __future__ import annotations

from megatron_agentrl.config import load_config
from megatron_agentrl.launch.ray_placement import plan_pools
from tests.e2e import support
from tests.e2e.support import ROOT, clean_env, run_check

SCRIPT = ROOT / "examples" / "run_qwen3_30b_a3b_lora.sh"
CONFIG = ROOT / "examples" / "configs" / "qwen3_30b_a3b_lora.yaml"
ENV_VARS = ("QWEN3_MOE_HF_DIR", "QWEN3_MOE_MEGATRON_DIR", "AGENTRL_ENV_CONTROLLER_URL", "CONFIG")


def test_lora_recipe_check_passes_on_one_node() -> None:
    proc = run_check(SCRIPT, clean_env(ENV_VARS))
    ok, _ = support.check_passed(proc, ("config", "layout", "LoRA", "memory estimate", "cross-policy sampling"))
    assert "4 train ranks; 1 version slots x 2 engines x 2 GPUs; 8 GPUs in 1 node(s)" in ok["layout"]
    assert "rank 32 on q_proj, k_proj, v_proj, o_proj" in ok["LoRA"] and "--enable-lora --max-lora-rank 32" in ok[
        "LoRA"] and "--max-loras-per-batch 4" in ok["LoRA"]
    assert "2 live versions as LoRA adapters on one engine pool" in ok["cross-policy sampling"]
    # the frozen base has no fp32 gradient, master weight or Adam moment: only the adapters' (which round to 0.0)
    assert "grads_fp32 0.0, master_weights_fp32 0.0, adam_states_fp32 0.0" in proc.stdout


def test_lora_recipe_places_one_engine_slot() -> None:
    cfg = load_config(str(CONFIG))
    pools = {p.name: len(p.bundles) for p in plan_pools(cfg)}
    assert pools == {"train": 4, "rollout_slot0": 2}
