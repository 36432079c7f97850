"""The gateway's HTTP server (aiohttp): a per-session base URL that speaks three APIs, and the session API around it.

Routes (``<id>``: a session id)::

    POST   /sessions                              {task?, index?, group_id?, metadata?}
                                                  -> {session_id, base_url, api_key, ...}
    GET    /sessions/<id>/v1/models               the one policy served
    POST   /sessions/<id>/v1/chat/completions     OpenAI Chat Completions (stream true or false)
    POST   /sessions/<id>/v1/responses            OpenAI Responses (stream, previous_response_id in the session)
    POST   /sessions/<id>/v1/messages             Anthropic Messages (stream; anthropic-version header)
    POST   /sessions/<id>/v1/env                  {messages?: [assistant message]} -> the task's reply
    POST   /sessions/<id>/reward                  {reward, metrics?}: ends the episode
    GET    /sessions/<id>/trajectory              token_ids, loss_mask, logprobs, versions, turn_spans, ...
    DELETE /sessions/<id>                         cancels and forgets the session
    GET    /metrics                               Prometheus text: queue depth, 429s, completions, sessions
    GET    /health                                open (no credential)

All three APIs are thin wire formats over one internal turn model (:mod:`~rollout_sglang.gateway.turn`): a turn
is the same trajectory segment whichever API asked for it. ``/v1/env`` sits under the base URL so that an agent
written against the ``openai`` package reaches it with the client it has (``await client.post("/env",
body=..., cast_to=object)``). Errors come in each API's own shape: OpenAI's ``{"error": {"message", "type",
"param", "code"}}``, Anthropic's ``{"type": "error", "error": {"type", "message"}}`` under ``/v1/messages``.
A stream is emulated: its first event goes out when the request is accepted, the rest once the engine
returned the whole turn.

Credentials: the routes under a session's base URL (``/sessions/<id>/v1/...``) take that session's own API key
(``api_key`` of ``POST /sessions``), as ``Authorization: Bearer`` (the openai SDK) or ``x-api-key`` (the
anthropic SDK): none is a 401, another session's a 403, so agents on one gateway cannot write into each other's
trajectories. The admin routes (open a session, reward, trajectory, delete, metrics) follow the controller's
rules: loopback by default; bound elsewhere they need the gateway's bearer token (``--token`` or
``$AGENTRL_GATEWAY_TOKEN``).

Backpressure: a turn that should wait (the rollout ahead of training, no engine slot that can serve, too many
turns queued: :meth:`Gateway._check_backpressure <rollout_sglang.gateway.gateway.Gateway._check_backpressure>`)
is a 429 with ``Retry-After``, which the SDKs' own retries honour.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import secrets
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from aiohttp import web

from env_controller.http.auth import Credentials, Role, is_loopback
from env_controller.http.options import HttpOptions
from env_controller.http.service import (
    ClientGone,
    HttpError,
    HttpService,
    json_response,
    loads_json,
    read_body,
    read_json_object,
)
from rollout_sglang.gateway import anthropic_format as anthropic
from rollout_sglang.gateway import responses_format as responses
from rollout_sglang.gateway.gateway import Completion, EnvStartError, Gateway
from rollout_sglang.gateway.openai_format import (
    SSE_DONE,
    ChunkHead,
    chunk_body,
    completion_body,
    logprobs_body,
    models_body,
    parse_chat_request,
    sse,
    stream_chunks,
    usage_body,
)
from rollout_sglang.gateway.options import TOKEN_ENV, GatewayOptions
from rollout_sglang.gateway.request_fields import is_int
from rollout_sglang.gateway.session import GatewaySession
from rollout_sglang.gateway.turn import ApiError, TurnRequest, bad, sse_event

logger = logging.getLogger(__name__)


def _is_anthropic(request: web.Request) -> bool:
    return request.path.endswith("/v1/messages")


@web.middleware
async def _api_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Errors of the gateway's own handlers in the shape of the API asked (Anthropic's under ``/v1/messages``,
    OpenAI's elsewhere); the outer middleware keeps the admin credential and 404s."""
    try:
        return await handler(request)
    except ClientGone:
        raise
    except HttpError as e:  # ours, or a body over the size limit, not JSON, ...
        err = e if isinstance(e, ApiError) else ApiError(e.status, e.message, headers=e.headers)
        body = err.anthropic_body() if _is_anthropic(request) else err.body()
        return json_response(body, status=err.status, headers=err.headers)


def _presented_key(request: web.Request) -> str | None:
    """The API key a request presents: ``x-api-key`` (anthropic) or ``Authorization: Bearer`` (openai)."""
    key = request.headers.get("x-api-key")
    if key:
        return key.strip()
    scheme, _, value = (request.headers.get("Authorization") or "").partition(" ")
    return value.strip() or None if scheme.lower() == "bearer" else None


async def _optional_object(request: web.Request) -> dict[str, Any]:
    """The body as a JSON object; an empty body is ``{}``."""
    raw = await read_body(request)
    if not raw.strip():
        return {}
    try:
        body = loads_json(raw)
    except ValueError as e:
        raise bad("body", f"is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad("body", f"must be a JSON object, got {type(body).__name__}")
    return body


def _only(body: dict[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise bad(unknown[0], f"unknown field(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}")


class GatewayServer(HttpService):
    """Serves a :class:`~rollout_sglang.gateway.gateway.Gateway` over HTTP (routes in the module doc).

    options: where to bind (``host``, ``port``: 0 picks a free one) and the connections held at once
    (``max_connections``: one more is answered 503 and closed, and logged once); None: the gateway's own.
    token: the bearer token the admin routes require (None: none, loopback only; a session's base URL takes the
    session's own key); record_timings: keep ``(handler seconds, engine seconds, api)`` of every completion in
    :attr:`timings` (api: "chat", "responses" or "messages"; benchmarks; the handler's time runs from its body
    read to its response built, or to a stream's last chunk written); reap_interval_s: how often idle sessions
    are looked for.
    """

    def __init__(self, gateway: Gateway, options: GatewayOptions | None = None, *, token: str | None = None,
                 record_timings: bool = False, reap_interval_s: float = 30.0) -> None:
        self.gateway = gateway
        options = options if options is not None else gateway.options
        self.host, self.port = options.host, int(options.port)
        self.reap_interval_s = float(reap_interval_s)
        self.timings: deque[tuple[float, float, str]] | None = deque(maxlen=1_000_000) if record_timings else None
        self._reaper: asyncio.Task | None = None
        routes = [
            ("GET", "/health", self._serve_health, Role.OPEN),
            ("POST", "/sessions", self._serve_open_session, Role.ANY),
            ("GET", "/sessions/{sid}/v1/models", self._serve_models, Role.OPEN),  # the session's own key: see _auth
            ("POST", "/sessions/{sid}/v1/chat/completions", self._serve_chat_completions, Role.OPEN),
            ("POST", "/sessions/{sid}/v1/responses", self._serve_responses, Role.OPEN),
            ("POST", "/sessions/{sid}/v1/messages", self._serve_messages, Role.OPEN),
            ("POST", "/sessions/{sid}/v1/env", self._serve_env_step, Role.OPEN),
            ("GET", "/metrics", self._serve_metrics, Role.ANY),
            ("POST", "/sessions/{sid}/reward", self._serve_reward, Role.ANY),
            ("GET", "/sessions/{sid}/trajectory", self._serve_trajectory, Role.ANY),
            ("DELETE", "/sessions/{sid}", self._serve_delete_session, Role.ANY),
        ]
        super().__init__(Credentials.single(token), routes, HttpOptions(max_connections=options.max_connections),
                         auth_hint=f"the gateway's --token / ${TOKEN_ENV}")
        self.app.middlewares.append(_api_errors)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> int:
        """Bind (loopback, or anywhere with a token) and serve; returns the bound port."""
        if not is_loopback(self.host) and not self.credentials.enabled:
            raise ValueError(f"the gateway bound to {self.host!r} (not loopback) needs a bearer token: pass --token "
                             f"or set ${TOKEN_ENV}; or bind 127.0.0.1")
        self.port = await self._serve(self.host, self.port, "the gateway")
        self._reaper = asyncio.create_task(self._reap_loop(), name="gateway-reaper")
        logger.info("gateway listening on %s (%s)", self.url,
                    "bearer token required" if self.credentials.enabled else "no token: loopback only")
        return self.port

    async def stop(self) -> None:
        """Stop serving (sessions stay with the gateway: :meth:`Gateway.aclose` ends them)."""
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.gather(self._reaper, return_exceptions=True)
            self._reaper = None
        await self._unserve()

    async def _reap_loop(self) -> None:
        while True:
            await asyncio.sleep(self.reap_interval_s)
            try:
                await self.gateway.reap_idle()
            except Exception:  # noqa: BLE001 - the next round tries again
                logger.exception("reaping idle gateway sessions failed")

    @property
    def url(self) -> str:
        """``http://host:port`` as a client on this machine reaches the server."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "", "::") else self.host
        return f"http://{'[' + host + ']' if ':' in host else host}:{self.port}"

    def base_url(self, session_id: str, origin: str | None = None) -> str:
        """The OpenAI base URL of a session (``origin``: scheme and host the client used; default :attr:`url`)."""
        return f"{origin or self.url}/sessions/{session_id}/v1"

    def anthropic_base_url(self, session_id: str, origin: str | None = None) -> str:
        """The Anthropic base URL of a session (the SDK appends ``/v1/messages``)."""
        return f"{origin or self.url}/sessions/{session_id}"

    # ------------------------------------------------------------------ handlers
    async def _serve_health(self, request: web.Request) -> web.Response:
        st = self.gateway.stats
        return json_response({"ok": True, "sessions": len(self.gateway.sessions), "completions": st.completions,
                              "history_rewrites": st.history_rewrites, "queue_depth": st.queue_depth,
                              "throttled": dict(st.throttled)})

    async def _serve_metrics(self, request: web.Request) -> web.Response:
        st = self.gateway.stats
        lines = ["# TYPE agentrl_gateway_queue_depth gauge", f"agentrl_gateway_queue_depth {st.queue_depth}",
                 "# TYPE agentrl_gateway_queue_depth_max gauge",
                 f"agentrl_gateway_queue_depth_max {st.queue_depth_max}",
                 "# TYPE agentrl_gateway_sessions gauge", f"agentrl_gateway_sessions {len(self.gateway.sessions)}",
                 "# TYPE agentrl_gateway_completions_total counter",
                 f"agentrl_gateway_completions_total {st.completions}",
                 "# TYPE agentrl_gateway_throttled_total counter"]
        for reason in ("rollout_ahead", "engines_busy", "queue_full"):
            lines.append(f'agentrl_gateway_throttled_total{{reason="{reason}"}} {st.throttled.get(reason, 0)}')
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain", charset="utf-8")

    def _auth(self, request: web.Request) -> GatewaySession:
        """The session of the request's base URL, when the request presents its API key (401 / 403 otherwise)."""
        return self.gateway.authorize(request.match_info["sid"], _presented_key(request))

    async def _serve_open_session(self, request: web.Request) -> web.Response:
        body = await _optional_object(request)
        _only(body, {"task", "index", "group_id", "metadata"})
        task, index = body.get("task"), body.get("index")
        if task is not None and (not isinstance(task, str) or not task):
            raise bad("task", f"must be a task name, got {task!r:.60}")
        if task is not None and not is_int(index):
            raise bad("index", f"must be the task's integer sample index (required with task), got {index!r:.60}")
        if task is None and index is not None:
            raise bad("index", "is only meaningful with task")
        group_id = body.get("group_id", 0)
        if not is_int(group_id):
            raise bad("group_id", f"must be an integer, got {group_id!r:.60}")
        metadata = body.get("metadata")
        if metadata is not None and not isinstance(metadata, dict):
            raise bad("metadata", f"must be an object, got {type(metadata).__name__}")
        try:
            s = await self.gateway.open_session(task, index or 0, group_id, metadata)
        except EnvStartError as e:
            raise ApiError(502, f"the environment failed to start the session: {e}", param="task",
                           code="env_error") from None
        return json_response({"session_id": s.id, "base_url": self.base_url(s.id, str(request.url.origin())),
                              "anthropic_base_url": self.anthropic_base_url(s.id, str(request.url.origin())),
                              "api_key": s.api_key, "status": s.status, "messages": s.first_messages,
                              "tools": s.tools}, status=201)

    async def _serve_models(self, request: web.Request) -> web.Response:
        self._auth(request)
        return json_response(models_body(self.gateway.model_name, self.gateway.created))

    async def _serve_chat_completions(self, request: web.Request) -> web.StreamResponse:
        s = self._auth(request)
        body = await read_json_object(request)
        t0 = time.perf_counter()  # timings start once the body is in: a slow client's upload is not the gateway's
        req = parse_chat_request(body)
        cid, created = f"chatcmpl-{secrets.token_hex(12)}", int(time.time())
        if not req.stream:
            c = await self.gateway.complete(s.id, req)
            resp = json_response(completion_body(cid, created, req.model, c.message, c.finish_reason, _usage(c),
                                                 f"v{c.version}", self._logprobs(req.logprobs, c)))
            self._timed(t0, c, "chat")
            return resp

        def rest(c: Completion) -> list[bytes]:
            head = ChunkHead(cid, created, req.model, f"v{c.version}")
            chunks = stream_chunks(head, c.message, c.finish_reason, _usage(c), self._logprobs(req.logprobs, c),
                                   req.include_usage)
            return [sse(ch) for ch in chunks] + [SSE_DONE]

        opening = [sse(chunk_body(ChunkHead(cid, created, req.model, None), {"role": "assistant", "content": ""}))]
        return await self._stream(request, s, req, t0, "chat", opening, rest, lambda e: [sse(e.body())])

    async def _serve_responses(self, request: web.Request) -> web.StreamResponse:
        s = self._auth(request)
        body = await read_json_object(request)
        t0 = time.perf_counter()
        r = responses.parse_responses_request(body)
        history: list[dict[str, Any]] = []
        if r.previous_response_id is not None:
            found = s.responses.get(r.previous_response_id)
            if found is None:
                raise bad("previous_response_id", f"{r.previous_response_id!r:.80} is not a stored response of session "
                                                  f"{s.id} (responses chain within their session, and only those "
                                                  "made with store true)", code="previous_response_not_found")
            history = found
        convo = history + r.turn.messages
        system = [{"role": "system", "content": r.instructions}] if r.instructions is not None else []
        req = dataclasses.replace(r.turn, messages=system + convo)
        rid, created = responses.new_id("resp"), int(time.time())

        def remember(c: Completion) -> None:
            if r.store:
                s.responses[rid] = convo + [responses.assistant_message(c)]

        def lps(c: Completion) -> list[dict[str, Any]] | None:
            body = self._logprobs(req.logprobs, c)
            return body["content"] if body is not None else None

        if not req.stream:
            c = await self.gateway.complete(s.id, req)
            remember(c)
            resp = json_response(responses.response_body(rid, created, req.model, r.echo,
                                                         responses.output_items(c, lps(c)), c))
            self._timed(t0, c, "responses")
            return resp

        def rest(c: Completion) -> list[bytes]:
            remember(c)
            return [sse_event(e) for e in responses.response_events(rid, created, req.model, r.echo, c, lps(c), 2)]

        opening = [sse_event(e) for e in responses.opening_events(rid, created, req.model, r.echo)]
        return await self._stream(request, s, req, t0, "responses", opening, rest,
                                  lambda e: [sse_event(responses.error_event(e, 2))])

    async def _serve_messages(self, request: web.Request) -> web.StreamResponse:
        s = self._auth(request)
        anthropic.check_version(request.headers.get("anthropic-version"))
        body = await read_json_object(request)
        t0 = time.perf_counter()
        req = anthropic.parse_messages_request(body, reasons=getattr(self.gateway.template, "reasoning_splitter",
                                                                     None) is not None)
        mid = anthropic.new_id()
        if not req.stream:
            c = await self.gateway.complete(s.id, req)
            resp = json_response(anthropic.message_body(mid, req.model, c))
            self._timed(t0, c, "messages")
            return resp
        return await self._stream(request, s, req, t0, "messages", [sse_event(anthropic.start_event(mid, req.model))],
                                  lambda c: [sse_event(e) for e in anthropic.message_events(c)],
                                  lambda e: [sse_event(e.anthropic_body())])

    async def _stream(self, request: web.Request, s: GatewaySession, req: TurnRequest, t0: float, api: str,
                      opening: list[bytes], rest: Callable[[Completion], list[bytes]],
                      error: Callable[[ApiError], list[bytes]]) -> web.StreamResponse:
        """A streamed turn: ``opening`` goes out once the request is accepted (an error before is an HTTP error
        reply), ``rest(completion)`` once the engine returned the turn; an error after the opening is sent as
        ``error(e)`` in the stream."""
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                             "Cache-Control": "no-cache"})

        async def ready() -> None:  # the request is accepted: headers and the opening go out now
            await stream.prepare(request)
            for x in opening:
                await stream.write(x)

        try:
            c = await self.gateway.complete(s.id, req, on_ready=ready)
        except ApiError as e:
            if not stream.prepared:
                raise
            for x in error(e):
                await stream.write(x)
            await stream.write_eof()
            return stream
        try:
            for x in rest(c):
                await stream.write(x)
            await stream.write_eof()
        except ConnectionError:  # the client left; the turn is recorded all the same
            logger.info("gateway session %s: the client closed its stream early", s.id)
        self._timed(t0, c, api)
        return stream

    def _logprobs(self, wanted: bool, c: Completion) -> dict[str, Any] | None:
        return logprobs_body(self.gateway.token_pieces(c.token_ids), c.logprobs) if wanted else None

    def _timed(self, t0: float, c: Completion, api: str) -> None:
        if self.timings is not None:
            self.timings.append((time.perf_counter() - t0, c.engine_s, api))

    async def _serve_env_step(self, request: web.Request) -> web.Response:
        self._auth(request)
        body = await _optional_object(request)
        _only(body, {"messages"})
        message = None
        if "messages" in body:
            msgs = body["messages"]
            if not isinstance(msgs, list) or len(msgs) != 1:
                raise bad("messages", "must be a list holding one assistant message (or left out: the last reply)")
            message = msgs[0]
        return json_response(await self.gateway.env_step(request.match_info["sid"], message))

    async def _serve_reward(self, request: web.Request) -> web.Response:
        body = await read_json_object(request)
        _only(body, {"reward", "metrics"})
        reward = body.get("reward")
        if reward is None:
            raise bad("reward", "is required: the episode's reward, a finite number")
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise bad("reward", f"must be a finite number, got {reward!r:.60}")
        metrics = body.get("metrics") or {}
        if not isinstance(metrics, dict) or not all(
                isinstance(k, str) and not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
                for k, v in metrics.items()):
            raise bad("metrics", "must be an object of finite numbers, e.g. {\"success\": 1.0}")
        sid = request.match_info["sid"]
        await self.gateway.set_reward(sid, float(reward), metrics)
        s = self.gateway.session(sid)
        return json_response({"session_id": sid, "status": s.status, "reward": s.reward})

    async def _serve_trajectory(self, request: web.Request) -> web.Response:
        return json_response(self.gateway.session(request.match_info["sid"]).to_json())

    async def _serve_delete_session(self, request: web.Request) -> web.Response:
        s = await self.gateway.delete(request.match_info["sid"])
        return json_response({"session_id": s.id, "status": s.status})


def _usage(c: Completion) -> dict[str, int]:
    return usage_body(c.prompt_tokens, c.completion_tokens)
