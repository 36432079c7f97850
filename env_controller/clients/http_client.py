"""The trainer-side client of the environment controller (asyncio, aiohttp).

:class:`HttpEnvClient` implements the agent loop's ``EnvClient`` protocol over HTTP, exactly as
:class:`~env_controller.clients.local.LocalEnvClient` does in process::

    async with HttpEnvClient("http://127.0.0.1:5020") as env:
        session_id, reply = await env.start_sample("lookup", 0)      # user message + tools
        reply = await env.interact(session_id, [assistant_message])  # tool messages
        await env.cancel(session_id)                                 # idempotent

Errors map as in the local client: an unknown task or index raises ValueError, a malformed
message :class:`~env_controller.protocol.MalformedMessageError`, an unknown session
:class:`~env_controller.clients.local.UnknownSessionError`. Every call has a timeout
(:class:`EnvTimeoutError`). Retries, with exponential backoff: 5xx replies (503 only for
``interact``, the one call that is not safe to repeat: the controller answers 503 only when it
did nothing) and connections that could not be opened; never 4xx replies, timeouts or
connections lost mid-request.
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from env_controller.clients.local import UnknownSessionError
from env_controller.http.auth import TOKEN_ENV, TRAINER_TOKEN_ENV, pick_token, resolve_token
from env_controller.http.json_io import dumps_json, loads_json
from env_controller.http.service import SESSION_HEADER, base_api_url
from env_controller.protocol import MalformedMessageError, TaskReply

logger = logging.getLogger(__name__)

#: a connection to the controller could not be opened (refused, or not within connect_timeout_s)
_CONNECT_ERRORS: tuple[type[BaseException], ...] = (aiohttp.ClientConnectorError,) + tuple(
    t for t in (getattr(aiohttp, "ConnectionTimeoutError", None),) if t is not None
)

#: observer(endpoint, seconds, status, headers) called after each HTTP reply (for benchmarks)
Observer = Callable[[str, float, int, Mapping[str, str]], None]


@dataclass
class ControllerReply(TaskReply):
    """A :class:`TaskReply` from the controller; ``error`` says why a session ended with ``task error``
    (or was cancelled) when the controller ended it (dead worker, timeout, idle GC), else ``""``."""

    error: str = ""


class EnvControllerError(RuntimeError):
    """The controller answered with an error, or could not be reached; ``status`` is 0 for the latter."""

    def __init__(self, status: int, message: str) -> None:
        """``status``: HTTP status (0 when there was no reply); ``message``: what went wrong."""
        super().__init__(message)
        self.status = status
        self.message = message


class EnvTimeoutError(EnvControllerError, TimeoutError):
    """No reply within the client's timeout."""


class HttpEnvClient:
    """The env protocol (start_sample / interact / cancel) against a controller over HTTP."""

    def __init__(
        self,
        url: str = "http://127.0.0.1:5020",
        *,
        token: str | None = None,
        timeout_s: float = 300.0,
        connect_timeout_s: float = 5.0,
        retries: int = 3,
        backoff_s: float = 0.25,
        max_connections: int = 256,
        observer: Observer | None = None,
    ) -> None:
        """``url``: the controller (``/api`` optional); ``token``: the trainer credential (default:
        the password of ``url`` when it holds one, else ``$AGENTRL_TRAINER_TOKEN``, else
        ``$AGENTRL_CONTROLLER_TOKEN``); ``timeout_s``: limit per call (keep it above the
        controller's interact timeout so the controller answers first); ``retries``: extra
        attempts on 5xx and on connections that could not be opened; ``backoff_s``: first wait
        (doubled each retry, jittered); ``max_connections``: pooled connections.
        """
        if not timeout_s > 0 or not connect_timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r} and connect_timeout_s={connect_timeout_s!r} must be > 0")
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ValueError(f"retries={retries!r} must be an integer >= 0")
        self.url, token = pick_token(token, base_api_url(url), "env client")  # never a URL login plus a header
        self.token = resolve_token(token, TRAINER_TOKEN_ENV, TOKEN_ENV)
        self.timeout_s = float(timeout_s)
        self.connect_timeout_s = float(connect_timeout_s)
        self.retries = retries
        self.backoff_s = float(backoff_s)
        self.max_connections = max_connections
        self.observer = observer
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._headers = {"Content-Type": "application/json"}
        if self.token:
            self._headers["Authorization"] = f"Bearer {self.token}"

    # -- plumbing --------------------------------------------------------------------------------

    def _http(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            connector = aiohttp.TCPConnector(limit=self.max_connections, keepalive_timeout=30)
            self._session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
            self._loop = loop
        return self._session

    async def _request(
        self,
        endpoint: str,
        method: str = "POST",
        body: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
        params: dict[str, str] | None = None,
        timeout_s: float | None = None,
        retry_5xx: bool = True,
    ) -> tuple[int, Any, Mapping[str, str]]:
        """One API call with the retry rules; returns (status, parsed JSON or text, headers).

        ``retry_5xx=False`` retries only 503 (the controller's "nothing happened, try later").
        """
        http = self._http()
        url = f"{self.url}/{endpoint}"
        data = dumps_json(body) if body is not None else None
        hdrs = {**self._headers, **headers} if headers else self._headers
        limit = timeout_s or self.timeout_s
        timeout = aiohttp.ClientTimeout(total=limit, sock_connect=self.connect_timeout_s)
        delay = self.backoff_s
        attempt = 0
        while True:
            t0 = time.perf_counter()
            try:
                async with http.request(method, url, data=data, headers=hdrs, params=params, timeout=timeout) as resp:
                    raw = await resp.read()
                    status = resp.status
                    resp_headers = resp.headers
            except _CONNECT_ERRORS as e:  # never reached the controller: safe to retry
                if attempt < self.retries:
                    attempt += 1
                    logger.warning(
                        "%s: cannot reach the controller (%s); retry %d/%d", endpoint, e, attempt, self.retries
                    )
                    await asyncio.sleep(delay * random.uniform(0.5, 1.5))
                    delay *= 2
                    continue
                raise EnvControllerError(
                    0, f"cannot reach the controller at {self.url}: {e or type(e).__name__}"
                ) from None
            except (TimeoutError, asyncio.TimeoutError):
                raise EnvTimeoutError(0, f"{endpoint}: no reply from the controller within {limit:g} s") from None
            except (aiohttp.ClientError, OSError) as e:
                raise EnvControllerError(
                    0, f"{endpoint}: connection to the controller lost: {type(e).__name__}: {e}"
                ) from None
            if self.observer is not None:
                self.observer(endpoint, time.perf_counter() - t0, status, resp_headers)
            try:
                payload: Any = loads_json(raw, strict=False) if raw else None
            except ValueError:
                payload = raw.decode(errors="replace")
            if (status >= 500 if retry_5xx else status == 503) and attempt < self.retries:
                attempt += 1
                wait = delay * random.uniform(0.5, 1.5)
                try:
                    wait = max(wait, min(float(resp_headers.get("Retry-After", 0)), 10.0))
                except ValueError:
                    pass
                logger.warning("%s: controller answered %d (%s); retry %d/%d in %.2f s",
                               endpoint, status, _message(payload), attempt, self.retries, wait)
                await asyncio.sleep(wait)
                delay *= 2
                continue
            return status, payload, resp_headers

    @staticmethod
    def _reply(payload: Any, what: str) -> ControllerReply:
        if not isinstance(payload, dict):
            raise EnvControllerError(200, f"{what}: the controller's reply is not a JSON object: {payload!r:.200}")
        try:
            r = TaskReply.from_json(payload)
        except ValueError as e:
            raise EnvControllerError(200, f"{what}: bad reply from the controller: {e}") from None
        error = str(payload.get("error") or "")
        if error:
            logger.warning("%s ended with %r: %s", what, r.status.value, error)
        return ControllerReply(r.messages, r.tools, r.status, r.finish, r.reward, r.metrics, error)

    # -- the EnvClient protocol ------------------------------------------------------------------

    async def start_sample(self, task: str, index: int | str) -> tuple[str, ControllerReply]:
        """Start an episode of ``task`` sample ``index``; returns ``(session_id, first reply)``.

        Raises ValueError for an unknown task or index, :class:`EnvControllerError` when no
        worker can take it (after retries) or on other errors.
        """
        status, payload, headers = await self._request("start_sample", body={"name": task, "index": index})
        if status == 200:
            session_id = headers.get(SESSION_HEADER)
            if session_id is None:
                raise EnvControllerError(
                    200, f"start_sample({task!r}, {index!r}): the reply has no '{SESSION_HEADER}' header"
                )
            return session_id, self._reply(payload, f"session {session_id} ({task} #{index})")
        if status in (400, 404):
            raise ValueError(_message(payload))
        raise EnvControllerError(status, f"start_sample({task!r}, {index!r}): HTTP {status}: {_message(payload)}")

    async def interact(self, session_id: str | int, messages: list[dict[str, Any]]) -> ControllerReply:
        """Send ``[assistant message]`` to an open session; returns the reply.

        Raises :class:`UnknownSessionError` (404), :class:`MalformedMessageError` (400),
        :class:`EnvControllerError` otherwise.
        """
        status, payload, _ = await self._request(  # an interact may have acted: retry only on 503
            "interact", body={"messages": messages}, headers={SESSION_HEADER: str(session_id)}, retry_5xx=False
        )
        if status == 200:
            return self._reply(payload, f"session {session_id}")
        if status == 404:
            raise UnknownSessionError(_message(payload))
        if status == 400:
            raise MalformedMessageError(_message(payload))
        raise EnvControllerError(status, f"interact on session {session_id}: HTTP {status}: {_message(payload)}")

    async def cancel(self, session_id: str | int) -> None:
        """End a session early; a no-op for an unknown or already ended one."""
        status, payload, _ = await self._request("cancel", headers={SESSION_HEADER: str(session_id)})
        if status == 404:
            logger.debug("cancel of session %s: %s", session_id, _message(payload))
            return
        if status != 200:
            raise EnvControllerError(status, f"cancel of session {session_id}: HTTP {status}: {_message(payload)}")

    # -- views -----------------------------------------------------------------------------------

    async def _get(self, endpoint: str, params: dict[str, str] | None = None) -> Any:
        status, payload, _ = await self._request(endpoint, method="GET", params=params)
        if status != 200:
            raise EnvControllerError(status, f"{endpoint}: HTTP {status}: {_message(payload)}")
        return payload

    async def list_workers(self) -> dict[str, Any]:
        """``GET /api/list_workers``: per task, its index count and workers."""
        return await self._get("list_workers")

    async def list_sessions(self) -> dict[str, Any]:
        """``GET /api/list_sessions``: open sessions by id."""
        return await self._get("list_sessions")

    async def indices(self, task: str) -> list[Any]:
        """``GET /api/get_indices?name=task``: the task's sample indices."""
        return await self._get("get_indices", {"name": task})

    async def health(self) -> dict[str, Any]:
        """``GET /api/health``."""
        return await self._get("health")

    async def aclose(self) -> None:
        """Close the connection pool."""
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None

    async def __aenter__(self) -> "HttpEnvClient":
        """``async with HttpEnvClient(url) as env:``."""
        return self

    async def __aexit__(self, *exc: Any) -> None:
        """Close the pool."""
        await self.aclose()


def _message(payload: Any) -> str:
    if isinstance(payload, dict):
        for key in ("error", "detail", "message"):
            if key in payload:
                return str(payload[key])
    return str(payload)[:500]
