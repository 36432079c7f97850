"""HTTP plumbing shared by the controller and the worker server (aiohttp, asyncio).

JSON error replies, the bind rule (loopback by default, a bearer token required elsewhere), the
token check, request-body parsing with errors that name the bad field, a small runner that
serves an aiohttp app on ``host:port`` (port 0 picks a free port) with uvloop when installed,
and :class:`HttpService`, the lifecycle both servers share.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
import ipaddress
import json
import logging
import os
import resource
import signal
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Self

from aiohttp import web

logger = logging.getLogger(__name__)

#: environment variable that holds the shared bearer token (controller, workers, clients)
TOKEN_ENV = "AGENTRL_CONTROLLER_TOKEN"
#: the header that carries a session id, as AgentRL clients and workers send it
SESSION_HEADER = "session_id"
#: largest request body accepted (assistant messages can be long)
MAX_BODY_BYTES = 32 * 1024 * 1024

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class HttpError(Exception):
    """A client error: becomes ``{"error": message}`` with ``status`` (4xx/5xx)."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        """``status``: HTTP status; ``message``: what is wrong and how to fix it."""
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    """A JSON response (compact encoding)."""
    return web.Response(
        body=json.dumps(body, separators=(",", ":")).encode(),
        status=status,
        headers=headers,
        content_type="application/json",
    )


def json_error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    """The JSON error reply ``{"error": message, "status": status}``."""
    return json_response({"error": message, "status": status}, status=status, headers=headers)


def base_api_url(url: str) -> str:
    """A controller URL, ``http://host:port`` or ``http://host:port/api``, as ``http://host:port/api``."""
    url = url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"controller URL {url!r} must start with http:// or https://, e.g. http://127.0.0.1:5020")
    return url if url.endswith("/api") else url + "/api"


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1)."""
    if host in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def resolve_token(token: str | None) -> str | None:
    """``token`` when given, else ``$AGENTRL_CONTROLLER_TOKEN``, else None (empty means None)."""
    token = token if token is not None else os.environ.get(TOKEN_ENV)
    return token or None


def check_bind(host: str, token: str | None, what: str) -> None:
    """Refuse to serve ``what`` on a non-loopback ``host`` without a token (ValueError says how)."""
    if not is_loopback(host) and not token:
        raise ValueError(
            f"{what} bound to {host!r} (not loopback) needs a bearer token: pass --token or set "
            f"${TOKEN_ENV}; or bind --host 127.0.0.1"
        )


def _token_ok(header: str | None, token: str) -> bool:
    if not header:
        return False
    scheme, _, value = header.partition(" ")
    scheme = scheme.lower()
    value = value.strip()
    if scheme == "bearer":
        return hmac.compare_digest(value.encode(), token.encode())
    if scheme == "basic":  # stock AgentRL workers can only embed it in the URL: http://agentrl:TOKEN@host/api
        try:
            _, _, password = base64.b64decode(value, validate=True).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return False
        return hmac.compare_digest(password.encode(), token.encode())
    return False


def make_middleware(token: str | None, on_error: Callable[[web.Request, int], None] | None = None) -> Any:
    """Middleware: bearer-token check (when ``token``), and JSON bodies for every error.

    ``on_error(request, status)`` is called for each error reply (for metrics).
    """

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if token is not None and not _token_ok(request.headers.get("Authorization"), token):
            status = 401
            response: web.StreamResponse = json_error(
                status,
                "missing or wrong bearer token: send 'Authorization: Bearer <token>' "
                f"(the controller's --token / ${TOKEN_ENV})",
                headers={"WWW-Authenticate": "Bearer"},
            )
        else:
            try:
                return await handler(request)
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
                    msg = f"request body too large (limit {MAX_BODY_BYTES} bytes)"
                else:
                    msg = e.text or e.reason
                response = json_error(status, msg)
            except (asyncio.CancelledError, KeyboardInterrupt):
                raise
            except Exception as e:  # noqa: BLE001 - one bad request must not kill the server
                logger.exception("%s %s failed", request.method, request.path)
                status = 500
                response = json_error(500, f"internal error: {type(e).__name__}: {e}")
        if on_error is not None:
            on_error(request, status)
        return response

    return middleware


async def read_json_object(request: web.Request) -> dict[str, Any]:
    """The request body as a JSON object; :class:`HttpError` 400 saying what is wrong."""
    raw = await request.read()
    if not raw:
        raise HttpError(400, f"{request.path}: empty request body; expected a JSON object")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise HttpError(400, f"{request.path}: request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise HttpError(400, f"{request.path}: request body must be a JSON object, got {type(body).__name__}")
    return body


def session_id_from(value: Any, where: str) -> int:
    """Parse a session id (an integer, or its decimal string); HttpError 400 naming ``where``."""
    if isinstance(value, bool):
        value = None
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    if value is None:
        raise HttpError(400, f"missing {where}: the integer session id returned by start_sample")
    raise HttpError(400, f"{where} must be an integer session id, got {value!r}")


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


async def start_site(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Serve ``app`` on ``host:port``; returns the runner (``await runner.cleanup()`` to stop) and the bound port."""
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
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


class HttpService(ABC):
    """An aiohttp app with the token / JSON-error middleware, served on ``host:port`` under the
    bind rule, stopped with a bounded wait, usable as ``async with service:``.

    Subclasses implement :meth:`start` and :meth:`stop` around :meth:`_serve` and :meth:`_unserve`.
    """

    def __init__(self, token: str | None, routes: Iterable[tuple[str, str, Handler]]) -> None:
        """``token``: bearer token required on every request (None: none); ``routes``: (method, path, handler)."""
        self.app = web.Application(middlewares=[make_middleware(token)], client_max_size=MAX_BODY_BYTES)
        for method, path, handler in routes:
            self.app.router.add_route(method, path, handler)
        self._runner: web.AppRunner | None = None

    async def _serve(self, host: str, port: int, token: str | None, what: str) -> int:
        """Check the bind rule for ``what`` (ValueError) and serve the app; returns the bound port."""
        check_bind(host, token, what)
        self._runner, bound = await start_site(self.app, host, port)
        return bound

    async def _unserve(self) -> None:
        """Stop serving (waits at most 10 s for open requests)."""
        if self._runner is not None:
            await asyncio.wait_for(self._runner.cleanup(), timeout=10)
            self._runner = None

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
