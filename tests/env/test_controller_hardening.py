"""The controller's and the worker server's HTTP edges under hostile input: every failure a clean
4xx with a message naming the problem, never a 500 or a traceback, and no client can hold a
connection open or inflate what the controller forwards.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import pytest
from aiohttp import web

from env_controller.controller.server import Controller
from env_controller.http.json_io import MAX_JSON_DEPTH, dumps_json, json_too_deep, loads_json
from env_controller.http.service import MAX_BODY_BYTES, start_site
from env_controller.protocol import SampleStatus
from env_controller.worker.server import WorkerServer
from tests.env.support import EchoTask, cluster, fast_config, raw, run, tool_call

NESTED = b"[" * 100_000


def big_message(text: str, dict_arguments: bool) -> dict[str, Any]:
    """An echo call carrying ``text``; its arguments as an object, or as a JSON string left unescaped."""
    arguments: Any = {"text": text} if dict_arguments else json.dumps({"text": text}, ensure_ascii=False)
    return {"role": "assistant", "content": "",
            "tool_calls": [{"id": "c0", "type": "function", "function": {"name": "echo", "arguments": arguments}}]}


def no_tracebacks(caplog: pytest.LogCaptureFixture) -> None:
    bad = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not bad, [r.getMessage() for r in bad]


async def open_raw(port: int, head: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head)
    await writer.drain()
    return reader, writer


def post_head(path: str, length: int, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n{extra}\r\n").encode()


# ----------------------------------------------------------------------------------------------
# JSON depth, field types


def test_json_depth_scan() -> None:
    assert not json_too_deep(b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH)
    assert json_too_deep(b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1))
    assert json_too_deep(b'{"a":' * 101 + b"1" + b"}" * 101)
    # interleaved: no long run of openers, still deep
    assert json_too_deep(b"[[]" * 200 + b"]" * 200)
    # brackets inside strings (escaped quotes included) do not nest
    assert not json_too_deep(json.dumps({"text": "[" * 10_000 + '\\"[[' * 100}).encode())
    assert not json_too_deep(b'["' + b"{" * 5000 + b'"]')
    # unbalanced: refused before the parser recurses, or left for the parser to reject
    assert json_too_deep(NESTED)
    with pytest.raises(ValueError, match="nested deeper than 100"):
        loads_json(NESTED)
    with pytest.raises(ValueError):
        loads_json(b"]" * 50_000 + b"[" * 50)
    with pytest.raises(ValueError, match="NaN is not a JSON value"):
        loads_json(b'{"reward": NaN}')
    assert loads_json(b'{"reward": NaN}', strict=False)["reward"] != 0
    # what goes out is JSON a strict parser (ours) takes: a float that is not finite is null, text as UTF-8,
    # a lone surrogate (no UTF-8 form) escaped
    out = dumps_json({"metric": {"a": float("nan"), "b": [float("inf"), 1.5]}, "text": "é"})
    assert out == '{"metric":{"a":null,"b":[null,1.5]},"text":"é"}'.encode()
    assert loads_json(dumps_json({"s": "\ud800", "x": float("-inf")})) == {"s": "\ud800", "x": None}


def test_deeply_nested_bodies_get_400_naming_the_depth(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)

    async def go() -> None:
        async with cluster() as (controller, workers, env):
            sid, _ = await env.start_sample("echo", 0)
            worker = workers[0].address
            for url, headers in ((controller.url + "/start_sample", {}),
                                 (controller.url + "/interact", {"session_id": sid}),
                                 (controller.url + "/receive_heartbeat", {}),
                                 (worker + "/start_sample", {}), (worker + "/interact", {})):
                status, body, _ = await raw(url, data=NESTED, headers=headers)
                assert status == 400, (url, body)
                assert "nested deeper than 100 levels" in body["error"], body
            # the session is unharmed
            reply = await env.interact(sid, [tool_call("echo", {"text": "still here"})])
            assert reply.messages[0]["content"] == "still here"

    run(go())
    no_tracebacks(caplog)


@pytest.mark.parametrize("index", [[0], {}, 1.5, True, None])
def test_worker_start_with_an_unhashable_or_wrong_index_gets_400(index: Any, caplog: pytest.LogCaptureFixture) -> None:
    async def go() -> None:
        async with WorkerServer(EchoTask()) as worker:
            status, body, _ = await raw(worker.address + "/start_sample", json_body={"index": index, "session_id": 7})
            assert status == 400 and "'index' must be an integer or a string" in body["error"], body
            assert type(index).__name__ in body["error"]
            status, body, _ = await raw(worker.address + "/start_sample", json_body={"index": 3, "session_id": 7})
            assert status == 200, body

    run(go())
    no_tracebacks(caplog)


def test_every_field_type_is_checked_and_named(caplog: pytest.LogCaptureFixture) -> None:
    async def go() -> None:
        async with cluster() as (controller, workers, env):
            sid, _ = await env.start_sample("echo", 0)
            c, w = controller.url, workers[0].address
            hb = {"name": "echo", "address": w, "concurrency": 4, "indices": list(range(10))}
            cases: list[tuple[str, Any, dict[str, str], int, str]] = [
                (c + "/start_sample", {"name": 3, "index": 0}, {}, 400, "'name' must be the task name"),
                (c + "/start_sample", {"name": "echo"}, {}, 400, "missing 'index'"),
                (c + "/start_sample", {"name": "echo", "index": [0]}, {}, 400, "'index' must be an integer or"),
                (c + "/start_sample", {"name": "echo", "index": 0, "custom_task": [1]}, {}, 400, "'custom_task'"),
                (c + "/start_sample", [1, 2], {}, 400, "must be a JSON object, got list"),
                (c + "/interact", {"messages": "hi"}, {"session_id": sid}, 400, "'messages' must be a list"),
                (c + "/interact", {"messages": [{"role": "assistant", "content": 5}]}, {"session_id": sid}, 400,
                 "messages[0].content must be a string or null, got int"),
                (c + "/interact", {"messages": []}, {"session_id": "abc"}, 400, "'session_id' request header"),
                (c + "/interact", {"messages": []}, {"session_id": "١٢"}, 400, "must be an integer session id"),
                (c + "/receive_heartbeat", {**hb, "concurrency": "4"}, {}, 400, "'concurrency' must be a positive"),
                (c + "/receive_heartbeat", {**hb, "indices": [True]}, {}, 400, "every index must be an integer"),
                (c + "/receive_heartbeat", {**hb, "name": "a\nfake log line"}, {}, 400, "no control characters"),
                (c + "/receive_heartbeat", {**hb, "address": "http://wörker:1/api"}, {}, 400, "printable ASCII"),
                (c + "/cancel_notice", {"session_id": 1}, {"session_id": "2"}, 400, "name different sessions"),
                (w + "/start_sample", {"index": 0, "session_id": "x"}, {}, 400, "'session_id' must be an integer"),
                (w + "/start_sample", {"index": 0, "session_id": 1, "custom_task": {"a": 1}}, {}, 400, "custom_task"),
                (w + "/interact", {"session_id": 1, "messages": None}, {}, 400, "No such session"),
                (w + "/cancel", {"session_id": {"a": 1}}, {}, 400, "'session_id' must be an integer"),
            ]
            for url, body, headers, want, text in cases:
                status, got, _ = await raw(url, json_body=body, headers=headers)
                assert status == want and text in got["error"], (url, body, got)
            reply = await env.interact(sid, [tool_call("finish", {})])
            assert reply.finish and reply.reward == 1.0

    run(go())
    no_tracebacks(caplog)


def test_a_worker_reply_nested_too_deep_ends_the_episode_cleanly(caplog: pytest.LogCaptureFixture) -> None:
    """A hostile worker cannot crash the controller's reply parsing either."""

    async def go() -> None:
        app = web.Application()

        async def start(request: web.Request) -> web.Response:
            return web.Response(body=NESTED, content_type="application/json")

        async def sessions(request: web.Request) -> web.Response:
            return web.json_response({})

        app.router.add_post("/api/start_sample", start)
        app.router.add_post("/api/cancel", sessions)
        app.router.add_get("/api/get_sessions", sessions)
        runner, port = await start_site(app, "127.0.0.1", 0)
        controller = Controller(fast_config())
        await controller.start()
        try:
            status, _, _ = await raw(controller.url + "/receive_heartbeat", json_body={
                "name": "deep", "address": f"http://127.0.0.1:{port}/api", "concurrency": 2, "indices": [0]})
            assert status == 200
            status, body, _ = await raw(controller.url + "/start_sample", json_body={"name": "deep", "index": 0})
            assert status == 200 and body["status"] == "task error" and "nested deeper" in body["error"], body
        finally:
            await controller.stop()
            await runner.cleanup()

    run(go())
    assert not [r for r in caplog.records if r.exc_info]


# ----------------------------------------------------------------------------------------------
# sizes: what is forwarded, and what is refused


def test_an_11_mb_non_ascii_interact_reaches_the_worker_intact(caplog: pytest.LogCaptureFixture) -> None:
    """11 MiB of 2-byte UTF-8 text would be 35 MB once escaped as \\u00e9 (over the 32 MiB limit): the
    controller forwards it as UTF-8, at its own size, so it passes a 16 MiB forward limit too."""
    text = "é" * 5_800_000
    assert len(text.encode()) > 11 * 1024 * 1024 and len(json.dumps(text)) > MAX_BODY_BYTES

    async def go() -> None:
        config = fast_config(max_forward_bytes=16 * 1024 * 1024)
        async with cluster(config=config) as (_, _, env):
            sid, _ = await env.start_sample("echo", 0)
            for dict_arguments in (True, False):
                reply = await env.interact(sid, [big_message(text, dict_arguments)])
                assert reply.status is SampleStatus.RUNNING and not reply.error
                assert reply.messages[0]["content"] == text
            reply = await env.interact(sid, [tool_call("finish", {})])  # the episode goes on to its end
            assert reply.finish and reply.reward == 1.0

    run(go())
    no_tracebacks(caplog)


def test_a_body_over_the_worker_limit_gets_413_and_the_session_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    message = big_message("x" * 2_000_000, dict_arguments=False)

    async def go() -> None:
        # the controller knows the limit: nothing is sent
        async with cluster(config=fast_config(max_forward_bytes=1_000_000)) as (controller, _, _):
            sid = (await raw(controller.url + "/start_sample", json_body={"name": "echo", "index": 0}))[2]["session_id"]
            status, body, _ = await raw(controller.url + "/interact", json_body={"messages": [message]},
                                        headers={"session_id": sid})
            assert status == 413, body
            assert "2000" in body["error"] and "over the limit of 1000000 bytes" in body["error"]
            assert "session stays open" in body["error"]
            status, body, _ = await raw(controller.url + "/interact", headers={"session_id": sid},
                                        json_body={"messages": [tool_call("echo", {"text": "ok"})]})
            assert status == 200 and body["messages"][0]["content"] == "ok"
        # a worker with a lower limit than the controller's: its 413 reaches the trainer, the session stays
        async with cluster(max_body_bytes=1_000_000) as (controller, _, env):
            sid, _ = await env.start_sample("echo", 0)
            status, body, _ = await raw(controller.url + "/interact", json_body={"messages": [message]},
                                        headers={"session_id": sid})
            assert status == 413 and "HTTP 413" in body["error"] and "session stays open" in body["error"], body
            reply = await env.interact(sid, [tool_call("echo", {"text": "ok"})])
            assert reply.messages[0]["content"] == "ok"

    run(go())
    no_tracebacks(caplog)


def test_a_body_over_the_request_limit_gets_413_naming_size_and_limit() -> None:
    async def go() -> None:
        async with cluster() as (controller, workers, _):
            for port in (controller.port, workers[0].port):
                reader, writer = await open_raw(port, post_head("/api/start_sample", MAX_BODY_BYTES + 1))
                head = await asyncio.wait_for(reader.read(4096), 5)
                writer.close()
                assert head.startswith(b"HTTP/1.1 413"), head
                assert f"of {MAX_BODY_BYTES + 1} bytes is over the limit of {MAX_BODY_BYTES} bytes".encode() in head

    run(go())


# ----------------------------------------------------------------------------------------------
# slow and vanishing clients


@pytest.mark.parametrize("side", ["controller", "worker"])
def test_clients_stuck_mid_body_are_dropped_within_the_timeout(side: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    timeout_s, clients = 0.5, 200

    async def go() -> None:
        async with cluster(config=fast_config(body_timeout_s=timeout_s), body_timeout_s=timeout_s) as (c, ws, _):
            port = c.port if side == "controller" else ws[0].port
            t0 = time.monotonic()
            conns = [await open_raw(port, post_head("/api/start_sample", 1000) + b'{"name": "ec')
                     for _ in range(clients)]
            answers = await asyncio.wait_for(asyncio.gather(*(r.read() for r, _ in conns)), timeout_s + 5)
            elapsed = time.monotonic() - t0
            for _, w in conns:
                w.close()
            # each got a 408 and then the end of the connection (read() returned: EOF)
            assert all(a.startswith(b"HTTP/1.1 408") and b"not received within 0.5 s" in a for a in answers)
            assert timeout_s <= elapsed < timeout_s + 3, elapsed
            # the server still serves
            assert (await raw(f"http://127.0.0.1:{port}/openapi.json", method="GET"))[0] == 200

    run(go())
    dropped = [r for r in caplog.records if "not received within" in r.getMessage()]
    assert len(dropped) == clients
    assert all("\n" not in r.getMessage() and not r.exc_info for r in dropped)
    no_tracebacks(caplog)


def test_clients_that_disconnect_mid_body_are_logged_in_one_line(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    clients = 200

    async def go() -> None:
        async with cluster() as (controller, _, env):
            conns = [await open_raw(controller.port, post_head("/api/interact", 5000, "session_id: 1\r\n") + b"{")
                     for _ in range(clients)]
            await asyncio.sleep(0.2)
            for _, w in conns:
                w.close()
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and sum("went away" in r.getMessage() for r in caplog.records) < clients:
                await asyncio.sleep(0.05)
            assert (await env.health())["status"] == "ok"

    run(go())
    gone = [r for r in caplog.records if "went away mid-body" in r.getMessage()]
    assert len(gone) == clients, [r.getMessage() for r in caplog.records]
    assert all("\n" not in r.getMessage() and not r.exc_info and r.levelno == logging.INFO for r in gone)
    no_tracebacks(caplog)


def test_a_client_stuck_in_the_request_head_is_dropped() -> None:
    async def go() -> None:
        config = fast_config(idle_timeout_s=0.5)
        async with cluster(config=config, idle_timeout_s=0.5) as (controller, workers, _):
            for port in (controller.port, workers[0].port):
                t0 = time.monotonic()
                reader, writer = await open_raw(port, b"POST /api/start_sample HTTP/1.1\r\nHost: t\r\nContent-Le")
                assert await asyncio.wait_for(reader.read(), 5) == b""  # closed, nothing answered
                writer.close()
                assert time.monotonic() - t0 < 0.5 + 2

    run(go())
