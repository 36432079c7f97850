"""``agentrl controller`` and ``agentrl worker`` as real processes: a worker killed with SIGKILL
mid-episode, clean shutdown on SIGTERM, and the CLI's error messages.
"""
from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from typing import Any

import pytest

from env_controller.clients.http_client import HttpEnvClient
from env_controller.clients.options import EnvClientOptions
from env_controller.http.net import free_port
from env_controller.protocol import SampleStatus
from env_controller.tasks import build_task
from tests.env.support import AGENTRL


def spawn(processes: list[subprocess.Popen[bytes]], *args: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [*AGENTRL, *args, "--log-level", "WARNING"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    processes.append(proc)
    return proc


async def wait_for_workers(
    env: HttpEnvClient, n: int, procs: list[subprocess.Popen[bytes]], limit_s: float = 30
) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                stderr = p.stderr.read().decode()[-2000:]  # type: ignore[union-attr]
                raise AssertionError(f"process exited with {p.returncode}: {stderr}")
        try:
            workers = await env.list_workers()
            if sum(len(t["workers"]) for t in workers.values()) >= n:
                return
        except Exception:  # noqa: BLE001 - the controller may not listen yet
            pass
        await asyncio.sleep(0.1)
    raise AssertionError(f"{n} workers did not register within {limit_s} s")


def test_killed_worker_process_ends_its_sessions_others_complete(processes: list[Any]) -> None:
    cport, wports = free_port(), [free_port(), free_port()]
    controller = spawn(
        processes, "controller", "--port", str(cport), "--suspect-after", "1", "--heartbeat-timeout", "2"
    )
    url = f"http://127.0.0.1:{cport}/api"
    workers = [
        spawn(processes, "worker", "--task", "lookup", "--controller", url, "--port", str(p), "--concurrency", "8",
              "--heartbeat-interval", "0.3", "--latency-ms", "300")
        for p in wports
    ]
    task = build_task("lookup")

    async def go() -> None:
        env = HttpEnvClient(url, EnvClientOptions(retries=5, backoff_s=0.1))
        try:
            await wait_for_workers(env, 2, [controller, *workers])
            started = [await env.start_sample("lookup", i) for i in range(6)]
            by_worker: dict[int, list[tuple[int, str]]] = {}
            sessions = await env.list_sessions()
            for i, (sid, _) in enumerate(started):
                by_worker.setdefault(sessions[sid]["worker_id"], []).append((i, sid))
            assert sorted(len(v) for v in by_worker.values()) == [3, 3]
            address = {w["id"]: w["address"] for w in (await env.list_workers())["lookup"]["workers"].values()}
            victim_id = next(wid for wid, a in address.items() if a.endswith(f":{wports[0]}/api"))

            async def episode(index: int, sid: str) -> tuple[SampleStatus, float, float]:
                demo, _ = task.demonstration(index)
                t0 = time.monotonic()
                reply = None
                for message in [m for m in demo if m["role"] == "assistant"]:
                    reply = await env.interact(sid, [message])
                    if reply.finish:
                        break
                assert reply is not None
                return reply.status, reply.reward, time.monotonic() - t0

            runs = [asyncio.ensure_future(episode(i, sid)) for i, (sid, _) in enumerate(started)]
            await asyncio.sleep(0.1)  # every session has an interact in flight (300 ms worker latency)
            workers[0].send_signal(signal.SIGKILL)
            results = await asyncio.wait_for(asyncio.gather(*runs), 20)
            for (sid, _), (status, reward, seconds) in zip(started, results):
                if any(sid == s for _, s in by_worker[victim_id]):
                    assert status is SampleStatus.TASK_ERROR and seconds < 2 + 3, (sid, status, seconds)
                else:
                    assert status is SampleStatus.COMPLETED and reward == 1.0
            await asyncio.sleep(2.5)
            states = {w["address"]: w["state"] for w in (await env.list_workers())["lookup"]["workers"].values()}
            assert states[address[victim_id]] == "dead"
            sid, reply = await env.start_sample("lookup", 7)  # new sessions go to the survivor
            assert not reply.finish
        finally:
            await env.aclose()

    asyncio.run(asyncio.wait_for(go(), 90))
    controller.send_signal(signal.SIGTERM)
    workers[1].send_signal(signal.SIGTERM)
    assert controller.wait(timeout=20) == 0
    assert workers[1].wait(timeout=20) == 0


@pytest.mark.parametrize(
    "args, message",
    [
        (["controller", "--host", "0.0.0.0"], "needs a bearer token"),
        (["controller", "--heartbeat-timeout", "1", "--suspect-after", "5"], "suspect_after_s=5.0 must be below"),
        (["worker", "--task", "nope"], "unknown task 'nope'"),
        (["worker", "--task", "lookup", "--param", "colour=1"], "unknown config key 'lookup.colour' (valid keys here:"),
        (["worker", "--task", "no.such.module:Task"], "cannot import 'no.such.module'"),
        (["worker", "--task", "lookup", "--controller", "localhost:5020"], "must start with http://"),
    ],
)
def test_cli_errors_are_one_clear_line(args: list[str], message: str) -> None:
    proc = subprocess.run([*AGENTRL, *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert message in proc.stderr and proc.stderr.startswith("agentrl: error:"), proc.stderr
