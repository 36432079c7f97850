"""The gateway's HTTP server (aiohttp): a per-session OpenAI base URL, and the session API around it.

Routes (``<id>``: a session id)::

    POST   /sessions                              {task?, index?, group_id?, metadata?} -> {session_id, base_url, ...}
    GET    /sessions/<id>/v1/models               the one policy served
    POST   /sessions/<id>/v1/chat/completions     OpenAI Chat Completions (stream true or false)
    POST   /sessions/<id>/v1/env                  {messages?: [assistant message]} -> the task's reply
    POST   /sessions/<id>/reward                  {reward, metrics?}: ends the episode
    GET    /sessions/<id>/trajectory              token_ids, loss_mask, logprobs, versions, turn_spans, ...
    DELETE /sessions/<id>                         cancels and forgets the session
    GET    /health                                open (no credential)

``/v1/env`` sits under the base URL so that an agent written against the ``openai`` package reaches it
with the client it has (``await client.post("/env", body=..., cast_to=object)``). Errors are OpenAI's
``{"error": {"message", "type", "param", "code"}}``. A stream is emulated: its first chunk (the role)
goes out when the request is accepted, the rest once the engine returned the whole turn.

Credentials follow the controller's rules: loopback by default; bound elsewhere the server needs a
bearer token (``--token`` or ``$AGENTRL_GATEWAY_TOKEN``), which an OpenAI client sends as its api key.
"""
from __future__ import annotations

import asyncio
import logging
import math
import secrets
import time
from collections import deque
from typing import Any

from aiohttp import web

from env_controller.http.auth import Credentials, Role, is_loopback
from env_controller.http.service import (
    ClientGone,
    HttpError,
    HttpService,
    json_response,
    loads_json,
    read_body,
    read_json_object,
)
from rollout_sglang.gateway.gateway import Completion, EnvStartError, Gateway
from rollout_sglang.gateway.openai_format import (
    SSE_DONE,
    ApiError,
    bad,
    chunk_body,
    completion_body,
    logprobs_body,
    models_body,
    parse_chat_request,
    sse,
    stream_chunks,
    usage_body,
)

logger = logging.getLogger(__name__)

#: environment variable of the gateway's bearer token
TOKEN_ENV = "AGENTRL_GATEWAY_TOKEN"


@web.middleware
async def _openai_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Errors of the gateway's own handlers in OpenAI's shape (the outer middleware keeps auth and 404s)."""
    try:
        return await handler(request)
    except ClientGone:
        raise
    except ApiError as e:
        return json_response(e.body(), status=e.status, headers=e.headers)
    except HttpError as e:  # a body over the size limit, not JSON, ...
        return json_response(ApiError(e.status, e.message).body(), status=e.status, headers=e.headers)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


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

    host, port: where to bind (port 0 picks a free one); token: the bearer token every route but
    ``/health`` requires (None: none, loopback only); record_timings: keep ``(handler seconds, engine
    seconds)`` of every completion in :attr:`timings` (benchmarks; the handler's time runs from its body
    read to its response built, or to a stream's last chunk written); reap_interval_s: how often idle
    sessions are looked for.
    """

    def __init__(self, gateway: Gateway, *, host: str = "127.0.0.1", port: int = 0, token: str | None = None,
                 record_timings: bool = False, reap_interval_s: float = 30.0) -> None:
        self.gateway = gateway
        self.host, self.port = host, int(port)
        self.reap_interval_s = float(reap_interval_s)
        self.timings: deque[tuple[float, float]] | None = deque(maxlen=1_000_000) if record_timings else None
        self._reaper: asyncio.Task | None = None
        routes = [
            ("GET", "/health", self._h_health, Role.OPEN),
            ("POST", "/sessions", self._h_open, Role.ANY),
            ("GET", "/sessions/{sid}/v1/models", self._h_models, Role.ANY),
            ("POST", "/sessions/{sid}/v1/chat/completions", self._h_chat, Role.ANY),
            ("POST", "/sessions/{sid}/v1/env", self._h_env, Role.ANY),
            ("POST", "/sessions/{sid}/reward", self._h_reward, Role.ANY),
            ("GET", "/sessions/{sid}/trajectory", self._h_trajectory, Role.ANY),
            ("DELETE", "/sessions/{sid}", self._h_delete, Role.ANY),
        ]
        super().__init__(Credentials.single(token), routes, auth_hint=f"the gateway's --token / ${TOKEN_ENV}")
        self.app.middlewares.append(_openai_errors)

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

    # ------------------------------------------------------------------ handlers
    async def _h_health(self, request: web.Request) -> web.Response:
        st = self.gateway.stats
        return json_response({"ok": True, "sessions": len(self.gateway.sessions), "completions": st.completions,
                              "history_rewrites": st.history_rewrites})

    async def _h_open(self, request: web.Request) -> web.Response:
        body = await _optional_object(request)
        _only(body, {"task", "index", "group_id", "metadata"})
        task, index = body.get("task"), body.get("index")
        if task is not None and (not isinstance(task, str) or not task):
            raise bad("task", f"must be a task name, got {task!r:.60}")
        if task is not None and not _is_int(index):
            raise bad("index", f"must be the task's integer sample index (required with task), got {index!r:.60}")
        if task is None and index is not None:
            raise bad("index", "is only meaningful with task")
        group_id = body.get("group_id", 0)
        if not _is_int(group_id):
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
                              "status": s.status, "messages": s.first_messages, "tools": s.tools}, status=201)

    async def _h_models(self, request: web.Request) -> web.Response:
        self.gateway.session(request.match_info["sid"])
        return json_response(models_body(self.gateway.model_name, self.gateway.created))

    async def _h_chat(self, request: web.Request) -> web.StreamResponse:
        sid = request.match_info["sid"]
        body = await read_json_object(request)
        t0 = time.perf_counter()  # timings start once the body is in: a slow client's upload is not the gateway's
        req = parse_chat_request(body)
        cid, created = f"chatcmpl-{secrets.token_hex(12)}", int(time.time())
        if not req.stream:
            c = await self.gateway.complete(sid, req)
            resp = json_response(completion_body(cid, created, req.model, c.message, c.finish_reason, _usage(c),
                                                 f"v{c.version}", self._logprobs(req.logprobs, c)))
            self._timed(t0, c)
            return resp
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                             "Cache-Control": "no-cache"})

        async def ready() -> None:  # the request is accepted: headers and the role chunk go out now
            await stream.prepare(request)
            await stream.write(sse(chunk_body(cid, created, req.model, None, {"role": "assistant", "content": ""})))

        try:
            c = await self.gateway.complete(sid, req, on_ready=ready)
        except ApiError as e:
            if not stream.prepared:
                raise
            await stream.write(sse(e.body()))
            await stream.write_eof()
            return stream
        try:
            for chunk in stream_chunks(cid, created, req.model, f"v{c.version}", c.message, c.finish_reason,
                                       _usage(c), self._logprobs(req.logprobs, c), req.include_usage):
                await stream.write(sse(chunk))
            await stream.write(SSE_DONE)
            await stream.write_eof()
        except ConnectionError:  # the client left; the turn is recorded all the same
            logger.info("gateway session %s: the client closed its stream early", sid)
        self._timed(t0, c)
        return stream

    def _logprobs(self, wanted: bool, c: Completion) -> dict[str, Any] | None:
        return logprobs_body(self.gateway.token_pieces(c.token_ids), c.logprobs) if wanted else None

    def _timed(self, t0: float, c: Completion) -> None:
        if self.timings is not None:
            self.timings.append((time.perf_counter() - t0, c.engine_s))

    async def _h_env(self, request: web.Request) -> web.Response:
        body = await _optional_object(request)
        _only(body, {"messages"})
        message = None
        if "messages" in body:
            msgs = body["messages"]
            if not isinstance(msgs, list) or len(msgs) != 1:
                raise bad("messages", "must be a list holding one assistant message (or left out: the last reply)")
            message = msgs[0]
        return json_response(await self.gateway.env_step(request.match_info["sid"], message))

    async def _h_reward(self, request: web.Request) -> web.Response:
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

    async def _h_trajectory(self, request: web.Request) -> web.Response:
        return json_response(self.gateway.session(request.match_info["sid"]).to_json())

    async def _h_delete(self, request: web.Request) -> web.Response:
        s = await self.gateway.delete(request.match_info["sid"])
        return json_response({"session_id": s.id, "status": s.status})


def _usage(c: Completion) -> dict[str, int]:
    return usage_body(c.prompt_tokens, c.completion_tokens)
