"""The terminal-agent recipe: ``run_qwen3_terminal_agent.sh --check`` on this machine.

The check runs with the real config (examples/configs/qwen3_30b_a3b_terminal.yaml): it must pass here, where
there is no GPU, no Qwen3 checkpoint and no worker node, name the terminal task sets served behind the env
controller, and fail on a layout that cannot work anywhere."""
from __future__ import annotations

import subprocess

from megatron_agentrl.config import load_config
from tests.e2e import support
from tests.e2e.support import ROOT, clean_env, run_check

SCRIPT = ROOT / "examples" / "run_qwen3_terminal_agent.sh"
CONFIG = ROOT / "examples" / "configs" / "qwen3_30b_a3b_terminal.yaml"
ENV_VARS = ("QWEN3_MOE_HF_DIR", "QWEN3_MOE_MEGATRON_DIR", "AGENTRL_ENV_CONTROLLER_URL", "CONFIG")


def _check(*overrides: str) -> subprocess.CompletedProcess:
    return run_check(SCRIPT, clean_env(ENV_VARS), *overrides)


def test_check_passes_here() -> None:
    proc = _check()
    ok, unverified = support.check_passed(proc, ("config", "layout", "mixture of experts", "memory estimate",
                                                 "cross-policy sampling", "per-task normalization", "sbatch script"))
    assert "per-task normalization" in ok and "over 2 task(s)" in ok["per-task normalization"]
    for task in ("terminal-bench", "swe-instances"):  # served by the terminal workers of the worker nodes
        assert f"task {task}" in unverified, proc.stdout
    assert "env controller" in unverified


def test_config_serves_terminal_tasks_behind_the_controller() -> None:
    cfg = load_config(CONFIG)
    assert {t.task for t in cfg.tasks} == {"terminal"} and cfg.sft.steps == 0
    assert cfg.env.controller_url and set(cfg.env.workers) == {t.name for t in cfg.tasks}
    assert not any(cfg.builds_task_here(t) for t in cfg.tasks)  # the task sets live on the worker nodes


def test_check_fails_on_a_layout_that_cannot_work() -> None:
    support.check_failed(_check("parallel.ep=3", "ray.train_workers=9"), "layout",
                         "parallel.ep=3 does not divide the model's 128 experts")
