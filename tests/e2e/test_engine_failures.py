"""Rollout engines killed with SIGKILL in the middle of a training run: the stand-in SGLang servers and the trainer
are processes of their own. Engine A dies and is restarted at its URL; engine B serves alone meanwhile; then B dies
for good, so the run can only go on through the restarted A, which first needs the trainer's weights. The run
completes every step, no infrastructure failure is trained, the turns a dead engine held are generated again on
another, and the restarted engine serves only the weights it was sent (at lag 0 its log-probs are the actor's)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from env_controller.http.net import free_port
from rollout_sglang.trajectory import INFRA_STATUSES

ROOT = Path(__file__).resolve().parents[2]
STANDIN = "rollout_sglang.testing.sglang_standin"


def _tiny_hf_checkpoint(path: Path) -> Path:
    """A random tiny Qwen2 checkpoint with the demo tokenizer's vocab (what a fresh engine serves)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rollout_sglang.tokenizer import load_tokenizer

    tok = load_tokenizer(str(ROOT / "examples/tokenizer/tiny_agent"))
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=True)
    Qwen2ForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return path


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def _steps(out: Path) -> int:
    path = out / "batches.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _wait(what: str, check, timeout_s: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        if proc.poll() is not None:
            raise AssertionError(f"the training run ended (exit {proc.returncode}) before {what}")
        time.sleep(0.05)
    raise AssertionError(f"no {what} within {timeout_s} s")


def test_engines_killed_and_one_restarted_mid_run(tmp_path, processes):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    ckpt = _tiny_hf_checkpoint(tmp_path / "hf")
    ports = [free_port(), free_port()]

    def engine(i: int) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-m", STANDIN, "--model-path", str(ckpt), "--port", str(ports[i])],
                             cwd=ROOT, env=env, stdout=(tmp_path / f"engine{i}.log").open("ab"),
                             stderr=subprocess.STDOUT)
        processes.append(p)
        return p

    engines = [engine(0), engine(1)]
    out = tmp_path / "run"
    urls = [[f"http://127.0.0.1:{p}"] for p in ports]
    train = subprocess.Popen(
        [sys.executable, "-m", "megatron_agentrl.cli", "train", "--config", "tests/configs/tiny_test.yaml",
         f"output_dir={out}", f"model.checkpoint={ckpt}", "model.arch.hidden_size=32",
         "model.arch.intermediate_size=64", "model.arch.num_hidden_layers=2", "sft.steps=0", "train.steps=10",
         "train.micro_batch_size=4", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=4",
         "rollout.max_new_tokens=12", "eval.samples_per_task=0", "pipeline.mode=async", "pipeline.staleness=1",
         "rollout.max_versions=2", f"rollout.engine_urls={json.dumps(urls)}", "rollout.engine_health_interval_s=0.2",
         "rollout.engine_health_timeout_s=2", "rollout.engine_unavailable_timeout_s=60",
         "rollout.engine_startup_timeout_s=60", "rollout.weight_sync_init_timeout_s=20",
         "rollout.weight_sync_bucket_timeout_s=20"],
        cwd=ROOT, env=env, stdout=(tmp_path / "train.log").open("wb"), stderr=subprocess.STDOUT)
    processes.append(train)

    # A dies while the run samples from both, and is restarted at once (a fresh server: start weights, no group)
    _wait("step 2", lambda: _steps(out) >= 2, 180, train)
    engines[0].send_signal(signal.SIGKILL)
    engines[0].wait(10)
    killed_at = _steps(out)
    engines[0] = engine(0)
    # B serves alone for a step, then dies too: from here on only the restarted A can sample
    _wait("a step on B alone", lambda: _steps(out) >= killed_at + 1, 120, train)
    engines[1].send_signal(signal.SIGKILL)
    engines[1].wait(10)
    b_killed_at = _steps(out)

    train.wait(300)
    log = (tmp_path / "train.log").read_text(errors="replace")
    assert train.returncode == 0, log[-4000:]
    rows = [json.loads(x) for x in (out / "batches.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 11))
    statuses = [s for r in rows for s in r["statuses"]]
    assert statuses and not INFRA_STATUSES & set(statuses), statuses
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
