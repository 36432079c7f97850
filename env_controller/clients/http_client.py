"""The trainer-side client of the environment controller (asyncio).

Calls to an ``http://`` controller go through the small pooled HTTP/1.1 client the controller uses for
its worker calls (:mod:`env_controller.http.client`: less CPU per call than aiohttp's);
an ``https://`` controller is called through aiohttp's client.

:class:`HttpEnvClient` implements the agent loop's ``EnvClient`` protocol over HTTP, exactly as
:class:`~env_controller.clients.local.LocalEnvClient` does in process::

    async with HttpEnvClient("http://127.0.0.1:5020", EnvClientOptions(retries=1)) as env:
        session_id, reply = await env.start_sample("lookup", 0)      # user message + tools
        reply = await env.interact(session_id, [assistant_message])  # tool messages
        await env.cancel(session_id)                                 # idempotent

Errors map as in the local client: an unknown task or index raises ValueError, a malformed
message :class:`~env_controller.protocol.MalformedMessageError`, an unknown session
:class:`~env_controller.clients.local.UnknownSessionError`. Every call has a timeout
(:class:`EnvTimeoutError`).

Retries. ``start_sample`` waits out a controller that cannot serve it (a connection refused or
reset, 502, 503 with ``Retry-After`` (honoured, capped), 504: a controller restarting, its workers
re-registering, or every worker full), for up to ``unavailable_timeout_s`` per call, then raises
naming the URL, the wait and the fix. The waiting starts share one state per outage: one of them
probes at a time, with jittered exponential backoff, the others wait for its answer, so thousands
of waiting starts cost the controller about one request per backoff step; the outage is logged
once when it begins and once when it ends, with counts. ``interact``, the one call that is not
safe to repeat, is retried only when nothing was sent (a connection that could not be opened) or
on 503 (the controller answers 503 only when it did nothing), ``retries`` times; an interact on a
session that a restarted controller does not know raises :class:`UnknownSessionError` with the
controller's text, which ends the episode as an infrastructure failure. Other 5xx replies are
retried ``retries`` times for calls other than ``interact``; 4xx replies and timeouts never.
``cancel`` is best effort: a short timeout, no retries while the controller is unreachable.
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import aiohttp

from env_controller.clients.local import UnknownSessionError
from env_controller.clients.options import EnvClientOptions
from env_controller.http.auth import TOKEN_ENV, TRAINER_TOKEN_ENV, pick_token, resolve_token
from env_controller.http.client import ConnectError, Disconnected, PooledHttp, parse_url
from env_controller.http.json_io import dumps_json, loads_json
from env_controller.http.service import SESSION_HEADER, base_api_url
from env_controller.protocol import MalformedMessageError, TaskReply

logger = logging.getLogger(__name__)

#: idle pooled connections to the controller are closed after this long (below its --idle-timeout, 75 s;
#: longer when it announces a longer one)
_KEEPALIVE_S = 30.0

#: a connection to the controller could not be opened (refused, or not within connect_timeout_s)
_CONNECT_ERRORS: tuple[type[BaseException], ...] = (aiohttp.ClientConnectorError,) + tuple(
    t for t in (getattr(aiohttp, "ConnectionTimeoutError", None),) if t is not None
)

#: the connection broke before a reply came: the controller died or closed a keep-alive connection we
#: reused. Safe to repeat for a start only (a controller that died lost its sessions; one that closed an
#: idle connection never read the request)
_DISCONNECT_ERRORS: tuple[type[BaseException], ...] = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)

#: replies that mean "the controller cannot serve this now; nothing happened": a start waits them out
_UNAVAILABLE = frozenset({502, 503, 504})

#: the longest Retry-After honoured, seconds (a larger one is cut to this, so a wait stays bounded)
MAX_RETRY_AFTER_S = 30.0

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


class EnvUnavailableError(EnvControllerError):
    """The controller could not serve a start within the client's ``unavailable_timeout_s``."""


class _Outage:
    """One period in which the controller could not serve starts (of any task, or of one task).

    Shared by every waiting start: ``probing`` marks the one request in flight that tests whether it
    is over; the others wait on ``changed`` (replaced after each wake-up) until ``next_try``.
    """

    def __init__(self, what: str, reason: str, backoff_s: float) -> None:
        self.what = what
        self.reason = reason
        self.since = time.monotonic()
        self.failures = 1
        self.waited = 0  # start calls that waited in it
        self.probing = False
        self.backoff_s = backoff_s
        self.next_try = self.since
        self.changed = asyncio.Event()

    def wake(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()


class HttpEnvClient:
    """The env protocol (start_sample / interact / cancel) against a controller over HTTP."""

    def __init__(self, url: str = "http://127.0.0.1:5020", options: EnvClientOptions | None = None, *,
                 observer: Observer | None = None) -> None:
        """``url``: the controller (``/api`` optional; credentials in it serve as the token when
        ``options.token`` is not given); ``options``: timeouts, retries and connections (None: the defaults);
        ``observer``: called after each HTTP reply (benchmarks)."""
        options = self.options = options if options is not None else EnvClientOptions()
        self.url, token = pick_token(options.token, base_api_url(url), "env client")  # never a URL login plus a header
        self.token = resolve_token(token, TRAINER_TOKEN_ENV, TOKEN_ENV)
        self.timeout_s = float(options.timeout_s)
        self.connect_timeout_s = float(options.connect_timeout_s)
        self.retries = options.retries
        self.backoff_s = float(options.backoff_s)
        self.max_connections = options.max_connections
        self.observer = observer
        self.unavailable_timeout_s = float(options.unavailable_timeout_s)
        self.max_backoff_s = float(options.max_backoff_s)
        self.cancel_timeout_s = float(options.cancel_timeout_s)
        #: open outages: None = the controller cannot be reached at all, a task name = it answers 503 for that task
        self._outages: dict[str | None, _Outage] = {}
        self.outages = 0  # outages seen (both kinds), for tests and reports
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # start, interact, cancel and the views go through the controller's own lean HTTP/1.1 client
        # (less CPU per call than aiohttp's) when the URL is plain http://; aiohttp otherwise
        self._lean: PooledHttp | None = None
        self._lean_loop: asyncio.AbstractEventLoop | None = None
        try:
            parse_url(self.url)
            self._lean_ok = True
        except ValueError:
            self._lean_ok = False
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

    @property
    def start_wait_s(self) -> float:
        """How much longer than one call's timeout a start may take while it waits for the controller
        (the agent loop adds it to its limit on a start)."""
        return self.unavailable_timeout_s

    async def _send(
        self,
        endpoint: str,
        method: str,
        data: bytes | None,
        headers: Mapping[str, str],
        params: dict[str, str] | None,
        limit: float,
    ) -> tuple[int, Any, Mapping[str, str]]:
        """One HTTP attempt: (status, parsed JSON or text, headers); :class:`_NoReply` when the
        connection could not be opened or broke before a reply, :class:`EnvTimeoutError` past ``limit``.
        Over the lean client for an ``http://`` controller (headers read case-insensitively, as aiohttp's),
        else over aiohttp."""
        url = f"{self.url}/{endpoint}"
        lean = self._lean_client()
        t0 = time.perf_counter()
        try:
            if lean is not None:
                reply = await lean.request(method, url + (f"?{urlencode(params)}" if params else ""), data, headers,
                                           limit)
                status, raw, resp_headers = reply.status, reply.body, _Headers(reply.headers)
            else:
                timeout = aiohttp.ClientTimeout(total=limit, sock_connect=self.connect_timeout_s)
                async with self._http().request(method, url, data=data, headers=headers, params=params,
                                                timeout=timeout) as resp:
                    raw = await resp.read()
                    status, resp_headers = resp.status, resp.headers
        except (ConnectError, *_CONNECT_ERRORS) as e:  # never reached the controller: safe to retry
            raise _NoReply(f"cannot connect: {e}", sent=False) from None
        except (TimeoutError, asyncio.TimeoutError):
            raise EnvTimeoutError(0, f"{endpoint}: no reply from the controller within {limit:g} s") from None
        except (Disconnected, *_DISCONNECT_ERRORS) as e:
            raise _NoReply(f"connection lost: {type(e).__name__}: {e}", sent=True) from None
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
        return status, payload, resp_headers

    def _lean_client(self) -> PooledHttp | None:
        """The pooled HTTP/1.1 client of the controller's worker calls, for an ``http://`` controller (None
        for ``https://``, which aiohttp serves); one per event loop."""
        if not self._lean_ok:
            return None
        loop = asyncio.get_running_loop()
        if self._lean is None or self._lean_loop is not loop:
            self._lean = PooledHttp(max_in_flight=self.max_connections, keepalive_s=_KEEPALIVE_S,
                                    connect_timeout_s=self.connect_timeout_s)
            self._lean_loop = loop
        return self._lean

    async def _request(
        self,
        endpoint: str,
        method: str = "POST",
        body: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
        params: dict[str, str] | None = None,
        timeout_s: float | None = None,
        retry_5xx: bool = True,
        retries: int | None = None,
    ) -> tuple[int, Any, Mapping[str, str]]:
        """One API call (not a start) with the retry rules; returns (status, parsed JSON or text, headers).

        Retries (``retries``, default the client's): connections that could not be opened, and 5xx
        replies; with ``retry_5xx=False`` only 503 (the controller's "nothing happened, try later").
        """
        data = dumps_json(body) if body is not None else None
        hdrs = {**self._headers, **headers} if headers else self._headers
        limit = timeout_s or self.timeout_s
        retries = self.retries if retries is None else retries
        delay = self.backoff_s
        attempt = 0
        while True:
            try:
                status, payload, resp_headers = await self._send(endpoint, method, data, hdrs, params, limit)
            except _NoReply as e:
                if e.sent:  # the controller may have acted on it: never repeated
                    raise EnvControllerError(0, f"{endpoint}: {e.reason} (the request may have reached the "
                                                f"controller at {self.url}; not repeated)") from None
                self._failed(None, e.reason)
                if attempt < retries:
                    attempt += 1
                    logger.debug("%s: %s; retry %d/%d", endpoint, e.reason, attempt, retries)
                    await asyncio.sleep(delay * random.uniform(0.5, 1.5))
                    delay *= 2
                    continue
                raise EnvControllerError(0, f"cannot reach the controller at {self.url}: {e.reason}") from None
            if status not in (502, 504):
                self._served(None)  # it answered: it can be reached
            if (status >= 500 if retry_5xx else status == 503) and attempt < retries:
                attempt += 1
                wait = max(delay * random.uniform(0.5, 1.5), _retry_after(resp_headers))
                logger.log(logging.DEBUG if status == 503 else logging.WARNING,
                           "%s: controller answered %d (%s); retry %d/%d in %.2f s",
                           endpoint, status, _message(payload), attempt, retries, wait)
                await asyncio.sleep(wait)
                delay *= 2
                continue
            return status, payload, resp_headers

    async def _start_request(self, task: str, index: int | str) -> tuple[int, Any, Mapping[str, str]]:
        """``POST start_sample``, waiting out an unavailable controller (see the module's docstring)."""
        what = f"start_sample({task!r}, {index!r})"
        data = dumps_json({"name": task, "index": index})
        first_wait: float | None = None  # when this call first met an outage: its budget counts from here
        waited_in: set[int] = set()
        tried = False
        attempt = 0
        delay = self.backoff_s
        while True:
            probe: _Outage | None = None
            while (outage := self._outages.get(None) or self._outages.get(task)) is not None:
                now = time.monotonic()
                first_wait = now if first_wait is None else first_wait
                if id(outage) not in waited_in:
                    waited_in.add(id(outage))
                    outage.waited += 1
                left = first_wait + self.unavailable_timeout_s - now
                last_chance = left <= 0 and not tried and not outage.probing  # every start is tried once
                if left <= 0 and not last_chance:
                    raise self._gave_up(what, outage, now - first_wait)
                if not outage.probing and (now >= outage.next_try or last_chance):
                    outage.probing, probe = True, outage  # this call tests whether the outage is over
                    break
                # one probe at a time: wait for its answer, or for the next try when none is out
                pause = left if outage.probing else min(left, outage.next_try - now)
                changed = outage.changed
                try:
                    await asyncio.wait_for(changed.wait(), pause)
                except (TimeoutError, asyncio.TimeoutError):
                    pass
            tried = True
            try:
                status, payload, headers = await self._send(
                    "start_sample", "POST", data, self._headers, None, self.timeout_s
                )
            except _NoReply as e:
                # a start is safe to repeat even when the connection broke after sending: a controller that
                # died lost its sessions, and one that closed an idle connection never read the request
                self._failed(None, e.reason, probe=probe)
                first_wait = time.monotonic() if first_wait is None else first_wait
                continue
            except BaseException:
                _release(probe)  # cancelled or timed out: let another start probe
                raise
            if status not in (502, 504):
                self._served(None)
            if status in _UNAVAILABLE:
                self._failed(task if status == 503 else None, f"HTTP {status}: {_message(payload)}",
                             _retry_after(headers), probe)
                first_wait = time.monotonic() if first_wait is None else first_wait
                continue
            self._served(task)
            _release(probe)
            if status >= 500 and attempt < self.retries:
                attempt += 1
                wait = delay * random.uniform(0.5, 1.5)
                logger.warning("%s: controller answered %d (%s); retry %d/%d in %.2f s",
                               what, status, _message(payload), attempt, self.retries, wait)
                await asyncio.sleep(wait)
                delay *= 2
                continue
            return status, payload, headers

    # -- outages ---------------------------------------------------------------------------------

    def _failed(self, key: str | None, reason: str, retry_after: float = 0.0, probe: _Outage | None = None) -> None:
        """A request found the controller unable to serve (``key`` None: unreachable; a task: 503 for it)."""
        now = time.monotonic()
        outage = self._outages.get(key)
        if outage is None:
            what = "is unreachable" if key is None else f"has no worker free for task {key!r}"
            outage = self._outages[key] = _Outage(what, reason, self.backoff_s)
            self.outages += 1
            outage.next_try = now + max(self.backoff_s * random.uniform(0.5, 1.0), retry_after)
            logger.warning("the env controller at %s %s (%s); starts wait for it, up to %g s each "
                           "(unavailable_timeout_s)", self.url, what, reason, self.unavailable_timeout_s)
        else:
            outage.failures += 1
            outage.reason = reason
            if probe is outage:  # its probe failed: back off before the next one (jittered, so the
                # waiting starts of several trainers do not probe in step)
                outage.backoff_s = min(outage.backoff_s * 2, self.max_backoff_s)
                outage.next_try = now + max(outage.backoff_s * random.uniform(0.5, 1.0), retry_after)
        _release(probe)

    def _served(self, key: str | None) -> None:
        """The controller answered (``key`` None) or served a start of task ``key``: that outage is over."""
        outage = self._outages.pop(key, None)
        if outage is None:
            return
        logger.warning("the env controller at %s is back after %.1f s (%s: %d failed requests, %d starts "
                       "waited; last: %s)", self.url, time.monotonic() - outage.since,
                       "unreachable" if key is None else f"no worker free for task {key!r}",
                       outage.failures, outage.waited, outage.reason)
        outage.probing = False
        outage.wake()

    def _gave_up(self, what: str, outage: _Outage, waited: float) -> EnvUnavailableError:
        fix = ("check that the controller runs and is reachable from here" if outage.what == "is unreachable"
               else "check that the task's workers run and have registered (GET /api/list_workers)")
        return EnvUnavailableError(
            0 if outage.what == "is unreachable" else 503,
            f"{what}: the env controller at {self.url} {outage.what}; waited {waited:.1f} s "
            f"(unavailable_timeout_s={self.unavailable_timeout_s:g}; last: {outage.reason}); {fix}, or raise "
            "unavailable_timeout_s (env.unavailable_timeout_s of a run)",
        )

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

        Raises ValueError for an unknown task or index, :class:`EnvUnavailableError` when the
        controller could not serve it within ``unavailable_timeout_s``, :class:`EnvControllerError`
        on other errors.
        """
        status, payload, headers = await self._start_request(task, index)
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

        Raises :class:`UnknownSessionError` (404: e.g. a restarted controller, which lost its sessions),
        :class:`MalformedMessageError` (400), :class:`EnvControllerError` otherwise.
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
        """End a session early; a no-op for an unknown or already ended one. Best effort: limited to
        ``cancel_timeout_s``, and not retried while the controller is unreachable (its sessions are gone)."""
        status, payload, _ = await self._request(
            "cancel", headers={SESSION_HEADER: str(session_id)}, timeout_s=self.cancel_timeout_s,
            retries=0 if None in self._outages else None,
        )
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

    async def metrics(self) -> str:
        """``GET /metrics`` (beside ``/api``): the controller's counters in Prometheus' text format."""
        async with self._http().get(self.url.removesuffix("/api") + "/metrics", headers=self._headers) as r:
            text = await r.text()
        if r.status != 200:
            raise EnvControllerError(r.status, f"metrics: HTTP {r.status}: {text[:200]}")
        return text

    async def aclose(self) -> None:
        """Close the connection pools."""
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None
        if self._lean is not None:
            lean, self._lean = self._lean, None
            if self._lean_loop is asyncio.get_running_loop():
                await lean.close()

    async def __aenter__(self) -> "HttpEnvClient":
        """``async with HttpEnvClient(url) as env:``."""
        return self

    async def __aexit__(self, *exc: Any) -> None:
        """Close the pool."""
        await self.aclose()


class _Headers(dict[str, str]):
    """A reply's headers (names lower-cased) read case-insensitively, as aiohttp's."""

    def __getitem__(self, name: str) -> str:
        return super().__getitem__(name.lower())

    def __contains__(self, name: object) -> bool:
        return super().__contains__(name.lower() if isinstance(name, str) else name)

    def get(self, name: str, default: Any = None) -> Any:  # type: ignore[override]
        """The value of header ``name`` (any case), or ``default``."""
        return super().get(name.lower(), default)


class _NoReply(Exception):
    """No HTTP reply: the connection could not be opened (``sent`` False) or broke before a reply came."""

    def __init__(self, reason: str, sent: bool) -> None:
        super().__init__(reason)
        self.reason = reason
        self.sent = sent


def _release(probe: _Outage | None) -> None:
    """End ``probe``'s turn as the outage's one request in flight, waking the waiting starts."""
    if probe is not None and probe.probing:
        probe.probing = False
        probe.wake()


def _retry_after(headers: Mapping[str, str]) -> float:
    """The reply's ``Retry-After`` in seconds (the delta form), at most :data:`MAX_RETRY_AFTER_S`; 0 when absent."""
    try:
        return min(max(float(headers.get("Retry-After", 0)), 0.0), MAX_RETRY_AFTER_S)
    except ValueError:  # the HTTP-date form: not worth a date parser here
        return 0.0


def _message(payload: Any) -> str:
    if isinstance(payload, dict):
        for key in ("error", "detail", "message"):
            if key in payload:
                return str(payload[key])
    return str(payload)[:500]
