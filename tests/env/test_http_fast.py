"""The fast front of the controller and the worker server (env_controller/http/fast.py): plain requests
served by it, every other one handed to aiohttp on the same connection with the bytes not yet used;
the controller's future-driven worker client; the batched metrics."""
from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import threading
import time

import pytest

from env_controller.controller.metrics import OVERHEAD_BUCKETS, ControllerMetrics
from env_controller.http.client import ConnectError, PooledHttp
from env_controller.http.net import free_port
from tests.env.support import AGENTRL, cluster, run, tool_call
from tests.support.http_cap import check_connection_cap


async def exchange(port: int, data: bytes, until: int = 1, timeout_s: float = 10) -> list[tuple[bytes, bytes]]:
    """Send ``data`` on one connection and read ``until`` replies: (status line + headers, body) each."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    out = []
    try:
        for _ in range(until):
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout_s)
            while head.startswith(b"HTTP/1.1 1"):  # an interim reply (100 Continue)
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout_s)
            length = 0
            chunked = False
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
                if line.lower().startswith(b"transfer-encoding:") and b"chunked" in line.lower():
                    chunked = True
            if chunked:
                body = b""
                while True:
                    size = int((await reader.readuntil(b"\r\n")).strip().split(b";")[0], 16)
                    chunk = await reader.readexactly(size + 2)
                    if size == 0:
                        break
                    body += chunk[:-2]
            else:
                body = await asyncio.wait_for(reader.readexactly(length), timeout_s)
            out.append((head, body))
    finally:
        writer.close()
    return out


def post(path: str, body: bytes, extra: str = "", version: str = "HTTP/1.1") -> bytes:
    return (f"POST {path} {version}\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"{extra}\r\n").encode() + body


def test_plain_requests_stay_on_the_fast_path_and_pipelined_ones_answer_in_order() -> None:
    async def go() -> None:
        async with cluster() as (controller, workers, env):
            sid, _ = await env.start_sample("echo", 0)
            front = controller._front
            assert front is not None and front.handed_over == 0
            body = json.dumps({"messages": [tool_call("echo", {"text": "ü 1"})]}, ensure_ascii=False).encode()
            body2 = json.dumps({"messages": [tool_call("echo", {"text": "2"})]}).encode()
            # two requests in one write (pipelined), then a health check, all on one connection
            replies = await exchange(controller.port, post("/api/interact", body, f"session_id: {sid}\r\n")
                                     + post("/api/interact", body2, f"Session_ID: {sid}\r\n")
                                     + b"GET /api/health HTTP/1.1\r\nHost: t\r\n\r\n", until=3)
            texts = [json.loads(b)["messages"][0]["content"] for _, b in replies[:2]]
            assert texts == ["ü 1", "2"]
            assert replies[0][0].startswith(b"HTTP/1.1 200 OK\r\n")
            assert b"x-controller-overhead-ms: " in replies[0][0]
            assert b"Content-Type: application/json; charset=utf-8" in replies[0][0]
            assert b"Keep-Alive: timeout=%d\r\n" % int(controller.idle_timeout_s) in replies[0][0]
            # so the controller keeps its connections to our workers pooled longer than its 3 s default
            assert controller._http is not None
            conns = [c for idle in controller._http._idle.values() for c in idle]
            assert conns and all(controller._http._keepalive(c) > controller.config.worker_keepalive_s for c in conns)
            assert json.loads(replies[2][1])["status"] == "ok"
            assert front.handed_over == 0 and workers[0]._front is not None and workers[0]._front.handed_over == 0
            # the worker's own API on its fast path too
            w = workers[0]
            [(head, b)] = await exchange(w.port, b"GET /api/worker_status HTTP/1.1\r\nHost: t\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200") and json.loads(b)["concurrency"] == w.concurrency

    run(go())


@pytest.mark.parametrize("case", ["chunked", "http10", "close", "unknown", "method", "expect", "bad_header", "query"])
def test_requests_that_are_not_plain_are_handed_to_aiohttp(case: str) -> None:
    async def go() -> None:
        async with cluster() as (controller, _, env):
            sid, _ = await env.start_sample("echo", 0)
            front = controller._front
            assert front is not None
            body = json.dumps({"messages": [tool_call("echo", {"text": "x"})]}).encode()
            session = f"session_id: {sid}\r\n"
            want_status, want_text = b"200", "x"
            if case == "chunked":
                data = (f"POST /api/interact HTTP/1.1\r\nHost: t\r\n{session}Transfer-Encoding: chunked\r\n\r\n"
                        f"{len(body):x}\r\n").encode() + body + b"\r\n0\r\n\r\n"
            elif case == "http10":
                data = post("/api/interact", body, session, version="HTTP/1.0")
            elif case == "close":
                data = post("/api/interact", body, session + "Connection: close\r\n")
            elif case == "expect":
                data = post("/api/interact", body, session + "Expect: 100-continue\r\n")
            elif case == "bad_header":  # a header name that is no token: aiohttp refuses the request
                data = post("/api/interact", body, session + "Bad Name: 1\r\n")
                want_status, want_text = b"400", ""
            elif case == "query":  # a query on a route the fast path knows: served there
                data = post("/api/interact?x=1", body, session)
            elif case == "unknown":
                data = post("/api/nope", body)
                want_status, want_text = b"404", "no such endpoint"
            else:
                data = b"DELETE /api/interact HTTP/1.1\r\nHost: t\r\nContent-Length: 0\r\n\r\n"
                want_status, want_text = b"405", "not allowed"
            [(head, reply)] = await exchange(controller.port, data)
            assert head.split(b" ")[1] == want_status, (head, reply)
            if want_status == b"200":
                assert json.loads(reply)["messages"][0]["content"] == want_text
            elif want_text:
                assert want_text in json.loads(reply)["error"]
            assert front.handed_over == (0 if case == "query" else 1)
            # a client's next request on a handed-over connection: aiohttp serves it as before
            assert (await env.health())["status"] == "ok"

    run(go())


def test_a_large_body_goes_to_aiohttp_and_a_slow_small_one_waits_on_the_fast_path() -> None:
    async def go() -> None:
        async with cluster() as (controller, _, env):
            sid, _ = await env.start_sample("echo", 0)
            front = controller._front
            assert front is not None
            text = "y" * (2 << 20)
            big = json.dumps({"messages": [tool_call("echo", {"text": text})]}).encode()
            [(head, reply)] = await exchange(controller.port, post("/api/interact", big, f"session_id: {sid}\r\n"))
            assert head.startswith(b"HTTP/1.1 200") and json.loads(reply)["messages"][0]["content"] == text
            assert front.handed_over == 1
            # a body in pieces, the head split too: still the fast path
            small = post("/api/interact", json.dumps({"messages": [tool_call("echo", {"text": "z"})]}).encode(),
                         f"session_id: {sid}\r\n")
            reader, writer = await asyncio.open_connection("127.0.0.1", controller.port)
            for i in range(0, len(small), 7):
                writer.write(small[i:i + 7])
                await writer.drain()
                await asyncio.sleep(0.002)
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            assert head.startswith(b"HTTP/1.1 200")
            writer.close()
            assert front.handed_over == 1

    run(go())


def test_idle_keepalive_connections_are_closed_after_the_idle_timeout() -> None:
    async def go() -> None:
        from tests.env.support import fast_config

        async with cluster(config=fast_config(idle_timeout_s=0.4)) as (controller, _, _env):
            reader, writer = await asyncio.open_connection("127.0.0.1", controller.port)
            writer.write(b"GET /api/health HTTP/1.1\r\nHost: t\r\n\r\n")
            await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            t0 = time.monotonic()
            rest = await asyncio.wait_for(reader.read(), 5)  # the body, then EOF once idle too long
            assert rest.endswith(b"}") and 0.3 < time.monotonic() - t0 < 2.5
            writer.close()

    run(go())


def test_worker_http_calls_are_futures_bounded_cancellable_and_timed_out() -> None:
    async def go() -> None:
        hold = asyncio.Event()
        served: list[int] = []

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while True:
                    await reader.readuntil(b"\r\n\r\n")
                    served.append(1)
                    await hold.wait()
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                    await writer.drain()
            except (asyncio.IncompleteReadError, ConnectionError):
                writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/x"
        http = PooledHttp(max_in_flight=2, keepalive_s=5, connect_timeout_s=2)
        try:
            calls = [http.start("GET", url, None, {}, 5) for _ in range(3)]
            await asyncio.sleep(0.2)
            assert len(served) == 2 and http._in_flight == 2 and len(http._waiting) == 1  # the third waits
            calls[0].cancel()  # abandoned: its slot goes to the third call, its connection is closed
            await asyncio.sleep(0.2)
            assert len(served) == 3 and http._in_flight == 2
            hold.set()
            for c in calls[1:]:
                assert (await c).body == b"ok"
            await asyncio.sleep(0)  # a future's done callbacks (which free the slot) run after it is done
            assert http._in_flight == 0
            hold.clear()
            t0 = time.monotonic()
            with pytest.raises(TimeoutError):
                await http.request("GET", url, None, {}, 0.3)
            await asyncio.sleep(0)
            assert time.monotonic() - t0 < 2 and http._in_flight == 0
            hold.set()
        finally:
            await http.close()
            server.close()
            await server.wait_closed()
        with pytest.raises(ConnectError):
            http.start("GET", url, None, {}, 1)  # closed

    run(go())


def test_batched_metrics_equal_direct_observations() -> None:
    from prometheus_client import CollectorRegistry, Histogram

    m = ControllerMetrics(lambda: {}, lambda: {})
    values = [0.00005, 0.0001, 0.0003, 0.004, 0.02, 0.3, 2.0, 7.0]
    batched = m.histogram(m.overhead_seconds, "interact")
    assert batched is m.overhead_interact
    ref = Histogram("r", "r", ["endpoint"], buckets=OVERHEAD_BUCKETS, registry=CollectorRegistry()).labels("interact")
    for v in values:
        batched.observe(v)
        ref.observe(v)
    m.counter(m.requests, "interact", "200").inc()
    m.counter(m.requests, "interact", "200").inc()
    text = m.render().decode()
    assert 'agentrl_controller_requests_total{code="200",endpoint="interact"} 2.0' in text
    assert f'agentrl_controller_overhead_seconds_count{{endpoint="interact"}} {float(len(values))}' in text
    got = [b.get() for b in batched.child._buckets]
    assert got == [b.get() for b in ref._buckets]
    assert batched.child._sum.get() == pytest.approx(ref._sum.get())
    m.flush()  # nothing pending: no change
    assert [b.get() for b in batched.child._buckets] == got


def test_interact_bodies_pass_through_when_already_normalized() -> None:
    async def go() -> None:
        async with cluster() as (controller, _, env):
            sid, _ = await env.start_sample("echo", 0)
            assert controller._http is not None
            sent: list[bytes] = []
            start = controller._http.start

            def record(method, url, body, headers, timeout_s):  # type: ignore[no-untyped-def]
                if url.endswith("/interact"):
                    sent.append(body)
                return start(method, url, body, headers, timeout_s)

            controller._http.start = record  # type: ignore[method-assign]
            normalized = {"role": "assistant", "content": "é",
                          "tool_calls": [{"id": "c0", "type": "function",
                                          "function": {"name": "echo", "arguments": "{\"text\": \"ü\"}"}}]}
            cases = [
                (json.dumps({"messages": [normalized]}, ensure_ascii=False).encode(), True, normalized),
                (b'  {"messages": ' + json.dumps([normalized], ensure_ascii=False).encode() + b"}\n", True, normalized),
                (json.dumps({"messages": [normalized]}).encode(), False, normalized),  # \u escapes: written as is
                (json.dumps({"messages": [{**normalized, "content": None}]}).encode(), False,  # normalized anew
                 {**normalized, "content": ""}),
                (json.dumps({"messages": [normalized], "x": 1}).encode(), False, normalized),  # only messages goes
            ]
            for raw, passed, want in cases:
                [(head, reply)] = await exchange(controller.port, post("/api/interact", raw, f"session_id: {sid}\r\n"))
                assert head.startswith(b"HTTP/1.1 200") and json.loads(reply)["messages"][0]["content"] == "ü"
                body = sent.pop()
                if passed:
                    assert body == b'{"session_id":%d,%s' % (int(sid), raw.lstrip()[1:])
                else:
                    assert b"\\u" not in body and json.loads(body) == {"session_id": int(sid), "messages": [want]}

    run(go())


def test_taskless_handlers_await_futures_answer_pipelined_requests_in_order_and_are_cancelled_on_close(
        caplog: pytest.LogCaptureFixture) -> None:
    """The controller's front drives handlers without a task: what a task gave them must still hold."""
    import logging

    caplog.set_level(logging.WARNING)
    from aiohttp import web

    from env_controller.http.fast import FastFront, Reply

    async def go() -> None:
        loop = asyncio.get_running_loop()
        gate: asyncio.Future[bytes] = loop.create_future()
        seen: list[str] = []

        async def at_once(request):  # type: ignore[no-untyped-def]
            return Reply(b'{"path":"%s"}' % request.path.encode())

        async def sleeps(request):  # type: ignore[no-untyped-def]
            await asyncio.sleep(0)  # a bare yield
            await asyncio.sleep(0.01)  # a future with a timer
            return Reply(b'"slept"', headers={"x-a": "1"})

        async def waits(request):  # type: ignore[no-untyped-def]
            try:
                return Reply(await gate)
            except asyncio.CancelledError:
                seen.append("cancelled")
                raise

        async def fallback(request: web.Request) -> web.Response:
            return web.Response(status=404)

        front = FastFront({("GET", "/now"): at_once, ("GET", "/sleep"): sleeps, ("GET", "/wait"): waits},
                          web.Server(fallback), body_timeout_s=5, idle_timeout_s=5,
                          on_gone=lambda *a: None, taskless=True)
        port = await front.start("127.0.0.1", 0)
        try:
            # 1,000 pipelined requests answered as they are read, on one connection: in order, none lost (and no
            # recursion from one reply to the next request), then requests whose handlers wait
            many = b"GET /now HTTP/1.1\r\nHost: t\r\n\r\n" * 1000 + b"".join(
                b"GET /now HTTP/1.1\r\nHost: t\r\n\r\nGET /sleep HTTP/1.1\r\nHost: t\r\n\r\n" for _ in range(20))
            replies = await exchange(port, many, until=1040, timeout_s=30)
            assert [json.loads(b) for _, b in replies] == [{"path": "/now"}] * 1000 + [{"path": "/now"}, "slept"] * 20
            assert b"x-a: 1\r\n" in replies[1001][0] and front.handed_over == 0
            # a handler waiting when the front closes sees CancelledError; the connection is closed
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /wait HTTP/1.1\r\nHost: t\r\n\r\n")
            deadline = time.monotonic() + 5
            while not any(c.busy for c in front.conns) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            await front.close(timeout_s=0.1)
            assert seen == ["cancelled"] and await asyncio.wait_for(reader.read(), 5) == b""
            writer.close()
            await asyncio.sleep(0.05)
            assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text  # quiet, no traceback
        finally:
            await front.close(timeout_s=0.1)

    run(go())


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def _connect(port: int, timeout_s: float) -> socket.socket:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return socket.create_connection(("127.0.0.1", port), timeout=5)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_a_client_that_does_not_read_its_replies_cannot_grow_the_server(processes) -> None:
    """1 MB of pipelined ``GET /openapi.json`` (a 17 KB reply each, no credential needed) that the client does not
    read: the controller grows by less than 64 MB (it stops serving the connection until the replies drain); once the
    client reads, every request is answered."""
    port = free_port()
    proc = subprocess.Popen([*AGENTRL, "controller", "--port", str(port), "--log-level", "WARNING"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    processes.append(proc)
    request = b"GET /openapi.json HTTP/1.1\r\nHost: t\r\n\r\n"
    with _connect(port, 60) as warm:  # the reply's first build, before the baseline
        warm.sendall(request)
        assert warm.recv(4096).startswith(b"HTTP/1.1 200 OK")
    before = _rss_mb(proc.pid)
    data = request * ((1 << 20) // len(request))
    with _connect(port, 10) as sock:
        sock.setblocking(False)
        sent, deadline = 0, time.monotonic() + 20
        while sent < len(data) and time.monotonic() < deadline:  # what the kernel takes; the rest is sent below
            try:
                sent += sock.send(data[sent:])
            except BlockingIOError:
                time.sleep(0.05)
        peak = before
        for _ in range(15):  # the server serves what it read until its replies back up
            time.sleep(0.2)
            peak = max(peak, _rss_mb(proc.pid))
        assert peak - before < 64, f"{peak - before:.0f} MB of growth for 1 MB of unread requests"

        sock.setblocking(True)
        sock.settimeout(30)
        rest = threading.Thread(target=sock.sendall, args=(data[sent:],), daemon=True)
        rest.start()
        status, answered, tail = b"HTTP/1.1 200 OK\r\n", 0, b""
        buf = bytearray(1 << 22)
        while answered < len(data) // len(request):
            n = sock.recv_into(buf)
            assert n, f"the connection closed after {answered} replies"
            chunk = tail + bytes(buf[:n])
            answered += chunk.count(status)
            tail = chunk[-(len(status) - 1):]
        rest.join(10)
        assert answered == len(data) // len(request)


@pytest.mark.parametrize("fast_front", [True, False])
def test_connections_past_the_cap_are_answered_503_and_the_cap_is_logged_once(fast_front: bool, caplog) -> None:
    """``max_connections`` open connections (idle, or handed to aiohttp after a request it serves): one more is
    answered 503 and closed, as many times as it comes, with one log line; once one closes, a new one is served."""
    from env_controller.controller.server import Controller
    from tests.env.support import fast_config

    async def go() -> None:
        controller = Controller(fast_config(max_connections=3, fast_front=fast_front))
        await controller.start()
        try:
            await check_connection_cap(controller.port, 3, caplog, "/api/health")
        finally:
            await controller.stop()

    run(go())


def test_a_workers_connections_are_capped_too(caplog) -> None:
    """The task worker's ``max_connections`` (``agentrl worker --max-connections``) holds as the controller's."""
    from env_controller.tasks import build_task
    from env_controller.worker.options import WorkerOptions
    from env_controller.worker.server import WorkerServer

    async def go() -> None:
        worker = WorkerServer(build_task("calc"), WorkerOptions(max_connections=2))
        await worker.start()
        try:
            await check_connection_cap(worker.port, 2, caplog, "/api/worker_status")
        finally:
            await worker.stop()

    run(go())
