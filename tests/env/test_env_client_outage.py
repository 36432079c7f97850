"""The HTTP env client against a controller that goes away and comes back: a real aiohttp server on loopback,
stopped and restarted on the same port. Starts wait (one probe at a time, Retry-After honoured) within
``unavailable_timeout_s``; an interact that went out is never sent again; a session the restarted controller
does not know ends the episode as an infrastructure failure with the controller's text."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import pytest
from aiohttp import web

from env_controller.clients.http_client import EnvControllerError, EnvUnavailableError, HttpEnvClient
from env_controller.clients.local import UnknownSessionError
from env_controller.clients.options import EnvClientOptions
from env_controller.http.net import free_port
from env_controller.http.service import start_site
from tests.env.support import run, tool_call

LOG = "env_controller.clients.http_client"


class FakeController:
    """A controller stand-in on a fixed port: ``up()`` / ``down()``; ``unavailable_for_s`` after an ``up()`` it
    answers starts 503 with ``Retry-After`` (workers re-registering); it counts what it was sent."""

    def __init__(self, retry_after: str = "1", unavailable_for_s: float = 0.0) -> None:
        self.port = free_port()
        self.retry_after = retry_after
        self.unavailable_for_s = unavailable_for_s
        self.hits: dict[str, list[float]] = {"start_sample": [], "interact": [], "cancel": []}
        self.answered_503 = 0
        self.sessions: set[str] = set()
        self.drop_interacts = False
        self._runner: web.AppRunner | None = None
        self._since = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    async def up(self) -> None:
        app = web.Application()
        app.router.add_post("/api/start_sample", self._start)
        app.router.add_post("/api/interact", self._interact)
        app.router.add_post("/api/cancel", self._cancel)
        self._runner, _ = await start_site(app, "127.0.0.1", self.port)
        self._since = time.monotonic()
        self.sessions = set()  # a restarted controller knows no session

    async def down(self) -> None:
        assert self._runner is not None
        await self._runner.cleanup()
        self._runner = None

    async def _start(self, request: web.Request) -> web.Response:
        self.hits["start_sample"].append(time.monotonic())
        if time.monotonic() - self._since < self.unavailable_for_s:
            self.answered_503 += 1
            return web.json_response({"error": "no worker of task 't' has registered yet", "status": 503},
                                     status=503, headers={"Retry-After": self.retry_after})
        sid = str(len(self.hits["start_sample"]))
        self.sessions.add(sid)
        return web.json_response({"messages": [{"role": "user", "content": "hi"}], "status": "running"},
                                 headers={"session_id": sid})

    async def _interact(self, request: web.Request) -> web.StreamResponse:
        self.hits["interact"].append(time.monotonic())
        sid = request.headers["session_id"]
        if self.drop_interacts:  # it got the request, then died before answering
            assert request.transport is not None
            request.transport.abort()
            await asyncio.sleep(1)
        if sid not in self.sessions:
            return web.json_response({"error": f"unknown session {sid}: never started on this controller, or "
                                               "ended long ago; open sessions: 0", "status": 404}, status=404)
        return web.json_response({"messages": [{"role": "tool", "content": "ok"}], "status": "running"})

    async def _cancel(self, request: web.Request) -> web.Response:
        self.hits["cancel"].append(time.monotonic())
        return web.json_response({"session_id": request.headers["session_id"], "status": "cancelled"})


def _messages(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOG and text in r.getMessage()]


def test_starts_wait_through_a_restart_with_one_probe_at_a_time(caplog: pytest.LogCaptureFixture) -> None:
    """500 starts during a 1 s outage, then 1.5 s of 503 "registering": all succeed once the controller serves,
    the controller sees a handful of 503 probes (not 500 x retries), one log line opens and one closes each outage."""
    caplog.set_level(logging.WARNING, logger=LOG)

    async def go() -> None:
        fake = FakeController(retry_after="0.3", unavailable_for_s=1.5)
        env = HttpEnvClient(fake.url, EnvClientOptions(unavailable_timeout_s=20, backoff_s=0.05, max_backoff_s=0.2))
        try:
            starts = [asyncio.ensure_future(env.start_sample("t", i)) for i in range(500)]
            await asyncio.sleep(1.0)
            assert not any(s.done() for s in starts)  # refused connections: all still waiting
            t_up = time.monotonic()
            await fake.up()
            results = await asyncio.wait_for(asyncio.gather(*starts), 20)
            assert len({sid for sid, _ in results}) == 500
            assert all(r.messages == [{"role": "user", "content": "hi"}] for _, r in results)
            # the 503 phase lasts 1.5 s and each probe waits >= Retry-After 0.3 s: at most 6 probes, never hundreds
            assert 1 <= fake.answered_503 <= 6, fake.answered_503
            assert time.monotonic() - t_up < 1.5 + 0.3 + 3.0
            assert len(_messages(caplog, "is unreachable")) == 1  # once per outage, not per request
            assert len(_messages(caplog, "has no worker free for task 't'")) == 1
            back = _messages(caplog, "is back after")
            assert len(back) == 2 and "500 starts waited" in back[0], back
            # a second outage is logged again, once
            await fake.down()
            late = asyncio.ensure_future(env.start_sample("t", 0))
            await asyncio.sleep(0.3)
            fake.unavailable_for_s = 0
            await fake.up()
            await asyncio.wait_for(late, 10)
            assert len(_messages(caplog, "is unreachable")) == 2 and env.outages == 3
        finally:
            await env.aclose()
            await fake.down()

    run(go())


def test_a_start_gives_up_after_the_budget_with_the_url_and_the_fix() -> None:
    async def go() -> None:
        fake = FakeController()  # never up: connection refused
        env = HttpEnvClient(fake.url, EnvClientOptions(unavailable_timeout_s=0.8, backoff_s=0.05, max_backoff_s=0.2))
        t0 = time.monotonic()
        with pytest.raises(EnvUnavailableError) as err:
            await env.start_sample("t", 3)
        took = time.monotonic() - t0
        assert 0.8 <= took < 3, took
        msg = str(err.value)
        assert err.value.status == 0
        for part in (fake.url, "is unreachable", "waited 0.8 s", "unavailable_timeout_s=0.8", "cannot connect",
                     "check that the controller runs", "env.unavailable_timeout_s"):
            assert part in msg, (part, msg)
        await env.aclose()

    run(go())


def test_retry_after_is_honoured_and_capped() -> None:
    """A 503 with Retry-After: 1 holds the next try back a second (not the 0.01 s backoff); a huge one is cut to the
    cap, so the budget still ends the wait on time."""

    async def go() -> None:
        fake = FakeController(retry_after="1", unavailable_for_s=0.5)
        await fake.up()
        env = HttpEnvClient(fake.url, EnvClientOptions(unavailable_timeout_s=10, backoff_s=0.01, max_backoff_s=0.05))
        try:
            await env.start_sample("t", 0)
            hits = fake.hits["start_sample"]
            assert len(hits) == 2, hits  # one 503, then the start one Retry-After later
            assert hits[1] - hits[0] >= 0.99, hits
            fake.retry_after, fake.unavailable_for_s = "86400", 1e9
            env.unavailable_timeout_s = 0.5
            t0 = time.monotonic()
            with pytest.raises(EnvUnavailableError, match="has no worker free for task 't'"):
                await env.start_sample("t", 1)
            assert time.monotonic() - t0 < 2
        finally:
            await env.aclose()
            await fake.down()

    run(go())


def test_an_interact_that_went_out_is_not_sent_again() -> None:
    async def go() -> None:
        fake = FakeController()
        await fake.up()
        env = HttpEnvClient(fake.url, EnvClientOptions(retries=3, backoff_s=0.01, unavailable_timeout_s=5))
        try:
            sid, _ = await env.start_sample("t", 0)
            fake.drop_interacts = True
            with pytest.raises(EnvControllerError, match="may have reached the controller") as err:
                await env.interact(sid, [tool_call("x", {})])
            assert not isinstance(err.value, UnknownSessionError)
            assert len(fake.hits["interact"]) == 1  # retries=3, yet sent once
            # the controller restarts: the session is gone, which the client says with the controller's text
            fake.drop_interacts = False
            await fake.down()
            with pytest.raises(EnvControllerError, match="cannot reach the controller"):
                await env.interact(sid, [tool_call("x", {})])  # refused: nothing sent (retried, then given up)
            assert len(fake.hits["interact"]) == 1
            await fake.up()
            with pytest.raises(UnknownSessionError, match=f"unknown session {sid}: never started on this controller"):
                await env.interact(sid, [tool_call("x", {})])
            assert len(fake.hits["interact"]) == 2
        finally:
            await env.aclose()
            await fake.down()

    run(go())


def test_cancel_is_best_effort_while_the_controller_is_down() -> None:
    """During an outage a cancel fails at once (no retries, the sessions are gone anyway), within its short timeout."""

    async def go() -> None:
        fake = FakeController()
        env = HttpEnvClient(fake.url, EnvClientOptions(retries=5, backoff_s=0.5, unavailable_timeout_s=0.2,
                                                       cancel_timeout_s=1))
        with pytest.raises(EnvUnavailableError):
            await env.start_sample("t", 0)  # opens the outage
        t0 = time.monotonic()
        with pytest.raises(EnvControllerError, match="cannot reach the controller"):
            await env.cancel("7")
        assert time.monotonic() - t0 < 0.3  # five retries at 0.5 s backoff would take seconds
        await env.aclose()

    run(go())


def test_a_session_lost_in_a_restart_ends_the_episode_as_an_infra_failure() -> None:
    """The agent loop over the HTTP client: the controller restarts between the start and the first interact; the
    episode ends with "task error" (an infra failure, never trained) and the controller's 404 text in its error."""
    pytest.importorskip("transformers")
    import tempfile

    from rollout_sglang.agent_loop import run_group_lockstep
    from rollout_sglang.chat_template import ChatTemplate
    from rollout_sglang.engines.protocol import GenerationOutput, SamplingParams
    from rollout_sglang.episode_options import EpisodeLimits, EpisodeOptions
    from rollout_sglang.tokenizer import train_bpe_tokenizer

    call = '<tool_call>\n{"name": "x", "arguments": {}}\n</tool_call>'

    async def go() -> None:
        fake = FakeController()
        await fake.up()
        env = HttpEnvClient(fake.url, EnvClientOptions(unavailable_timeout_s=5))
        with tempfile.TemporaryDirectory() as tmp:
            template = ChatTemplate(train_bpe_tokenizer([call, "hi ok"] * 5, vocab_size=300, out_dir=tmp))

            class RestartingEngine:
                """Generates one tool call; the controller restarts while it does."""

                version = 0

                async def generate(self, prompts: list[list[int]], params: SamplingParams, seeds=None) -> list[Any]:
                    await fake.down()
                    await fake.up()
                    ids = template.tokenizer.encode(call, add_special_tokens=False) + [template.im_end_id]
                    return [GenerationOutput(ids, [-0.5] * len(ids), "stop", 0) for _ in prompts]

            try:
                params = SamplingParams(max_new_tokens=50, temperature=1.0, seed=0)
                (traj,) = await run_group_lockstep(RestartingEngine(), env, template, [("t", 0, 0)], params,
                                                 EpisodeOptions(EpisodeLimits(4, 4096)))
            finally:
                await env.aclose()
                await fake.down()
        assert traj.status == "task error" and traj.infra_failed, traj
        assert "unknown session 1: never started on this controller" in traj.error, traj.error

    run(go())
