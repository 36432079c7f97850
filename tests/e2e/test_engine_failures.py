"""Rollout engines killed with SIGKILL in the middle of a training run: the stand-in SGLang servers and the trainer
are processes of their own. Engine A dies and is restarted at its URL; engine B serves alone meanwhile; then B dies
for good, so the run can only go on through the restarted A, which first needs the trainer's weights. The run
completes every step, no infrastructure failure is trained, the turns a dead engine held are generated again on
another, and the restarted engine serves only the weights it was sent (at lag 0 its log-probs are the actor's)."""
from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

from env_controller.http.net import free_port
from env_controller.servers.process import stop_process
from env_controller.servers.process import wait_until as _wait
from tests.e2e.support import finished_without_training_infra, start_python
from tests.e2e.support import get_json as _get
from tests.support.tiny_models import tiny_agent_checkpoint as _tiny_hf_checkpoint

STANDIN = "rollout_sglang.testing.sglang_standin"


def _steps(out: Path) -> int:
    path = out / "batches.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_engines_killed_and_one_restarted_mid_run(tmp_path, processes):
    ckpt = _tiny_hf_checkpoint(tmp_path / "hf")
    ports = [free_port(), free_port()]

    def engine(i: int) -> subprocess.Popen:
        return start_python(processes, tmp_path / f"engine{i}.log", "-m", STANDIN, "--model-path", str(ckpt),
                            "--port", str(ports[i]))

    engines = [engine(0), engine(1)]
    out = tmp_path / "run"
    urls = [[f"http://127.0.0.1:{p}"] for p in ports]
    train = start_python(
        processes, tmp_path / "train.log", "-m", "megatron_agentrl.cli", "train", "--config",
        "tests/configs/tiny_test.yaml", f"output_dir={out}", f"model.checkpoint={ckpt}", "model.arch.hidden_size=32",
        "model.arch.intermediate_size=64", "model.arch.num_hidden_layers=2", "sft.steps=0", "train.steps=10",
        "train.micro_batch_size=4", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=4",
        "rollout.max_new_tokens=12", "eval.samples_per_task=0", "pipeline.mode=async", "pipeline.staleness=1",
        "rollout.max_versions=2", f"rollout.engine_urls={json.dumps(urls)}", "rollout.engine_health_interval_s=0.2",
        "rollout.engine_health_timeout_s=2", "rollout.engine_unavailable_timeout_s=60",
        "rollout.engine_startup_timeout_s=60", "rollout.weight_sync_init_timeout_s=20",
        "rollout.weight_sync_bucket_timeout_s=20")

    # A dies while the run samples from both, and is restarted at once (a fresh server: start weights, no group)
    _wait("step 2", lambda: _steps(out) >= 2, 180, train)
    stop_process(engines[0], first_signal=signal.SIGKILL)
    killed_at = _steps(out)
    engines[0] = engine(0)
    # B serves alone for a step, then dies too: from here on only the restarted A can sample
    _wait("a step on B alone", lambda: _steps(out) >= killed_at + 1, 120, train)
    stop_process(engines[1], first_signal=signal.SIGKILL)
    b_killed_at = _steps(out)

    log, _ = finished_without_training_infra(train, tmp_path / "train.log", out, 10, 300)
    assert "is out of rotation" in log and "is back after" in log, log[-4000:]
    assert _steps(out) > b_killed_at

    rl = [m for m in (json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()) if m["phase"] == "rl"]
    last = rl[-1]
    assert last["engines/failures"] >= 2 and last["engines/returns"] >= 1, last
    assert last["engines/out_of_rotation"] == 1, last  # B stays dead; A took its slot's weights
    # the restarted engine holds a version the trainer sent after it came back ...
    served = _get(f"{urls[0][0]}/model_info")["weight_version"]
    assert served.isdigit() and int(served) >= b_killed_at, (served, b_killed_at)
    # ... and every token sampled at lag 0 (the trainer's own weights) has the trainer's log-prob
    lag0 = [m["mismatch/abs_lag0"] for m in rl if "mismatch/abs_lag0" in m]
    assert lag0 and max(lag0) < 1e-4, lag0
