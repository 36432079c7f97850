"""A small pooled HTTP/1.1 client: the controller's calls to task workers, the env client's to the controller,
the SGLang client's ``/generate`` calls.

The controller's hot path is a proxy: every trainer request becomes one request to a worker; a rollout holds a
request open at an SGLang server for each running turn, thousands at once. This client does only what those
calls need (JSON POST/GET over plain ``http://``, keep-alive
pooling, Content-Length or chunked replies) on asyncio protocols, at less CPU per call than aiohttp's
pooled ``ClientSession`` (measured side by side in docs/BENCHMARKS.md).

Errors: :class:`ConnectError` (the connection could not be opened: nothing was sent),
:class:`Disconnected` (the connection failed after the request was sent), ``TimeoutError``.
"""
from __future__ import annotations

import asyncio
import re
import time
from collections import deque
from collections.abc import Mapping
from typing import NamedTuple
from urllib.parse import urlsplit


class ConnectError(OSError):
    """The connection could not be opened (refused, unreachable, connect timeout)."""


class Disconnected(OSError):
    """The connection broke before the whole reply arrived."""


class Response(NamedTuple):
    """A reply: status code, headers (names lower-cased) and body."""

    status: int
    headers: dict[str, str]
    body: bytes


class Target(NamedTuple):
    """Where a URL points: host, port, path, and the Host header value."""

    host: str
    port: int
    path: str
    host_header: str


_HOST = re.compile(r"[A-Za-z0-9._-]{1,253}|\[[0-9A-Fa-f:.]{2,45}\]")
_PRINTABLE = re.compile(r"[!-~]*")


def parse_url(url: str) -> Target:
    """Split an ``http://host:port/path`` URL; ValueError for anything else (https included).

    The host must be a name or an IP address and the whole URL printable ASCII: it goes into a
    request line and a Host header as is.
    """
    if not isinstance(url, str) or not _PRINTABLE.fullmatch(url):
        raise ValueError(f"{url!r:.200}: a URL must be printable ASCII without spaces (percent-encode the rest)")
    try:
        parts = urlsplit(url)
        port = parts.port or 80
    except ValueError as e:
        raise ValueError(f"{url!r:.200}: {e}") from None
    netloc_host = parts.netloc.rpartition("@")[2]
    netloc_host = netloc_host.rsplit(":", 1)[0] if not netloc_host.endswith("]") else netloc_host
    if parts.scheme != "http" or not parts.hostname or not _HOST.fullmatch(netloc_host):
        raise ValueError(f"{url!r:.200}: only http://host[:port]/path URLs are supported")
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    host = parts.hostname
    host_header = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return Target(host, port, path, host_header)


def _keepalive_timeout(hint: str) -> float | None:
    """The ``timeout=N`` of a ``Keep-Alive`` header, in seconds (None when absent or malformed)."""
    for part in hint.split(","):
        name, _, value = part.strip().partition("=")
        if name.strip().lower() == "timeout":
            try:
                return float(value.strip())
            except ValueError:
                return None
    return None


class _Conn(asyncio.Protocol):
    """One keep-alive connection; parses one reply at a time into ``self.waiter``."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[Response] | None = None
        self.buf = bytearray()
        self.closed = False
        self.reusable = True
        self.idle_since = time.monotonic()
        #: how long the server keeps this connection idle, as its ``Keep-Alive: timeout=N`` says (None: unsaid)
        self.server_keepalive_s: float | None = None
        self._head: tuple[int, dict[str, str]] | None = None
        self._body_start = 0

    # -- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # noqa: D102
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:  # noqa: D102
        if self.waiter is None:  # bytes nobody asked for: the connection is out of step
            self.close()
            return
        self.buf += data
        try:
            self._parse()
        except ValueError as e:
            self._fail(Disconnected(f"bad HTTP reply: {e}"))

    def eof_received(self) -> bool:  # noqa: D102
        if self.waiter is not None and self._head is not None and self._framing == "eof":
            status, headers = self._head
            self._finish(Response(status, headers, bytes(self.buf[self._body_start:])), reusable=False)
        return False

    def connection_lost(self, exc: Exception | None) -> None:  # noqa: D102
        self.closed = True
        if self.waiter is not None and not self.waiter.done():
            reason = f"{type(exc).__name__}: {exc}" if exc else "the server closed the connection"
            self.waiter.set_exception(Disconnected(reason))

    # -- parsing -----------------------------------------------------------------------------

    _framing = "length"
    _length = 0

    def _parse(self) -> None:
        buf = self.buf
        while self._head is None:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > 65536:
                    raise ValueError("reply headers longer than 64 KiB")
                return
            lines = bytes(buf[:end]).decode("latin-1").split("\r\n")
            version, _, rest = lines[0].partition(" ")
            if not version.startswith("HTTP/1."):
                raise ValueError(f"status line {lines[0][:80]!r}")
            status = int(rest[:3])
            headers: dict[str, str] = {}
            for line in lines[1:]:
                name, sep, value = line.partition(":")
                if sep:
                    headers[name.strip().lower()] = value.strip()
            if 100 <= status < 200:  # interim reply: skip it
                del buf[: end + 4]
                continue
            self._head = (status, headers)
            self._body_start = end + 4
            hint = headers.get("keep-alive")
            if hint is not None:
                self.server_keepalive_s = _keepalive_timeout(hint)
            connection = headers.get("connection", "").lower()
            self.reusable = (version == "HTTP/1.1" and connection != "close") or connection == "keep-alive"
            if status in (204, 304):
                self._framing, self._length = "length", 0
            elif "chunked" in headers.get("transfer-encoding", "").lower():
                self._framing = "chunked"
            elif "content-length" in headers:
                self._framing, self._length = "length", int(headers["content-length"])
            else:
                self._framing = "eof"
        status, headers = self._head
        if self._framing == "length":
            if len(buf) - self._body_start >= self._length:
                body = bytes(buf[self._body_start : self._body_start + self._length])
                extra = len(buf) - self._body_start - self._length
                self._finish(Response(status, headers, body), reusable=self.reusable and extra == 0)
        elif self._framing == "chunked":
            body = self._dechunk()
            if body is not None:
                self._finish(Response(status, headers, body), reusable=self.reusable)

    def _dechunk(self) -> bytes | None:
        out = bytearray()
        pos = self._body_start
        buf = self.buf
        while True:
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                return None
            size = int(bytes(buf[pos:eol]).split(b";")[0].strip() or b"0", 16)
            if size == 0:  # the last chunk; (optional trailers and) an empty line end the body
                return bytes(out) if buf.find(b"\r\n\r\n", eol) >= 0 else None
            start = eol + 2
            if len(buf) < start + size + 2:
                return None
            out += buf[start : start + size]
            pos = start + size + 2

    def _finish(self, response: Response, reusable: bool) -> None:
        waiter, self.waiter = self.waiter, None
        self.buf = bytearray()
        self._head = None
        self.reusable = reusable
        if waiter is not None and not waiter.done():
            waiter.set_result(response)

    def _fail(self, exc: Exception) -> None:
        waiter, self.waiter = self.waiter, None
        self.close()
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)

    def close(self) -> None:
        """Close the connection (it leaves the pool)."""
        self.closed = True
        self.reusable = False
        if self.transport is not None:
            self.transport.close()


#: the longest a connection stays pooled idle, whatever its server's Keep-Alive says
MAX_KEEPALIVE_S = 60.0


class _Call:
    """One request in flight: its reply future, its slot, its connection, its deadline."""

    __slots__ = ("http", "future", "key", "target", "data", "conn", "timer", "connecting", "has_slot")

    def __init__(self, http: PooledHttp, future: asyncio.Future[Response], target: Target, data: bytes) -> None:
        self.http = http
        self.future = future
        self.key = (target.host, target.port)
        self.target = target
        self.data = data
        self.conn: _Conn | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.connecting: asyncio.Task[None] | None = None
        self.has_slot = False

    def send(self, conn: _Conn) -> None:
        """Write the request on ``conn``; its reply resolves the future."""
        self.conn = conn
        conn.waiter = self.future
        assert conn.transport is not None
        conn.transport.write(self.data)

    def expire(self) -> None:
        self.timer = None
        if not self.future.done():
            self.future.set_exception(TimeoutError())

    def finished(self, future: asyncio.Future[Response]) -> None:
        """The future is done (a reply, an error, the timeout, or cancelled by the caller): keep or close
        the connection, give the slot to the next call waiting for one."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        conn = self.conn
        if conn is not None:
            self.conn = None
            if conn.waiter is future:
                conn.waiter = None
            if not future.cancelled() and future.exception() is None and conn.reusable and not conn.closed:
                conn.idle_since = time.monotonic()
                self.http._idle.setdefault(self.key, []).append(conn)
            else:
                conn.close()
        if self.connecting is not None and not self.connecting.done():
            self.connecting.cancel()
        self.connecting = None
        if self.has_slot:
            self.has_slot = False
            self.http._release()


class PooledHttp:
    """Pooled keep-alive HTTP/1.1 connections to many ``host:port`` pairs.

    ``max_in_flight`` bounds concurrent requests (and so open connections); idle connections
    are closed after ``keepalive_s`` (keep it below the servers' own keep-alive timeout), or a second
    before the timeout their server announces in ``Keep-Alive: timeout=N`` when that is longer (the fast
    front announces its idle timeout: our workers' and controller's connections stay pooled, stock
    AgentRL workers' (uvicorn, 5 s, unannounced) close after ``keepalive_s``).

    A request is a future driven by callbacks (:meth:`start`): no task, timeout scope or lock per
    call; only opening a connection runs as a task. The request head of each (method, URL,
    headers) is built once.
    """

    def __init__(self, max_in_flight: int = 2048, keepalive_s: float = 3.0, connect_timeout_s: float = 5.0,
                 refused_for_s: float = 0.0) -> None:
        """See the class docstring; ``refused_for_s``: after a connection to an address could not be
        opened, calls to it fail at once (the same :class:`ConnectError`) for this long (0: never)."""
        self.keepalive_s = float(keepalive_s)
        self.refused_for_s = float(refused_for_s)
        self.connect_timeout_s = float(connect_timeout_s)
        self.max_in_flight = int(max_in_flight)
        self._idle: dict[tuple[str, int], list[_Conn]] = {}
        self._in_flight = 0
        self._waiting: deque[_Call] = deque()  # calls waiting for a slot, oldest first
        self._targets: dict[str, Target] = {}
        self._heads: dict[tuple[str, str, tuple[tuple[str, str], ...]], bytes] = {}
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop of its connections (one loop per client)
        #: addresses a connection could not be opened to: until when calls to them fail at once, and why
        self._refused: dict[tuple[str, int], tuple[float, str]] = {}
        self._closed = False

    def target(self, url: str) -> Target:
        """``parse_url`` with a cache (a worker's few URLs are called many times)."""
        t = self._targets.get(url)
        if t is None:
            if len(self._targets) > 10_000:
                self._targets.clear()
            t = self._targets[url] = parse_url(url)
        return t

    def _head(self, method: str, url: str, t: Target, headers: Mapping[str, str]) -> bytes:
        key = (method, url, tuple(headers.items()))
        head = self._heads.get(key)
        if head is None:
            if len(self._heads) > 10_000:
                self._heads.clear()
            lines = [f"{method} {t.path} HTTP/1.1\r\nHost: {t.host_header}\r\n"]
            lines += [f"{name}: {value}\r\n" for name, value in headers.items()]
            head = self._heads[key] = "".join(lines).encode("latin-1")
        return head

    async def _connect(self, t: Target) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(_Conn, t.host, t.port)
        except TimeoutError:
            raise ConnectError(f"no connection to {t.host_header} within {self.connect_timeout_s:g} s") from None
        except OSError as e:
            raise ConnectError(f"cannot connect to {t.host_header}: {e.strerror or e}") from None
        return conn

    async def _connect_for(self, call: _Call) -> None:
        try:
            conn = await self._connect(call.target)
        except ConnectError as e:
            if self.refused_for_s > 0:
                self._refused[call.key] = (time.monotonic() + self.refused_for_s, str(e))
            if not call.future.done():
                call.future.set_exception(e)
            return
        if call.future.done():  # timed out or cancelled meanwhile: the connection serves a later call
            conn.idle_since = time.monotonic()
            self._idle.setdefault(call.key, []).append(conn)
            return
        try:
            call.send(conn)
        except Exception as e:  # noqa: BLE001 - a transport that broke at once
            call.future.set_exception(Disconnected(f"{type(e).__name__}: {e}"))

    def _keepalive(self, conn: _Conn) -> float:
        """How long ``conn`` may stay idle: ``keepalive_s``, or, when its server says it keeps connections
        longer (``Keep-Alive: timeout=N``, as the fast front says), up to a second short of that (at most
        :data:`MAX_KEEPALIVE_S`)."""
        hint = conn.server_keepalive_s
        if hint is None or hint - 1.0 <= self.keepalive_s:
            return self.keepalive_s
        return min(hint - 1.0, MAX_KEEPALIVE_S)

    def _take_idle(self, key: tuple[str, int]) -> _Conn | None:
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < self._keepalive(conn):
                return conn
            conn.close()
        return None

    def _begin(self, call: _Call) -> None:
        """Take a slot for ``call`` and send it on an idle connection, or open one (or fail it at once when
        opening one to that address failed less than ``refused_for_s`` ago)."""
        self._in_flight += 1
        call.has_slot = True
        conn = self._take_idle(call.key)
        if conn is None:
            refused = self._refused.get(call.key)
            if refused is not None:
                if time.monotonic() < refused[0]:
                    call.future.set_exception(ConnectError(refused[1]))
                    return
                del self._refused[call.key]
            call.connecting = self._loop.create_task(self._connect_for(call))
            return
        try:
            call.send(conn)
        except Exception as e:  # noqa: BLE001 - a transport that broke at once
            call.future.set_exception(Disconnected(f"{type(e).__name__}: {e}"))

    def _release(self) -> None:
        self._in_flight -= 1
        waiting = self._waiting
        while waiting and self._in_flight < self.max_in_flight:
            call = waiting.popleft()
            if not call.future.done():
                self._begin(call)

    def start(
        self,
        method: str,
        url: str,
        body: bytes | None,
        headers: Mapping[str, str],
        timeout_s: float,
    ) -> asyncio.Future[Response]:
        """Send one request; the future resolves to the whole reply within ``timeout_s`` (waiting for a
        slot and connecting included) or fails (:class:`ConnectError`, :class:`Disconnected`,
        ``TimeoutError``). Cancelling it abandons the request (its connection is closed).
        ValueError for a URL no request can carry."""
        if self._closed:
            raise ConnectError("the worker HTTP client is closed")
        t = self.target(url)
        head = self._head(method, url, t, headers)
        if body is None:
            data = head + b"\r\n"
        else:
            data = b"".join((head, b"Content-Length: %d\r\n\r\n" % len(body), body))
        loop = self._loop
        if loop is None or loop.is_closed():  # kept: asyncio.get_running_loop() costs a getpid() call each time
            loop = self._loop = asyncio.get_running_loop()
        future: asyncio.Future[Response] = loop.create_future()
        call = _Call(self, future, t, data)
        call.timer = loop.call_later(timeout_s, call.expire)
        future.add_done_callback(call.finished)
        if self._in_flight < self.max_in_flight:
            self._begin(call)
        else:
            self._waiting.append(call)
        return future

    #: ``await http.request(...)``: send one request and read the whole reply (:meth:`start`'s future)
    request = start

    def sweep(self) -> int:
        """Close idle connections older than ``keepalive_s``; returns how many were closed."""
        now = time.monotonic()
        n = 0
        for key, idle in list(self._idle.items()):
            keep = []
            for conn in idle:
                if conn.closed or now - conn.idle_since >= self._keepalive(conn):
                    conn.close()
                    n += 1
                else:
                    keep.append(conn)
            if keep:
                self._idle[key] = keep
            else:
                del self._idle[key]
        return n

    async def close(self) -> None:
        """Close every idle connection and refuse new requests."""
        self._closed = True
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
        await asyncio.sleep(0)
