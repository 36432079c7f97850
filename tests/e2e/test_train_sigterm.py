"""SIGTERM to a training run (a scheduler's preemption or time limit) ends it through its cleanup: the containers
its in-process tasks hold are removed before it exits, not left to the next start's reap."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import docker.errors

from env_controller.servers.process import start_process, stop_process

REPO = Path(__file__).resolve().parents[2]
OWNER_LABEL = "org.agentrl.owner"


def _owned_by(client: Any, pid: int) -> list[str]:
    """Ids of the engine's containers whose owner label names process ``pid`` (``host:pid:start``). One list call
    (``containers.list`` inspects each container after listing, which fails on one the run removes meanwhile)."""
    return [row["Id"] for row in client.api.containers(all=True, filters={"label": OWNER_LABEL})
            if (row.get("Labels") or {}).get(OWNER_LABEL, "").split(":")[-2:-1] == [str(pid)]]


def test_sigterm_during_the_warm_up_removes_the_runs_containers(docker_engine: Any, tmp_path: Path) -> None:
    # the terminal demo in process: its warm-up plays demonstrations in containers of the trainer's own pools
    cmd = [sys.executable, "-m", "megatron_agentrl.cli", "train", "--config", "examples/configs/tiny_cpu_terminal.yaml",
           f"output_dir={tmp_path / 'run'}", "sft.steps=50", "train.steps=1", "model.arch.num_hidden_layers=1"]
    log = tmp_path / "train.log"
    client = docker_engine.client()
    proc = start_process(cmd, log, env={**os.environ, "DOCKER_HOST": docker_engine.url}, cwd=REPO, group=None)
    try:
        deadline = time.monotonic() + 300
        while not _owned_by(client, proc.pid):
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the warm-up started no container in 300 s:\n" + log.read_text()[-3000:]
            time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            raise AssertionError("the run did not end within 120 s of SIGTERM:\n" + log.read_text()[-3000:]) from None
        assert code == 128 + signal.SIGTERM, (code, log.read_text()[-3000:])
        assert "SIGTERM: stopping the run" in log.read_text()
        assert _owned_by(client, proc.pid) == [], "containers outlived the run's SIGTERM"
    finally:
        stop_process(proc, grace_s=0.0, first_signal=signal.SIGKILL)
        for cid in _owned_by(client, proc.pid):
            with contextlib.suppress(docker.errors.NotFound):  # gone meanwhile
                client.api.remove_container(cid, force=True)
        client.close()
