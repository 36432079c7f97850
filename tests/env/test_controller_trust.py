"""Who may do what on the controller: trainer and worker credentials kept apart, a worker token
bound to its task names, no credential in any log line or error message, and workers that
say why their heartbeats are refused and back off.
"""
from __future__ import annotations

import asyncio
import base64
import logging
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from env_controller.cli import worker_tokens
from env_controller.clients.http_client import EnvControllerError, HttpEnvClient
from env_controller.clients.options import EnvClientOptions
from env_controller.controller.server import Controller, ControllerConfig
from env_controller.http.auth import redact_url, split_url_credentials
from env_controller.http.net import free_port
from env_controller.http.service import start_site
from env_controller.tasks import build_task
from env_controller.worker.options import WorkerOptions
from env_controller.worker.server import WorkerServer
from tests.env.support import AGENTRL, EchoTask, cluster, fast_config, raw, run, tool_call

TRAINER, ECHO, CALC = "trainer-tok-7f3a", "echo-tok-91be", "calc-tok-c20d"
TOKENS = (TRAINER, ECHO, CALC)


def split_config(**kw: Any) -> ControllerConfig:
    return fast_config(trainer_token=TRAINER, worker_tokens={"echo": ECHO, "calc": CALC}, **kw)


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def assert_no_tokens(caplog: pytest.LogCaptureFixture, *texts: Any, tokens: tuple[str, ...] = TOKENS) -> None:
    """No token in any log record (message, arguments, traceback) nor in ``texts``."""
    logged = [r.getMessage() + (caplog.handler.format(r) if r.exc_info else "") for r in caplog.records]
    for token in tokens:
        leaks = [t for t in [*logged, *map(str, texts)] if token in t]
        assert not leaks, (token, leaks[:3])


async def heartbeat_as(controller: Controller, token: str | None, name: str = "echo") -> tuple[int, Any]:
    body = {"name": name, "address": "http://127.0.0.1:9/api", "concurrency": 1, "indices": [0]}
    status, payload, _ = await raw(controller.url + "/receive_heartbeat", json_body=body,
                                   headers=bearer(token) if token else None)
    return status, payload


# ----------------------------------------------------------------------------------------------
# roles


def test_only_a_worker_token_of_the_task_can_register_a_worker(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    bodies: list[Any] = []

    async def go() -> None:
        controller = Controller(split_config())
        await controller.start()
        try:
            for token, status, text in ((None, 401, "missing or wrong bearer token"),
                                        ("nope", 401, "missing or wrong bearer token"),
                                        (TRAINER, 403, "a trainer credential cannot register workers"),
                                        (CALC, 403, "may serve the task(s) calc, not 'echo'")):
                got, body = await heartbeat_as(controller, token)
                bodies.append(body)
                assert got == status and text in body["error"], (token, body)
            status, workers, _ = await raw(controller.url + "/list_workers", method="GET", headers=bearer(TRAINER))
            assert status == 200 and workers == {}  # nobody got in
            assert (await heartbeat_as(controller, CALC, "calc"))[0] == 200
            assert (await heartbeat_as(controller, ECHO, "echo"))[0] == 200
        finally:
            await controller.stop()

    run(go())
    assert_no_tokens(caplog, *bodies)


def test_a_worker_credential_cannot_start_sessions_and_the_trainer_one_can(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    bodies: list[Any] = []

    async def go() -> None:
        # the worker requires its own token from the controller: every call to it carries ECHO
        async with cluster(config=split_config(), token=ECHO) as (controller, _, _):
            for token in (ECHO, CALC):
                status, body, _ = await raw(controller.url + "/start_sample", json_body={"name": "echo", "index": 0},
                                            headers=bearer(token))
                bodies.append(body)
                assert status == 403 and "needs the trainer credential" in body["error"], body
            for path in ("/list_workers", "/list_sessions", "/get_indices?name=echo"):
                status, body, _ = await raw(controller.url + path, method="GET", headers=bearer(ECHO))
                assert status == 403, (path, body)
            assert (await raw(controller.url + "/health", method="GET", headers=bearer(ECHO)))[0] == 200
            assert (await raw(controller.url.removesuffix("/api") + "/metrics", method="GET",
                              headers=bearer(ECHO)))[0] == 403
            assert (await raw(controller.url.removesuffix("/api") + "/openapi.json", method="GET"))[0] == 200

            env = HttpEnvClient(controller.url, EnvClientOptions(token=TRAINER, retries=0))
            try:
                with pytest.raises(EnvControllerError) as err:
                    await HttpEnvClient(controller.url, EnvClientOptions(token=ECHO, retries=0)).start_sample("echo", 0)
                assert err.value.status == 403
                sid, _ = await env.start_sample("echo", 0)
                reply = await env.interact(sid, [tool_call("echo", {"text": "hi"})])
                assert reply.messages[0]["content"] == "hi"
                # a worker token of another task cannot cancel the session; the session's own can
                for token, want in ((CALC, 403), (TRAINER, 403), (ECHO, 200)):
                    status, body, _ = await raw(controller.url + "/cancel_notice", json_body={"session_id": int(sid)},
                                                headers=bearer(token))
                    bodies.append(body)
                    assert status == want, (token, body)
                reply = await env.interact(sid, [tool_call("echo", {"text": "hi"})])
                assert reply.finish and reply.status.value == "cancelled"
                # refusals before any handler ran are counted too: 403 above, 401, an unknown endpoint
                assert (await raw(controller.url + "/list_workers", method="GET", headers=bearer("nope")))[0] == 401
                assert (await raw(controller.url + "/no_such_thing", method="GET", headers=bearer(TRAINER)))[0] == 404
                _, text, _ = await raw(controller.url.removesuffix("/api") + "/metrics", method="GET",
                                       headers=bearer(TRAINER))
                counted = {(m[1], m[2]): float(m[3]) for m in re.finditer(
                    r'agentrl_controller_requests_total\{code="(\d+)",endpoint="(\w+)"\} (\S+)', str(text))}
                assert counted[("403", "start_sample")] == 3 and counted[("403", "metrics")] == 1, counted
                assert counted[("401", "list_workers")] == 1 and counted[("404", "unknown")] == 1, counted
                assert counted[("403", "cancel_notice")] == 2 and counted[("200", "cancel_notice")] == 1, counted
            finally:
                await env.aclose()

    run(go())
    assert_no_tokens(caplog, *bodies)


def test_the_shared_token_serves_both_roles_and_basic_auth() -> None:
    """``--token`` alone keeps working for trainers and workers, stock AgentRL workers' Basic auth included."""

    async def go() -> None:
        token = "shared-tok-5e"
        controller = Controller(fast_config(token=token))
        await controller.start()
        try:
            basic = base64.b64encode(f"agentrl:{token}".encode()).decode()
            body = {"name": "any", "address": "http://127.0.0.1:9/api", "concurrency": 1, "indices": [0]}
            status, _, _ = await raw(controller.url + "/receive_heartbeat", json_body=body,
                                     headers={"Authorization": f"Basic {basic}"})
            assert status == 200
            status, workers, _ = await raw(controller.url + "/list_workers", method="GET", headers=bearer(token))
            assert status == 200 and "any" in workers
        finally:
            await controller.stop()

    run(go())


def test_credentials_for_one_role_only_are_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match="no worker could register") as err:
        ControllerConfig(trainer_token=TRAINER)
    assert TRAINER not in str(err.value)
    with pytest.raises(ValueError, match="no trainer could start sessions"):
        ControllerConfig(worker_tokens={"echo": ECHO})
    with pytest.raises(ValueError, match="trainer token equals a worker token") as err:
        ControllerConfig(trainer_token=ECHO, worker_tokens={"echo": ECHO})
    assert ECHO not in str(err.value)
    assert not any(t in repr(split_config()) for t in TOKENS)
    # --token fills the role that has no credential of its own
    creds = ControllerConfig(token="t", worker_tokens={"echo": ECHO}).credentials()
    assert creds.trainer == "t" and dict(creds.workers) == {"echo": ECHO}
    with pytest.raises(ValueError, match="needs a bearer token"):
        run(Controller(fast_config(host="0.0.0.0")).start())


def test_worker_tokens_from_flags_and_file(tmp_path: Path) -> None:
    f = tmp_path / "tokens.yaml"
    f.write_text(f"echo: {ECHO}\n'*': {CALC}\n")
    assert worker_tokens([f"calc={CALC}=x"], str(f)) == {"echo": ECHO, "*": CALC, "calc": f"{CALC}=x"}
    with pytest.raises(ValueError, match="is not NAME=TOKEN") as err:
        worker_tokens([ECHO], None)
    assert ECHO not in str(err.value)
    f.write_text(f"- {ECHO}\n")
    with pytest.raises(ValueError, match="must be a YAML mapping") as err:
        worker_tokens([], str(f))
    assert ECHO not in str(err.value)


# ----------------------------------------------------------------------------------------------
# tokens in URLs and logs


def test_url_helpers_redact_and_split() -> None:
    assert redact_url("http://agentrl:s3cret@host:5020/api") == "http://agentrl:***@host:5020/api"
    assert redact_url("http://host:5020/api") == "http://host:5020/api"
    assert split_url_credentials("http://agentrl:s3cret@host:5020/api") == ("http://host:5020/api", "s3cret")
    assert split_url_credentials("http://host/api") == ("http://host/api", None)


def test_a_worker_with_url_credentials_keeps_them_out_of_its_log(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    token = "url-tok-3c81"

    async def go() -> None:
        controller = Controller(fast_config(token=token))
        await controller.start()
        url = controller.url.replace("http://", f"http://agentrl:{token}@")
        try:
            async with WorkerServer(EchoTask(), WorkerOptions(controller_url=url, heartbeat_interval_s=0.1)) as worker:
                assert worker.heartbeat_ok is not None
                await asyncio.wait_for(worker.heartbeat_ok.wait(), 10)
                assert worker.controller_url == controller.url and worker.token == token
            # the trainer client takes URL credentials too
            async with HttpEnvClient(url, EnvClientOptions(retries=0)) as env:
                assert (await env.list_workers())["echo"]["indices"] == 10
        finally:
            await controller.stop()

    run(go())
    started = [r.getMessage() for r in caplog.records if "listening on" in r.getMessage()]
    assert started and "controller http://127.0.0.1:" in started[-1]
    assert_no_tokens(caplog, tokens=(token,))


@pytest.mark.parametrize("url_token", ["same", "other"])
def test_a_worker_with_both_token_and_url_credentials_registers(url_token: str,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """aiohttp refuses a request with both an Authorization header and URL credentials: the worker
    drops the URL's, keeps --token, and warns (without either value) when they differ."""
    caplog.set_level(logging.DEBUG)
    token, other = "both-tok-a1", "both-tok-b2"

    async def go() -> None:
        async with cluster(config=fast_config(token=token), token=token) as (controller, _, _):
            in_url = token if url_token == "same" else other
            url = controller.url.replace("http://", f"http://agentrl:{in_url}@")
            async with WorkerServer(build_task("calc"), WorkerOptions(controller_url=url, token=token,
                                                                     heartbeat_interval_s=0.1)) as worker:
                assert worker.heartbeat_ok is not None
                await asyncio.wait_for(worker.heartbeat_ok.wait(), 10)

    run(go())
    warned = [r.getMessage() for r in caplog.records if "both a token and credentials in the URL" in r.getMessage()]
    assert len(warned) == (0 if url_token == "same" else 1)
    assert not warned or "agentrl:***@" in warned[0]
    assert_no_tokens(caplog, tokens=(token, other))


def test_agentrl_worker_process_with_token_and_url_credentials(processes: list[Any]) -> None:
    """The command line: ``agentrl worker --token T --controller http://agentrl:U@host/api`` registers and
    prints neither token."""
    token, other = "cli-tok-d4", "cli-tok-e5"
    cport = free_port()
    url = f"http://127.0.0.1:{cport}/api"
    env = dict(os.environ, AGENTRL_CONTROLLER_TOKEN=token)
    common = dict(env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    controller = subprocess.Popen([*AGENTRL, "controller", "--port", str(cport), "--log-level", "INFO"], **common)
    processes.append(controller)
    worker = subprocess.Popen([*AGENTRL, "worker", "--task", "lookup", "--port", str(free_port()), "--token", token,
                               "--controller", f"http://agentrl:{other}@127.0.0.1:{cport}/api",
                               "--heartbeat-interval", "0.2", "--log-level", "INFO"], **common)
    processes.append(worker)

    async def registered() -> bool:
        async with HttpEnvClient(url, EnvClientOptions(token=token, retries=0, timeout_s=5)) as client:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                try:
                    if "lookup" in await client.list_workers():
                        return True
                except EnvControllerError:
                    pass
                await asyncio.sleep(0.1)
        return False

    assert asyncio.run(registered())
    for p in (worker, controller):
        p.terminate()
    errs = [p.communicate(timeout=20)[1] for p in (worker, controller)]
    assert "both a token and credentials in the URL" in errs[0] and "agentrl:***@" in errs[0], errs[0]
    assert token not in errs[0] + errs[1] and other not in errs[0] + errs[1]


# ----------------------------------------------------------------------------------------------
# refused heartbeats


def test_refused_heartbeats_are_logged_once_and_backed_off(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    interval, cap = 0.05, 0.4

    async def go() -> None:
        beats: list[float] = []
        answer = {"status": 401, "error": "missing or wrong bearer token"}

        async def heartbeat(request: web.Request) -> web.Response:
            beats.append(time.monotonic())
            if answer["status"] == 200:
                return web.json_response({"worker_id": 1, "state": "alive"})
            return web.json_response(answer, status=answer["status"])

        app = web.Application()
        app.router.add_post("/api/receive_heartbeat", heartbeat)
        runner, port = await start_site(app, "127.0.0.1", 0)
        worker = WorkerServer(EchoTask(), WorkerOptions(
            controller_url=f"http://127.0.0.1:{port}/api", token="wrong-tok-0", heartbeat_interval_s=interval,
            heartbeat_backoff_cap_s=cap))
        try:
            await worker.start()
            await asyncio.sleep(2.0)
            gaps = [b - a for a, b in zip(beats, beats[1:])]
            # without backoff 40 beats; with it waits of 0.1, 0.2, 0.4, 0.4, ... (a sleep is never shorter)
            assert 4 <= len(beats) <= 9, gaps
            planned = [min(interval * 2 ** (i + 1), cap) for i in range(len(gaps))]
            assert all(g >= p * 0.95 for g, p in zip(gaps, planned)), (gaps, planned)
            assert all(g < cap + 0.5 for g in gaps), gaps
            assert worker.heartbeat_refusal == (401, "missing or wrong bearer token")
            # accepted: logged once, and the normal rate comes back
            answer["status"] = 200
            assert worker.heartbeat_ok is not None
            await asyncio.wait_for(worker.heartbeat_ok.wait(), cap + 2)
            n = len(beats)
            await asyncio.sleep(0.5)
            assert len(beats) - n >= 4 and worker.heartbeat_refusal is None
            # refused again, for another reason: a new log line
            answer.update(status=403, error="this worker credential may serve the task(s) calc, not 'echo'")
            await asyncio.sleep(0.5)
        finally:
            await worker.stop()
            await runner.cleanup()

    run(go())
    refused = [r for r in caplog.records if "refused the heartbeat" in r.getMessage()]
    assert len(refused) == 2, [r.getMessage() for r in refused]
    assert "HTTP 401" in refused[0].getMessage() and "check the worker token" in refused[0].getMessage()
    assert "HTTP 403" in refused[1].getMessage() and "not 'echo'" in refused[1].getMessage()
    assert sum("accepted again" in r.getMessage() for r in caplog.records) == 1
    assert_no_tokens(caplog, tokens=("wrong-tok-0",))


def test_a_stock_agentrl_worker_registers_with_its_worker_token_in_the_url(tmp_path: Path,
                                                                           processes: list[Any]) -> None:
    """Split credentials with a stock ``agentrl-worker``: its task's worker token in the controller URL
    (Basic auth) registers it; the trainer drives it with the trainer token."""
    pytest.importorskip("agentrl.worker.task_worker", reason="agentrl-worker is in the dev extra")
    from tests.env.support import CONFIG, TASK_MODULE, start_agentrl_worker, wait_registered

    (tmp_path / "arw_add_task.py").write_text(TASK_MODULE)
    (tmp_path / "arw.yaml").write_text(CONFIG)
    config = ControllerConfig(port=0, suspect_after_s=10.0, heartbeat_timeout_s=20.0, trainer_token=TRAINER,
                              worker_tokens={"arwadd": ECHO})

    async def go() -> None:
        controller = Controller(config)
        await controller.start()
        env = HttpEnvClient(controller.url, EnvClientOptions(token=TRAINER, retries=0, timeout_s=30))
        try:
            url = controller.url.replace("http://", f"http://agentrl:{ECHO}@")
            proc, _ = start_agentrl_worker(tmp_path, url, processes)
            await wait_registered(env, proc, "arwadd")
            sid, reply = await env.start_sample("arwadd", 2)
            assert reply.messages == [{"role": "user", "content": "What is 2 + 5?"}]
            await env.cancel(sid)
        finally:
            await env.aclose()
            await controller.stop()

    asyncio.run(asyncio.wait_for(go(), 90))

