"""On-policy distillation in whole runs: ``agentrl train`` of the demo's distillation config with a teacher that a
run exported, with one teacher per task, and with the teacher's SGLang server SIGKILLed mid-run."""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.demo_run import SHRUNK, TINY_MODEL, train_demo

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
DISTILL = "examples/configs/tiny_cpu_distill.yaml"
TASKS = ("calc", "guess", "lookup")


@pytest.fixture(scope="module")
def teacher(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A teacher: the shrunk demo's RL policy, exported (weights and tokenizer)."""
    out = tmp_path_factory.mktemp("teacher")
    train_demo(out, 1, *TINY_MODEL)
    assert (out / "hf_export" / "tokenizer.json").is_file()
    return out / "hf_export"


def _distill(out: Path, *overrides: str, steps: int = 2) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "megatron_agentrl.cli", "train", "--config", DISTILL, "--nproc", "1",
           f"output_dir={out}", *SHRUNK, *TINY_MODEL, f"train.steps={steps}", f"checkpoint.interval={steps}",
           *overrides]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen, timeout_s: float = 300) -> str:
    out, _ = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, out[-4000:]
    return out


def _rl_rows(out: Path) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["phase"] == "rl"]


def test_a_distillation_run_trains_on_the_teachers_signal(teacher: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    log = _finish(_distill(out, f"distill.teachers=[{{checkpoint: {teacher}}}]"))
    rows = _rl_rows(out)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert math.isfinite(r["loss"]) and r["num_tokens"] > 0
        trained = [t for t in TASKS if f"reward/{t}" in r]
        assert trained and all(math.isfinite(r[f"distill/reverse_kl/{t}"]) for t in trained), r  # every one scored
        assert r["distill/score_s"] >= 0
    assert "distill: teacher 0" in log and (out / "hf_export" / "config.json").is_file()


def test_one_teacher_per_task_scores_its_own_tasks(teacher: Path, tmp_path: Path) -> None:
    """Two teachers (here the same weights in two places): calc goes to the first, the others to the second."""
    second = tmp_path / "teacher2"
    second.symlink_to(teacher, target_is_directory=True)
    out = tmp_path / "run"
    log = _finish(_distill(out, f"distill.teachers=[{{checkpoint: {teacher}, tasks: [calc]}}, "
                                f"{{checkpoint: {second}}}]"))
    assert "distill: teacher 0" in log and "scores calc" in log and "distill: teacher 1" in log
    assert "scores lookup, guess" in log or "scores guess, lookup" in log, log[-3000:]
    assert all(math.isfinite(r[f"distill/reverse_kl/{t}"]) for r in _rl_rows(out) for t in TASKS if f"reward/{t}" in r)


def test_a_teacher_server_killed_mid_run_costs_no_unscored_training(teacher: Path, tmp_path: Path) -> None:
    """The teacher served by two SGLang servers (the stand-in, launched as SGLang is); one is SIGKILLed once the
    run is up: the run goes on, scoring on the other, and ends with every trained batch scored (a batch with an
    unscored episode cannot be built: ``build_rl_batch`` refuses it)."""
    from rollout_sglang.engines.sglang_client import SGLangEngine
    from rollout_sglang.engines.sglang_options import SGLangLaunchOptions

    servers = [SGLangEngine.launch(teacher, SGLangLaunchOptions(server_module="rollout_sglang.testing.sglang_standin",
                                                                startup_timeout_s=120, log_dir=tmp_path / "logs"))
               for _ in range(2)]
    try:
        urls = ", ".join(s.base_url for s in servers)
        out = tmp_path / "run"
        proc = _distill(out, f"distill.teachers=[{{engine_urls: [{urls}], tokenizer: {teacher}}}]",
                        "distill.score_timeout_s=30", "distill.max_attempts=2", steps=4)
        # killed once the run is up, before its first episode is scored: every step's scoring finds it dead (killed
        # after a step, the queue may already hold every episode the run trains, and it is never asked)
        time.sleep(1.0)
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        os.killpg(servers[0].process.pid, signal.SIGKILL)
        log = _finish(proc)
    finally:
        for s in servers:
            s.shutdown()
    rows = _rl_rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(math.isfinite(r[f"distill/reverse_kl/{t}"]) for r in rows for t in TASKS if f"reward/{t}" in r)
    assert "scoring" in log and "failed" in log  # the dead server was tried, then routed around


def test_gateway_episodes_are_distilled_and_a_distillation_run_resumes(teacher: Path, tmp_path: Path) -> None:
    """An agent of the user's own behind the gateway (``rollout.agent: gateway``): its trajectories are scored and
    trained like the agent loop's; the run's checkpoint resumes into more distillation steps, and ``agentrl eval``
    evaluates it without its teacher."""
    out = tmp_path / "run"
    gateway = ["rollout.agent=gateway", "rollout.agent_fn=examples.agents.openai_tool_agent:run_agent",
               f"distill.teachers=[{{checkpoint: {teacher}}}]"]
    _finish(_distill(out, *gateway))
    assert all(any(k.startswith("distill/reverse_kl/") for k in r) for r in _rl_rows(out))
    _finish(_distill(out, *gateway, "checkpoint.resume=latest", steps=3))
    assert [r["step"] for r in _rl_rows(out)][-1] == 3
    # evaluated as any run (no teacher needed: its path is gone)
    cmd = [sys.executable, "-m", "megatron_agentrl.cli", "eval", "--config", DISTILL, f"output_dir={out}", *SHRUNK,
           *TINY_MODEL, "checkpoint.resume=latest", "distill.teachers=[{checkpoint: /gone}]"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert json.loads((out / "eval" / "eval.json").read_text())["step"] == 3
