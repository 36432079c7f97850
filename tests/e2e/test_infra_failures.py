"""A task worker killed with SIGKILL in the middle of a training run: the controller, the workers and the
trainer are processes of their own. The sessions the dead worker held end as infrastructure failures: counted,
their groups trained on the valid episodes or re-run on the other worker, and none of them trained as a zero."""
from __future__ import annotations

import json
import signal
import subprocess
import time

from env_controller.http.net import free_port
from env_controller.servers.process import stop_process
from env_controller.servers.process import wait_until as _wait
from tests.e2e.support import finished_without_training_infra, start_python
from tests.e2e.support import get_json as _get


def test_a_worker_killed_mid_run_costs_no_trained_sample(tmp_path, processes):
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"

    def spawn(*args: str, log: str) -> subprocess.Popen:
        return start_python(processes, tmp_path / log, *args)

    spawn("-m", "env_controller.cli", "controller", "--port", str(port), "--heartbeat-timeout", "2",
          "--suspect-after", "1", log="controller.log")
    _wait("controller", lambda: _get(f"{api}/health"), 30)
    workers = {}
    for name, task in (("lookup-a", "lookup"), ("lookup-b", "lookup"), ("calc", "calc")):
        wport = free_port()
        workers[name] = (wport, spawn("-m", "env_controller.cli", "worker", "--task", task, "--port", str(wport),
                                      "--controller", api, "--heartbeat-interval", "0.3", "--latency-ms", "400",
                                      log=f"{name}.log"))
    _wait("three workers", lambda: sum(len(t["workers"]) for t in _get(f"{api}/list_workers").values()) == 3, 30)

    out = tmp_path / "run"
    train = spawn("-m", "megatron_agentrl.cli", "train", "--config", "tests/configs/tiny_test.yaml",
                  f"output_dir={out}", f"env.controller_url={api}", "tasks=[{name: lookup}, {name: calc}]",
                  "model.arch.hidden_size=32", "model.arch.intermediate_size=64", "model.arch.num_hidden_layers=2",
                  "sft.steps=0", "train.steps=8", "train.micro_batch_size=4", "rollout.prompts_per_step=2",
                  "rollout.samples_per_prompt=4", "rollout.max_new_tokens=12", "eval.samples_per_task=0",
                  "pipeline.mode=async", "pipeline.staleness=1", log="train.log")

    # kill lookup-a while one of the run's sessions has an interact in flight there (the worker sleeps
    # --latency-ms before it answers): that episode is under way, so it cannot be retried and must end as
    # an infra failure. A session waiting for the model is not enough: the model's next turn may fail
    # validation, which ends the episode without another env call. (A start cut short is retried by the
    # controller on the other worker: nothing happened to the episode.)
    victim_port, victim = workers["lookup-a"]

    def victim_interacts() -> int:
        ids = {wid for wid, w in _get(f"{api}/list_workers").get("lookup", {}).get("workers", {}).items()
               if w["address"].endswith(f":{victim_port}/api")}
        now = time.time()
        # in an interact, idle_s counts from the call; in a start, from the session's creation
        return sum(1 for s in _get(f"{api}/list_sessions").values()
                   if str(s["worker_id"]) in ids and s["busy"] and s["idle_s"] < 0.2
                   and now - s["start"] - s["idle_s"] > 0.3)

    held = _wait("an interact in flight on lookup-a", victim_interacts, 180, proc=train, poll_s=0.01)
    stop_process(victim, first_signal=signal.SIGKILL)

    log, rows = finished_without_training_infra(train, tmp_path / "train.log", out, 8, 300)
    assert all(len(r["statuses"]) == len(r["advantages"]) == len(r["staleness"]) for r in rows)
    summary = json.loads((out / "summary.json").read_text())
    failed = summary["infra"]["failed_episodes"]
    assert failed.get("lookup", 0) >= held, (held, summary["infra"], log[-4000:])  # the interacts cut short
    assert "declared dead" in log or "cannot be reached" in log or "connect" in log.lower()
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rl = [m for m in metrics if m["phase"] == "rl"]
    assert all("infra/failed_lookup" in m and "infra/groups_dropped" in m for m in rl)
