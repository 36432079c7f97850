"""A task worker server: one of our :class:`~env_controller.tasks.Task` objects behind the
AgentBench-FC / AgentRL task-worker HTTP protocol, so our controller (or AgentRL's) can drive it.

Endpoints (under ``/api``, shapes as the ``agentrl-worker`` package serves them):

* ``POST /start_sample {index, session_id}`` -> ``{messages, tools, status, finish, reward,
  metric}`` with the ``session_id`` header; 400 duplicate id or bad index, 406 at concurrency.
* ``POST /interact {session_id, messages}`` -> ``{session_id, env_out: {...the same reply...}}``;
  400 ``No such session`` or a call still running.
* ``POST /cancel {session_id}`` -> ``{session_id}``; ``POST /cancel_all``;
  ``POST /cancel_with_notice {session_id}`` (answers at once, cancels, then tells the controller
  at ``/cancel_notice``).
* ``GET /get_indices``, ``GET /get_sessions`` (``{session_id: index}``), ``GET /worker_status``
  (``{concurrency, current}``, plus ``sandbox_pool``: the counters of the task's sandbox pool, when it has
  one), ``POST /sample_status {session_id}``; ``GET /metrics`` (Prometheus: sessions, and the pool's
  sandboxes by state and its counters).

A task with a sandbox pool (:class:`~env_controller.sandbox.pool.PooledTask`, e.g. ``os_shell``) gets it
started when the worker starts, so that the sandboxes a killed worker left behind are removed then and
warm ones are ready before the first session; its ``max_containers`` caps the concurrency the worker
advertises, so the controller never sends more sessions than the worker may hold sandboxes.

Every reply carries ``x-worker-time`` (seconds the worker spent on it), which the controller
subtracts to measure its own overhead. The server heartbeats ``{name, address, concurrency,
indices}`` to ``<controller>/receive_heartbeat`` every ``heartbeat_interval_s``; a heartbeat the
controller refuses (4xx: a wrong or missing token, a task name the token may not serve) is logged
once per change of answer and retried with exponential backoff up to ``heartbeat_backoff_cap_s``.
``token`` is the worker's credential: sent on heartbeats, required on every request (the
controller sends it back); credentials in ``controller_url`` (``http://agentrl:TOKEN@host``, as
stock AgentRL workers give them) serve when no ``token`` is given. A task that
raises or runs past ``timeout_s`` ends its episode with ``task error``; a session left idle
for ``session_idle_timeout_s`` (its controller gone) is closed. ``latency_s`` adds a simulated
delay (uniform in [0.5, 1.5] x latency_s) to each start and interact, for benchmarks and tests.
"""
from __future__ import annotations

import asyncio
import logging
import random
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from env_controller.http.auth import WORKER_TOKEN_ENV, Credentials, Role, pick_token, redact_url
from env_controller.http.service import (
    SESSION_HEADER,
    HttpError,
    HttpService,
    Reply,
    base_api_url,
    cancel_and_wait,
    json_reply,
    loads_json,
    read_json_object,
    session_id_from,
)
from env_controller.protocol import (
    MAX_ERROR_CHARS,
    MalformedMessageError,
    SampleStatus,
    TaskReply,
    validate_assistant_messages,
)
from env_controller.sandbox.pool import PooledTask, SandboxPool
from env_controller.tasks.base import Task, TaskSession
from env_controller.worker.options import WorkerOptions

logger = logging.getLogger(__name__)
_perf = time.perf_counter


@dataclass(eq=False)
class _Open:
    index: Any
    session: TaskSession | None = None
    busy: bool = True
    running: asyncio.Future[Any] | None = None
    last_active: float = field(default_factory=time.monotonic)


class WorkerServer(HttpService):
    """Serves one task over the task-worker protocol and heartbeats to a controller."""

    def __init__(self, task: Task, options: WorkerOptions | None = None) -> None:
        """``task``: the task served; ``options``: how it is served (None: the defaults, no heartbeats)."""
        options = self.options = options if options is not None else WorkerOptions()
        self.task = task
        self.name = options.name or getattr(task, "name", None) or type(task).__name__
        concurrency = options.concurrency
        cap = task.max_containers if isinstance(task, PooledTask) else None
        if cap is not None and concurrency > cap:
            logger.info("worker %s: concurrency %d lowered to max_containers=%d (one sandbox per session)",
                        self.name, concurrency, cap)
            concurrency = cap
        #: the task's sandbox pool, once started (see the module docstring)
        self.pool: SandboxPool | None = None
        controller_url, token = options.controller_url, options.token
        if controller_url:  # kept without credentials: it is logged, and aiohttp refuses a URL login plus a header
            controller_url, token = pick_token(token, base_api_url(controller_url), f"worker {self.name}")
        self.controller_url = controller_url or None
        self.host = options.host
        self.port = options.port
        self._self_address = options.self_address.rstrip("/") if options.self_address else None
        self.concurrency = concurrency
        self.heartbeat_interval_s = float(options.heartbeat_interval_s)
        self.timeout_s = float(options.timeout_s)
        self.latency_s = float(options.latency_s)
        self.token = token
        self.session_idle_timeout_s = float(options.session_idle_timeout_s)
        self.heartbeat_backoff_cap_s = max(float(options.heartbeat_backoff_cap_s), self.heartbeat_interval_s)
        self.indices: list[Any] = list(task.indices())
        self._index_set = set(self.indices)
        self._sessions: dict[int, _Open] = {}
        self._http: aiohttp.ClientSession | None = None
        self._loops: list[asyncio.Task[None]] = []
        self._notices: set[asyncio.Future[None]] = set()
        #: set once a heartbeat was accepted (created in start(), inside the loop)
        self.heartbeat_ok: asyncio.Event | None = None
        #: the controller's last refusal of a heartbeat, ``(status, message)``; None while they are accepted
        self.heartbeat_refusal: tuple[int, str] | None = None
        super().__init__(Credentials.single(token), self._routes(), options,
                         auth_hint=f"the worker's --token / ${WORKER_TOKEN_ENV}", fast=True)

    # -- lifecycle -------------------------------------------------------------------------------

    @property
    def address(self) -> str:
        """The URL the controller reaches this worker at (``.../api``)."""
        if self._self_address:
            return self._self_address
        if self.port == 0:
            raise RuntimeError("the worker is not started (port 0 is picked at start)")
        host = self.host
        if host in ("0.0.0.0", "::", ""):
            host = socket.getfqdn()
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}/api"

    async def start(self) -> int:
        """Start the task's sandbox pool (if any), bind, serve, and start heartbeating; returns the bound port."""
        self.heartbeat_ok = asyncio.Event()
        if isinstance(self.task, PooledTask) and self.pool is None:
            self.pool = await asyncio.get_running_loop().run_in_executor(None, self.task.sandbox_pool)
        self.port = await self._serve(self.host, self.port, "the worker")
        self._http = aiohttp.ClientSession()
        self._loops.append(asyncio.create_task(self._gc_loop(), name="worker-gc"))
        if self.controller_url:
            self._loops.append(asyncio.create_task(self._heartbeat_loop(), name="worker-heartbeat"))
        logger.info(
            "worker %s listening on %s (concurrency %d, %d indices), controller %s",
            self.name, redact_url(self.address), self.concurrency, len(self.indices),
            redact_url(self.controller_url) if self.controller_url else "none",
        )
        return self.port

    async def stop(self) -> None:
        """Stop heartbeats, close every session, stop serving (bounded waits)."""
        await cancel_and_wait(self._loops)
        self._loops.clear()
        if self._notices:
            await asyncio.wait(list(self._notices), timeout=10)
        for sid in list(self._sessions):
            await self._cancel(sid)
        await self._unserve()
        if self._http is not None:
            await self._http.close()
            self._http = None

    # -- app -------------------------------------------------------------------------------------

    def _routes(self) -> list[tuple[str, str, Any, Role]]:
        caller = Role.ANY  # the controller, with this worker's token
        return [
            ("POST", "/api/start_sample", self._handle_start, caller),
            ("POST", "/api/interact", self._handle_interact, caller),
            ("POST", "/api/cancel", self._handle_cancel, caller),
            ("POST", "/api/cancel_with_notice", self._handle_cancel_with_notice, caller),
            ("POST", "/api/cancel_all", self._handle_cancel_all, caller),
            ("POST", "/api/sample_status", self._handle_sample_status, caller),
            ("GET", "/api/get_indices", self._handle_get_indices, caller),
            ("GET", "/api/get_sessions", self._handle_get_sessions, caller),
            ("GET", "/api/worker_status", self._handle_worker_status, caller),
            ("GET", "/metrics", self._handle_metrics, caller),
            ("GET", "/openapi.json", self._handle_openapi, Role.OPEN),
        ]

    async def _delay(self) -> None:
        if self.latency_s > 0:
            await asyncio.sleep(self.latency_s * random.uniform(0.5, 1.5))

    async def _run_in(self, entry: Any, call: Any, what: str) -> Any:
        """Run a task call as ``entry.running`` (so /api/cancel can stop it) and map its end:
        the call's result; a CANCELLED reply when it was cancelled; a task-error reply when it
        raised. Clears ``entry.running`` and ``entry.busy`` in every case."""
        entry.running = asyncio.ensure_future(call)
        try:
            return await entry.running
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if me is not None and me.cancelling():
                raise
            return TaskReply(messages=[], status=SampleStatus.CANCELLED, finish=True)
        except Exception as e:  # noqa: BLE001 - a task's failure ends its sample
            return self._error_reply(what, e)
        finally:
            entry.running = None
            entry.busy = False

    def _error_reply(self, what: str, exc: BaseException) -> TaskReply:
        """A task-error reply whose ``error`` says which call failed and how (the trainer records it)."""
        if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
            logger.error("%s timed out after %g s", what, self.timeout_s)
            why = f"{what} timed out after {self.timeout_s:g} s"
        else:
            logger.error("%s failed: %s", what, exc, exc_info=exc)
            why = f"{what} failed: {type(exc).__name__}: {exc}"
        return TaskReply(messages=[], status=SampleStatus.TASK_ERROR, finish=True, error=why[:MAX_ERROR_CHARS])

    async def _close(self, session: TaskSession | None, sid: int) -> None:
        if session is None:
            return
        try:
            await asyncio.wait_for(session.close(), self.timeout_s)
        except Exception:  # noqa: BLE001 - closing is best effort
            logger.exception("closing session %d failed", sid)

    # -- handlers --------------------------------------------------------------------------------

    async def _handle_start(self, request: web.Request) -> Reply:
        t0 = _perf()
        body = await read_json_object(request)
        sid = session_id_from(body.get("session_id"), "'session_id'")
        if "index" not in body:
            raise HttpError(400, "missing 'index': the sample index to start")
        index = body["index"]
        if isinstance(index, bool) or not isinstance(index, (int, str)):
            raise HttpError(400, f"'index' must be an integer or a string sample index, got {type(index).__name__}")
        if body.get("custom_task") is not None:
            raise HttpError(400, f"worker {self.name!r} serves its own samples only; 'custom_task' is not supported")
        if sid in self._sessions:
            raise HttpError(400, "Session ID already exists")
        if len(self._sessions) >= self.concurrency:
            raise HttpError(406, f"Sample concurrency limit reached: {self.concurrency}")
        if index not in self._index_set:
            raise HttpError(
                400, f"task {self.name!r} has no sample index {index!r:.100}; it has {len(self.indices)} indices"
            )
        entry = _Open(index)
        self._sessions[sid] = entry

        async def run() -> tuple[TaskSession, TaskReply]:
            await self._delay()
            return await asyncio.wait_for(self.task.start(index), self.timeout_s)

        result = await self._run_in(entry, run(), f"start of {self.name!r} index {index!r} (session {sid})")
        session, reply = result if isinstance(result, tuple) else (None, result)
        if self._sessions.get(sid) is not entry:  # cancelled while starting
            await self._close(session, sid)
            reply = TaskReply(messages=[], status=SampleStatus.CANCELLED, finish=True)
        elif reply.finish:
            del self._sessions[sid]
            await self._close(session, sid)
        else:
            entry.session = session
            entry.last_active = time.monotonic()
        return json_reply(
            reply.to_json("metric"), headers={SESSION_HEADER: str(sid), "x-worker-time": f"{_perf() - t0:.6f}"}
        )

    async def _open_session(self, request: web.Request) -> tuple[dict[str, Any], int, _Open]:
        """The request body, its ``session_id`` and that open session; HttpError 400 when none is open."""
        body = await read_json_object(request)
        sid = session_id_from(body.get("session_id"), "'session_id'")
        entry = self._sessions.get(sid)
        if entry is None:
            raise HttpError(400, "No such session")
        return body, sid, entry

    async def _handle_interact(self, request: web.Request) -> Reply:
        t0 = _perf()
        body, sid, entry = await self._open_session(request)
        if entry.busy or entry.session is None:
            raise HttpError(400, "Task Executing, please do not send new request.")
        try:
            message = validate_assistant_messages(body.get("messages"))
        except MalformedMessageError as e:
            raise HttpError(400, str(e)) from None
        session = entry.session
        entry.busy = True
        entry.last_active = time.monotonic()

        async def run() -> TaskReply:
            await self._delay()
            return await asyncio.wait_for(session.interact(message), self.timeout_s)

        reply = await self._run_in(entry, run(), f"interact of {self.name!r} session {sid}")
        entry.last_active = time.monotonic()
        if reply.finish and self._sessions.get(sid) is entry:
            del self._sessions[sid]
            await self._close(session, sid)
        return json_reply(
            {"session_id": sid, "env_out": reply.to_json("metric")}, headers={"x-worker-time": f"{_perf() - t0:.6f}"}
        )

    async def _cancel(self, sid: int) -> bool:
        entry = self._sessions.pop(sid, None)
        if entry is None:
            return False
        if entry.running is not None and not entry.running.done():
            entry.running.cancel()
            await asyncio.wait([entry.running], timeout=self.timeout_s)
        await self._close(entry.session, sid)
        return True

    async def _handle_cancel(self, request: web.Request) -> Reply:
        body = await read_json_object(request)
        sid = session_id_from(body.get("session_id"), "'session_id'")
        if not await self._cancel(sid):
            raise HttpError(400, "No such session")
        return json_reply({"session_id": sid})

    async def _handle_cancel_with_notice(self, request: web.Request) -> Reply:
        _, sid, _ = await self._open_session(request)

        async def cancel_and_notify() -> None:
            await self._cancel(sid)
            if self._http is None or self.controller_url is None:
                return
            headers = {SESSION_HEADER: str(sid)}
            if self.token:
                headers["Authorization"] = f"Bearer {self.token}"
            try:
                async with self._http.post(self.controller_url + "/cancel_notice", json={"session_id": sid},
                                           headers=headers, timeout=aiohttp.ClientTimeout(total=10)) as resp:
                    await resp.read()
            except (aiohttp.ClientError, OSError, TimeoutError, asyncio.TimeoutError) as e:
                logger.warning("cancel notice of session %d to %s failed: %r", sid, self.controller_url, e)

        task = asyncio.ensure_future(cancel_and_notify())
        self._notices.add(task)
        task.add_done_callback(self._notices.discard)
        return json_reply({"session_id": sid})

    async def _handle_cancel_all(self, request: web.Request) -> Reply:
        sids = list(self._sessions)
        await asyncio.gather(*(self._cancel(sid) for sid in sids))
        return json_reply({"cancelled": sids})

    async def _handle_sample_status(self, request: web.Request) -> Reply:
        _, sid, entry = await self._open_session(request)
        return json_reply({"session_id": sid, "index": entry.index, "status": {"busy": entry.busy}})

    async def _handle_get_indices(self, request: web.Request) -> Reply:
        return json_reply(self.indices)

    async def _handle_get_sessions(self, request: web.Request) -> Reply:
        return json_reply({str(sid): e.index for sid, e in self._sessions.items()})

    async def _handle_worker_status(self, request: web.Request) -> Reply:
        status: dict[str, Any] = {"concurrency": self.concurrency, "current": len(self._sessions)}
        if self.pool is not None:
            status["sandbox_pool"] = self.pool.stats()
        return json_reply(status)

    async def _handle_metrics(self, request: web.Request) -> Reply:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Reply(_render_metrics(self.name, self.concurrency, len(self._sessions),
                                     self.pool.stats() if self.pool is not None else None),
                     content_type=CONTENT_TYPE_LATEST)

    async def _handle_openapi(self, request: web.Request) -> Reply:
        from env_controller.openapi import worker_spec

        return json_reply(worker_spec())

    # -- background ------------------------------------------------------------------------------

    async def _beat(self) -> tuple[str, int, str]:
        """Send one heartbeat: ``("ok" | "refused" | "failed", HTTP status or 0, what went wrong)``."""
        assert self._http is not None and self.controller_url is not None
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else None
        body = {"name": self.name, "address": self.address, "concurrency": self.concurrency, "indices": self.indices}
        timeout = aiohttp.ClientTimeout(total=max(2.0, self.heartbeat_interval_s))
        try:
            async with self._http.post(
                self.controller_url + "/receive_heartbeat", json=body, headers=headers, timeout=timeout
            ) as resp:
                raw = await resp.read()
                if resp.status == 200:
                    return "ok", 200, ""
                return ("refused" if resp.status < 500 else "failed"), resp.status, _error_text(raw)
        except (aiohttp.ClientError, OSError, TimeoutError, asyncio.TimeoutError) as e:
            return "failed", 0, f"{type(e).__name__}: {e}"

    async def heartbeat_once(self) -> bool:
        """Send one heartbeat; True when the controller accepted it."""
        return (await self._beat())[0] == "ok"

    async def _heartbeat_loop(self) -> None:
        url = redact_url(self.controller_url or "")
        failing_since: float | None = None
        last_log = 0.0
        delay = self.heartbeat_interval_s
        while True:
            outcome, status, detail = await self._beat()
            now = time.monotonic()
            if outcome == "ok":
                assert self.heartbeat_ok is not None
                self.heartbeat_ok.set()
                if failing_since is not None or self.heartbeat_refusal is not None:
                    logger.info("heartbeats of %s to %s are accepted again", self.name, url)
                failing_since = self.heartbeat_refusal = None
                delay = self.heartbeat_interval_s
            elif outcome == "refused":  # the controller is up and says no: no point in asking at full rate
                failing_since = None
                if (status, detail) != self.heartbeat_refusal:  # log once per change of answer, not every beat
                    hint = (f" (check the worker token: --token / ${WORKER_TOKEN_ENV}, or the credentials in the "
                            "controller URL)") if status in (401, 403) else ""
                    logger.error("the controller at %s refused the heartbeat of %s: HTTP %d: %s%s; retrying with "
                                 "backoff (at most every %g s)", url, self.name, status, detail[:500], hint,
                                 self.heartbeat_backoff_cap_s)
                self.heartbeat_refusal = (status, detail)
                delay = min(delay * 2, self.heartbeat_backoff_cap_s)
            else:  # no answer (a controller starting or restarting): keep the normal rate
                self.heartbeat_refusal = None
                if failing_since is None:
                    failing_since = now
                if now - last_log > 30:
                    last_log = now
                    logger.warning("heartbeats of %s to %s failing for %.0f s: %s", self.name, url,
                                   now - failing_since, detail[:300])
                delay = self.heartbeat_interval_s
            await asyncio.sleep(delay)

    async def _gc_loop(self) -> None:
        every = min(60.0, self.session_idle_timeout_s / 4)
        while True:
            await asyncio.sleep(every)
            now = time.monotonic()
            for sid, entry in list(self._sessions.items()):
                if not entry.busy and now - entry.last_active > self.session_idle_timeout_s:
                    logger.warning("closing session %d: idle for %.0f s", sid, now - entry.last_active)
                    await self._cancel(sid)


#: the pool's counters exported as ``agentrl_worker_sandbox_events_total{event=...}``
_POOL_EVENTS = ("created", "removed", "create_failures", "acquired", "served_warm", "served_cold", "reused",
                "wipe_failures", "waited", "timeouts", "swept")
_POOL_STATES = ("leased", "idle", "starting", "resetting", "removing")


def _render_metrics(task: str, concurrency: int, sessions: int, pool: dict[str, Any] | None) -> bytes:
    """The worker's metrics in the Prometheus text format, from a snapshot taken now."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    families: list[Any] = []
    for name, doc, value in (("sessions_open", "Open sessions", sessions),
                             ("concurrency", "Sessions allowed at once (advertised)", concurrency)):
        g = GaugeMetricFamily(f"agentrl_worker_{name}", doc, labels=["task"])
        g.add_metric([task], value)
        families.append(g)
    if pool is not None:
        g = GaugeMetricFamily("agentrl_worker_sandboxes", "Sandboxes of the pool by state", labels=["task", "state"])
        for state in _POOL_STATES:
            g.add_metric([task, state], pool[state])
        families.append(g)
        for name, doc in (("max", "Most sandboxes live at once (+Inf: no cap)"),
                          ("warm_target", "Idle sandboxes the pool keeps now"),
                          ("peak_live", "Most sandboxes live at once so far"),
                          ("waiting", "Sessions waiting for a sandbox at the max")):
            g = GaugeMetricFamily(f"agentrl_worker_sandbox_pool_{name}", doc, labels=["task"])
            g.add_metric([task], float("inf") if pool[name] is None else pool[name])
            families.append(g)
        c = CounterMetricFamily("agentrl_worker_sandbox_events", "Pool events since the worker started",
                                labels=["task", "event"])
        for event in _POOL_EVENTS:
            c.add_metric([task, event], pool[event])
        families.append(c)

    class _Snapshot:
        def collect(self) -> list[Any]:
            return families

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot())  # type: ignore[arg-type]
    return generate_latest(registry)


def _error_text(raw: bytes) -> str:
    """The ``error`` (or ``detail``) of a JSON error reply, else its text, shortened."""
    try:
        body = loads_json(raw, strict=False)
    except ValueError:
        return raw[:500].decode(errors="replace").strip()
    if isinstance(body, dict):
        for key in ("error", "detail"):
            if key in body:
                return str(body[key])[:500]
    return str(body)[:500]
