"""The GLM-4-9B multitask recipe: ``run_glm4_9b_multitask.sh --check`` on this machine, and its plan.

The check runs with the real config (examples/configs/glm4_9b_multitask.yaml): it must pass here,
where there is no GPU, no GLM-4 checkpoint and no AgentBench-FC worker, and say that it could not
verify those; it must fail on a layout that cannot work anywhere.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from megatron_agentrl.config import ModelConfig, load_config
from megatron_agentrl.launch.plan import ModelShape, estimate_memory
from tests.e2e import support
from tests.e2e.support import ROOT, clean_env, report_lines, run_check

SCRIPT = ROOT / "examples" / "run_glm4_9b_multitask.sh"
CONFIG = ROOT / "examples" / "configs" / "glm4_9b_multitask.yaml"
REFERENCE = ROOT / "examples" / "configs" / "glm4_9b_0414" / "config.json"
TASKS = ("alfworld-std", "dbbench-std", "kg-std", "os-std", "webshop-std")


def _check(*overrides: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return run_check(SCRIPT, clean_env(("GLM4_HF_DIR", "AGENTRL_ENV_CONTROLLER_URL", "AGENTRL_TRAINER_TOKEN"),
                                       **(env or {})), *overrides)


def test_check_passes_here_and_reports_what_it_cannot_verify() -> None:
    proc = _check()
    out = proc.stdout
    # verified anywhere: config, layout, memory per GPU, the recipe's switches, the script and tools
    ok, unverified = support.check_passed(proc, ("config", "layout", "memory estimate", "cross-policy sampling",
                                                 "per-task normalization", "sbatch script", "Ray", "agentrl convert"))
    assert "TP 2 x PP 2 x CP 1 x DP 2, EP 1: 8 train ranks" in ok["layout"] and "16 GPUs in 2 node(s)" in ok["layout"]
    assert "mixture of experts" not in ok  # a dense model
    # not verifiable here, and said so: GPUs, the weights, the task endpoints
    if not shutil.which("nvidia-smi"):
        assert "GPUs" in unverified and "2 node(s) x 8 GPU(s)" in unverified["GPUs"]
    assert "model.checkpoint" in unverified
    assert "env controller" in unverified and "not reachable from here" in unverified["env controller"]
    for task in TASKS:
        assert f"task {task}" in unverified, out
    # the plan: per-GPU memory of both pools
    assert "model: 9.40B parameters" in out
    assert "train GPU   (GiB)" in out and "rollout GPU (GiB)" in out and "kv_cache" in out


@pytest.fixture()
def endpoint() -> Iterator[str]:
    """A local HTTP server that answers every GET (stands in for the controller and a worker); under
    ``/locked/`` it wants ``Authorization: Bearer s3cret``, as a controller with a trainer token does."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            body = json.dumps([0, 1, 2]).encode()
            locked = self.path.startswith("/locked/") and self.headers.get("Authorization") != "Bearer s3cret"
            self.send_response(401 if locked else 200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_reachable_endpoints_and_present_weights_are_verified(endpoint: str, tmp_path: Path) -> None:
    hf = tmp_path / "GLM-4-9B-0414"
    hf.mkdir()
    shutil.copy(REFERENCE, hf / "config.json")
    (hf / "model.safetensors").write_bytes(b"")  # the check looks for weights, it does not load them
    (hf / "tokenizer.json").write_text("{}")
    proc = _check(f"env.workers={{alfworld-std: ['{endpoint}/api']}}",
                  env={"GLM4_HF_DIR": str(hf), "AGENTRL_ENV_CONTROLLER_URL": endpoint})
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    ok, unverified = report_lines(out, "ok"), report_lines(out, "not verified here")
    assert "answers (HTTP 200)" in ok["env controller"]
    assert "1 worker(s) answer" in ok["task alfworld-std"]
    assert "model.checkpoint" in ok and "model config" in ok and "glm4" in ok["model config"]
    assert "task kg-std" in unverified and "no worker endpoint listed" in unverified["task kg-std"]


def test_the_check_sends_the_trainer_credential(endpoint: str) -> None:
    """A controller that wants a token: refused without it (FAIL naming env.token), answers with it."""
    env = {"AGENTRL_ENV_CONTROLLER_URL": f"{endpoint}/locked", "AGENTRL_TRAINER_TOKEN": ""}
    refused = _check(env=env)
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "refused the trainer's credential (HTTP 401)" in report_lines(refused.stdout, "FAIL")["env controller"]
    assert "env.token" in refused.stdout and "s3cret" not in refused.stdout
    allowed = _check(env={**env, "AGENTRL_TRAINER_TOKEN": "s3cret"})
    assert "answers (HTTP 200)" in report_lines(allowed.stdout, "ok")["env controller"], allowed.stdout


@pytest.mark.parametrize("overrides, item, needle", [
    # 9.4B on TP 2 alone without the distributed optimizer: ~109 GiB per GPU (~69 GiB with it)
    (["parallel.pp=1", "train.use_distributed_optimizer=false"], "memory", "train pool needs"),
    (["parallel.tp=4", "parallel.pp=1"], "layout", "num_key_value_heads=2"),  # megatron cannot split 2 KV heads 4 ways
    (["rollout.engines_per_slot=8"], "pools vs allocation", "need 24 GPUs"),
    (["env.controller_url=''"], "tasks", "not built-in tasks"),
])
def test_check_fails_on_what_cannot_work_anywhere(overrides: list[str], item: str, needle: str) -> None:
    support.check_failed(_check(*overrides), item, needle)


def test_glm4_reference_numbers() -> None:
    """The shipped reference config is GLM-4-9B-0414's, loads through the project's HF config path,
    and the estimator's per-GPU numbers follow from it."""
    from megatron_agentrl.hf_io import load_hf_config

    hf = json.loads(REFERENCE.read_text())
    shape = ModelShape.from_hf(hf)
    assert round(shape.total_params() / 1e9, 2) == 9.40
    assert shape.kv_bytes_per_token(2) == 2 * 40 * 2 * 128 * 2
    hf_cfg = load_hf_config(ModelConfig(hf_config=str(REFERENCE)))
    assert hf_cfg.model_type == "glm4" and hf_cfg.num_key_value_heads == 2
    cfg = load_config(CONFIG)
    plan = estimate_memory(hf, cfg, gpu_memory_gib=80, total_gpus=16)
    stage = (20 * shape.layer_params() + shape.embedding_params()) / 2  # PP stage 0 of 2, split over TP 2
    assert plan.train["weights"] == pytest.approx(stage * 2 / 1024**3)
    # the distributed optimizer shards fp32 main weights and Adam moments over DP 2 (8 workers / TP 2 x PP 2)
    assert plan.train["adam_states_fp32"] == pytest.approx(stage * 8 / 2 / 1024**3)
    assert plan.train["master_weights_fp32"] == pytest.approx(stage * 4 / 2 / 1024**3)
    assert plan.rollout["weights"] == pytest.approx(shape.total_params() * 2 / 1024**3)
    assert plan.layout["train_workers"] + plan.layout["rollout_gpus"] == 16
    assert not plan.problems()


@pytest.mark.parametrize("megatron_dir", [None, "custom"])
def test_script_trains_from_the_checkpoint_it_converts(tmp_path: Path, megatron_dir: str | None) -> None:
    """Submit mode with a stand-in for ``agentrl``: the conversion's --out-dir is the
    model.megatron_checkpoint the pre-flight check and the submitted job get."""
    hf = tmp_path / "GLM-4-9B-0414"
    hf.mkdir()
    stub, log = support.agentrl_stub(tmp_path)
    env = {**os.environ, "AGENTRL_PYTHON": str(stub), "GLM4_HF_DIR": str(hf)}
    env.pop("AGENTRL_ENV_CONTROLLER_URL", None)
    env.pop("GLM4_MEGATRON_DIR", None)
    want = "checkpoints/GLM-4-9B-0414-megatron-tp2pp2"  # the config's model.megatron_checkpoint
    if megatron_dir:
        want = str(tmp_path / megatron_dir)
        env["GLM4_MEGATRON_DIR"] = want
    proc = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    convert = support.converted_then_trained(log, want)
    assert convert.startswith(f"convert hf-to-megatron --hf-dir {hf} --out-dir {want} --tp 2 --pp 2")
