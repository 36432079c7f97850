"""Every GPU recipe's memory plan fits an 80 GB GPU with at least 10 % to spare, in both pools, and its SGLang
engines' ``mem_fraction_static`` holds the weights and KV cache the plan gives them."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_agentrl.config import load_config
from megatron_agentrl.launch.plan import estimate_memory

ROOT = Path(__file__).resolve().parents[2]
RECIPES = {  # config -> the published model config it plans from
    "glm4_9b_multitask": "glm4_9b_0414",
    "qwen3_8b_one_node": "qwen3_8b",
    "qwen3_30b_a3b_multitask": "qwen3_30b_a3b",
    "qwen3_30b_a3b_lora": "qwen3_30b_a3b",
    "qwen3_30b_a3b_terminal": "qwen3_30b_a3b",
}


def test_every_gpu_recipe_is_listed_here():
    gpu = {p.stem for p in (ROOT / "examples" / "configs").glob("*.yaml")
           if load_config(p, []).slurm.gpus_per_node}
    assert gpu == set(RECIPES)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_the_recipe_fits_with_headroom(name):
    cfg = load_config(ROOT / "examples" / "configs" / f"{name}.yaml", [])
    hf = json.loads((ROOT / "examples" / "configs" / RECIPES[name] / "config.json").read_text())
    plan = estimate_memory(hf, cfg, gpu_memory_gib=80.0, total_gpus=cfg.slurm.nodes * cfg.slurm.gpus_per_node)
    assert not plan.problems(), plan.problems()
    assert plan.train_total_gib <= 0.9 * 80 and plan.rollout_total_gib <= 0.9 * 80, (plan.train, plan.rollout)
    assert cfg.rollout.sglang_server_args.get("mem_fraction_static"), "the recipe sets SGLang's memory fraction"
    assert cfg.rollout.sglang_server_args.get("context_length", 0) >= cfg.rollout.max_total_tokens


def test_a_memory_fraction_too_small_for_the_planned_kv_cache_fails_the_plan():
    cfg = load_config(ROOT / "examples" / "configs" / "qwen3_8b_one_node.yaml",
                      ["rollout.sglang_server_args.mem_fraction_static=0.4"])
    hf = json.loads((ROOT / "examples" / "configs" / "qwen3_8b" / "config.json").read_text())
    (problem,) = estimate_memory(hf, cfg).problems()
    assert "mem_fraction_static=0.4" in problem and "lower max_running_requests" in problem
