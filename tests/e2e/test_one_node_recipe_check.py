"""The one-node recipe (Qwen3-8B on 8 GPUs): ``run_qwen3_8b_one_node.sh --check`` passes on this machine, its plan
fits one node with the headroom every recipe keeps, and its engines are placed by the local Ray it enables."""
from __future__ import annotations

import json

from megatron_agentrl.config import ModelConfig, load_config
from megatron_agentrl.hf_io import load_hf_config
from megatron_agentrl.launch.plan import ModelShape
from tests.e2e import support
from tests.e2e.support import ROOT, clean_env, run_check

SCRIPT = ROOT / "examples" / "run_qwen3_8b_one_node.sh"
CONFIG = ROOT / "examples" / "configs" / "qwen3_8b_one_node.yaml"
REFERENCE = ROOT / "examples" / "configs" / "qwen3_8b" / "config.json"


def test_check_passes_here_on_one_node_of_8_gpus() -> None:
    proc = run_check(SCRIPT, clean_env(("QWEN3_HF_DIR", "AGENTRL_ENV_CONTROLLER_URL", "AGENTRL_TRAINER_TOKEN")))
    ok, unverified = support.check_passed(proc, ("config", "layout", "memory estimate", "engine placement",
                                                 "cross-policy sampling", "per-task normalization", "sbatch script"))
    assert "TP 4 x PP 1 x CP 1 x DP 1, EP 1: 4 train ranks" in ok["layout"] and "8 GPUs in 1 node(s)" in ok["layout"]
    assert "placed by Ray" in ok["engine placement"]
    assert "model: 8.19B parameters" in proc.stdout and "mem_fraction_static=0.8" in proc.stdout
    assert "model.checkpoint" in unverified


def test_qwen3_8b_reference_numbers() -> None:
    """The shipped reference config is Qwen3-8B's (8.19B parameters) and loads through the project's HF path."""
    hf = json.loads(REFERENCE.read_text())
    assert abs(ModelShape.from_hf(hf).total_params() / 1e9 - 8.19) < 0.01
    assert load_hf_config(ModelConfig(hf_config=str(REFERENCE))).model_type == "qwen3"
    cfg = load_config(CONFIG, [])
    assert cfg.ray.enabled and cfg.engine_placement_problem(on_ray=True) is None
