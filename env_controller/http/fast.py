"""A lean HTTP/1.1 front for an aiohttp app: plain requests to known routes are served by a small
asyncio protocol, everything else is handed to aiohttp on the same connection.

The controller is a proxy whose every trainer request becomes one worker call; aiohttp's server costs
several times what parsing a plain keep-alive request and writing its reply needs (docs/BENCHMARKS.md
has the two side by side). :class:`FastFront` listens in aiohttp's place. On each connection it reads
request heads itself, and a request it recognises as *plain* (``HTTP/1.1``, a route of the app with
that method and path, a ``Content-Length`` body no larger than ``max_fast_body`` or none, header
names that are tokens and values of printable ASCII, each header once, no ``Transfer-Encoding``,
``Expect``, ``Upgrade`` or ``Connection: close``) goes to the route's handler with a
:class:`LiteRequest`; the handler's :class:`Reply` is written by hand. The first request
that is not plain (or any byte it cannot judge) hands the connection, with every byte not yet used, to
aiohttp's own protocol for the rest of its life: so every oddity of HTTP (chunked bodies, large ones,
malformed heads, unknown paths, 404 / 405) keeps aiohttp's handling and its error replies.

With ``taskless``, the front runs a fast route's handler coroutine itself instead of in an ``asyncio.Task``:
its first step runs as the request is read (the worker call goes out in the same pass of the loop), and
each later one when the future it awaits is done: no task's scheduling, registration and context per
request. Such handlers may await futures and coroutines that await futures (a worker call, ``gather``,
``sleep``), but nothing that needs a current task (``asyncio.timeout()``, Python 3.12's ``wait_for``).

Limits kept as aiohttp keeps them: a request head must arrive within ``idle_timeout_s`` of the
connection's opening or its previous reply (else the connection is closed unanswered), and idle
keep-alive connections are closed after ``idle_timeout_s``; a body must arrive within
``body_timeout_s`` of its head (else ``408`` and the connection is closed); a client that leaves
mid-body is logged in one line. Replies go out in request order (one request at a time per
connection, as HTTP/1.1 keep-alive clients send them). A client that does not read its replies gets no
more served: once the unsent bytes pass the transport's high-water mark, the connection neither reads
nor serves until they drain, so pipelined requests wait in the client's socket rather than as replies
in this process; one that still has not read after ``idle_timeout_s`` is dropped.
"""
from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from http import HTTPStatus
from typing import Any, NamedTuple
from urllib.parse import parse_qsl

from aiohttp import web

logger = logging.getLogger(__name__)

#: the largest body served on the fast path (larger ones go to aiohttp, whose limits apply)
MAX_FAST_BODY = 1 << 20
#: the longest request head looked at (longer ones go to aiohttp, which refuses them)
MAX_HEAD = 16384
#: open connections a server keeps at once by default (its clients pool theirs: a trainer's env client 256)
MAX_CONNECTIONS = 4096

_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_HANDED_OVER_HEADERS = frozenset(("transfer-encoding", "expect", "upgrade"))
#: header names seen, as sent -> lower-cased (only valid tokens get in; bounded)
_NAMES: dict[str, str] = {}


class LiteRequest:
    """What a handler reads of a request on the fast path (a subset of ``aiohttp.web.Request``):
    ``method``, ``path``, ``headers`` (names lower-cased), ``query``, ``body``, ``remote``,
    ``content_length``, ``body_exists``, and per-request values by key (``request[key]``)."""

    __slots__ = ("method", "path", "headers", "query", "body", "_conn", "_values")

    def __init__(self, method: str, path: str, headers: dict[str, str], query: dict[str, str], body: bytes,
                 conn: _FastConn) -> None:
        """See the class docstring."""
        self.method = method
        self.path = path
        self.headers = headers
        self.query = query
        self.body = body
        self._conn = conn
        self._values: dict[Any, Any] = {}

    @property
    def remote(self) -> str | None:
        """The client's address (as aiohttp's ``request.remote``)."""
        return self._conn.remote()

    @property
    def content_length(self) -> int:
        """Bytes in the body."""
        return len(self.body)

    @property
    def body_exists(self) -> bool:
        """Whether the request has a body."""
        return bool(self.body)

    def __getitem__(self, key: Any) -> Any:
        return self._values[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        self._values[key] = value

    def get(self, key: Any, default: Any = None) -> Any:
        """A per-request value, or ``default``."""
        return self._values.get(key, default)


#: a fast route's handler: the request in, the reply out (errors already made into replies)
FastHandler = Callable[[LiteRequest], Awaitable["Reply"]]
#: a body that did not arrive: called with (method, path, remote, status, message); returns the reply
GoneHandler = Callable[[str, str, str | None, int, str], "Reply | None"]


class Reply(NamedTuple):
    """A handler's answer on either path: ``body`` (bytes), ``status``, extra ``headers`` (e.g. the session id)
    and ``content_type``. The fast front writes it as it is; :meth:`to_aiohttp` makes aiohttp's response (a
    ``web.Response`` costs several times the building and writing of these bytes)."""

    body: bytes
    status: int = 200
    headers: Mapping[str, str] | None = None
    content_type: str = "application/json; charset=utf-8"

    def to_aiohttp(self) -> web.Response:
        """The same reply as an ``aiohttp.web.Response``."""
        headers = {**self.headers, "Content-Type": self.content_type} if self.headers else {
            "Content-Type": self.content_type}
        return web.Response(body=self.body, status=self.status, headers=headers)


#: reason phrases by status code
_REASONS = {int(s): s.phrase for s in HTTPStatus}
#: headers the serializer writes itself (a handler's own are left out)
_OWN_HEADERS = frozenset(("content-length", "connection", "transfer-encoding", "content-type", "keep-alive"))


def serialize(reply: Reply, close: bool = False, keepalive_s: float | None = None) -> bytes:
    """The bytes of ``reply`` (status line, Content-Type, its headers, Content-Length, the body);
    ``keepalive_s``: announced as ``Keep-Alive: timeout=N`` (how long an idle connection is kept), unless
    ``close``."""
    body = reply.body
    parts = ["HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n" % (
        reply.status, _REASONS.get(reply.status, "Unknown"), reply.content_type, len(body))]
    if reply.headers:
        for name, value in reply.headers.items():
            if name.lower() not in _OWN_HEADERS:
                parts.append("%s: %s\r\n" % (name, value))
    if close:
        parts.append("Connection: close\r\n\r\n")
    elif keepalive_s is not None:
        parts.append("Keep-Alive: timeout=%d\r\n\r\n" % keepalive_s)
    else:
        parts.append("\r\n")
    return "".join(parts).encode("latin-1") + body


class FastFront:
    """Serves ``routes`` (``(method, path) -> handler``) on the fast path; ``fallback()`` makes the aiohttp
    protocol a connection is handed to (no routes: every connection is, at its first request). See the module
    docstring for the limits."""

    def __init__(
        self,
        routes: dict[tuple[str, str], FastHandler],
        fallback: web.Server,
        *,
        body_timeout_s: float,
        idle_timeout_s: float,
        on_gone: GoneHandler,
        max_fast_body: int = MAX_FAST_BODY,
        taskless: bool = False,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        """See the class docstring; ``on_gone``: logs (and counts) a body that did not arrive, and gives
        the reply for a stalled one (status 408); ``taskless``: drive handlers without a task (module
        docstring); ``max_connections``: connections open at once, on either path; one more is answered 503 and
        closed, and reaching the cap is logged once each time."""
        self.routes = routes
        self.fallback = fallback
        self.max_connections = max_connections
        self.refused = 0  # connections refused at the cap
        self._at_cap = False
        self.body_timeout_s = float(body_timeout_s)
        self.idle_timeout_s = float(idle_timeout_s)
        self.max_fast_body = max_fast_body
        self.on_gone = on_gone
        self.taskless = bool(taskless)
        self.conns: set[_FastConn] = set()
        self.handed_over = 0
        self._server: asyncio.AbstractServer | None = None
        #: the event loop it serves on (kept: asyncio.get_running_loop() costs a getpid() call each time)
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]
        self._sweeper: asyncio.TimerHandle | None = None
        self._closing = False

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0: a free port); returns the bound port."""
        loop = self.loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._accept, host, port, backlog=4096, reuse_address=True)
        self._schedule_sweep()
        return int(self._server.sockets[0].getsockname()[1])

    def open_connections(self) -> int:
        """Connections open now: on the fast path (from their acceptance) and handed to aiohttp."""
        return len(self.conns) + len(self.fallback.connections)

    def _accept(self) -> asyncio.Protocol:
        """A new connection's protocol: a fast one, or, with ``max_connections`` open, one that refuses it."""
        if self.open_connections() < self.max_connections:
            self._at_cap = False
            conn = _FastConn(self)
            self.conns.add(conn)  # counted from here, not from connection_made: a burst of accepts comes first
            return conn
        self.refused += 1
        if not self._at_cap:
            self._at_cap = True
            logger.warning("%d connections open, the cap (max_connections=%d): new connections are answered 503 "
                           "and closed until some close; raise max_connections if the clients are yours, else "
                           "look for a client that opens connections and leaves them open",
                           self.open_connections(), self.max_connections)
        body = ('{"error": "the server has %d connections open, its cap; retry later", "status": 503}'
                % self.max_connections).encode()
        return _Refused(serialize(Reply(body, 503, {"Retry-After": "1"}), close=True))

    def _schedule_sweep(self) -> None:
        every = max(0.05, min(5.0, self.idle_timeout_s / 4))
        self._sweeper = self.loop.call_later(every, self._sweep)

    def _sweep(self) -> None:
        """Close keep-alive connections idle past ``idle_timeout_s`` (partial requests have timers of their own),
        and drop those whose client has not read a reply for as long (what is unsent is dropped with them)."""
        now = time.monotonic()
        for conn in list(self.conns):
            if now - conn.idle_since <= self.idle_timeout_s:
                continue
            if conn.write_paused:
                conn.abort()
            elif not conn.busy and not conn.buf:
                conn.close()
        if not self._closing:
            self._schedule_sweep()

    async def close(self, timeout_s: float = 5.0) -> None:
        """Stop listening; close idle connections, let requests in progress answer (at most
        ``timeout_s``), then close the rest. Connections handed to aiohttp are aiohttp's to close."""
        self._closing = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._server is not None:
            self._server.close()
        for conn in list(self.conns):
            conn.close_when_idle()
        deadline = time.monotonic() + timeout_s
        while any(c.busy for c in self.conns) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for conn in list(self.conns):
            conn.close()
            conn.cancel()
        if self._server is not None:
            try:
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
            except TimeoutError:
                pass
            self._server = None


class _Refused(asyncio.Protocol):
    """A connection past the cap: its bytes (a 503 reply) written, then closed."""

    def __init__(self, reply: bytes) -> None:
        self.reply = reply

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # noqa: D102
        transport.write(self.reply)  # type: ignore[attr-defined]
        transport.close()


class _FastConn(asyncio.Protocol):
    """One client connection on the fast path (until it is handed to aiohttp)."""

    __slots__ = ("front", "transport", "buf", "busy", "idle_since", "timer", "task", "awaiting", "closed",
                 "_close_after", "_pending", "_parsed", "_remote", "_paused", "write_paused")

    def __init__(self, front: FastFront) -> None:
        self.front = front
        self.transport: asyncio.Transport | None = None
        self.buf: bytes | bytearray = b""
        self.busy = False  # a request of this connection is in its handler
        self.idle_since = time.monotonic()
        self.timer: asyncio.TimerHandle | None = None
        self.task: asyncio.Task[None] | None = None
        self.awaiting: asyncio.Future[Any] | None = None  # what a taskless handler waits for
        self.closed = False
        self._close_after = False
        self._pending: tuple[str, str] | None = None  # (method, path) whose body is still arriving
        self._parsed: tuple[Any, ...] | None = None  # that request's parsed head
        self._remote: str | None = None
        self._paused = False  # reading paused
        self.write_paused = False  # the transport holds more unsent reply bytes than its high-water mark

    # -- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # noqa: D102
        self.transport = transport  # type: ignore[assignment]
        self.front.conns.add(self)
        if self.front._closing:
            self.close()

    def data_received(self, data: bytes) -> None:  # noqa: D102
        if not self.buf:
            self.buf = data
        else:  # a request in pieces: gather them in place (no copy of all so far per piece)
            if not isinstance(self.buf, bytearray):
                self.buf = bytearray(self.buf)
            self.buf += data
        if self.busy or self.write_paused:
            if len(self.buf) > self.front.max_fast_body + MAX_HEAD:
                self._pause_reading()  # a client sending ahead of its replies waits for them
            return
        self._next()

    def pause_writing(self) -> None:  # noqa: D102
        # the client does not read its replies: serve and read nothing more until it does, so that what it
        # sends ahead waits in its own socket, not as replies in this process
        self.write_paused = True
        self._pause_reading()

    def resume_writing(self) -> None:  # noqa: D102
        self.write_paused = False
        if not self.busy and not self.closed:
            self._resume_reading()
            if self.buf:
                self.front.loop.call_soon(self._next)

    def eof_received(self) -> bool:  # noqa: D102
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:  # noqa: D102
        self.closed = True
        self.front.conns.discard(self)
        self._cancel_timer()
        if self._pending is not None:
            method, path = self._pending
            self._pending = None
            why = f"{type(exc).__name__}: {exc}" if exc else "the connection was closed"
            self.front.on_gone(method, path, self.remote(), 400, f"client went away mid-body ({why})")

    # -- requests ----------------------------------------------------------------------------

    def remote(self) -> str | None:
        """The peer's host (as ``aiohttp.web.Request.remote``)."""
        if self._remote is None and self.transport is not None:
            peer = self.transport.get_extra_info("peername")
            self._remote = str(peer[0]) if isinstance(peer, (tuple, list)) and peer else None
        return self._remote

    def _next(self) -> None:
        """Serve the request at the head of the buffer when it is complete; hand over what is not plain."""
        buf = self.buf
        if not buf or self.busy or self.closed or self.write_paused:
            return
        if self._parsed is not None:  # its head was read before: only the body was awaited
            end, parsed = self._parsed
        else:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > MAX_HEAD:
                    self._handover()
                elif self.timer is None:  # the head must arrive within idle_timeout_s of the last reply
                    self._arm(self.idle_since + self.front.idle_timeout_s, self._head_timeout)
                return
            parsed = self._parse_head(buf, end)
            if parsed is None:
                self._handover()
                return
        handler, method, path, headers, query, length = parsed
        total = end + 4 + length
        if len(buf) < total:
            if self._pending is None:
                self._pending = (method, path)
                self._parsed = (end, parsed)
                self._cancel_timer()
                self._arm(time.monotonic() + self.front.body_timeout_s, self._body_timeout)
            return
        self._pending = self._parsed = None
        self._cancel_timer()
        body = buf[end + 4 : total]
        self.buf = buf[total:]
        self.busy = True
        request = LiteRequest(method, path, headers, query, bytes(body), self)
        if self.front.taskless:
            self._step(handler(request), None, None)
        else:
            self.task = self.front.loop.create_task(self._serve(handler, request))

    def _parse_head(
        self, buf: bytes | bytearray, end: int
    ) -> tuple[FastHandler, str, str, dict[str, str], dict[str, str], int] | None:
        """The route and the request's parts, or None when the request is not plain."""
        try:
            text = buf[:end].decode("ascii")
        except UnicodeDecodeError:
            return None
        lines = text.split("\r\n")
        first = lines[0].split(" ")
        if len(first) != 3 or first[2] != "HTTP/1.1":
            return None
        method, target = first[0], first[1]
        path, _, qs = target.partition("?")
        handler = self.front.routes.get((method, path))
        if handler is None:
            return None
        headers: dict[str, str] = {}
        names = _NAMES
        fields = lines[1:]
        for line in fields:
            name, sep, value = line.partition(":")
            key = names.get(name)
            if key is None or not sep:  # a name not seen before: a token? (then remembered, lower-cased)
                if not sep or not _TOKEN.fullmatch(name):
                    return None
                key = name.lower()
                if len(names) < 4096:
                    names[name] = key
            headers[key] = value.strip(" ")
        # checked once for all lines: no header twice, none of those aiohttp must handle, printable values
        if (len(headers) != len(fields) or not _HANDED_OVER_HEADERS.isdisjoint(headers)
                or not "".join(fields).isprintable()):
            return None
        if headers.get("connection", "keep-alive").lower() != "keep-alive":
            return None
        length_text = headers.get("content-length", "0")
        if not (length_text.isascii() and length_text.isdigit()) or len(length_text) > 12:
            return None
        length = int(length_text)
        if length > self.front.max_fast_body:
            return None
        query: dict[str, str] = {}
        if qs:
            for k, v in parse_qsl(qs, keep_blank_values=True):
                query.setdefault(k, v)
        return handler, method, path, headers, query, length

    async def _serve(self, handler: FastHandler, request: LiteRequest) -> None:
        try:
            response = await handler(request)
        finally:
            self.busy = False
            self.task = None
        self._answer(response)

    def _step(self, coro: Coroutine[Any, Any, Reply], value: Any, exc: BaseException | None) -> None:
        """Run a taskless handler to its next wait (as a task's step would): send it ``value`` or throw
        ``exc``; when it returns, answer; when it waits on a future, resume it once that is done."""
        try:
            awaited = coro.send(value) if exc is None else coro.throw(exc)
        except StopIteration as done:
            self.busy = False
            self._answer(done.value)
            return
        except (Exception, asyncio.CancelledError) as e:  # the service makes errors replies: cancelled, or a bug
            self.busy = False
            if not isinstance(e, asyncio.CancelledError):
                logger.error("a fast-path handler raised %s: %s; the connection is closed", type(e).__name__, e)
            self.close()
            return
        if awaited is None:  # a bare yield (asyncio.sleep(0)): the next pass of the loop resumes it
            self.front.loop.call_soon(self._step, coro, None, None)
            return
        if not asyncio.isfuture(awaited):
            self.front.loop.call_soon(self._step, coro, None,
                                      RuntimeError(f"a taskless handler awaited {awaited!r}, not a future"))
            return
        awaited._asyncio_future_blocking = False  # as a task does: it is handled
        self.awaiting = awaited
        awaited.add_done_callback(lambda f: self._resume(coro, f))

    def _resume(self, coro: Coroutine[Any, Any, Reply], future: asyncio.Future[Any]) -> None:
        self.awaiting = None
        try:
            value = future.result()
        except BaseException as e:  # noqa: BLE001 - thrown into the handler, as a task would
            self._step(coro, None, e)
        else:
            self._step(coro, value, None)

    def _answer(self, response: Reply) -> None:
        """Write a handler's reply (unless the client left), then serve what the client sent meanwhile."""
        if self.closed:
            return
        close = self._close_after
        self.transport.write(serialize(response, close, self.front.idle_timeout_s))  # type: ignore[union-attr]
        self.idle_since = time.monotonic()
        if close:
            self.close()
            return
        if self.write_paused:  # resume_writing() goes on
            return
        self._resume_reading()
        if self.buf:  # a request sent ahead: on the next pass (a taskless reply may come within this call)
            self.front.loop.call_soon(self._next)

    def _pause_reading(self) -> None:
        if not self._paused and self.transport is not None and not self.transport.is_closing():
            self._paused = True
            self.transport.pause_reading()

    def _resume_reading(self) -> None:
        if self._paused and self.transport is not None and not self.transport.is_closing():
            self._paused = False
            self.transport.resume_reading()

    def cancel(self) -> None:
        """Cancel the request in progress, if any (its handler sees ``CancelledError``)."""
        if self.task is not None and not self.task.done():
            self.task.cancel()
        if self.awaiting is not None and not self.awaiting.done():
            self.awaiting.cancel()

    # -- hand-over, timers, closing ----------------------------------------------------------

    def _handover(self) -> None:
        """Give the connection, and the bytes not yet used, to aiohttp's protocol."""
        self._cancel_timer()
        self._pending = self._parsed = None
        self.front.conns.discard(self)
        self.front.handed_over += 1
        transport, data = self.transport, self.buf
        self.buf = b""
        self.closed = True  # for this protocol; the connection lives on under aiohttp
        protocol = self.front.fallback()
        assert transport is not None
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        if self.write_paused:  # aiohttp's protocol waits for resume_writing() before its next write
            protocol.pause_writing()
        if self._paused:
            transport.resume_reading()
        if data:
            protocol.data_received(bytes(data))

    def _arm(self, when_monotonic: float, callback: Callable[[], None]) -> None:
        loop = self.front.loop
        self.timer = loop.call_at(loop.time() + max(0.0, when_monotonic - time.monotonic()), callback)

    def _cancel_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _head_timeout(self) -> None:
        self.timer = None
        if not self.busy and not self.closed:
            self.close()  # as aiohttp: a connection without a complete request head is closed unanswered

    def _body_timeout(self) -> None:
        self.timer = None
        if self._pending is None or self.closed:
            return
        method, path = self._pending
        self._pending = self._parsed = None
        msg = f"request body not received within {self.front.body_timeout_s:g} s; connection closed"
        response = self.front.on_gone(method, path, self.remote(), 408, msg)
        if response is not None and self.transport is not None:
            self.transport.write(serialize(response, close=True))
        self.close()

    def close_when_idle(self) -> None:
        """Close now when no request is in progress, else after its reply."""
        if self.busy:
            self._close_after = True
        else:
            self.close()

    def close(self) -> None:
        """Close the connection (once what is written is sent)."""
        self._cancel_timer()
        self._pending = self._parsed = None
        if self.transport is None:  # accepted, never made: nothing will call connection_lost
            self.front.conns.discard(self)
        elif not self.transport.is_closing():
            self.transport.close()

    def abort(self) -> None:
        """Close the connection now, unsent replies dropped."""
        self._cancel_timer()
        self._pending = self._parsed = None
        if self.transport is not None:
            self.transport.abort()
