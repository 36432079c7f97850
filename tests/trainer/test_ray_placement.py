"""Ray placement on a local Ray cluster (``ray.cluster_utils.Cluster``: real raylets on this machine).

GPUs are logical resources here (the head node declares 4), so the pools are placed as on a GPU
cluster while the trainer itself runs on CPU. One cluster serves the whole module: the placement
groups of the pools, a layout that does not fit, a tiny training run on Ray with the env
controller as an actor, a node removed mid-run, a trainer actor killed mid-run (restarted and resumed, or the run
stopped with ray.max_restarts=0) and an engine actor killed (back at its URL; slow).
"""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.placement_group import placement_group_table  # noqa: E402

from megatron_agentrl.config import ConfigError, load_config  # noqa: E402
from megatron_agentrl.launch.ray_placement import (  # noqa: E402
    EnvControllerActor,
    PlacementError,
    RayRun,
    RunLostError,
    create_placement_groups,
    engine_launch,
    plan_pools,
    remove_placement_groups,
    run_on_ray,
)
from tests.support.tiny_models import tiny_agent_checkpoint as _tiny_hf_checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TINY = ["model.arch.hidden_size=32", "model.arch.intermediate_size=64", "model.arch.num_hidden_layers=2",
        "sft.steps=1", "sft.batch_size=4", "train.micro_batch_size=4", "eval.samples_per_task=2",
        "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_turns=2"]


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Cluster]:
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 4, "include_dashboard": False})
    ray.init(address=c.address, namespace="agentrl_test", log_to_driver=False)
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def _cfg(tmp_path: Path, *extra: str):
    return load_config(ROOT / "tests/configs/tiny_test.yaml",
                       [f"output_dir={tmp_path / 'run'}", "ray.enabled=true", *TINY, *extra])


def _ours_left() -> list[str]:
    """Placement groups of runs that are not removed yet."""
    return [pg["name"] for pg in placement_group_table().values()
            if pg["name"].startswith("agentrl_") and pg["state"] != "REMOVED"]


def test_pools_are_placement_groups(ray_cluster: Cluster, tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "ray.train_workers=2", "ray.train_gpus_per_worker=1", "ray.train_cpus_per_worker=0.25",
               "ray.rollout_gpus_per_engine=1", "ray.rollout_cpus_per_engine=0.25", "ray.controller=true",
               "ray.controller_cpus=0.25")
    cfg.rollout.max_versions = 2  # two version slots (the pipeline's own checks are not what this tests)
    pools = plan_pools(cfg)
    assert [(p.name, len(p.bundles)) for p in pools] == [("train", 2), ("rollout_slot0", 1), ("rollout_slot1", 1),
                                                          ("env_controller", 1)]
    assert pools[0].bundles[0] == {"CPU": 0.25, "GPU": 1.0}
    pgs = create_placement_groups(pools, timeout_s=60, prefix="agentrl_test")
    try:
        table = {v["name"]: v for v in placement_group_table().values()}
        for name in ("train", "rollout_slot0", "rollout_slot1", "env_controller"):
            assert table[f"agentrl_test_{name}"]["state"] == "CREATED"
        _wait_for_free_gpus(0, "2 train + 2 rollout slots should hold all 4 GPUs")
    finally:
        remove_placement_groups(pgs)
    _wait_for_free_gpus(4, "GPUs not released after removing the placement groups")


def _wait_for_free_gpus(n: float, why: str, timeout_s: float = 30.0) -> None:
    """Ray's resource view reaches the driver asynchronously: poll it, with a deadline."""
    deadline = time.monotonic() + timeout_s
    while (free := ray.available_resources().get("GPU", 0)) != n:
        assert time.monotonic() < deadline, f"{why}: {free} GPUs free after {timeout_s} s, expected {n}"
        time.sleep(0.2)


def test_layout_that_does_not_fit_fails_clearly(ray_cluster: Cluster, tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "ray.train_workers=8", "ray.train_gpus_per_worker=1", "ray.train_cpus_per_worker=0.1",
               "ray.placement_timeout_s=3")
    t0 = time.monotonic()
    with pytest.raises(PlacementError) as err:
        run_on_ray(cfg, str(ROOT / "tests/configs/tiny_test.yaml"), [])
    msg = str(err.value)
    assert "train: 8 x {'CPU': 0.1, 'GPU': 1.0}" in msg and "The cluster has" in msg and "'GPU': 4.0" in msg, msg
    assert time.monotonic() - t0 < 30
    assert not _ours_left()


def test_train_on_ray_with_controller_and_engine_actors(ray_cluster: Cluster, tmp_path: Path) -> None:
    """A tiny run on Ray: the env controller (with workers for the built-in tasks) and one rollout
    engine (the SGLang stand-in, launched the way SGLang is) as actors in their own placement
    groups, the trainer in the train pool; the episodes go through both over HTTP."""
    ckpt = _tiny_hf_checkpoint(tmp_path / "hf")
    overrides = [f"output_dir={tmp_path / 'run'}", "ray.enabled=true", *TINY, "train.steps=1",
                 f"model.checkpoint={ckpt}", "ray.controller=true", "ray.controller_port=0",
                 "ray.controller_cpus=0.25", "ray.rollout_gpus_per_engine=1", "ray.rollout_cpus_per_engine=0.25",
                 "ray.engine_server_module=rollout_sglang.testing.sglang_standin", "ray.train_cpus_per_worker=0.5",
                 "rollout.sglang_server_args={mem_fraction_static: 0.7, context_length: 4096}"]
    cfg = load_config(ROOT / "tests/configs/tiny_test.yaml", overrides)
    summary = run_on_ray(cfg, str(ROOT / "tests/configs/tiny_test.yaml"), overrides)
    out = tmp_path / "run"
    assert summary["hf_export"] == str(out / "hf_export") and (out / "hf_export" / "config.json").is_file()
    # the trainer ranks got the controller actor's URL through the config ...
    assert "controller_url: http://" in (out / "config.yaml").read_text()
    # ... and the engine URLs per version slot, also through the config; the engine served until the run ended
    slots = json.loads((out / "ray" / "engines.json").read_text())
    assert len(slots) == 1 and len(slots[0]) == 1 and slots[0][0].startswith("http://")
    assert yaml.safe_load((out / "config.yaml").read_text())["rollout"]["engine_urls"] == slots
    # the server was started with the config's SGLang flags
    (log,) = (out / "ray" / "engine_logs").glob("sglang_*.log")
    assert "--mem-fraction-static 0.7 --context-length 4096" in log.read_text()
    logs = list((out / "ray" / "engine_logs").glob("sglang_*.log"))
    assert logs and "stand-in ready" in logs[0].read_text(), logs
    # the trainer found the engine by that URL: it opened the weight-sync group with it
    assert "weight-sync group" in logs[0].read_text(), logs[0].read_text()
    assert not _ours_left()
    alive = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("agentrl_")]
    assert not alive, alive


def test_node_lost_mid_run_stops_with_a_resumable_checkpoint(ray_cluster: Cluster, tmp_path: Path) -> None:
    # the trainer asks for 3 CPUs: only the added node (4 CPUs) can hold it, the head has 2
    node = ray_cluster.add_node(num_cpus=4)
    ray_cluster.wait_for_nodes()
    config = str(ROOT / "tests/configs/tiny_test.yaml")
    base = [f"output_dir={tmp_path / 'run'}", "ray.enabled=true", *TINY, "ray.health_check_interval_s=1",
            "checkpoint.interval=1", "checkpoint.resume=latest"]
    # no restart: the train pool cannot be placed again on what is left (ray.max_restarts would wait for it)
    overrides = [*base, "train.steps=1000", "ray.train_cpus_per_worker=3", "ray.max_restarts=0"]
    cfg = load_config(config, overrides)
    result: dict[str, BaseException] = {}

    def run() -> None:
        try:
            run_on_ray(cfg, config, overrides)
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            result["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    latest = tmp_path / "run" / "checkpoints" / "latest"
    deadline = time.monotonic() + 180
    while not latest.is_file():  # the node goes down after the run saved a checkpoint
        assert t.is_alive(), result
        assert time.monotonic() < deadline, "no checkpoint written"
        time.sleep(0.5)
    t_kill = time.monotonic()
    ray_cluster.remove_node(node, allow_graceful=False)
    t.join(timeout=90)
    assert not t.is_alive(), "the run did not stop after its node was removed"
    err = result.get("error")
    assert isinstance(err, RunLostError), repr(err)
    msg = str(err)
    assert "lost" in msg and "mid-run" in msg and "trainer rank 0" in msg and "The run was stopped" in msg, msg
    assert "(ray.max_restarts=0: no restart)" in msg, msg
    assert "the last checkpoint is " + str(tmp_path / "run" / "checkpoints" / "step_") in msg, msg
    assert "the same command resumes from it" in msg, msg
    print(f"run stopped {time.monotonic() - t_kill:.1f}s after its node was removed: {msg}")
    assert not _ours_left()
    # the same command, on what is left of the cluster (the trainer fits on the head now), resumes
    step = int(latest.read_text().strip().removeprefix("step_"))
    resumed = [*base, f"train.steps={step + 1}", "ray.train_cpus_per_worker=1"]
    summary = run_on_ray(load_config(config, resumed), config, resumed)
    assert summary["last_checkpoint"].endswith(f"step_{step + 1:06d}"), summary
    assert (tmp_path / "run" / "hf_export" / "config.json").is_file()


def test_unreachable_cluster_address_fails_fast() -> None:
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "megatron_agentrl.cli", "train",
                           "--config", "tests/configs/tiny_test.yaml",
                           f"ray.address=127.0.0.1:{port}", "ray.placement_timeout_s=2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert f"cannot connect to Ray at ray.address='127.0.0.1:{port}'" in proc.stderr
    assert "ray start --head" in proc.stderr
    assert time.monotonic() - t0 < 60


def test_running_engines_and_ray_engines_together_are_refused(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "ray.rollout_gpus_per_engine=1", "rollout.engine_urls=[[http://127.0.0.1:3001]]")
    with pytest.raises(ConfigError, match=r"rollout.engine_urls=.*ray.rollout_gpus_per_engine=1 asks Ray to start "
                                          r"its own; clear one of the two"):
        plan_pools(cfg)


def test_engine_paths_leave_the_driver_resolved(tmp_path: Path, monkeypatch) -> None:
    """An engine actor on another node (or in another working directory) loads the checkpoint the driver named: a
    relative model.checkpoint goes out absolute, the server starts in the driver's directory, a hub id goes as is."""
    (tmp_path / "ckpt").mkdir()
    monkeypatch.chdir(tmp_path)
    run = engine_launch(_cfg(tmp_path, "model.checkpoint=ckpt", "output_dir=run"), keys=None)
    assert run.model_path == str(tmp_path / "ckpt") and run.workdir == str(tmp_path)
    assert run.log_dir == str(tmp_path / "run" / "ray" / "engine_logs")
    assert engine_launch(_cfg(tmp_path, "model.checkpoint=Qwen/Qwen3-8B"), keys=None).model_path == "Qwen/Qwen3-8B"


def _run_in_thread(run: RayRun) -> tuple[threading.Thread, dict]:
    """``run.run()`` (then its cleanup) on a thread; the dict gets its ``summary`` or ``error``."""
    result: dict = {}

    def target() -> None:
        try:
            result["summary"] = run.run()
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            result["error"] = e
        finally:
            run.cleanup()

    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t, result


def _kill_trainer_after_checkpoint(run: RayRun, t: threading.Thread, result: dict, out: Path) -> None:
    """SIGKILL trainer rank 0's actor process once the run wrote its first checkpoint."""
    import os
    import signal

    deadline = time.monotonic() + 120
    while not (out / "checkpoints" / "latest").is_file():
        assert t.is_alive(), result
        assert time.monotonic() < deadline, "no checkpoint written"
        time.sleep(0.2)
    rank0 = next(m for m in run.members if m.kind == "trainer")
    os.kill(rank0.pid, signal.SIGKILL)


# slower steps (env latency), so that the kill lands while steps past the checkpoint run
SLOW_STEPS = ["train.steps=4", "checkpoint.interval=2", "ray.health_check_interval_s=1",
              "pipeline.sim_env_latency_s=0.15", "pipeline.sim_env_latency_alpha=50"]


def test_killed_trainer_restarts_and_resumes_from_its_checkpoint(ray_cluster: Cluster, tmp_path: Path, caplog) -> None:
    """Trainer rank 0's process SIGKILLed after the step-2 checkpoint: the launcher starts a fresh trainer that
    resumes from it (ray.max_restarts), the run completes all steps, each recorded once, and summary.json covers
    the whole run."""
    import logging

    out = tmp_path / "run"
    overrides = [f"output_dir={out}", "ray.enabled=true", *TINY, "sft.steps=0", *SLOW_STEPS, "ray.max_restarts=1"]
    config = str(ROOT / "tests/configs/tiny_test.yaml")
    run = RayRun(load_config(config, overrides), config, overrides)
    caplog.set_level(logging.WARNING, logger="megatron_agentrl.launch.ray_placement")
    t, result = _run_in_thread(run)
    _kill_trainer_after_checkpoint(run, t, result, out)
    t.join(timeout=150)
    assert not t.is_alive(), "the restarted run did not end"
    assert "error" not in result, repr(result.get("error"))
    assert run.restarts == 1
    restart = [r.getMessage() for r in caplog.records if "trainer group restart" in r.getMessage()]
    assert len(restart) == 1 and "trainer rank 0" in restart[0] and "its actor died" in restart[0], restart
    assert "resuming from " + str(out / "checkpoints" / "step_0000") in restart[0], restart
    summary = result["summary"]
    assert (summary["resumes"], summary["resumed_from_step"]) == (1, 2), summary
    assert summary["trained_samples"] == 4 * 2 * 2, summary
    rows = [json.loads(x) for x in (out / "batches.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    rl = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in rl if m["phase"] == "rl"] == [1, 2, 3, 4]
    assert not _ours_left()


@pytest.mark.slow  # the no-restart message is also checked by the node-lost test in the default run
def test_killed_trainer_without_restarts_stops_the_run(ray_cluster: Cluster, tmp_path: Path) -> None:
    out = tmp_path / "run"
    overrides = [f"output_dir={out}", "ray.enabled=true", *TINY, "sft.steps=0", *SLOW_STEPS, "ray.max_restarts=0"]
    config = str(ROOT / "tests/configs/tiny_test.yaml")
    run = RayRun(load_config(config, overrides), config, overrides)
    t, result = _run_in_thread(run)
    _kill_trainer_after_checkpoint(run, t, result, out)
    t.join(timeout=60)
    assert not t.is_alive(), "the run did not stop after its trainer died"
    err = result.get("error")
    assert isinstance(err, RunLostError), repr(err)
    msg = str(err)
    assert "lost trainer rank 0" in msg and "its actor died" in msg and "(ray.max_restarts=0: no restart)" in msg
    assert "the last checkpoint is " + str(out / "checkpoints" / "step_000002") in msg, msg
    assert run.restarts == 0 and not _ours_left()


@pytest.mark.slow  # two launches of the stand-in server
def test_killed_engine_actor_comes_back_at_its_url(ray_cluster: Cluster, tmp_path: Path, caplog) -> None:
    """A rollout engine's actor SIGKILLed (its server, in a session of its own, outlives it): the launcher starts a
    new actor in the same bundle, which stops the old server and launches one at the same host:port; a second
    loss past ray.engine_max_restarts stops the run, naming the key."""
    import logging
    import os
    import signal
    import urllib.request

    from megatron_agentrl.launch.ray_placement import _running

    ckpt = _tiny_hf_checkpoint(tmp_path / "hf")
    overrides = [f"output_dir={tmp_path / 'run'}", "ray.enabled=true", *TINY, f"model.checkpoint={ckpt}",
                 "ray.rollout_gpus_per_engine=1", "ray.rollout_cpus_per_engine=0.25", "ray.health_check_interval_s=1",
                 "ray.engine_server_module=rollout_sglang.testing.sglang_standin", "ray.engine_max_restarts=1"]
    config = str(ROOT / "tests/configs/tiny_test.yaml")
    run = RayRun(load_config(config, overrides), config, overrides)
    caplog.set_level(logging.WARNING, logger="megatron_agentrl.launch.ray_placement")
    try:
        run.pgs = create_placement_groups(run.pools, 60, run.prefix)
        [[url]] = run.start_engines()
        engine = next(m for m in run.members if m.kind == "engine")
        old_server, old_actor = engine.server_pid, engine.pid
        os.kill(old_actor, signal.SIGKILL)
        deadline = time.monotonic() + 90
        while engine.restarts == 0 or engine.starting is not None:  # the watch loop's ticks
            assert time.monotonic() < deadline, "the engine did not come back"
            run._check_service(engine)
            time.sleep(0.5)
        assert engine.url == url and engine.pid != old_actor and engine.server_pid != old_server
        assert not _running(old_server)
        with urllib.request.urlopen(url + "/health", timeout=10) as r:
            assert r.status == 200
        logs = [r.getMessage() for r in caplog.records]
        assert any("restart 1 of 1 (ray.engine_max_restarts) of rollout engine 0 of version slot 0 at " + url in x
                   and "its actor died" in x for x in logs), logs
        assert any(f"is back at {url}" in x for x in logs), logs
        os.kill(engine.server_pid, signal.SIGKILL)  # now the server exits: past the limit, the run stops
        with pytest.raises(RunLostError, match=r"its process exited; it was restarted 1 time\(s\), "
                                               r"ray.engine_max_restarts=1"):
            while time.monotonic() < deadline + 30:
                run._check_service(engine)
                time.sleep(0.5)
    finally:
        run.cleanup()
    assert not _ours_left()


def test_controller_actor_serves_a_task_entry_under_its_own_name() -> None:
    """An entry ``{name: sums, task: calc}`` (several entries of one built-in class) gets a worker of the class
    that announces the entry's name, as the trainer asks for it; the actor's class runs here without Ray."""
    import urllib.request

    actor = EnvControllerActor()
    try:
        url = actor.start(0, "tok", [("sums", "calc", {}), ("lookup", "lookup", {})], timeout_s=60)
        req = urllib.request.Request(f"{url}/list_workers", headers={"Authorization": "Bearer tok"})
        with urllib.request.urlopen(req, timeout=10) as r:  # noqa: S310 - loopback
            listed = json.loads(r.read())
        assert {n for n, t in listed.items() if t["workers"]} == {"sums", "lookup"}, listed
    finally:
        actor.stop()
