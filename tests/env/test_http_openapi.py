"""The controller's and the worker server's HTTP APIs fuzzed from their OpenAPI descriptions (schemathesis).

Live servers run on an event loop in a background thread: the controller with a scripted task
worker (credentials configured, each operation called with the credential of its role), and a
worker server with the built-in ``calc`` task. Every operation gets valid and invalid requests
(derandomized, a bounded number each); every answer must be no 5xx, a documented status code
with a documented content type, headers and body, and invalid requests must be refused.
"""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is in the dev extra: pip install -e '.[dev]'")

import requests  # noqa: E402 - schemathesis brings it
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from env_controller.controller.server import Controller  # noqa: E402
from env_controller.openapi import controller_spec, worker_spec  # noqa: E402
from env_controller.tasks import build_task  # noqa: E402
from env_controller.worker.options import WorkerOptions  # noqa: E402
from env_controller.worker.server import WorkerServer  # noqa: E402
from tests.env.support import EchoTask, fast_config  # noqa: E402

TRAINER, WORKER = "trainer-secret-1", "worker-secret-2"
#: valid and invalid requests per operation and mode (the worker and the controller have about 10 operations each)
EXAMPLES = 40
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          response_headers_conformance]
FUZZ = settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                suppress_health_check=list(HealthCheck))


class LoopThread:
    """An asyncio loop in a daemon thread: the servers live there while the test calls them with requests."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="openapi-servers", daemon=True)
        self.thread.start()

    def run(self, coro: Awaitable[Any], timeout_s: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)  # type: ignore[arg-type]

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, str]]:
    """A controller (split credentials) with a registered echo worker, and a calc worker of its own."""
    lt = LoopThread()
    # fuzzed heartbeats register workers at random addresses: keep connection attempts to them short
    # registration_window_s=0: fuzzed task names get 404 at once, not the fresh controller's 503 (a 5xx fails the fuzz)
    controller = Controller(fast_config(trainer_token=TRAINER, worker_tokens={"*": WORKER}, connect_timeout_s=1.0,
                                        registration_window_s=0))
    echo = WorkerServer(EchoTask(), WorkerOptions(heartbeat_interval_s=0.2, token=WORKER))
    calc = WorkerServer(build_task("calc"), WorkerOptions(concurrency=8))

    async def up() -> None:
        await controller.start()
        echo.controller_url = controller.url
        await echo.start()
        assert echo.heartbeat_ok is not None
        await asyncio.wait_for(echo.heartbeat_ok.wait(), 10)
        await calc.start()

    lt.run(up())
    try:
        yield {"controller": controller.url.removesuffix("/api"), "worker": f"http://127.0.0.1:{calc.port}"}
    finally:
        for server in (echo, calc, controller):
            lt.run(server.stop())
        lt.close()


def http() -> requests.Session:
    """A requests session for the loopback servers (no proxy from the environment)."""
    session = requests.Session()
    session.trust_env = False
    return session


def fuzz(spec: dict[str, Any], base_url: str, headers_for: Callable[[str], dict[str, str]]) -> None:
    """Every operation of ``spec`` against ``base_url``, valid then invalid requests."""
    schema = schemathesis.openapi.from_dict(spec)
    session = http()
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 9
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            fuzz_operation(operation, mode, base_url, session, headers_for(operation.path))


def fuzz_operation(operation: Any, mode: GenerationMode, base_url: str, session: requests.Session,
                   headers: dict[str, str]) -> None:
    """``EXAMPLES`` requests of one operation in one mode, each answer checked."""
    checks = CHECKS + ([negative_data_rejection] if mode is GenerationMode.NEGATIVE else [])

    @FUZZ
    @given(case=operation.as_strategy(generation_mode=mode))
    def check(case: Any) -> None:
        case.call_and_validate(base_url=base_url, session=session, headers=headers, checks=checks, timeout=30)

    try:
        check()
    except Unsatisfiable:  # nothing to make invalid: an operation without parameters or body
        assert mode is GenerationMode.NEGATIVE, operation.label


def controller_headers(path: str) -> dict[str, str]:
    worker_side = path in ("/api/receive_heartbeat", "/api/cancel_notice")
    token = WORKER if worker_side else TRAINER
    return {"Authorization": f"Bearer {token}"} if path != "/openapi.json" else {}


def test_controller_api_conforms_to_its_openapi_description(servers: dict[str, str]) -> None:
    served = http().get(servers["controller"] + "/openapi.json", timeout=10).json()
    assert served == controller_spec()
    fuzz(served, servers["controller"], controller_headers)
    # the controller still works after the fuzzing: a session of the scripted task starts
    reply = http().post(servers["controller"] + "/api/start_sample", json={"name": "echo", "index": 0},
                          headers={"Authorization": f"Bearer {TRAINER}"}, timeout=10)
    assert reply.status_code == 200 and reply.json()["status"] == "running", reply.text


def test_worker_api_conforms_to_its_openapi_description(servers: dict[str, str]) -> None:
    served = http().get(servers["worker"] + "/openapi.json", timeout=10).json()
    assert served == worker_spec()
    fuzz(served, servers["worker"], lambda path: {})
    # the worker still works after the fuzzing
    assert http().post(servers["worker"] + "/api/cancel_all", timeout=10).status_code == 200
    reply = http().post(servers["worker"] + "/api/start_sample", json={"index": 0, "session_id": 1}, timeout=10)
    assert reply.status_code == 200 and reply.json()["status"] == "running", reply.text
