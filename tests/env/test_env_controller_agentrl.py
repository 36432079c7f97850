"""Compatibility: a stock ``agentrl-worker`` TaskWorker (the PyPI package, started with its own
``python -m agentrl.worker`` entry point and config file) registers with our controller and serves
sessions end to end through the trainer-facing API.
"""
from __future__ import annotations

import asyncio
import json
import signal
import textwrap
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

pytest.importorskip("agentrl.worker.task_worker", reason="agentrl-worker is in the dev extra: pip install -e '.[dev]'")

from env_controller.clients.http_client import EnvControllerError, HttpEnvClient  # noqa: E402
from env_controller.clients.local import UnknownSessionError  # noqa: E402
from env_controller.clients.options import EnvClientOptions  # noqa: E402
from env_controller.controller.server import Controller, ControllerConfig  # noqa: E402
from env_controller.protocol import MalformedMessageError, SampleStatus  # noqa: E402
from tests.env.support import CONFIG, TASK_MODULE, start_agentrl_worker, wait_registered  # noqa: E402


def call(name: str, args: dict[str, Any]) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": f"call_{name}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
        ],
    }


@pytest.fixture
def agentrl_worker_files(tmp_path: Path) -> Path:
    (tmp_path / "arw_add_task.py").write_text(textwrap.dedent(TASK_MODULE))
    (tmp_path / "arw.yaml").write_text(CONFIG)
    return tmp_path




async def worker_sessions(address: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s:
        async with s.get(address + "/get_sessions", timeout=aiohttp.ClientTimeout(total=10)) as r:
            return await r.json()


def test_agentrl_worker_serves_sessions_through_our_controller(
    agentrl_worker_files: Path, processes: list[Any]
) -> None:
    # AgentRL workers heartbeat every 8 s: the suspect threshold must stay above that
    config = ControllerConfig(port=0, suspect_after_s=10.0, heartbeat_timeout_s=20.0)

    async def go() -> None:
        controller = Controller(config)
        await controller.start()
        env = HttpEnvClient(controller.url, EnvClientOptions(retries=0, timeout_s=30, unavailable_timeout_s=0.5))
        try:
            proc, address = start_agentrl_worker(agentrl_worker_files, controller.url, processes)
            entry = await wait_registered(env, proc, "arwadd")
            (worker,) = entry["workers"].values()
            assert entry["indices"] == 20 and worker["address"] == address
            assert worker["concurrency"] == 4 and worker["state"] == "alive"
            assert await env.indices("arwadd") == list(range(20))

            async def episode(index: int, right: bool) -> tuple[float, list[dict[str, Any]]]:
                sid, reply = await env.start_sample("arwadd", index)
                assert reply.status is SampleStatus.RUNNING and not reply.finish
                assert [t["function"]["name"] for t in reply.tools] == ["add", "answer"]
                assert reply.messages == [{"role": "user", "content": f"What is {index} + {2 * index + 1}?"}]
                r1 = await env.interact(sid, [call("add", {"a": index, "b": 2 * index + 1})])
                assert not r1.finish and r1.messages == [
                    {"role": "tool", "tool_call_id": "call_add", "content": str(3 * index + 1)}]
                r2 = await env.interact(sid, [call("answer", {"value": 3 * index + 1 + (0 if right else 1)})])
                assert r2.finish and r2.status is SampleStatus.COMPLETED
                return r2.reward, r2.messages

            # four sessions at once (the worker's concurrency), right and wrong answers
            results = await asyncio.gather(*(episode(i, right=i % 2 == 0) for i in range(4)))
            assert [r for r, _ in results] == [1.0, 0.0, 1.0, 0.0]
            assert results[0][1][0]["content"] == "correct" and results[1][1][0]["content"] == "wrong"

            # a fifth concurrent session finds no free slot: 503 after the client's retries
            open_sids = [(await env.start_sample("arwadd", i))[0] for i in range(4)]
            with pytest.raises(EnvControllerError) as err:
                await env.start_sample("arwadd", 5)
            assert err.value.status == 503 and "at capacity" in err.value.message
            assert sorted(await worker_sessions(address)) == sorted(open_sids)

            # malformed messages are stopped at the controller; the session stays usable
            with pytest.raises(MalformedMessageError):
                await env.interact(open_sids[0], [{"role": "assistant", "tool_calls": [{"function": {}}]}])
            reply = await env.interact(open_sids[0], [call("add", {"a": 1, "b": 1})])
            assert reply.messages[0]["content"] == "2"

            # an assistant message without tool calls ends the episode as the task decides
            reply = await env.interact(open_sids[1], [{"role": "assistant", "content": "I give up"}])
            assert reply.finish and reply.status is SampleStatus.AGENT_INVALID_ACTION

            # cancel reaches the worker
            await env.cancel(open_sids[2])
            for _ in range(100):
                if open_sids[2] not in await worker_sessions(address):
                    break
                await asyncio.sleep(0.05)
            assert sorted(await worker_sessions(address)) == sorted([open_sids[0], open_sids[3]])
            with pytest.raises(UnknownSessionError):
                await env.interact(open_sids[2], [call("add", {"a": 1, "b": 1})])

            # the worker process dies: its sessions end with task error at the next call, never hang
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
            t0 = time.monotonic()
            reply = await env.interact(open_sids[0], [call("answer", {"value": 2})])
            assert time.monotonic() - t0 < 5
            assert reply.finish and reply.status is SampleStatus.TASK_ERROR
            workers = await env.list_workers()
            assert [w["state"] for w in workers["arwadd"]["workers"].values()] == ["suspect"]
            with pytest.raises(EnvControllerError) as err:
                await env.start_sample("arwadd", 1)
            assert err.value.status == 503
        finally:
            await env.aclose()
            await controller.stop()

    asyncio.run(asyncio.wait_for(go(), 120))
