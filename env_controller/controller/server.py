"""The environment controller: one asyncio HTTP server between the trainer and many task workers.

Wire-compatible with the AgentBench-FC / AgentRL task-worker protocol (DESIGN.md, "Env
protocol"). The app is aiohttp's, served behind :mod:`~env_controller.http.fast` (plain requests
are parsed and answered there, every other one by aiohttp); calls to workers go through the small
pooled HTTP/1.1 client of :mod:`~env_controller.http.client` (a future per call, driven by
callbacks). The hot path is described in docs/environments.md ("The hot path"). Workers register with heartbeats
(:mod:`~env_controller.controller.registry`); the trainer starts, drives and cancels sessions
(:mod:`~env_controller.controller.sessions`); every start goes to the least-loaded alive worker of the task.

Trainer-facing API (all JSON; errors are ``{"error": "...", "status": code}``):

* ``POST /api/start_sample {name, index[, custom_task]}`` -> ``{messages, tools, status, finish,
  reward, metrics}``, the session id in the ``session_id`` response header.
  404 unknown task, 400 bad body or index, 503 (with ``Retry-After``) no free worker, or a task no
  worker has registered yet within ``heartbeat_timeout_s`` of the controller's start (a restarted
  controller: its workers come back with their next heartbeat).
* ``POST /api/interact`` with header ``session_id`` and ``{messages: [assistant message]}`` ->
  the same flat reply. 400 malformed body or header, 404 unknown session, 409 an interact on the
  session is still running.
* ``POST /api/cancel`` with header ``session_id`` -> ``{session_id, status}``; 404 unknown session.
* ``GET /api/list_workers``, ``GET /api/list_sessions``, ``GET /api/get_indices?name=``,
  ``GET /api/health``, ``GET /metrics`` (Prometheus).
* Worker-facing: ``POST /api/receive_heartbeat {name, address, concurrency, indices}``,
  ``POST /api/cancel_notice`` (header ``session_id``: the worker cancelled that session).
* ``GET /openapi.json``: this API in OpenAPI 3 (:mod:`env_controller.openapi`).

Credentials (:class:`~env_controller.controller.options.ControllerConfig`): with any configured, the trainer
API needs the trainer token and the worker API a worker token listed for the task name (401 without a valid one, 403
for the wrong role or task). Bodies are parsed under a size, nesting and time limit (400, 408,
413) and forwarded to workers as UTF-8, never larger than ``max_forward_bytes`` (else 413, the
session untouched).

Failure rules. A 5xx reply means the request had no effect (nothing was started or sent to a
task), so clients may retry it. Once a worker may have acted, failures end the session and the
trainer gets a finished ``task error`` reply whose ``error`` field says why: a worker that cannot
be reached or drops the connection, a call past its timeout, a worker declared dead (no heartbeat
for ``heartbeat_timeout_s``: its in-flight calls are aborted at once and its idle sessions answer
their next interact with the error), or a session idle longer than ``session_idle_timeout_s``.
No request waits longer than its timeout.

Controller overhead: each start/interact reply carries ``x-controller-overhead-ms``, the handler's
wall time minus the worker's own time (the worker's ``x-worker-time`` header when it sends one,
else the whole round trip to the worker), with ``x-worker-time-ms`` and the round trip to the
worker ``x-worker-rtt-ms``; the overhead also feeds the ``agentrl_controller_overhead_seconds``
histogram. It is an upper bound of the controller's own time: it also holds the network stack
to the worker and the worker's HTTP layer (its time before and after its handler).
"""
from __future__ import annotations

import asyncio
import logging
import re
import time
from typing import Any, NamedTuple

from aiohttp import web

from env_controller.controller.metrics import ControllerMetrics
from env_controller.controller.options import ControllerConfig
from env_controller.controller.registry import NoWorkerError, RegistryError, Worker, WorkerRegistry, WorkerState
from env_controller.controller.sessions import Session, SessionTable, final_reply
from env_controller.http.auth import TRAINER_TOKEN_ENV, Role, split_url_credentials
from env_controller.http.client import ConnectError, PooledHttp, parse_url
from env_controller.http.service import (
    SESSION_HEADER,
    HttpError,
    HttpService,
    Reply,
    cancel_and_wait,
    dumps_json,
    identity_of,
    json_reply,
    loads_json,
    read_json_object,
    read_json_object_raw,
    session_id_from,
)
from env_controller.protocol import MalformedMessageError, SampleStatus, TaskReply, validate_assistant_messages

logger = logging.getLogger(__name__)

_perf = time.perf_counter
_mono = time.monotonic
#: a dead worker's sessions are ended this many at a time, the event loop serving requests between
_END_SLICE = 256
#: task names land in logs and metric labels: no control characters (no forged log lines), bounded length
_TASK_NAME = re.compile(r"[^\x00-\x1f\x7f]{1,200}")


class WorkerReply(NamedTuple):
    """A worker's answer: its JSON ``payload``, its own time ``worker_s`` and the round trip ``rtt_s``."""

    payload: Any
    worker_s: float
    rtt_s: float


class WorkerCallError(Exception):
    """A controller -> worker call that failed.

    kind: ``connect`` (never reached the worker), ``disconnect`` (connection lost mid-call),
    ``timeout``, ``http`` (non-200 reply, ``status`` set) or ``bad_reply`` (not JSON).
    """

    def __init__(self, kind: str, message: str, status: int = 0) -> None:
        """See the class docstring."""
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.status = status


class _Aborted(Exception):
    """The controller aborted a session's worker call (dead worker, trainer cancel)."""

    def __init__(self, status: SampleStatus, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


def _pass_through(raw: bytes, body: dict[str, Any], message: dict[str, Any], sid: int) -> bytes | None:
    """The worker's interact body made from the trainer's bytes, not re-encoded: ``{"session_id": sid,`` and
    the rest of the trainer's object, when that object holds only ``messages``, its message is already in
    the normalized form, and its text is UTF-8 (as ``{`` first shows) without ``\\u`` escapes (which a
    re-encoding writes as the characters, up to a third of the size); else None (the body is encoded anew)."""
    start = len(raw) - len(raw.lstrip())
    if len(body) != 1 or raw[start:start + 1] != b"{" or b"\\u" in raw or body["messages"][0] != message:
        return None
    return b'{"session_id":%d,%s' % (sid, raw[start + 1:])


def _detail(raw: bytes) -> str:
    """The error text of a worker reply (FastAPI ``detail``, our ``error``, or the raw text)."""
    text = raw[:2000].decode(errors="replace")
    try:
        body = loads_json(raw, strict=False)
    except ValueError:
        return text.strip()
    if isinstance(body, dict):
        for key in ("detail", "error", "message"):
            if key in body:
                return str(body[key])
    return text.strip()


class Controller(HttpService):
    """The controller's state and its aiohttp application.

    ``await controller.start()`` serves it (returns the bound port); ``await controller.stop()``
    stops it. ``controller.url`` is the API base, ``http://host:port/api``.
    """

    def __init__(self, config: ControllerConfig | None = None) -> None:
        """Build the tables and the app (nothing is bound until :meth:`start`)."""
        self.config = config or ControllerConfig()
        config = self.config
        self.registry = WorkerRegistry(config.suspect_after_s, config.heartbeat_timeout_s, config.forget_dead_after_s)
        self.sessions = SessionTable(remember=config.remember_ended)
        self.metrics = ControllerMetrics(self._open_per_task, self.registry.counts)
        self.port: int | None = None
        self._http: PooledHttp | None = None
        self._monitor_task: asyncio.Task[None] | None = None
        self._bg: set[asyncio.Task[Any]] = set()
        self._call_hist: dict[str, Any] = {}
        self._born = time.monotonic()  # the registration window of unknown tasks counts from here
        super().__init__(
            config.credentials(), self._routes(), config,
            auth_hint=f"the controller's --trainer-token / --worker-token / --token; ${TRAINER_TOKEN_ENV}",
            on_rejected=self._count_rejected, fast=config.fast_front, taskless=True,  # its handlers await only futures
        )

    # -- lifecycle -------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """``http://host:port/api`` once started."""
        if self.port is None:
            raise RuntimeError("the controller is not started")
        host = self.config.host
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}/api"

    async def start(self) -> int:
        """Bind and serve; start the monitor (heartbeat timeouts, idle GC, worker sync). Returns the port."""
        config = self.config
        # a worker that refused a connection is not tried again for a second: a killed worker's thousands of
        # sessions would each open one otherwise (its starts go elsewhere: it is suspect until it beats again)
        self._http = PooledHttp(config.max_worker_connections, config.worker_keepalive_s, config.connect_timeout_s,
                                refused_for_s=1.0)
        try:
            self.port = await self._serve(config.host, config.port, "the controller")
        except BaseException:
            await self._http.close()
            self._http = None
            raise
        self._monitor_task = asyncio.create_task(self._monitor(), name="controller-monitor")
        creds = self.credentials
        if creds.enabled:
            logger.info("controller listening on %s (credentials required: trainer, workers of %s)", self.url,
                        ", ".join(sorted(creds.workers)))
        else:
            logger.warning("controller listening on %s without credentials: any process that can reach it may "
                           "start sessions and register workers; on a shared node pass --token", self.url)
        return self.port

    async def stop(self) -> None:
        """Stop serving: abort open calls, cancel background work, close connections (bounded waits)."""
        await cancel_and_wait([self._monitor_task])
        self._monitor_task = None
        for session in list(self.sessions.open.values()):
            if session.call is not None and not session.call.done():
                session.abort = (SampleStatus.TASK_ERROR, "the controller is shutting down")
                session.call.cancel()
        for task in list(self._bg):
            task.cancel()
        if self._bg:
            await asyncio.wait(list(self._bg), timeout=5)
        await self._unserve()
        if self._http is not None:
            await self._http.close()
            self._http = None

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    # -- app -------------------------------------------------------------------------------------

    def _routes(self) -> list[tuple[str, str, Any, Role]]:
        trainer, worker = Role.TRAINER, Role.WORKER
        routes = [
            ("POST", "/api/start_sample", "start_sample", self._handle_start, trainer),
            ("POST", "/api/interact", "interact", self._handle_interact, trainer),
            ("POST", "/api/cancel", "cancel", self._handle_cancel, trainer),
            ("POST", "/api/receive_heartbeat", "receive_heartbeat", self._handle_heartbeat, worker),
            ("POST", "/api/cancel_notice", "cancel_notice", self._handle_cancel_notice, worker),
            ("GET", "/api/list_workers", "list_workers", self._handle_list_workers, trainer),
            ("GET", "/api/list_sessions", "list_sessions", self._handle_list_sessions, trainer),
            ("GET", "/api/get_indices", "get_indices", self._handle_get_indices, trainer),
            ("GET", "/api/health", "health", self._handle_health, Role.ANY),
            ("GET", "/metrics", "metrics", self._handle_metrics, trainer),
            ("GET", "/openapi.json", "openapi", self._handle_openapi, Role.OPEN),
        ]
        self._endpoints = {(method, path): endpoint for method, path, endpoint, _, _ in routes}
        return [(method, path, self._instrument(endpoint, handler), role)
                for method, path, endpoint, handler, role in routes]

    def _count_rejected(self, method: str, path: str, status: int) -> None:
        """Count a request refused before its handler ran (401 / 403 credentials; 404 / 405 as "unknown"; a
        body that did not arrive on the fast path under its endpoint)."""
        self.metrics.requests.labels(self._endpoints.get((method, path), "unknown"), str(status)).inc()

    def _instrument(self, endpoint: str, handler: Any) -> Any:
        seconds = self.metrics.histogram(self.metrics.request_seconds, endpoint)
        ok = self.metrics.counter(self.metrics.requests, endpoint, "200")
        requests = self.metrics.requests

        async def wrapped(request: web.Request) -> Reply:
            t0 = _perf()
            try:
                response = await handler(request)
            except HttpError as e:
                requests.labels(endpoint, str(e.status)).inc()
                raise
            seconds.observe(_perf() - t0)
            if response.status == 200:
                ok.inc()
            else:
                requests.labels(endpoint, str(response.status)).inc()
            return response

        wrapped.__name__ = f"handle_{endpoint}"
        return wrapped

    # -- calls to workers ------------------------------------------------------------------------

    async def call_worker(
        self, worker: Worker, api: str, body: dict[str, Any] | bytes | None, timeout_s: float, method: str = "POST",
        session: Session | None = None,
    ) -> WorkerReply:
        """Call ``worker.address + api`` with ``body`` (an object, or its JSON already encoded);
        returns the parsed JSON reply and its timings.

        The worker's own time is its ``x-worker-time`` header when present, else the round trip.
        Raises :class:`WorkerCallError`. With a ``session``, the call in flight is ``session.call``
        (a future): cancelling it after setting ``session.abort`` makes this raise :class:`_Aborted`.
        """
        if self._http is None:
            raise WorkerCallError("connect", "the controller is not started")
        data = body if isinstance(body, bytes) or body is None else dumps_json(body)
        t0 = _perf()
        try:
            future = self._http.start(method, worker.address + api, data, worker.call_headers, timeout_s)
        except ConnectError as e:
            self.metrics.counter(self.metrics.worker_errors, api, "connect").inc()
            raise WorkerCallError("connect", f"cannot reach {worker.describe()}: {e}") from None
        except ValueError as e:  # an address that passed the heartbeat's check but no request can carry
            self.metrics.counter(self.metrics.worker_errors, api, "connect").inc()
            raise WorkerCallError("connect", f"cannot call {worker.describe()}: {e}") from None
        if session is not None:
            session.call = future
        try:
            resp = await future
        except asyncio.CancelledError:
            if session is None or session.abort is None or not future.cancelled():
                raise
            me = asyncio.current_task()
            if me is not None and me.cancelling():  # this handler itself is being cancelled
                raise
            raise _Aborted(*session.abort) from None
        except ConnectError as e:
            self.metrics.counter(self.metrics.worker_errors, api, "connect").inc()
            raise WorkerCallError("connect", f"cannot reach {worker.describe()}: {e}") from None
        except TimeoutError:
            self.metrics.counter(self.metrics.worker_errors, api, "timeout").inc()
            raise WorkerCallError(
                "timeout", f"{worker.describe()} did not answer {api} within {timeout_s:g} s"
            ) from None
        except OSError as e:
            self.metrics.counter(self.metrics.worker_errors, api, "disconnect").inc()
            raise WorkerCallError("disconnect", f"connection to {worker.describe()} lost during {api}: {e}") from None
        finally:
            if session is not None:
                session.call = None
            del future  # a failed call's traceback holds this frame: no frame -> future -> exception cycle
        rtt = _perf() - t0
        raw, status, worker_time = resp.body, resp.status, resp.headers.get("x-worker-time")
        self._call_seconds(api).observe(rtt)
        if status != 200:
            self.metrics.counter(self.metrics.worker_errors, api, "http").inc()
            raise WorkerCallError(
                "http", f"{worker.describe()} answered {api} with HTTP {status}: {_detail(raw)}", status
            )
        try:
            payload = loads_json(raw, strict=False) if raw else None
        except ValueError as e:
            self.metrics.counter(self.metrics.worker_errors, api, "bad_reply").inc()
            raise WorkerCallError(
                "bad_reply", f"{worker.describe()} answered {api} with bad JSON ({e}): {raw[:200]!r}"
            ) from None
        own = rtt
        if worker_time is not None:
            try:
                own = min(max(float(worker_time), 0.0), rtt)
            except ValueError:
                pass
        return WorkerReply(payload, own, rtt)

    def _call_seconds(self, api: str) -> Any:
        child = self._call_hist.get(api)
        if child is None:
            child = self._call_hist[api] = self.metrics.histogram(self.metrics.worker_call_seconds, api)
        return child

    async def _cancel_on_worker(self, worker: Worker, session_id: int) -> None:
        worker.cancelling.add(session_id)
        try:
            await self.call_worker(worker, "/cancel", {"session_id": session_id}, self.config.cancel_timeout_s)
        except WorkerCallError as e:
            if (e.kind == "http" and e.status in (400, 404)) or worker.state is not WorkerState.ALIVE:
                logger.debug("cancel of session %d: %s", session_id, e.message)
            else:
                logger.warning("cancel of session %d on %s failed: %s", session_id, worker.describe(), e.message)
        finally:
            worker.cancelling.discard(session_id)

    async def sync_worker(self, worker: Worker) -> int:
        """Ask ``worker`` for its sessions and cancel those the controller does not hold; returns how many."""
        try:
            payload = (
                await self.call_worker(worker, "/get_sessions", None, self.config.cancel_timeout_s, method="GET")
            ).payload
        except WorkerCallError as e:
            logger.warning("sync of %s failed: %s", worker.describe(), e.message)
            return 0
        if not isinstance(payload, dict):
            return 0
        orphans = []
        for key in payload:
            try:
                sid = int(key)
            except (TypeError, ValueError):
                continue
            if sid not in worker.sessions and sid not in worker.cancelling:
                orphans.append(sid)
        if orphans:
            logger.info(
                "%s holds %d session(s) the controller does not know; cancelling them", worker.describe(), len(orphans)
            )
            await asyncio.gather(*(self._cancel_on_worker(worker, sid) for sid in orphans))
        return len(orphans)

    # -- sessions --------------------------------------------------------------------------------

    def _end(
        self,
        session: Session,
        status: SampleStatus | str,
        reason: str,
        final: dict[str, Any] | None = None,
        cancel_on_worker: bool = False,
        log: bool = True,
    ) -> bool:
        """Close a session once (frees its worker slot); optionally cancel it on the worker in the background."""
        status = status.value if isinstance(status, SampleStatus) else status
        if not self.sessions.remove(session, status, reason, final):
            return False
        self.metrics.counter(self.metrics.sessions_ended, session.task, status).inc()
        if log and status == SampleStatus.TASK_ERROR.value:
            logger.warning(
                "session %d (%s #%s) ended with task error: %s", session.id, session.task, session.index, reason
            )
        if cancel_on_worker and session.worker.state is not WorkerState.DEAD:
            self._spawn(self._cancel_on_worker(session.worker, session.id))
        return True

    def _fail(
        self, session: Session, status: SampleStatus, reason: str, cancel_on_worker: bool = False
    ) -> Reply:
        """End ``session`` and answer the trainer with the finished reply carrying ``reason``."""
        self._end(session, status, reason, cancel_on_worker=cancel_on_worker)
        self.sessions.take_final(session.id)
        return json_reply(final_reply(status, reason), headers={SESSION_HEADER: str(session.id)})

    @staticmethod
    def _timing_headers(t0: float, answer: WorkerReply, histogram: Any) -> dict[str, str]:
        """Record the overhead of a request served by one worker call; the headers that report it."""
        total = _perf() - t0
        overhead = total - answer.worker_s
        histogram.observe(overhead)
        return {  # %-formatting: cheaper than an f-string's format spec
            "x-controller-overhead-ms": "%.3f" % (overhead * 1000),
            "x-worker-time-ms": "%.3f" % (answer.worker_s * 1000),
            "x-worker-rtt-ms": "%.3f" % (answer.rtt_s * 1000),
        }

    def _open_per_task(self) -> dict[str, int]:
        out: dict[str, int] = {name: 0 for name in self.registry.tasks}
        for s in self.sessions.open.values():
            out[s.task] = out.get(s.task, 0) + 1
        return out

    def _check_forward_size(self, size: int, what: str) -> None:
        """HttpError 413 when a body of ``size`` bytes is over what may be sent to a worker."""
        limit = self.config.max_forward_bytes
        if size > limit:
            raise HttpError(
                413, f"{what}: the body for the worker would be {size} bytes, over the limit of {limit} bytes "
                     "(the workers' request limit, controller max_forward_bytes); nothing was sent and a session "
                     "stays open: send a shorter message",
            )

    def _session_from_header(self, request: web.Request) -> int:
        value = request.headers.get(SESSION_HEADER)
        if value is None:
            value = request.headers.get("session-id")
        return session_id_from(value, f"'{SESSION_HEADER}' request header")

    # -- trainer-facing handlers -----------------------------------------------------------------

    async def _handle_start(self, request: web.Request) -> Reply:
        t0 = _perf()
        body = await read_json_object(request)
        name = body.get("name")
        index = body.get("index")
        custom_task = body.get("custom_task")
        if not isinstance(name, str) or not name:
            raise HttpError(400, f"'name' must be the task name (a non-empty string), got {name!r:.100}")
        if "index" not in body:
            raise HttpError(400, "missing 'index': the sample index of the task (see GET /api/get_indices?name=...)")
        if isinstance(index, bool) or not isinstance(index, (int, str)):
            raise HttpError(400, f"'index' must be an integer or a string sample index, got {index!r:.100}")
        if custom_task is not None and not isinstance(custom_task, dict):
            raise HttpError(400, f"'custom_task' must be an object or absent, got {type(custom_task).__name__}")
        if custom_task is not None:  # the only part of a start that can be large
            self._check_forward_size(len(dumps_json(custom_task)), "start_sample")
        entry = self.registry.tasks.get(name)
        if entry is None:
            known = ", ".join(sorted(self.registry.tasks)) or "none yet (no worker has sent a heartbeat)"
            age = time.monotonic() - self._born
            window = self.config.registration_window_s
            if age < (self.config.heartbeat_timeout_s if window is None else window):
                # a (re)started controller: the task's workers register with their next heartbeat, so
                # "try again" (a 5xx: nothing happened) rather than "no such task" until one is overdue
                raise HttpError(503, f"no worker of task {name!r:.100} has registered yet: the controller started "
                                     f"{age:.1f} s ago and workers register by heartbeat (tasks registered: {known})",
                                headers={"Retry-After": "1"})
            raise HttpError(404, f"unknown task {name!r:.100}; tasks with registered workers: {known}")
        if not entry.has_index(index):
            n = len(entry.indices)
            sample = ", ".join(repr(i) for i in entry.indices[:3]) + (", ..." if n > 3 else "")
            raise HttpError(400, f"task {name!r:.100} has no sample index {index!r:.100}; it has {n} indices "
                                 f"({sample})")
        worker_body: dict[str, Any] = {"index": index}
        if custom_task is not None:
            worker_body["custom_task"] = custom_task
        tried: set[int] = set()
        last_error = ""
        while True:
            try:
                worker = self.registry.pick(name, tried)
            except NoWorkerError as e:
                msg = str(e) + (f"; last failure: {last_error}" if last_error else "")
                raise HttpError(503, msg, headers={"Retry-After": "1"}) from None
            session = Session(self.sessions.new_id(), name, index, worker, busy=True)
            self.sessions.add(session)
            worker_body["session_id"] = session.id
            try:
                answer = await self.call_worker(session.worker, "/start_sample", worker_body,
                                                self.config.start_timeout_s, session=session)
            except _Aborted as a:
                if a.status is SampleStatus.CANCELLED:
                    return self._fail(session, a.status, a.reason)
                self._end(session, a.status, a.reason)  # worker declared dead while starting: try another one
                last_error = a.reason
                tried.add(worker.id)
                continue
            except WorkerCallError as e:
                last_error = e.message
                if e.kind == "connect":
                    self.registry.mark_suspect(worker, e.message)
                    self._end(session, "not started", e.message)
                elif e.kind == "http" and e.status == 406:  # the worker is full: our count is off
                    self._end(session, "not started", e.message)
                    self._spawn(self.sync_worker(worker))
                elif e.kind == "http" and e.status == 413:  # nothing started: the worker's limit is below ours
                    self._end(session, "not started", e.message)
                    raise HttpError(413, f"start_sample: {e.message}") from None
                elif e.kind == "disconnect":
                    self.registry.mark_suspect(worker, e.message)
                    self._end(session, "not started", e.message, cancel_on_worker=True)
                else:  # timeout, worker error, bad reply: this episode fails
                    return self._fail(session, SampleStatus.TASK_ERROR, e.message, cancel_on_worker=True)
                tried.add(worker.id)
                continue
            finally:
                session.busy = False
            break
        try:
            reply = TaskReply.from_json(answer.payload)
        except ValueError as e:
            return self._fail(
                session, SampleStatus.TASK_ERROR, f"{worker.describe()} start_sample: {e}", cancel_on_worker=True
            )
        session.last_active = _mono()
        self.metrics.counter(self.metrics.sessions_started, name).inc()
        if reply.finish:
            self._end(session, reply.status, "finished at start")
        elif session.abort is not None:
            return self._fail(session, *session.abort)
        headers = self._timing_headers(t0, answer, self.metrics.overhead_start)
        headers[SESSION_HEADER] = str(session.id)
        return json_reply(reply.to_json(), headers=headers)

    async def _handle_interact(self, request: web.Request) -> Reply:
        t0 = _perf()
        sid = self._session_from_header(request)
        body, raw = await read_json_object_raw(request)
        session = self.sessions.open.get(sid)
        if session is None:
            final = self.sessions.take_final(sid)
            if final is not None:  # ended by the controller while the trainer was away
                return json_reply(final, headers={SESSION_HEADER: str(sid)})
            raise HttpError(404, self.sessions.why_unknown(sid))
        if session.busy:
            raise HttpError(
                409, f"session {sid} is busy: its previous interact is not answered yet; send one interact at a time"
            )
        if session.abort is not None:  # its worker was declared dead: being ended, it answers that now
            return self._fail(session, *session.abort)
        if "messages" not in body:
            raise HttpError(400, "missing 'messages': a list holding the one assistant message of this turn")
        try:
            message = validate_assistant_messages(body["messages"])
        except MalformedMessageError as e:
            raise HttpError(400, str(e)) from None
        data = _pass_through(raw, body, message, sid)
        if data is None:
            data = dumps_json({"session_id": sid, "messages": [message]})
        self._check_forward_size(len(data), f"interact on session {sid}")
        worker = session.worker
        session.busy = True
        session.last_active = _mono()
        try:
            answer = await self.call_worker(worker, "/interact", data, self.config.interact_timeout_s, session=session)
        except _Aborted as a:
            return self._fail(session, a.status, a.reason)
        except WorkerCallError as e:
            if e.kind == "http" and e.status == 413:  # the worker refused it unread: the session goes on
                raise HttpError(413, f"interact on session {sid}: {e.message}; nothing was sent to the task and "
                                     "the session stays open: send a shorter message") from None
            if e.kind in ("connect", "disconnect"):
                self.registry.mark_suspect(worker, e.message)
            return self._fail(session, SampleStatus.TASK_ERROR, e.message, cancel_on_worker=e.kind != "connect")
        finally:
            session.busy = False
        try:
            reply = TaskReply.from_json(answer.payload)
        except ValueError as e:
            return self._fail(
                session, SampleStatus.TASK_ERROR, f"{worker.describe()} interact: {e}", cancel_on_worker=True
            )
        session.turns += 1
        session.last_active = _mono()
        if reply.finish:
            self._end(session, reply.status, "finished by the task")
        elif session.abort is not None:
            return self._fail(session, *session.abort)
        return json_reply(reply.to_json(), headers=self._timing_headers(t0, answer, self.metrics.overhead_interact))

    async def _handle_cancel(self, request: web.Request) -> Reply:
        sid = self._session_from_header(request)
        session = self.sessions.open.get(sid)
        if session is None:
            if sid in self.sessions.ended:
                why = self.sessions.why_unknown(sid)
                self.sessions.take_final(sid)
                return json_reply({"session_id": sid, "status": "already ended", "detail": why})
            raise HttpError(404, self.sessions.why_unknown(sid))
        reason = "cancelled by the trainer"
        session.abort = (SampleStatus.CANCELLED, reason)
        if session.call is not None and not session.call.done():
            session.call.cancel()
        self._end(session, SampleStatus.CANCELLED, reason, cancel_on_worker=True)
        return json_reply({"session_id": sid, "status": SampleStatus.CANCELLED.value})

    async def _handle_list_workers(self, request: web.Request) -> Reply:
        return json_reply(self.registry.dump())

    async def _handle_list_sessions(self, request: web.Request) -> Reply:
        return json_reply(self.sessions.dump())

    async def _handle_get_indices(self, request: web.Request) -> Reply:
        name = request.query.get("name")
        if not name:
            raise HttpError(400, "missing query parameter 'name': GET /api/get_indices?name=<task>")
        entry = self.registry.tasks.get(name)
        if entry is None:
            known = ", ".join(sorted(self.registry.tasks)) or "none"
            raise HttpError(404, f"unknown task {name!r:.100}; tasks with registered workers: {known}")
        return json_reply(entry.indices)

    async def _handle_health(self, request: web.Request) -> Reply:
        counts = self.registry.counts()
        alive = sum(n for (_, state), n in counts.items() if state == WorkerState.ALIVE.value)
        return json_reply(
            {
                "status": "ok",
                "workers_alive": alive,
                "workers": len(self.registry.workers),
                "sessions": len(self.sessions.open),
            }
        )

    async def _handle_openapi(self, request: web.Request) -> Reply:
        from env_controller.openapi import controller_spec

        return json_reply(controller_spec())

    async def _handle_metrics(self, request: web.Request) -> Reply:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Reply(self.metrics.render(), content_type=CONTENT_TYPE_LATEST)

    # -- worker-facing handler -------------------------------------------------------------------

    async def _handle_heartbeat(self, request: web.Request) -> Reply:
        body = await read_json_object(request)
        name, address = body.get("name"), body.get("address")
        concurrency, indices = body.get("concurrency"), body.get("indices")
        if not isinstance(name, str) or not _TASK_NAME.fullmatch(name):
            raise HttpError(400, f"heartbeat: 'name' must be the task name (1 to 200 characters, no control "
                                 f"characters), got {name!r:.100}")
        identity = identity_of(request)
        if not identity.may_serve(name):
            allowed = ", ".join(sorted(identity.tasks))
            raise HttpError(403, f"heartbeat: this worker credential may serve the task(s) {allowed}, not "
                                 f"{name!r:.100}; use the worker token the controller lists for that task "
                                 "(--worker-token NAME=TOKEN)")
        if not isinstance(address, str) or not address.startswith("http://"):
            raise HttpError(
                400,
                f"heartbeat: 'address' must be the worker's HTTP API URL, e.g. http://10.0.0.5:5021/api, got "
                f"{address!r:.100} (https and the gRPC transport are not supported)",
            )
        try:
            parse_url(address)
        except ValueError as e:
            raise HttpError(400, f"heartbeat: 'address': {e}") from None
        address = split_url_credentials(address)[0]  # never stored or logged with credentials in it
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise HttpError(400, f"heartbeat: 'concurrency' must be a positive integer, got {concurrency!r:.100}")
        if not isinstance(indices, list):
            raise HttpError(400, f"heartbeat: 'indices' must be a list of sample indices, got {type(indices).__name__}")
        for i in indices:
            if isinstance(i, bool) or not isinstance(i, (int, str)):
                raise HttpError(400, f"heartbeat: every index must be an integer or a string, got {i!r:.100}")
        try:
            worker, event = self.registry.heartbeat(name, address, concurrency, indices)
        except RegistryError as e:
            raise HttpError(409, f"heartbeat: {e}") from None
        worker.set_token(identity.token)  # the controller's calls to it carry the token it proved
        self.metrics.heartbeats.inc()
        if event != "beat":  # new, revived or recovered: drop what it holds that we do not
            self._spawn(self.sync_worker(worker))
        return json_reply({"worker_id": worker.id, "state": worker.state.value})

    async def _handle_cancel_notice(self, request: web.Request) -> Reply:
        """A worker says it cancelled a session on its own (AgentRL's ``/cancel_with_notice``)."""
        header = request.headers.get(SESSION_HEADER)
        body = await read_json_object(request) if request.body_exists else {}
        if header is None and "session_id" not in body:
            session_id_from(None, "session id ('session_id' header or body field)")
        sid = session_id_from(header, f"'{SESSION_HEADER}' header") if header is not None else None
        if "session_id" in body:  # both are checked when both are sent: a bad one is never ignored
            from_body = session_id_from(body["session_id"], "body field 'session_id'")
            if sid is not None and from_body != sid:
                raise HttpError(400, f"the '{SESSION_HEADER}' header ({sid}) and the body ({from_body}) name "
                                     "different sessions; send one of them")
            sid = from_body
        assert sid is not None
        session = self.sessions.open.get(sid)
        if session is not None and not identity_of(request).may_serve(session.task):
            raise HttpError(403, f"cancel_notice: session {sid} belongs to task {session.task!r}, which this worker "
                                 "credential may not serve")
        if session is not None:
            reason = f"{session.worker.describe()} cancelled the session"
            session.abort = (SampleStatus.CANCELLED, reason)
            if session.call is not None and not session.call.done():
                session.call.cancel()
            final = None if session.busy else final_reply(SampleStatus.CANCELLED, reason)
            self._end(session, SampleStatus.CANCELLED, reason, final=final)
        return json_reply({"session_id": sid})

    # -- monitor ---------------------------------------------------------------------------------

    async def _monitor(self) -> None:
        config = self.config
        tick = max(0.05, min(0.5, config.suspect_after_s / 4, config.heartbeat_timeout_s / 10))
        gc_every = max(tick, min(5.0, config.session_idle_timeout_s / 4))
        last_gc = last_sync = _mono()
        while True:
            before = _mono()
            await asyncio.sleep(tick)
            self.registry.add_stall(_mono() - before - tick - 0.05)  # beyond 50 ms of ordinary jitter
            try:
                for worker in self.registry.sweep():
                    self._worker_died(worker)
                self.metrics.flush()
                now = _mono()
                if now - last_gc >= gc_every:
                    last_gc = now
                    self._gc_idle(now)
                    if self._http is not None:
                        self._http.sweep()
                if now - last_sync >= config.sync_interval_s:
                    last_sync = now
                    for worker in list(self.registry.workers.values()):
                        if worker.state is WorkerState.ALIVE:
                            self._spawn(self.sync_worker(worker))
            except Exception:  # noqa: BLE001 - the monitor must keep running
                logger.exception("controller monitor step failed")

    def _worker_died(self, worker: Worker) -> None:
        """End every session of a dead worker with ``task error``: abort calls in flight now, mark every
        session aborted (an interact on one answers the error at once), and end them in slices of
        :data:`_END_SLICE` (idle ones with a parked final reply), the event loop serving between slices."""
        self.metrics.worker_deaths.labels(worker.name).inc()
        reason = f"{worker.describe()} declared dead: {worker.reason}"
        doomed: list[Session] = []
        for sid in list(worker.sessions):
            session = self.sessions.open.get(sid)
            if session is None:
                worker.sessions.discard(sid)
                continue
            session.abort = (SampleStatus.TASK_ERROR, reason)
            if session.busy and session.call is not None and not session.call.done():
                session.call.cancel()
            doomed.append(session)
        if doomed:
            self._spawn(self._end_doomed(worker, doomed, reason))

    async def _end_doomed(self, worker: Worker, doomed: list[Session], reason: str) -> None:
        for i, session in enumerate(doomed):
            if i and i % _END_SLICE == 0:
                await asyncio.sleep(0)
            final = None if session.busy else final_reply(SampleStatus.TASK_ERROR, reason)
            self._end(session, SampleStatus.TASK_ERROR, reason, final=final, log=False)
        logger.error("%d session(s) of %s ended with task error", len(doomed), worker.describe())

    def _gc_idle(self, now: float) -> None:
        limit = self.config.session_idle_timeout_s
        for session in list(self.sessions.open.values()):
            idle = now - session.last_active
            if not session.busy and idle > limit:
                reason = (
                    f"closed by the controller after {idle:.0f} s without interact (session idle timeout {limit:g} s)"
                )
                self._end(
                    session, SampleStatus.TASK_ERROR, reason,
                    final=final_reply(SampleStatus.TASK_ERROR, reason), cancel_on_worker=True,
                )


async def serve_controller(config: ControllerConfig) -> None:
    """Run a controller until SIGINT/SIGTERM (the ``agentrl controller`` command)."""
    from env_controller.http.service import settle_gc, wait_for_signal

    controller = Controller(config)
    await controller.start()
    settle_gc()  # no full collector passes over the sessions while they are served
    try:
        await wait_for_signal()
    finally:
        logger.info("controller stopping")
        await controller.stop()
