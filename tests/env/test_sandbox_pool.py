"""The sandbox pool on a real Docker engine (a private dockerd started by the tests): containers started ahead
of demand, the maximum enforced, reuse only when allowed (and a wipe that really resets), shrinking, no leak
after close, and the containers of a worker killed with ``kill -9`` removed by the next worker's start.
Skips only where dockerd cannot run."""
from __future__ import annotations

import asyncio
import inspect
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

docker = pytest.importorskip("docker", reason="the docker SDK is not installed (pip install docker)")

from env_controller.clients.http_client import HttpEnvClient  # noqa: E402
from env_controller.clients.options import EnvClientOptions  # noqa: E402
from env_controller.http.net import free_port  # noqa: E402
from env_controller.openapi import worker_spec  # noqa: E402
from env_controller.protocol import SampleStatus  # noqa: E402
from env_controller.sandbox import SandboxError, SandboxLimits  # noqa: E402
from env_controller.sandbox.docker import LABEL, OWNER_LABEL, DockerBackend, DockerSandbox, owner_id  # noqa: E402
from env_controller.sandbox.options import DockerOptions, PoolOptions  # noqa: E402
from env_controller.sandbox.pool import PoolExhaustedError, SandboxPool  # noqa: E402
from env_controller.tasks import build_task  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
# background jobs kept, so that the wipe has processes to kill
LIMITS = SandboxLimits(timeout_s=5, max_processes=32, memory_mb=128, tmp_mb=8, max_file_mb=4, background_jobs=True)


@pytest.fixture(scope="module")
def backend(docker_engine: Any, os_shell_image: str) -> Iterator[DockerBackend]:
    b = DockerBackend(LIMITS, DockerOptions(image=os_shell_image, docker_host=docker_engine.url, home_mb=16))
    yield b
    b.close()
    assert _ps_a(docker_engine) == [], "a sandbox container outlived the tests"


def _ids(engine: Any, *labels: str) -> list[str]:
    """Ids of the engine's sandbox containers carrying ``labels`` (``key=value``), in one API call."""
    client = engine.client()
    try:
        found = client.api.containers(all=True, filters={"label": [f"{LABEL}=1", *labels]})
    finally:
        client.close()
    return sorted(c["Id"] for c in found)


def _ps_a(engine: Any) -> list[str]:
    """``docker ps -aq --filter label=org.agentrl.sandbox=1``, through the docker CLI where it is installed."""
    if not shutil.which("docker"):
        return [i[:12] for i in _ids(engine)]
    ps = subprocess.run(["docker", "ps", "-aq", "--filter", f"label={LABEL}=1"], capture_output=True, text=True,
                        timeout=30, env={**os.environ, "DOCKER_HOST": engine.url})
    assert ps.returncode == 0, ps.stderr
    return ps.stdout.split()


def _wait(what: str, check: Callable[[], Any], timeout_s: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        time.sleep(0.05)


def _processes(box: DockerSandbox) -> list[str]:
    top = box.container.top()
    column = top["Titles"].index("CMD")
    return [row[column] for row in top["Processes"]]


def test_warm_pool_starts_ahead_of_demand_and_shrinks(backend: DockerBackend, docker_engine: Any) -> None:
    mine = "agentrl.test=warm"
    pool = SandboxPool(backend, PoolOptions(max_containers=6, warm_containers="1:3", warm_window_s=2.0,
                                             shrink_after_s=2.0, refill_interval_s=0.05),
                       labels={"agentrl.test": "warm"})
    try:
        # one container is started before anyone asks
        _wait("warm_min idle", lambda: pool.stats()["idle"] == 1)
        assert len(_ids(docker_engine, mine)) == 1
        t0 = time.monotonic()
        first = pool.acquire(labels={"agentrl.index": "1"})
        assert time.monotonic() - t0 < 0.5 and first.run("echo hi").output == "hi\n"
        assert "agentrl.index" not in first.container.labels  # started before its session was known
        boxes = [first, pool.acquire(labels={"agentrl.index": "2"}), pool.acquire(labels={"agentrl.index": "3"})]
        stats = pool.stats()
        assert stats["served_warm"] >= 1 and stats["acquired"] == 3, stats
        # three acquisitions in the window: three kept warm beside the three leased (max 6)
        _wait("warm target 3", lambda: pool.stats()["idle"] == 3)
        assert pool.stats()["warm_target"] == 3 and len(_ids(docker_engine, mine)) == 6
        for box in boxes:
            pool.release(box, reusable=True)  # the pool does not reuse: removed
            assert box.closed
        assert len(_ids(docker_engine, mine)) == 3
        # demand falls out of the window: back to warm_min, the others removed
        _wait("shrunk to warm_min", lambda: pool.stats()["idle"] == 1 and len(_ids(docker_engine, mine)) == 1, 10)
        stats = pool.stats()
        assert stats["live"] == 1 and stats["removed"] == stats["created"] - 1 and stats["peak_live"] == 6, stats
    finally:
        pool.close()
    assert _ids(docker_engine, mine) == [] and backend.live() == []


def test_max_is_enforced(backend: DockerBackend, docker_engine: Any) -> None:
    pool = SandboxPool(backend, PoolOptions(max_containers=2, acquire_timeout_s=1.0), labels={"agentrl.test": "max"},
                       limit_hint="max_containers (the worker's --max-containers)")
    try:
        a, b = pool.acquire(), pool.acquire()
        t0 = time.monotonic()
        with pytest.raises(PoolExhaustedError, match=r"all 2 allowed by max_containers \(the worker's "
                           r"--max-containers\) are live \(2 held by sessions.*raise max_containers"):
            pool.acquire()
        assert 0.9 < time.monotonic() - t0 < 3
        # a release while one waits hands its slot over
        threading.Timer(0.3, pool.release, (a,)).start()
        t0 = time.monotonic()
        c = pool.acquire(timeout_s=20)
        assert time.monotonic() - t0 >= 0.3 and c is not a and a.closed
        stats = pool.stats()
        assert stats["peak_live"] == 2 and stats["timeouts"] == 1 and stats["waited"] == 2, stats
        assert len(_ids(docker_engine, "agentrl.test=max")) == 2
        pool.release(b)
    finally:
        pool.close()
    assert c.closed and _ids(docker_engine, "agentrl.test=max") == []
    with pytest.raises(RuntimeError, match="closed"):
        pool.acquire()


DIRTY = """mkdir -p ~/d/locked /tmp/t; echo s > ~/d/locked/f; chmod 000 ~/d/locked; echo x > ~/.hidden
echo y > /tmp/t/y; echo z > /dev/shm/z; chmod 777 ~; cd /tmp; export SECRET=1; umask 077
sleep 1000 & sleep 1000 &
echo dirty"""


def test_reuse_only_when_allowed_and_the_wipe_resets(backend: DockerBackend, docker_engine: Any,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    with SandboxPool(backend, PoolOptions(max_containers=1), labels={"agentrl.test": "reuse"}) as fresh:
        box = fresh.acquire()
        box.run("echo mine > ~/marker")
        fresh.release(box, reusable=True)  # reuse is off: removed
        again = fresh.acquire()
        assert again is not box and box.closed and again.run("ls ~").output == ""
    with SandboxPool(backend, PoolOptions(max_containers=1, reuse_containers=True),
                     labels={"agentrl.test": "reuse"}) as pool:
        box = pool.acquire()
        container = box.container.id
        assert box.run(DIRTY).output == "dirty\n"
        assert sum("sleep 1000" in p for p in _processes(box)) == 2
        pool.release(box, reusable=True)
        same = pool.acquire()
        assert same is box and same.container.id == container and pool.stats()["reused"] == 1
        # files (hidden, locked, in /tmp and /dev/shm), cwd, variables, umask, processes, the home's mode
        r = same.run("pwd; echo ${SECRET:-unset}; umask; ls -A ~ /tmp /dev/shm; stat -c %a ~")
        assert r.output == "/home/user\nunset\n0022\n/dev/shm:\n\n/home/user:\n\n/tmp:\n700\n", r
        procs = _processes(same)
        assert len(procs) == 3 and not any("sleep 1000" in p for p in procs), procs
        # a caller that says no (a broken session), or a wipe that fails: removed, never reused
        pool.release(same, reusable=False)
        assert same.closed
        box = pool.acquire()
        monkeypatch.setattr(box, "wipe", lambda: (_ for _ in ()).throw(SandboxError("left something")))
        pool.release(box, reusable=True)
        assert box.closed and pool.stats()["wipe_failures"] == 1
    assert _ids(docker_engine, "agentrl.test=reuse") == []


def test_os_shell_reuses_containers_only_when_its_param_says(docker_engine: Any, os_shell_image: str) -> None:
    def two_sessions(**params: Any) -> tuple[str, str]:
        task = build_task("os_shell", backend="docker", image=os_shell_image, docker_host=docker_engine.url,
                          max_containers=1, **params)
        ids = []
        try:
            for index in (0, 1):
                session, _ = task.new_session(index)
                assert session.sandbox.run("ls ~/marker").exit_code != 0  # nothing of the previous session
                session.sandbox.run("echo mine > ~/marker")
                ids.append(session.sandbox.container.id)
                session.release_once()
        finally:
            task.close()
        assert _ids(docker_engine, "agentrl.task=os_shell") == []
        return ids[0], ids[1]

    first, second = two_sessions()
    assert first != second  # a fresh container per session, as in AgentBench
    first, second = two_sessions(reuse_containers=True)
    assert first == second


def test_containers_no_sandbox_holds_are_swept(docker_engine: Any, os_shell_image: str) -> None:
    b = DockerBackend(LIMITS, DockerOptions(image=os_shell_image, docker_host=docker_engine.url, home_mb=16))
    other = DockerBackend(LIMITS, DockerOptions(image=os_shell_image, docker_host=docker_engine.url, home_mb=16))
    try:
        kept, lost, others = b.create(), b.create(), other.create()
        b._forget(lost.id)  # as after a removal the engine refused
        assert b.sweep(min_age_s=120) == []  # young: it may still be starting
        assert b.sweep() == [lost.container.id]
        assert _ids(docker_engine, f"{OWNER_LABEL}={owner_id()}") == sorted([kept.container.id, others.container.id])
        b.close()  # closing sweeps too; the other backend of this process keeps its container
        assert _ids(docker_engine, f"{OWNER_LABEL}={owner_id()}") == [others.container.id]
    finally:
        b.close()
        other.close()
    assert _ids(docker_engine, f"{OWNER_LABEL}={owner_id()}") == []


async def _until(what: str, check: Callable[[], Any], timeout_s: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        await asyncio.sleep(0.1)


def test_containers_of_a_killed_worker_are_removed_by_the_next_start(
        docker_engine: Any, os_shell_image: str, processes: list[subprocess.Popen[bytes]], tmp_path: Path) -> None:
    cli = [sys.executable, "-m", "env_controller.cli"]
    cport = free_port()
    controller = f"http://127.0.0.1:{cport}/api"
    log = open(tmp_path / "processes.log", "wb")
    processes.append(subprocess.Popen([*cli, "controller", "--port", str(cport)], cwd=REPO, stdout=log, stderr=log))

    def worker() -> tuple[subprocess.Popen[bytes], str]:
        port = free_port()
        proc = subprocess.Popen([*cli, "worker", "--task", "os_shell", "--param", "backend=docker", "--param",
                                 f"image={os_shell_image}", "--param", f"docker_host={docker_engine.url}",
                                 "--max-containers", "3", "--warm-containers", "1", "--port", str(port),
                                 "--controller", controller, "--heartbeat-interval", "0.3"],
                                cwd=REPO, stdout=log, stderr=log)
        processes.append(proc)
        return proc, f"http://127.0.0.1:{port}/api"

    async def go() -> None:
        env = HttpEnvClient(controller, EnvClientOptions(retries=0, timeout_s=60))
        try:
            first, first_url = worker()

            async def registered(url: str) -> bool:
                try:
                    return any(w["address"] == url and w["state"] == "alive"
                               for w in (await env.list_workers()).get("os_shell", {}).get("workers", {}).values())
                except Exception:  # noqa: BLE001 - the controller is starting
                    return False

            await _until("the first worker registered", lambda: registered(first_url))
            sid, reply = await env.start_sample("os_shell", 0)
            assert reply.status is SampleStatus.RUNNING
            owner = owner_id(first.pid)
            # the session's container and the warm one, both labelled with the worker as owner
            held = await _until("a session's and a warm container",
                                lambda: len(ids := _ids(docker_engine, f"{OWNER_LABEL}={owner}")) == 2 and ids)
            status = await (await env._http().get(first_url + "/worker_status")).json()
            assert status["concurrency"] == 3 and status["current"] == 1, status
            assert status["sandbox_pool"]["leased"] == 1 and status["sandbox_pool"]["max"] == 3, status
            # as the worker's OpenAPI description says
            described = worker_spec()["paths"]["/api/worker_status"]["get"]["responses"]["200"]
            jsonschema.validate(status, described["content"]["application/json"]["schema"])
            metrics = await (await env._http().get(first_url.removesuffix("/api") + "/metrics")).text()
            assert 'agentrl_worker_sandboxes{state="leased",task="os_shell"} 1.0' in metrics, metrics

            first.send_signal(signal.SIGKILL)  # not waited for: a zombie owner counts as dead too
            await _until("the worker killed", lambda: Path(f"/proc/{first.pid}/stat").read_text().split(") ")[1][0]
                         == "Z")
            assert _ids(docker_engine, f"{OWNER_LABEL}={owner}") == held  # nobody removed them yet
            # the controller ends the session on the dead worker with a task error, without hanging
            call = {"id": "0", "type": "function", "function": {"name": "bash_action", "arguments": '{"script": "id"}'}}
            reply = await env.interact(sid, [{"role": "assistant", "content": "", "tool_calls": [call]}])
            assert reply.finish and reply.status is SampleStatus.TASK_ERROR, reply

            second, second_url = worker()
            await _until("the second worker registered", lambda: registered(second_url))
            # reaped by the second one, in the background of its start
            await _until("the dead worker's containers reaped", lambda: _ids(docker_engine, f"{OWNER_LABEL}={owner}")
                         == [])
            await _until("the second worker's warm container",
                         lambda: len(_ids(docker_engine, f"{OWNER_LABEL}={owner_id(second.pid)}")) == 1)
            # a worker that stops cleanly takes its warm containers with it
            new_owner = owner_id(second.pid)
            second.send_signal(signal.SIGTERM)
            assert second.wait(30) == 0
            assert _ids(docker_engine, f"{OWNER_LABEL}={new_owner}") == []
        finally:
            await env.aclose()

    try:
        asyncio.run(go())
    finally:
        log.close()
    assert _ps_a(docker_engine) == []


def test_worker_flags_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    from env_controller.cli import main

    assert main(["worker", "--task", "lookup", "--max-containers", "3"]) == 2
    assert "task 'lookup' runs no sandboxes" in capsys.readouterr().err
    assert main(["worker", "--task", "os_shell", "--warm-containers", "5:2"]) == 2
    assert "--warm-containers='5:2' must be N (keep N warm) or MIN:MAX" in capsys.readouterr().err
    assert main(["worker", "--task", "os_shell", "--max-containers", "2", "--warm-containers", "3"]) == 2
    assert "warm_containers='3' keeps more warm than max_containers=2" in capsys.readouterr().err


class _Box:
    """A stand-in sandbox for the pool's bookkeeping alone (the tests above use real containers)."""

    def __init__(self, n: int) -> None:
        self.id, self.closed = f"box-{n}", False

    def close(self) -> None:
        self.closed = True

    def wipe(self) -> None:
        pass


class _Backend:
    name = "stand-in"

    def __init__(self) -> None:
        self.made = 0

    def create(self, limits: Any = None, labels: Any = None) -> _Box:
        self.made += 1
        return _Box(self.made)


def test_the_warm_target_falls_only_after_the_shrink_delay() -> None:
    """Demand in bursts (an RL step's episodes, then a pause): the burst's containers stay warm for shrink_after_s
    after the demand left the window, then the pool shrinks to warm_min; a new burst within the delay finds them."""
    backend = _Backend()
    pool = SandboxPool(backend, PoolOptions(max_containers=10, warm_containers="1:8", warm_window_s=0.5,
                                            shrink_after_s=2.0, reuse_containers=True, refill_interval_s=0.02,
                                            sweep_interval_s=0))
    try:
        _wait("warm_min idle", lambda: pool.stats()["idle"] == 1)
        boxes = [pool.acquire() for _ in range(6)]
        for box in boxes:
            pool.release(box, reusable=True)
        _wait("the burst's containers idle", lambda: pool.stats()["idle"] >= 6)
        time.sleep(1.0)  # the burst left the demand window (0.5 s), not the shrink delay (2 s)
        stats = pool.stats()
        assert stats["idle"] >= 6 and stats["warm_target"] >= 6 and stats["removed"] == 0, stats
        made, warm = backend.made, stats["served_warm"]
        again = [pool.acquire() for _ in range(6)]  # the next burst: served warm, nothing new made
        assert backend.made == made and pool.stats()["served_warm"] == warm + 6, pool.stats()
        for box in again:
            pool.release(box, reusable=True)
        _wait("shrunk to warm_min", lambda: pool.stats()["idle"] == 1, 10)
        assert pool.stats()["warm_target"] == 1
    finally:
        pool.close()
    with pytest.raises(ValueError, match="shrink_after_s=0 must be a positive"):
        PoolOptions(shrink_after_s=0)


def test_a_bursts_wiped_sandboxes_serve_the_next_burst() -> None:
    """Demand at warm_min's level in bursts, with reuse: the pool refills itself during a burst, so the burst's
    sandboxes come back wiped above the target. They stay idle (up to warm_max) for shrink_after_s instead of
    being removed at once, and the next burst takes them: fewer starts per burst, and none beyond warm_max."""
    backend = _Backend()
    pool = SandboxPool(backend, PoolOptions(max_containers=10, warm_containers="4:6", warm_window_s=0.3,
                                            shrink_after_s=5.0, reuse_containers=True, refill_interval_s=0.02,
                                            sweep_interval_s=0))
    try:
        _wait("warm_min idle", lambda: pool.stats()["idle"] == 4)
        for burst in range(2):
            made = backend.made
            boxes = [pool.acquire() for _ in range(4)]
            _wait("refilled to the target", lambda: pool.stats()["idle"] == 4)
            for box in boxes:
                pool.release(box, reusable=True)
            # 8 idle: the 2 beyond warm_max go at once, the other 2 above the target stay for now
            _wait("back to warm_max", lambda: pool.stats()["idle"] == 6 and pool.stats()["removing"] == 0)
            # the first burst found 4 idle and refilled 4; the second found 6 and needed only 2 more
            assert backend.made - made == (4 if burst == 0 else 2), (burst, backend.made - made, pool.stats())
            time.sleep(0.5)  # out of the demand window, inside shrink_after_s
        assert pool.stats()["idle"] == 6 and pool.stats()["served_warm"] == 8
        _wait("shrunk to warm_min once unused for shrink_after_s", lambda: pool.stats()["idle"] == 4, 20)
    finally:
        pool.close()
