"""Faults in the middle of an in-flight weight update (``rollout.weight_update_mode=retract``), with real processes
and SIGKILL: the stand-in SGLang servers and the trainer each run in a process of their own, and the stand-in's test
hooks (``--test-sigkill-on-pause``, ``--test-hold-update``) put each fault at a known point of an update.

Whatever dies, no engine may stay paused for ever. An engine killed while paused with requests held is restarted at
its URL: the requests it held are generated again on the other engine, the run trains no infrastructure failure,
and the restarted engine gets the trainer's weights and serves. A trainer killed while an update is open leaves its
server paused, the session open; the next run against that server pauses it again, loads its weights and lets it
generate.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import urllib.request
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


def _rl_metrics(out: Path) -> list[dict]:
    """The metrics of each RL step recorded so far."""
    rows = (json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines())
    return [m for m in rows if m["phase"] == "rl"]


def _rerouted(out: Path) -> float:
    """Prompts the run has generated again on another engine so far (as its last recorded step counted them)."""
    rows = _rl_metrics(out)
    return rows[-1]["engines/rerouted_prompts"] if rows else 0.0


def _train(processes: list, log: Path, out: Path, ckpt: Path, urls: list[list[str]], steps: int) -> subprocess.Popen:
    """``agentrl train`` of the tiny model, async, with in-flight updates (``retract``) on the servers ``urls``
    (one list per slot). Turns of up to 200 tokens (the random model seldom stops early), so that updates often
    find requests running. A dead server refuses connections at once: the probes' limit only needs to
    outlast a slow answer of a loaded machine."""
    return start_python(
        processes, log, "-m", "megatron_agentrl.cli", "train", "--config", "tests/configs/tiny_test.yaml",
        f"output_dir={out}", f"model.checkpoint={ckpt}", "model.arch.hidden_size=32",
        "model.arch.intermediate_size=64", "model.arch.num_hidden_layers=2", "sft.steps=0", f"train.steps={steps}",
        "train.micro_batch_size=4", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=4",
        "rollout.max_new_tokens=200", "eval.samples_per_task=0", "pipeline.mode=async", "pipeline.staleness=1",
        "rollout.weight_update_mode=retract", f"rollout.max_versions={len(urls)}",
        f"rollout.engines_per_slot={len(urls[0])}", f"rollout.engine_urls={json.dumps(urls)}",
        "rollout.engine_health_interval_s=0.2", "rollout.engine_health_timeout_s=10",
        "rollout.engine_unavailable_timeout_s=60", "rollout.engine_startup_timeout_s=60",
        "rollout.weight_sync_init_timeout_s=20", "rollout.weight_sync_bucket_timeout_s=20")


def _generates(url: str) -> str:
    """POST a short ``/generate`` to the server; the weight version it answers with."""
    body = json.dumps({"input_ids": [3, 14, 15, 92, 65], "sampling_params": {"max_new_tokens": 4}}).encode()
    req = urllib.request.Request(f"{url}/generate", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        answer = json.loads(r.read())
    assert len(answer["output_ids"]) == 4, answer
    return answer["meta_info"]["weight_version"]


def _log_has(path: Path, text: str) -> bool:
    return path.exists() and text in path.read_text(errors="replace")


def test_an_engine_killed_while_paused_for_an_update_comes_back_and_its_requests_go_elsewhere(tmp_path, processes,
                                                                                           monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # three processes share the cores: more threads only wait on each other
    ckpt = _tiny_hf_checkpoint(tmp_path / "hf")
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    logs = [tmp_path / "engine0.log", tmp_path / "engine1.log"]

    def engine(i: int, *hooks: str) -> subprocess.Popen:
        return start_python(processes, logs[i], "-m", STANDIN, "--model-path", str(ckpt), "--port", str(ports[i]),
                            *hooks)

    # one slot of two engines: every update pauses both, and the slot keeps taking requests, which wait at its
    # paused engines. Engine 0 SIGKILLs itself right after it answered the first pause that held requests
    engines = [engine(0, "--test-sigkill-on-pause", "1"), engine(1)]
    # whether an update's pause finds requests running is timing: most runs see the first by the 4th update, a few
    # only by the 8th; 16 steps leave room for engine 0 to come back after that
    out, steps = tmp_path / "run", 16
    train = _train(processes, tmp_path / "train.log", out, ckpt, [urls], steps)

    _wait("engine 0's death while paused", lambda: engines[0].poll() is not None, 240, train)
    assert engines[0].returncode == -signal.SIGKILL
    hook = re.search(r"SIGKILL on the /pause_generation while paused \(retract\) holding (\d+) requests",
                     logs[0].read_text())
    assert hook, logs[0].read_text()[-2000:]
    # each request it held (one /generate per call of the run) is generated again, every prompt of it, on engine 1
    # (paused by the same update, then continued)
    held = int(hook.group(1))
    _wait(f"the {held} held requests generated again", lambda: _rerouted(out) >= held, 120, train)
    # engine 0 restarts at its URL (a fresh server: the start weights, no group, not paused) while the run is
    # frozen, so that steps are left for it to come back in: the run goes on with engine 1 before and after
    frozen_at = _steps(out)
    assert frozen_at <= steps - 3, f"the fault came at step {frozen_at} of {steps}: too late to see engine 0 return"
    os.kill(train.pid, signal.SIGSTOP)
    try:
        engines[0] = engine(0)
        _wait("engine 0 restarted", lambda: _get(f"{urls[0]}/model_info"), 120, engines[0])
    finally:
        os.kill(train.pid, signal.SIGCONT)

    log, _ = finished_without_training_infra(train, tmp_path / "train.log", out, steps, 240)
    assert f"{urls[0]} (slot 0) is out of rotation" in log and f"{urls[0]} (slot 0) is back after" in log, log[-4000:]
    last = _rl_metrics(out)[-1]
    assert last["engines/failures"] >= 1 and last["engines/returns"] >= 1, last
    # the restarted engine took the slot's weights: every engine serves at the end
    assert last["engines/out_of_rotation"] == 0, last
    # the restarted server is not paused, holds no open update, and generates with a version the trainer sent it
    info = _get(f"{urls[0]}/server_info")
    assert not info["paused"] and not info["weight_update_session"], info
    version = _generates(urls[0])
    assert version == info["weight_version"] == str(steps), (version, info)
    assert not _get(f"{urls[1]}/server_info")["paused"]


def test_a_trainer_killed_while_an_update_is_open_leaves_the_server_paused_until_the_next_run(tmp_path, processes,
                                                                                            monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the processes share the cores: more threads only wait on each other
    ckpt = _tiny_hf_checkpoint(tmp_path / "hf")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    engine_log = tmp_path / "engine.log"
    # the 3rd update (step 2's push: the first is the start weights) holds its answer to /begin_weight_update: the
    # server is paused (retract), its session open, and the trainer waits for the answer
    start_python(processes, engine_log, "-m", STANDIN, "--model-path", str(ckpt), "--port", str(port),
                 "--test-hold-update", "3", "--test-hold-update-s", "30")
    first = _train(processes, tmp_path / "first.log", tmp_path / "first", ckpt, [[url]], 8)
    _wait("the held update", lambda: _log_has(engine_log, "test hook: update 3's session is open"), 240, first)
    stop_process(first, first_signal=signal.SIGKILL)

    # nobody will continue it: the server stays paused, the session open
    info = _get(f"{url}/server_info")
    assert info["paused"] and info["pause_mode"] == "retract" and info["weight_update_session"], info
    assert info["weight_version"] == "1", info  # step 1's weights; step 2's never came

    # a new run against the same server pauses it again, closes the stale session, sends its weights, continues it
    out, steps = tmp_path / "second", 3
    second = _train(processes, tmp_path / "second.log", out, ckpt, [[url]], steps)
    finished_without_training_infra(second, tmp_path / "second.log", out, steps, 240)
    info = _get(f"{url}/server_info")
    assert not info["paused"] and not info["weight_update_session"], info
    version = _generates(url)
    assert version == info["weight_version"] == str(steps), (version, info)
