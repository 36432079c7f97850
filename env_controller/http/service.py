"""HTTP plumbing shared by the controller and the worker server (aiohttp, asyncio).

JSON in and out (through :mod:`~env_controller.http.json_io`: a nesting limit on what comes in, UTF-8
without escapes on what goes out), JSON error replies, the middleware that checks credentials
(``auth.py``) against each route's role, request-body reading under a size and a time limit, a small
runner that serves an aiohttp app on ``host:port`` (port 0 picks a free port) with uvloop when
installed, and :class:`HttpService`, the lifecycle both servers share; its limits are its
:class:`~env_controller.http.options.HttpOptions`.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import resource
import signal
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, Self

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from env_controller.http.auth import (
    OPEN_IDENTITY,
    TOKEN_ENV,
    TRAINER_TOKEN_ENV,
    Credentials,
    Identity,
    Role,
    check_bind,
    redact_url,
)
from env_controller.http.fast import MAX_FAST_BODY, FastFront, LiteRequest, Reply
from env_controller.http.json_io import dumps_json, loads_json
from env_controller.http.options import BODY_TIMEOUT_S, IDLE_TIMEOUT_S, MAX_BODY_BYTES, HttpOptions

logger = logging.getLogger(__name__)

#: the header that carries a session id, as AgentRL clients and workers send it
SESSION_HEADER = "session_id"
#: a route's handler: a :class:`Reply` (any service's), or aiohttp's own response (a service without the fast
#: front, e.g. one that streams)
Handler = Callable[[web.Request], Awaitable["Reply | web.StreamResponse"]]


class HttpError(Exception):
    """A client error: becomes ``{"error": message}`` with ``status`` (4xx/5xx)."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        """``status``: HTTP status; ``message``: what is wrong and how to fix it."""
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}


class ClientGone(HttpError):
    """The client disconnected or stalled while sending its request (logged in one line, no traceback)."""


def json_reply(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Reply:
    """A JSON reply (compact UTF-8) of an :class:`HttpService` handler."""
    return Reply(dumps_json(body), status, headers)


def error_reply(status: int, message: str, headers: dict[str, str] | None = None) -> Reply:
    """The JSON error reply ``{"error": message, "status": status}``."""
    return json_reply({"error": message, "status": status}, status, headers)


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    """:func:`json_reply` as an aiohttp response (for handlers that stream, or return aiohttp's responses)."""
    return json_reply(body, status, headers).to_aiohttp()


def json_error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    """:func:`error_reply` as an aiohttp response."""
    return error_reply(status, message, headers).to_aiohttp()


# -- URLs and credentials (the credential model itself: auth.py) ------------------------------------


def base_api_url(url: str) -> str:
    """A controller URL, ``http://host:port`` or ``http://host:port/api``, as ``http://host:port/api``."""
    url = url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(
            f"controller URL {redact_url(url)!r} must start with http:// or https://, e.g. http://127.0.0.1:5020"
        )
    return url if url.endswith("/api") else url + "/api"


#: where the auth middleware leaves a request's identity
IDENTITY_KEY = web.RequestKey("agentrl_identity", Identity)


def identity_of(request: web.Request | LiteRequest) -> Identity:
    """The identity the auth middleware found for ``request``."""
    return request.get(IDENTITY_KEY, OPEN_IDENTITY)


def _role_error(role: Role, path: str) -> HttpError:
    if role is Role.TRAINER:
        return HttpError(403, f"{path} needs the trainer credential; this one is a worker's (it may only register "
                              f"workers and send heartbeats): use --trainer-token / ${TRAINER_TOKEN_ENV}")
    return HttpError(403, f"{path} is for task workers; a trainer credential cannot register workers or act for "
                          "them: give the worker a worker token (the controller's --worker-token NAME=TOKEN)")


def authorize(credentials: Credentials, role: Role, authorization: str | None, path: str, auth_hint: str) -> Identity:
    """The identity an ``Authorization`` header proves for a route of ``role`` (credentials enabled, role
    not open); :class:`HttpError` 401 without a valid credential, 403 with one of the wrong role."""
    identity = credentials.identify(authorization)
    if identity is None:
        raise HttpError(
            401, f"missing or wrong bearer token: send 'Authorization: Bearer <token>' ({auth_hint})",
            headers={"WWW-Authenticate": "Bearer"},
        )
    if (role is Role.TRAINER and not identity.trainer) or (role is Role.WORKER and not identity.worker):
        raise _role_error(role, path)
    return identity


#: called for a request refused before its route's handler ran: (method, route path or "", status)
OnRejected = Callable[[str, str, int], None]


def make_middleware(
    credentials: Credentials,
    roles: Mapping[tuple[str, str], Role] | None = None,
    on_error: OnRejected | None = None,
    auth_hint: str = f"the controller's --token / ${TOKEN_ENV}",
) -> Any:
    """Middleware: the credential check (when ``credentials`` has any) against the route's role in
    ``roles`` (``(method, path)``; default :attr:`Role.ANY`), and JSON bodies for every error.

    ``on_error(method, route_path, status)`` is called for each error reply given before a route's handler ran
    (a refused credential, an unknown endpoint or method: the handlers count their own, for metrics);
    ``auth_hint`` names where the expected token comes from in the 401 message (never the token itself).
    """
    roles = roles if roles is not None else {}  # not copied: HttpService fills it after building the app

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        reached = False  # whether a route's own handler ran (and counted its errors itself)
        try:
            if credentials.enabled:
                resource = request.match_info.route.resource
                role = roles.get((request.method, resource.canonical if resource else ""), Role.ANY)
                if role is not Role.OPEN:
                    request[IDENTITY_KEY] = authorize(credentials, role, request.headers.get("Authorization"),
                                                      request.path, auth_hint)
            reached = request.match_info.http_exception is None
            answer = await handler(request)
            # a route's Reply made aiohttp's response here, not in a wrapper coroutine per route
            return answer.to_aiohttp() if type(answer) is Reply else answer
        except ClientGone as e:
            level = logging.WARNING if e.status == 408 else logging.INFO
            logger.log(level, "%s %s from %s: %s", request.method, request.path, request.remote, e.message)
            status = e.status
            response: web.StreamResponse = json_error(e.status, e.message, e.headers)
            if e.status == 408:  # answer, then drop the connection: the rest of the body is not awaited
                response.force_close()
                try:
                    await response.prepare(request)
                    await response.write_eof()
                except (ConnectionError, RuntimeError):
                    pass
                request.protocol.force_close()
        except HttpError as e:
            status = e.status
            response = json_error(e.status, e.message, e.headers)
        except web.HTTPException as e:
            status = e.status
            if status == 404:
                msg = f"no such endpoint: {request.method} {request.path}"
            elif status == 405:
                msg = f"method {request.method} not allowed on {request.path}"
            elif status == 413:
                msg = f"request body too large (limit {request.app.get(MAX_BODY_KEY, MAX_BODY_BYTES)} bytes)"
            else:
                msg = e.text or e.reason
            response = json_error(status, msg, {k: v for k, v in e.headers.items() if k.lower() == "allow"})
        except (asyncio.CancelledError, KeyboardInterrupt):
            raise
        except Exception as e:  # noqa: BLE001 - one bad request must not kill the server
            logger.exception("%s %s failed", request.method, request.path)
            status = 500
            response = json_error(500, f"internal error: {type(e).__name__}: {e}")
        if on_error is not None and not reached:
            resource = request.match_info.route.resource
            on_error(request.method, resource.canonical if resource is not None else "", status)
        return response

    return middleware


# -- request bodies --------------------------------------------------------------------------------

#: where :class:`HttpService` keeps its body timeout and size limit on the app (read by :func:`read_body`)
BODY_TIMEOUT_KEY = web.AppKey("agentrl_body_timeout_s", float)
MAX_BODY_KEY = web.AppKey("agentrl_max_body_bytes", int)


async def read_body(request: web.Request | LiteRequest) -> bytes:
    """The whole request body, within the size limit and the app's body timeout.

    :class:`HttpError` 413 over the limit; :class:`ClientGone` 408 when the client stalls and 400
    when it disconnects or breaks the framing mid-body. On the fast path (:class:`LiteRequest`) the
    body is already read, under the same limits.
    """
    if type(request) is LiteRequest:
        return request.body
    limit = request.app.get(MAX_BODY_KEY, MAX_BODY_BYTES)
    declared = request.content_length
    if declared is not None and declared > limit:
        raise HttpError(413, f"{request.path}: request body of {declared} bytes is over the limit of {limit} bytes")
    timeout_s = request.app.get(BODY_TIMEOUT_KEY, BODY_TIMEOUT_S)
    try:
        return await asyncio.wait_for(request.read(), timeout_s)
    except TimeoutError:
        raise ClientGone(408, f"request body not received within {timeout_s:g} s; connection closed") from None
    except web.HTTPRequestEntityTooLarge:
        raise HttpError(413, f"{request.path}: request body over the limit of {limit} bytes") from None
    except (ConnectionError, HttpProcessingError) as e:
        raise ClientGone(400, f"client went away mid-body ({type(e).__name__}: {e})") from None


async def read_json_object(request: web.Request | LiteRequest) -> dict[str, Any]:
    """The request body as a JSON object; :class:`HttpError` 400 saying what is wrong."""
    return (await read_json_object_raw(request))[0]


async def read_json_object_raw(request: web.Request | LiteRequest) -> tuple[dict[str, Any], bytes]:
    """:func:`read_json_object`, and the body's bytes (for a handler that can pass them on as they are)."""
    raw = await read_body(request)
    if not raw:
        raise HttpError(400, f"{request.path}: empty request body; expected a JSON object")
    try:
        body = loads_json(raw)
    except ValueError as e:  # UnicodeDecodeError included
        raise HttpError(400, f"{request.path}: request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise HttpError(400, f"{request.path}: request body must be a JSON object, got {type(body).__name__}")
    return body, raw


def session_id_from(value: Any, where: str) -> int:
    """Parse a session id (an integer, or its decimal string in ASCII digits); HttpError 400 naming ``where``."""
    if isinstance(value, str):
        digits = value[1:] if value[:1] == "-" else value
        if digits.isascii() and digits.isdigit() and len(digits) <= 30:
            return int(value)
    elif isinstance(value, bool):
        value = None
    elif isinstance(value, int):
        return value
    if value is None:
        raise HttpError(400, f"missing {where}: the integer session id returned by start_sample")
    raise HttpError(400, f"{where} must be an integer session id, got {value!r:.100}")


def settle_gc() -> None:
    """For a long-running server, once it is up: what exists now (modules, classes, the app) is kept out
    of the collector's passes (``gc.freeze``), and the young generation is collected every 100,000
    allocations net instead of 700, the oldest every 100 of the middle one's passes instead of 10. Nearly
    everything a request allocates is freed by reference counting, so a young pass visits only what is
    still alive: fewer passes cost less (with thousands of sessions, frequent young passes take a noticeable
    share of the controller's CPU). The collector's full passes over thousands of sessions would otherwise stall every
    request in flight for tens to hundreds of ms."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(100_000, 10, 100)


def install_uvloop() -> bool:
    """Use uvloop for new event loops when it is installed; returns whether it is."""
    try:
        import uvloop
    except ImportError:
        return False
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True


def raise_nofile_limit(want: int = 65536) -> int:
    """Raise the soft open-files limit towards ``want`` (thousands of sockets); returns the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            logger.warning("could not raise the open-files limit from %d to %d", soft, target)
    return soft


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any] | None]) -> None:
    """Cancel each of ``tasks`` (None: skipped) and wait until all have ended, whatever they raised."""
    running = [task for task in tasks if task is not None]
    for task in running:
        task.cancel()
    if running:
        await asyncio.gather(*running, return_exceptions=True)


async def start_site(
    app: web.Application, host: str, port: int, idle_timeout_s: float = IDLE_TIMEOUT_S
) -> tuple[web.AppRunner, int]:
    """Serve ``app`` on ``host:port``; returns the runner (``await runner.cleanup()`` to stop) and the bound port.

    ``idle_timeout_s`` bounds both the wait for a request head and idle keep-alive connections.
    """
    runner = web.AppRunner(app, access_log=None, handle_signals=False, keepalive_timeout=idle_timeout_s)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=4096, reuse_address=True)
    try:
        await site.start()
    except OSError:
        await runner.cleanup()
        raise
    bound = port
    for addr in runner.addresses:
        if isinstance(addr, tuple) and len(addr) >= 2:
            bound = int(addr[1])
            break
    return runner, bound


#: one route of an :class:`HttpService`: (method, path, handler, who may call it)
Route = tuple[str, str, Handler, Role]


class HttpService(ABC):
    """An aiohttp app with the credential / JSON-error middleware, served on ``host:port`` under the
    bind rule, stopped with a bounded wait, usable as ``async with service:``.

    Subclasses implement :meth:`start` and :meth:`stop` around :meth:`_serve` and :meth:`_unserve`.
    """

    def __init__(
        self,
        credentials: Credentials,
        routes: Iterable[Route],
        options: HttpOptions | None = None,
        *,
        auth_hint: str = f"the controller's --token / ${TOKEN_ENV}",
        on_rejected: OnRejected | None = None,
        fast: bool = False,
        taskless: bool = False,
    ) -> None:
        """``credentials``: what requests must prove (none: open); ``routes``: (method, path,
        handler, role); ``options``: the limits on requests and connections (a server's own options include
        them; None: the defaults); ``on_rejected(method, route_path, status)``: called for each request refused
        before its handler ran (bad credential, unknown endpoint or method, a body that did not arrive on
        the fast path); ``fast``: serve plain requests through :class:`~env_controller.http.fast.FastFront`
        (aiohttp takes every other one), else aiohttp serves all; ``taskless``: the fast front drives the
        handlers without a task (they await only futures: see :mod:`~env_controller.http.fast`)."""
        limits = options if options is not None else HttpOptions()
        self.max_connections = limits.max_connections
        self.credentials = credentials
        self.idle_timeout_s = float(limits.idle_timeout_s)
        self.body_timeout_s = float(limits.body_timeout_s)
        self.max_body_bytes = limits.max_body_bytes
        self._auth_hint = auth_hint
        self._on_rejected = on_rejected
        roles: dict[tuple[str, str], Role] = {}
        self.app = web.Application(client_max_size=self.max_body_bytes)
        self.app.middlewares.append(make_middleware(credentials, roles, on_error=on_rejected, auth_hint=auth_hint))
        self.app[BODY_TIMEOUT_KEY] = self.body_timeout_s
        self.app[MAX_BODY_KEY] = self.max_body_bytes
        self._fast_routes: dict[tuple[str, str], Any] | None = {} if fast else None
        self._taskless = bool(taskless)
        for method, path, handler, role in routes:
            self.app.router.add_route(method, path, handler)
            roles[(method, path)] = role
            if self._fast_routes is not None:
                self._fast_routes[(method, path)] = self._fast_handler(method, path, handler, role)
        self._runner: web.AppRunner | None = None
        self._front: FastFront | None = None

    async def _serve(self, host: str, port: int, what: str) -> int:
        """Check the bind rule for ``what`` (ValueError) and serve the app; returns the bound port. The fast front
        listens either way (it caps the connections); without ``fast`` it hands each one to aiohttp at its first
        request."""
        check_bind(host, self.credentials.enabled, what)
        runner = web.AppRunner(self.app, access_log=None, handle_signals=False, keepalive_timeout=self.idle_timeout_s)
        await runner.setup()
        assert runner.server is not None
        front = FastFront(self._fast_routes or {}, runner.server, body_timeout_s=self.body_timeout_s,
                          idle_timeout_s=self.idle_timeout_s, on_gone=self._body_gone,
                          max_fast_body=min(self.max_body_bytes, MAX_FAST_BODY), taskless=self._taskless,
                          max_connections=self.max_connections)
        try:
            bound = await front.start(host, port)
        except OSError:
            await runner.cleanup()
            raise
        self._runner, self._front = runner, front
        return bound

    async def _unserve(self) -> None:
        """Stop serving (waits at most 10 s for open requests)."""
        if self._front is not None:
            await self._front.close(timeout_s=5)
            self._front = None
        if self._runner is not None:
            await asyncio.wait_for(self._runner.cleanup(), timeout=10)
            self._runner = None

    def _fast_handler(self, method: str, path: str, handler: Handler, role: Role) -> Any:
        """``handler`` on the fast path: the credential check and the error replies of the middleware."""
        credentials, hint, on_rejected = self.credentials, self._auth_hint, self._on_rejected
        check = credentials.enabled and role is not Role.OPEN

        async def serve(request: LiteRequest) -> Reply:
            reached = False
            try:
                if check:
                    request[IDENTITY_KEY] = authorize(credentials, role, request.headers.get("authorization"),
                                                      path, hint)
                reached = True
                return await handler(request)  # type: ignore[arg-type,return-value]
            except HttpError as e:
                status, response = e.status, error_reply(e.status, e.message, e.headers)
            except (asyncio.CancelledError, KeyboardInterrupt):
                raise
            except Exception as e:  # noqa: BLE001 - one bad request must not kill the server
                logger.exception("%s %s failed", method, path)
                status, response = 500, error_reply(500, f"internal error: {type(e).__name__}: {e}")
            if on_rejected is not None and not reached:
                on_rejected(method, path, status)
            return response

        return serve

    def _body_gone(self, method: str, path: str, remote: str | None, status: int, message: str) -> Reply:
        """A body that did not arrive on the fast path: logged and counted as the middleware does."""
        logger.log(logging.WARNING if status == 408 else logging.INFO, "%s %s from %s: %s", method, path, remote,
                   message)
        if self._on_rejected is not None:
            self._on_rejected(method, path, status)
        return error_reply(status, message)

    @abstractmethod
    async def start(self) -> int:
        """Serve; returns the bound port."""

    @abstractmethod
    async def stop(self) -> None:
        """Stop serving and release everything."""

    async def __aenter__(self) -> Self:
        """``async with service:`` starts it."""
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        """Stops it."""
        await self.stop()


async def wait_for_signal() -> None:
    """Wait for SIGINT or SIGTERM."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
