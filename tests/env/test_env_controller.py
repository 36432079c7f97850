"""The environment controller, the worker server and the HTTP client, in one process over real HTTP.

Every test runs its own controller and workers on free loopback ports and stops them in a
``finally``; every wait is bounded (``asyncio.wait_for``).
"""
from __future__ import annotations

import asyncio
import base64
import json
import socket
import time
from typing import Any

import pytest

from env_controller.clients.http_client import EnvControllerError, HttpEnvClient
from env_controller.clients.local import UnknownSessionError
from env_controller.clients.options import EnvClientOptions
from env_controller.controller.registry import NoWorkerError, RegistryError, WorkerRegistry, WorkerState
from env_controller.controller.server import Controller
from env_controller.http.net import free_port
from env_controller.protocol import MalformedMessageError, SampleStatus, TaskReply
from env_controller.tasks import Task, build_task
from env_controller.worker.options import WorkerOptions
from env_controller.worker.server import WorkerServer
from tests.env.support import EchoTask, beat, cluster, fast_config, raw, run, tool_call

# ----------------------------------------------------------------------------------------------
# end to end


def test_builtin_tasks_replay_demonstrations_over_http() -> None:
    """lookup, calc and guess behind worker servers reach reward 1 through the controller, message for message."""
    names = ["lookup", "calc", "guess"]
    tasks = [build_task(n) for n in names]

    async def go() -> None:
        async with cluster(tasks) as (controller, _, env):
            async def episode(task: Task, index: int) -> None:
                demo, tools = task.demonstration(index)
                sid, reply = await env.start_sample(task.name, index)
                assert isinstance(sid, str) and int(sid) > 0
                assert reply.tools == tools and reply.status is SampleStatus.RUNNING
                conversation = list(reply.messages)
                for message in [m for m in demo if m["role"] == "assistant"]:
                    assert not reply.finish
                    conversation.append(message)
                    reply = await env.interact(sid, [message])
                    conversation.extend(reply.messages)
                assert conversation == demo
                assert reply.finish and reply.status is SampleStatus.COMPLETED and reply.reward == 1.0
                assert reply.metrics["success"] == 1.0

            await asyncio.gather(*(episode(t, i) for t in tasks for i in range(12)))
            assert await env.list_sessions() == {}
            workers = await env.list_workers()
            assert set(workers) == set(names)
            assert await env.indices("calc") == list(range(512))

    run(go())


def test_many_concurrent_sessions_spread_least_loaded() -> None:
    """Three workers of one task share 60 open sessions 20/20/20; a full task answers 503."""

    async def go() -> None:
        controller = Controller(fast_config())
        await controller.start()
        options = WorkerOptions(controller_url=controller.url, heartbeat_interval_s=0.2, concurrency=20)
        workers = [WorkerServer(EchoTask(), options) for _ in range(3)]
        env = HttpEnvClient(controller.url, EnvClientOptions(retries=1, backoff_s=0.01, unavailable_timeout_s=0.5))
        try:
            for w in workers:
                await w.start()
                await asyncio.wait_for(w.heartbeat_ok.wait(), 10)  # type: ignore[union-attr]
            opened = await asyncio.gather(*(env.start_sample("echo", i % 9) for i in range(60)))
            loads = sorted(len(w._sessions) for w in workers)
            assert loads == [20, 20, 20]
            listed = await env.list_workers()
            assert sorted(w["current"] for w in listed["echo"]["workers"].values()) == [20, 20, 20]
            with pytest.raises(EnvControllerError) as err:
                await env.start_sample("echo", 0)
            assert err.value.status == 503 and "free slot" in err.value.message
            # one freed slot is reused by the least-loaded worker
            await env.cancel(opened[0][0])
            await env.start_sample("echo", 1)
            replies = await asyncio.gather(*(env.interact(sid, [tool_call("finish", {})]) for sid, _ in opened[1:]))
            assert all(r.finish and r.reward == 1.0 for r in replies)
        finally:
            await env.aclose()
            for w in workers:
                await w.stop()
            await controller.stop()

    run(go())


def test_agent_loop_runs_over_the_http_client() -> None:
    """The agent loop drives a controller-backed episode exactly as it drives LocalEnvClient."""
    pytest.importorskip("transformers")
    from rollout_sglang.agent_loop import run_group_lockstep
    from rollout_sglang.engines.protocol import GenerationOutput, SamplingParams
    from rollout_sglang.episode_options import EpisodeLimits, EpisodeOptions
    from rollout_sglang.tool_parser import parse_assistant_text  # noqa: F401  (the loop's parser)

    task = build_task("lookup")
    demo, _ = task.demonstration(5)
    turns = [m for m in demo if m["role"] == "assistant"]

    def render(message: dict[str, Any]) -> str:
        fn = message["tool_calls"][0]["function"]
        return '<tool_call>\n{"name": "%s", "arguments": %s}\n</tool_call>' % (fn["name"], fn["arguments"])

    texts = [render(m) for m in turns]

    async def go() -> None:
        import tempfile

        from rollout_sglang.chat_template import ChatTemplate
        from rollout_sglang.tokenizer import train_bpe_tokenizer

        with tempfile.TemporaryDirectory() as tmp:
            corpus = texts + [json.dumps(task.tools()), demo[0]["content"], "correct pink red"]
            template = ChatTemplate(train_bpe_tokenizer(corpus * 3, vocab_size=400, out_dir=tmp))

            class ScriptEngine:
                version = 0

                async def generate(self, prompts: list[list[int]], params: SamplingParams,
                                   seeds=None) -> list[GenerationOutput]:
                    outs = []
                    for p in prompts:
                        turn = template.decode(p).count("<|im_start|>assistant") - 1
                        ids = template.tokenizer.encode(texts[turn], add_special_tokens=False) + [template.im_end_id]
                        outs.append(GenerationOutput(ids, [-0.5] * len(ids), "stop", 0))
                    return outs

            async with cluster([task]) as (_, _, env):
                params = SamplingParams(max_new_tokens=200, temperature=1.0, seed=0)
                trajs = await run_group_lockstep(ScriptEngine(), env, template, [("lookup", 5, 0)], params,
                                                 EpisodeOptions(EpisodeLimits(4, 4096)))
                (traj,) = trajs
                assert traj.status in (SampleStatus.COMPLETED, SampleStatus.COMPLETED.value), traj
                assert traj.reward == 1.0

    run(go())


# ----------------------------------------------------------------------------------------------
# errors a client can cause


def test_bad_requests_get_clear_4xx_json_errors() -> None:
    async def go() -> None:
        async with cluster(config=fast_config(registration_window_s=0)) as (controller, _, env):
            api = controller.url
            cases: list[tuple[str, str, dict[str, Any], int, str]] = [
                ("start_sample", "not json{", {}, 400, "not valid JSON"),
                ("start_sample", "[1, 2]", {}, 400, "must be a JSON object"),
                ("start_sample", "", {}, 400, "empty request body"),
                ("start_sample", json.dumps({"index": 1}), {}, 400, "'name'"),
                ("start_sample", json.dumps({"name": "echo"}), {}, 400, "missing 'index'"),
                ("start_sample", json.dumps({"name": "echo", "index": True}), {}, 400, "'index' must be"),
                ("start_sample", json.dumps({"name": "nope", "index": 1}), {}, 404, "unknown task 'nope'"),
                ("start_sample", json.dumps({"name": "echo", "index": 99}), {}, 400, "no sample index 99"),
                ("interact", json.dumps({"messages": []}), {}, 400, "missing 'session_id' request header"),
                ("interact", json.dumps({"messages": []}), {"session_id": "abc"}, 400, "must be an integer"),
                ("interact", json.dumps({"messages": []}), {"session_id": "12345"}, 404, "unknown session 12345"),
                ("cancel", "", {"session_id": "12345"}, 404, "unknown session 12345"),
                ("receive_heartbeat", json.dumps({"name": "x"}), {}, 400, "'address'"),
                (
                    "receive_heartbeat",
                    json.dumps({"name": "x", "address": "http://h:1/api", "concurrency": 0, "indices": []}),
                    {},
                    400,
                    "'concurrency'",
                ),
                (
                    "receive_heartbeat",
                    json.dumps({"name": "x", "address": "http://h:1/api", "concurrency": 1, "indices": [None]}),
                    {},
                    400,
                    "every index",
                ),
                ("no_such_endpoint", "{}", {}, 404, "no such endpoint"),
            ]
            for endpoint, data, headers, want, text in cases:
                status, body, _ = await raw(f"{api}/{endpoint}", data=data, headers=headers)
                assert status == want, (endpoint, data, body)
                assert isinstance(body, dict) and text in body["error"], (endpoint, body)
            status, body, _ = await raw(f"{api}/start_sample", method="GET")
            assert status == 405 and "not allowed" in body["error"]
            status, body, _ = await raw(f"{api}/get_indices", method="GET")
            assert status == 400 and "'name'" in body["error"]

            # a malformed message leaves the session usable; a second concurrent interact gets 409
            sid, _ = await env.start_sample("echo", 0)
            for bad in ([], [{"role": "user", "content": "hi"}], [{"role": "assistant", "tool_calls": "x"}]):
                with pytest.raises(MalformedMessageError):
                    await env.interact(sid, bad)
            slow = asyncio.ensure_future(env.interact(sid, [tool_call("sleep", {"seconds": 0.5})]))
            await asyncio.sleep(0.1)
            status, body, _ = await raw(f"{api}/interact", json_body={"messages": [tool_call("echo", {"text": "x"})]},
                                        headers={"session_id": sid})
            assert status == 409 and "busy" in body["error"]
            assert (await asyncio.wait_for(slow, 10)).messages[0]["content"] == "slept"
            reply = await env.interact(sid, [tool_call("echo", {"text": "still here"})])
            assert reply.messages[0]["content"] == "still here"
            # the client maps errors like LocalEnvClient does
            with pytest.raises(ValueError, match="unknown task"):
                await env.start_sample("nope", 0)
            with pytest.raises(UnknownSessionError, match="unknown session"):
                await env.interact("999", [tool_call("echo", {"text": "x"})])
            await env.cancel("999")  # idempotent
            await env.cancel(sid)
            with pytest.raises(UnknownSessionError, match="already ended with status 'cancelled'"):
                await env.interact(sid, [tool_call("echo", {"text": "x"})])

    run(go())


def test_task_failures_end_the_episode_with_task_error() -> None:
    async def go() -> None:
        async with cluster() as (controller, workers, env):
            sid, reply = await env.start_sample("echo", 9)  # start raises in the task
            assert reply.finish and reply.status is SampleStatus.TASK_ERROR
            sid, _ = await env.start_sample("echo", 1)
            reply = await env.interact(sid, [tool_call("boom", {})])
            assert reply.finish and reply.status is SampleStatus.TASK_ERROR
            assert controller.sessions.open == {} and workers[0]._sessions == {}
            with pytest.raises(UnknownSessionError, match="task error"):
                await env.interact(sid, [tool_call("echo", {"text": "x"})])

    run(go())


def test_interact_timeout_ends_session_and_cancels_on_worker() -> None:
    async def go() -> None:
        async with cluster(config=fast_config(interact_timeout_s=0.5)) as (controller, workers, env):
            sid, _ = await env.start_sample("echo", 1)
            t0 = time.monotonic()
            reply = await env.interact(sid, [tool_call("sleep", {"seconds": 30})])
            assert time.monotonic() - t0 < 3
            assert reply.finish and reply.status is SampleStatus.TASK_ERROR
            for _ in range(100):
                if not workers[0]._sessions:
                    break
                await asyncio.sleep(0.05)
            assert workers[0]._sessions == {}, "the controller cancels the timed-out session on the worker"

    run(go())


# ----------------------------------------------------------------------------------------------
# cancel, idle GC


def test_cancel_aborts_a_running_interact() -> None:
    async def go() -> None:
        async with cluster() as (controller, workers, env):
            sid, _ = await env.start_sample("echo", 2)
            pending = asyncio.ensure_future(env.interact(sid, [tool_call("sleep", {"seconds": 30})]))
            await asyncio.sleep(0.2)
            t0 = time.monotonic()
            await env.cancel(sid)
            reply = await asyncio.wait_for(pending, 5)
            assert time.monotonic() - t0 < 2
            assert reply.finish and reply.status is SampleStatus.CANCELLED
            for _ in range(100):
                if not workers[0]._sessions:
                    break
                await asyncio.sleep(0.05)
            assert workers[0]._sessions == {} and workers[0].task.closed >= 1  # type: ignore[attr-defined]
            status, body, _ = await raw(controller.url + "/cancel", headers={"session_id": sid})
            assert status == 200 and body["status"] == "already ended"

    run(go())


def test_idle_sessions_are_collected_with_a_reason() -> None:
    async def go() -> None:
        async with cluster(config=fast_config(session_idle_timeout_s=0.4)) as (controller, workers, env):
            sid, _ = await env.start_sample("echo", 3)
            await asyncio.sleep(1.5)
            assert controller.sessions.open == {}
            assert workers[0]._sessions == {}, "the worker session is cancelled too"
            reply = await env.interact(sid, [tool_call("echo", {"text": "late"})])
            assert reply.finish and reply.status is SampleStatus.TASK_ERROR
            with pytest.raises(UnknownSessionError, match="idle"):
                await env.interact(sid, [tool_call("echo", {"text": "later"})])

    run(go())


# ----------------------------------------------------------------------------------------------
# worker health


def test_dead_worker_ends_its_sessions_within_the_heartbeat_timeout() -> None:
    """Heartbeats stop: suspect (no new sessions), then dead: a hanging call and an idle session end with task error."""
    suspect, dead = 0.4, 1.0

    async def go() -> None:
        controller = Controller(fast_config(suspect_after_s=suspect, heartbeat_timeout_s=dead))
        await controller.start()
        worker = WorkerServer(EchoTask())  # no controller_url: this test sends its heartbeats
        env = HttpEnvClient(controller.url, EnvClientOptions(retries=0, unavailable_timeout_s=0.2))
        try:
            await worker.start()
            assert (await beat(controller.url, worker))[0] == 200
            idle_sid, _ = await env.start_sample("echo", 1)
            busy_sid, _ = await env.start_sample("echo", 2)
            hanging = asyncio.ensure_future(env.interact(busy_sid, [tool_call("sleep", {"seconds": 60})]))
            await asyncio.sleep(0.1)
            t_last_beat = time.monotonic()
            await beat(controller.url, worker)
            await asyncio.sleep(suspect)
            for _ in range(100):  # poll: the first state after alive must be suspect
                (state,) = [w["state"] for w in (await env.list_workers())["echo"]["workers"].values()]
                if state != "alive":
                    break
                await asyncio.sleep(0.02)
            assert state == "suspect"
            with pytest.raises(EnvControllerError) as err:
                await env.start_sample("echo", 3)
            assert err.value.status == 503 and "1 suspect" in err.value.message
            reply = await asyncio.wait_for(hanging, 10)
            waited = time.monotonic() - t_last_beat
            assert reply.finish and reply.status is SampleStatus.TASK_ERROR
            assert dead <= waited < dead + 1.5, waited  # + monitor tick and any stall of the loaded test machine
            reply = await env.interact(idle_sid, [tool_call("echo", {"text": "x"})])
            assert reply.finish and reply.status is SampleStatus.TASK_ERROR
            (state,) = [w["state"] for w in (await env.list_workers())["echo"]["workers"].values()]
            assert state == "dead"
            assert controller.sessions.open == {}
            ended = controller.sessions.ended[int(idle_sid)]
            assert "declared dead" in ended.reason and "heartbeat" in ended.reason
            # the worker comes back: alive again, and the sessions it still holds are cancelled
            assert len(worker._sessions) == 2
            assert (await beat(controller.url, worker))[0] == 200
            for _ in range(100):
                if not worker._sessions:
                    break
                await asyncio.sleep(0.05)
            assert worker._sessions == {}
            sid, reply = await env.start_sample("echo", 4)
            assert not reply.finish
        finally:
            await env.aclose()
            await worker.stop()
            await controller.stop()

    run(go())


def test_unreachable_worker_fails_over_and_ends_its_sessions() -> None:
    """A worker that stops listening: its open session ends at once; new starts go to the other worker."""

    async def go() -> None:
        controller = Controller(fast_config())
        await controller.start()
        a, b = (WorkerServer(EchoTask(), WorkerOptions(concurrency=5)) for _ in range(2))
        env = HttpEnvClient(controller.url, EnvClientOptions(retries=0))
        try:
            await a.start()
            await b.start()
            await beat(controller.url, a)
            await beat(controller.url, b)
            sids = [(await env.start_sample("echo", i))[0] for i in range(4)]
            on_a = [sid for sid in sids if int(sid) in a._sessions]
            assert len(on_a) == 2
            await a.stop()  # a stops listening; the controller has not noticed yet
            reply = await env.interact(on_a[0], [tool_call("echo", {"text": "x"})])
            assert reply.finish and reply.status is SampleStatus.TASK_ERROR
            assert controller.registry.workers[1].state is WorkerState.SUSPECT
            # starts skip the suspect worker
            for i in range(3):
                sid, reply = await env.start_sample("echo", i)
                assert int(sid) in b._sessions and not reply.finish
        finally:
            await env.aclose()
            await b.stop()
            await controller.stop()

    run(go())


def test_start_fails_over_when_the_picked_worker_refuses_connections() -> None:
    async def go() -> None:
        controller = Controller(fast_config())
        await controller.start()
        good = WorkerServer(EchoTask())
        gone = WorkerServer(EchoTask())
        env = HttpEnvClient(controller.url, EnvClientOptions(retries=0))
        try:
            await good.start()
            await gone.start()
            gone_address = gone.address
            await gone.stop()
            # the gone worker registers first, so it is the least recently picked
            await beat(controller.url, gone, address=gone_address)
            await beat(controller.url, good)
            for i in range(3):
                sid, reply = await env.start_sample("echo", i)
                assert int(sid) in good._sessions
            states = {w["address"]: w["state"] for w in (await env.list_workers())["echo"]["workers"].values()}
            assert states[gone_address] == "suspect" and states[good.address] == "alive"
        finally:
            await env.aclose()
            await good.stop()
            await controller.stop()

    run(go())


def test_heartbeat_with_other_indices_is_rejected() -> None:
    async def go() -> None:
        async with cluster() as (controller, workers, _):
            status, body = await beat(controller.url, workers[0], address="http://127.0.0.1:1/api", indices=[0, 1])
            assert status == 409 and "other indices" in body["error"] and "2 indices instead of 10" in body["error"]

    run(go())


# ----------------------------------------------------------------------------------------------
# auth, metrics, views


def test_token_is_required_when_set_and_off_loopback() -> None:
    async def go() -> None:
        token = "s3cret"
        async with cluster(config=fast_config(token=token), token=token) as (controller, _, _):
            status, body, headers = await raw(controller.url + "/list_workers", method="GET")
            assert status == 401 and "bearer token" in body["error"] and headers["WWW-Authenticate"] == "Bearer"
            status, _, _ = await raw(
                controller.url + "/list_workers", method="GET", headers={"Authorization": "Bearer nope"}
            )
            assert status == 401
            basic = base64.b64encode(f"agentrl:{token}".encode()).decode()
            status, body, _ = await raw(
                controller.url + "/list_workers", method="GET", headers={"Authorization": f"Basic {basic}"}
            )
            assert status == 200 and "echo" in body  # the worker's heartbeats carried the token
            env = HttpEnvClient(controller.url, EnvClientOptions(token=token))
            try:
                sid, reply = await env.start_sample("echo", 0)  # the controller sends the token on to the worker
                assert not reply.finish
                await env.cancel(sid)
            finally:
                await env.aclose()

    run(go())
    with pytest.raises(ValueError, match="needs a bearer token"):
        run(Controller(fast_config(host="0.0.0.0")).start())
    with pytest.raises(ValueError, match="needs a bearer token"):
        run(WorkerServer(EchoTask(), WorkerOptions(host="0.0.0.0")).start())


def test_metrics_and_views() -> None:
    async def go() -> None:
        async with cluster() as (controller, _, env):
            sid, _ = await env.start_sample("echo", 0)
            await env.interact(sid, [tool_call("echo", {"text": "a"})])
            sessions = await env.list_sessions()
            assert sessions[sid]["name"] == "echo" and sessions[sid]["turns"] == 1 and sessions[sid]["busy"] is False
            await env.interact(sid, [tool_call("finish", {})])
            status, text, headers = await raw(controller.url.removesuffix("/api") + "/metrics", method="GET")
            assert status == 200 and headers["Content-Type"].startswith("text/plain")
            for line in (
                'agentrl_controller_sessions_started_total{task="echo"} 1.0',
                'agentrl_controller_sessions_ended_total{status="completed",task="echo"} 1.0',
                'agentrl_controller_workers{state="alive",task="echo"} 1.0',
                'agentrl_controller_sessions_open{task="echo"} 0.0',
                'agentrl_controller_requests_total{code="200",endpoint="interact"} 2.0',
            ):
                assert line in text, line
            assert 'agentrl_controller_overhead_seconds_count{endpoint="interact"} 2.0' in text
            assert (await env.health())["workers_alive"] == 1

    run(go())


def test_overhead_header_excludes_worker_time() -> None:
    """With 50-150 ms of simulated worker latency per call: the worker's time holds it, and the controller's
    overhead is what is left of the request (the two add up to no more than the client's round trip, whatever
    the machine's load; an overhead that counted the worker's time would add it twice)."""

    async def go() -> None:
        seen: list[tuple[str, float, float, float]] = []

        def observe(endpoint: str, seconds: float, status: int, headers: Any) -> None:
            if "x-controller-overhead-ms" in headers:
                seen.append((endpoint, seconds, float(headers["x-controller-overhead-ms"]) / 1000,
                             float(headers["x-worker-time-ms"]) / 1000))

        async with cluster(latency_s=0.1) as (controller, _, env):
            env.observer = observe
            sid, _ = await env.start_sample("echo", 0)
            for _ in range(3):
                await env.interact(sid, [tool_call("echo", {"text": "a"})])
        assert len(seen) == 4
        for endpoint, rtt, overhead, worker in seen:
            assert worker >= 0.05 and overhead >= 0 and overhead + worker <= rtt + 1e-3, (endpoint, rtt, overhead,
                                                                                          worker)

    run(go())


# ----------------------------------------------------------------------------------------------
# the worker server and the client on their own


def test_worker_server_speaks_the_agentrl_worker_protocol() -> None:
    async def go() -> None:
        worker = WorkerServer(EchoTask(), WorkerOptions(concurrency=2))
        await worker.start()
        api = worker.address
        try:
            status, body, headers = await raw(api + "/start_sample", json_body={"index": 1, "session_id": 7})
            assert status == 200 and headers["session_id"] == "7" and float(headers["x-worker-time"]) >= 0
            assert body == {"messages": [{"role": "user", "content": "sample 1"}], "tools": [], "status": "running",
                            "finish": False, "reward": 0.0, "metric": {}}
            again = await raw(api + "/start_sample", json_body={"index": 1, "session_id": 7})
            assert again[1]["error"] == "Session ID already exists"
            assert (await raw(api + "/start_sample", json_body={"index": 2, "session_id": 8}))[0] == 200
            status, body, _ = await raw(api + "/start_sample", json_body={"index": 3, "session_id": 9})
            assert status == 406 and "concurrency limit" in body["error"]
            status, body, _ = await raw(
                api + "/interact", json_body={"session_id": 7, "messages": [tool_call("echo", {"text": "hi"})]}
            )
            assert status == 200 and body["session_id"] == 7 and body["env_out"]["messages"][0]["content"] == "hi"
            assert TaskReply.from_json(body).to_json()["status"] == "running"
            status, body, _ = await raw(api + "/interact", json_body={"session_id": 70, "messages": []})
            assert status == 400 and body["error"] == "No such session"
            assert (await raw(api + "/get_sessions", method="GET"))[1] == {"7": 1, "8": 2}
            assert (await raw(api + "/worker_status", method="GET"))[1] == {"concurrency": 2, "current": 2}
            assert (await raw(api + "/get_indices", method="GET"))[1] == list(range(10))
            assert (await raw(api + "/cancel", json_body={"session_id": 7}))[1] == {"session_id": 7}
            assert (await raw(api + "/cancel", json_body={"session_id": 7}))[0] == 400
            assert (await raw(api + "/cancel_all", json_body={}))[1] == {"cancelled": [8]}
            assert worker._sessions == {}
        finally:
            await worker.stop()

    run(go())


def test_client_retries_5xx_and_refused_connections_only() -> None:
    from aiohttp import web

    from env_controller.http.service import start_site

    async def go() -> None:
        hits: dict[str, int] = {"start_sample": 0, "interact": 0}

        async def start(request: web.Request) -> web.Response:
            hits["start_sample"] += 1
            if hits["start_sample"] < 3:
                return web.json_response({"error": "no free slot"}, status=503)
            return web.json_response({"messages": [], "status": "running"}, headers={"session_id": "5"})

        async def interact(request: web.Request) -> web.Response:
            hits["interact"] += 1
            code = {"400": 400, "500": 500, "503": 503}[request.headers["session_id"]]
            return web.json_response({"error": "bad"}, status=code)

        app = web.Application()
        app.router.add_post("/api/start_sample", start)
        app.router.add_post("/api/interact", interact)
        runner, port = await start_site(app, "127.0.0.1", 0)
        try:
            env = HttpEnvClient(f"http://127.0.0.1:{port}", EnvClientOptions(retries=3, backoff_s=0.01))
            sid, reply = await env.start_sample("t", 0)
            assert sid == "5" and hits["start_sample"] == 3
            with pytest.raises(MalformedMessageError):
                await env.interact("400", [tool_call("x", {})])
            assert hits["interact"] == 1, "4xx is not retried"
            with pytest.raises(EnvControllerError):
                await env.interact("500", [tool_call("x", {})])
            assert hits["interact"] == 2, "an interact that may have acted (500) is not retried"
            with pytest.raises(EnvControllerError):
                await env.interact("503", [tool_call("x", {})])
            assert hits["interact"] == 6, "503 is retried"
            env.unavailable_timeout_s = 0.3  # a start waits out 503s for this long, whatever `retries` says
            hits["start_sample"] = -100
            with pytest.raises(EnvControllerError) as err:
                await env.start_sample("t", 0)
            assert err.value.status == 503 and "no free slot" in err.value.message and hits["start_sample"] > -98
            await env.aclose()
        finally:
            await runner.cleanup()
        # a port bound and not listening refuses every connection, and no other test can take it meanwhile
        with socket.socket() as closed:
            closed.bind(("127.0.0.1", 0))
            env = HttpEnvClient(f"http://127.0.0.1:{closed.getsockname()[1]}",
                                EnvClientOptions(retries=2, backoff_s=0.01, unavailable_timeout_s=0.5))
            t0 = time.monotonic()
            with pytest.raises(EnvControllerError, match="is unreachable"):
                await env.start_sample("t", 0)
            assert 0.5 <= time.monotonic() - t0 < 5
            with pytest.raises(EnvControllerError, match="cannot reach the controller"):
                await env.interact("1", [tool_call("x", {})])
            await env.aclose()

    run(go())


# ----------------------------------------------------------------------------------------------
# the registry on its own (a fake clock)


def test_task_reply_parses_every_wire_form_and_names_the_bad_field() -> None:
    flat = TaskReply.from_json({"messages": None, "status": "running", "metrics": {"success": 1.0}})
    assert (flat.messages, flat.finish, flat.metrics) == ([], False, {"success": 1.0})
    wrapped = TaskReply.from_json(
        {"session_id": 3, "env_out": {"status": "completed", "reward": "1", "metric": {"s": 1}}}
    )
    expected = (SampleStatus.COMPLETED, True, 1.0, {"s": 1})
    assert (wrapped.status, wrapped.finish, wrapped.reward, wrapped.metrics) == expected
    assert TaskReply.from_json(wrapped.to_json()) == wrapped
    assert TaskReply.from_json(wrapped.to_json("metric")) == wrapped
    for body, message in [
        ([], "not a JSON object but list"),
        ({"messages": {}}, "'messages' is dict, not a list"),
        ({"tools": "x"}, "'tools' is str, not a list"),
        ({"status": "done"}, "status 'done' is not one of"),
        ({"reward": "high"}, "reward 'high' is not a number"),
    ]:
        with pytest.raises(ValueError, match=message):
            TaskReply.from_json(body)


def test_registry_states_and_least_loaded_choice() -> None:
    now = [100.0]
    reg = WorkerRegistry(suspect_after_s=5, dead_after_s=10, forget_after_s=20, clock=lambda: now[0])
    a, ev = reg.heartbeat("t", "http://a/api/", 2, [0, 1])
    assert ev == "new" and a.address == "http://a/api"
    b, _ = reg.heartbeat("t", "http://b/api", 4, [0, 1])
    assert reg.heartbeat("t", "http://a/api", 2, [0, 1])[1] == "beat"
    picks = []
    for sid in range(6):
        w = reg.pick("t")
        w.sessions.add(sid)
        picks.append(w.address[-5])
    assert picks.count("a") == 2 and picks.count("b") == 4  # by load ratio, up to each concurrency
    with pytest.raises(NoWorkerError, match="at capacity"):
        reg.pick("t")
    with pytest.raises(KeyError):
        reg.pick("other")
    with pytest.raises(RegistryError, match="other indices"):
        reg.heartbeat("t", "http://c/api", 1, [0, 1, 2])
    now[0] += 6
    reg.heartbeat("t", "http://b/api", 4, [0, 1])
    assert reg.sweep() == [] and a.state is WorkerState.SUSPECT and b.state is WorkerState.ALIVE
    now[0] += 5.5
    assert reg.sweep() == [a] and a.state is WorkerState.DEAD and "heartbeat timeout" in a.reason
    assert b.state is WorkerState.SUSPECT
    a.sessions.clear()
    now[0] += 21
    assert reg.sweep() == [b]
    assert a.id not in reg.workers and b.id in reg.workers  # a forgotten; b dead but holds sessions
    assert reg.heartbeat("t", "http://b/api", 4, [0, 1])[1] == "revived"
    assert b.state is WorkerState.ALIVE
    # time the controller itself was stalled does not count as a worker's silence
    now[0] += 9
    reg.add_stall(8)
    assert reg.sweep() == [] and b.state is WorkerState.ALIVE and reg.silence(b) == pytest.approx(1)
    now[0] += 9.5
    assert reg.sweep() == [b]


def test_env_controller_never_imports_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys, env_controller.controller.server, env_controller.worker.server, "
        "env_controller.clients.http_client, env_controller.cli; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


def test_cancel_with_notice_reaches_the_controller() -> None:
    """AgentRL's worker-initiated cancel: the worker cancels, then tells the controller, which ends the session."""

    async def go() -> None:
        async with cluster() as (controller, workers, env):
            sid, _ = await env.start_sample("echo", 1)
            status, body, _ = await raw(workers[0].address + "/cancel_with_notice", json_body={"session_id": int(sid)})
            assert status == 200 and body == {"session_id": int(sid)}
            for _ in range(100):
                if not controller.sessions.open:
                    break
                await asyncio.sleep(0.05)
            assert controller.sessions.open == {} and workers[0]._sessions == {}
            reply = await env.interact(sid, [tool_call("echo", {"text": "x"})])
            assert reply.finish and reply.status is SampleStatus.CANCELLED and "cancelled the session" in reply.error
            status, body, _ = await raw(controller.url + "/cancel_notice", headers={"session_id": "424242"})
            assert status == 200  # unknown sessions are fine (the notice may arrive late)

    run(go())


# ----------------------------------------------------------------------------------------------
# the controller's worker HTTP client against hand-written replies


def test_worker_http_client_framing_pooling_and_errors() -> None:
    from env_controller.http.client import ConnectError, Disconnected, PooledHttp, parse_url

    replies: list[list[bytes]] = []  # per request: the pieces the server writes (b"" = close)
    connections: list[int] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                await reader.readexactly(length)
                for piece in replies.pop(0):
                    if piece == b"":
                        writer.close()
                        return
                    if piece == b"hang":
                        await asyncio.sleep(30)
                    writer.write(piece)
                    await writer.drain()
                    await asyncio.sleep(0.01)
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def go() -> None:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        url = f"http://127.0.0.1:{port}/api/x"
        http = PooledHttp(max_in_flight=8, keepalive_s=5, connect_timeout_s=2)
        try:
            ok = b'HTTP/1.1 200 OK\r\nContent-Length: 7\r\nX-Worker-Time: 0.5\r\n\r\n{"a":1}'
            replies.append([ok[:20], ok[20:50], ok[50:]])  # split anywhere
            r = await http.request("POST", url, b"{}", {"Content-Type": "application/json"}, 5)
            assert (r.status, r.body, r.headers["x-worker-time"]) == (200, b'{"a":1}', "0.5")
            replies.append(
                [
                    b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n",
                    b"2;ext=1\r\nde\r\n0\r\n\r\n",
                ]
            )
            r = await http.request("GET", url, None, {}, 5)
            assert (r.status, r.body) == (200, b"abcde")
            assert len(connections) == 1, "keep-alive: one connection so far"
            replies.append([b"HTTP/1.1 404 Not Found\r\nConnection: close\r\nContent-Length: 2\r\n\r\nno"])
            r = await http.request("GET", url, None, {}, 5)
            assert (r.status, r.body) == (404, b"no")
            replies.append([b"HTTP/1.0 200 OK\r\n\r\nuntil-eof", b""])  # no length: the body ends at EOF
            r = await http.request("GET", url, None, {}, 5)
            assert r.body == b"until-eof" and len(connections) == 2
            replies.append([b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort", b""])
            with pytest.raises(Disconnected):
                await http.request("GET", url, None, {}, 5)
            replies.append([b"hang"])
            t0 = time.monotonic()
            with pytest.raises(TimeoutError):
                await http.request("GET", url, None, {}, 0.3)
            assert time.monotonic() - t0 < 2
            replies.append([ok])  # the timed-out connection was dropped: a new one serves this
            r = await http.request("GET", url, None, {}, 5)
            assert r.status == 200 and len(connections) == 5
            assert parse_url("http://[::1]:9/api").host_header == "[::1]:9"
            with pytest.raises(ValueError, match="only http://"):
                parse_url("https://h/api")
        finally:
            await http.close()
            server.close()
            await server.wait_closed()
        free = free_port()  # nothing listens there
        with pytest.raises(ConnectError):
            await PooledHttp().request("GET", f"http://127.0.0.1:{free}/", None, {}, 5)

    run(go())
