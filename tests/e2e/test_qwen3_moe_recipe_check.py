"""The Qwen3-30B-A3B multitask recipe: ``run_qwen3_30b_a3b_multitask.sh --check`` on this machine, and its plan.

The check runs with the real config (examples/configs/qwen3_30b_a3b_multitask.yaml): it must pass here,
where there is no GPU, no Qwen3 checkpoint and no AgentBench-FC worker, report memory per GPU of both
pools, and fail on an expert layout that cannot work anywhere.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from megatron_agentrl.config import ModelConfig, load_config
from megatron_agentrl.launch.plan import GiB, ModelShape, estimate_memory
from tests.e2e import support
from tests.e2e.support import ROOT, clean_env, run_check

SCRIPT = ROOT / "examples" / "run_qwen3_30b_a3b_multitask.sh"
CONFIG = ROOT / "examples" / "configs" / "qwen3_30b_a3b_multitask.yaml"
REFERENCE = ROOT / "examples" / "configs" / "qwen3_30b_a3b" / "config.json"
TASKS = ("alfworld-std", "dbbench-std", "kg-std", "os-std", "webshop-std")
ENV_VARS = ("QWEN3_MOE_HF_DIR", "QWEN3_MOE_MEGATRON_DIR", "AGENTRL_ENV_CONTROLLER_URL", "CONFIG")


def _env(**extra: str) -> dict[str, str]:
    return clean_env(ENV_VARS, **extra)


def _check(*overrides: str) -> subprocess.CompletedProcess:
    return run_check(SCRIPT, _env(), *overrides)


def test_check_passes_here_and_reports_memory_per_gpu() -> None:
    proc = _check()
    out = proc.stdout
    ok, unverified = support.check_passed(proc, ("config", "layout", "mixture of experts", "memory estimate",
                                                 "cross-policy sampling", "per-task normalization", "sbatch script",
                                                 "Ray", "agentrl convert"))
    assert "TP 1 x PP 3 x CP 1 x DP 4, EP 4 (32 of 128 experts per rank, expert DP 1): 12 train ranks" in ok["layout"]
    assert "2 version slots x 1 engines x 2 GPUs; 16 GPUs in 2 node(s)" in ok["layout"]
    assert "128 experts, top-8" in ok["mixture of experts"] and "load-balancing loss off, dropless" in ok[
        "mixture of experts"]
    assert "train ~" in ok["memory estimate"] and "rollout ~" in ok["memory estimate"]
    assert "model config" in unverified and "qwen3_moe" in unverified["model config"]
    assert "model.checkpoint" in unverified and "model.megatron_checkpoint" in unverified
    for task in TASKS:
        assert f"task {task}" in unverified, out
    # the plan: per-GPU memory of both pools, all experts on the engines
    assert "model: 30.53B parameters (3.35B active per token: top-8 of 128 experts)" in out
    assert "train GPU   (GiB)" in out and "rollout GPU (GiB)" in out and "kv_cache" in out
    assert "SGLang --tp-size 2, no expert parallelism" in out


@pytest.mark.parametrize("overrides, item, needle", [
    # the suggested 8-rank pool: expert optimizer state sharded over 8 / (8 x 1) = 1 rank, ~87 GiB per GPU
    (["ray.train_workers=8", "parallel.pp=1", "parallel.ep=8"], "memory", "train pool needs ~87"),
    # 9 ranks = lcm(1, 3) x PP 3 load, but 3 does not divide 128 experts
    (["parallel.ep=3", "ray.train_workers=9"], "layout", "parallel.ep=3 does not divide the model's 128 experts"),
    (["rollout.engines_per_slot=4"], "pools vs allocation", "need 28 GPUs"),
])
def test_check_fails_on_what_cannot_work_anywhere(overrides: list[str], item: str, needle: str) -> None:
    support.check_failed(_check(*overrides), item, needle)


def test_qwen3_30b_a3b_reference_numbers() -> None:
    """The shipped reference config is Qwen3-30B-A3B's, loads through the project's HF config path, and
    the plan's per-GPU numbers follow from it."""
    from megatron_agentrl.hf_io import load_hf_config

    hf = json.loads(REFERENCE.read_text())
    shape = ModelShape.from_hf(hf)
    assert round(shape.total_params() / 1e9, 2) == 30.53 and round(shape.active_params() / 1e9, 2) == 3.35
    assert shape.moe_layers == (True,) * 48 and shape.experts_per_token == 8
    assert shape.kv_bytes_per_token(2) == 2 * 48 * 4 * 128 * 2
    hf_cfg = load_hf_config(ModelConfig(hf_config=str(REFERENCE)))
    assert hf_cfg.model_type == "qwen3_moe" and hf_cfg.num_experts == 128 and hf_cfg.moe_intermediate_size == 768
    cfg = load_config(CONFIG)
    assert cfg.train.moe_aux_loss_coeff == 0 and cfg.model.chat_template == "auto"
    plan = estimate_memory(hf, cfg, gpu_memory_gib=80, total_gpus=16)
    # PP stage 0 of 3: 16 layers' attention and routers + the embedding at TP 1; 16 layers' experts over EP 4
    dense = 16 * (shape.attention_params() + shape.router_params()) + shape.embedding_params()
    experts = 16 * 128 * 3 * 2048 * 768 / 4
    assert plan.train["weights"] == pytest.approx((dense + experts) * 2 / GiB)
    # distributed optimizer: dense states over DP 4 (12 ranks / PP 3), expert states over 12 / (EP 4 x PP 3) = 1
    assert plan.train["adam_states_fp32"] == pytest.approx((dense / 4 + experts) * 8 / GiB)
    assert plan.rollout["weights"] == pytest.approx(shape.total_params() * 2 / 2 / GiB)  # all experts over TP 2
    assert plan.layout["train_workers"] + plan.layout["rollout_gpus"] == 16
    assert not plan.problems() and plan.train_total_gib < 70 and plan.rollout_total_gib < 70


def test_script_converts_at_the_config_layout_and_trains_from_it(tmp_path: Path) -> None:
    """Submit mode with a stand-in for ``agentrl``: converted at the config's TP x PP (any EP loads it), and
    the conversion's --out-dir is the model.megatron_checkpoint the check and the submitted job get."""
    hf = tmp_path / "Qwen3-30B-A3B"
    hf.mkdir()
    stub, log = support.agentrl_stub(tmp_path)
    proc = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, capture_output=True, text=True, timeout=180,
                          env=_env(AGENTRL_PYTHON=str(stub), QWEN3_MOE_HF_DIR=str(hf)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    want = "checkpoints/Qwen3-30B-A3B-megatron-tp1pp3"  # the config's model.megatron_checkpoint
    convert = support.converted_then_trained(log, want)
    assert convert == f"convert hf-to-megatron --hf-dir {hf} --out-dir {want} --tp 1 --pp 3 --dtype bfloat16"
