"""The controller's HTTP client for calls to task workers: one interface, two implementations.

``request(method, url, body, headers, timeout_s) -> Response``; errors: :class:`ConnectError`
(nothing was sent), :class:`Disconnected` (the connection broke after sending), ``TimeoutError``.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple, Protocol

import aiohttp

from env_controller.workerhttp import ConnectError, Disconnected, WorkerHttp

CLIENTS = ("aiohttp", "workerhttp")


class Response(NamedTuple):
    """A reply: status code, headers (looked up case-insensitively by lower-case name) and body."""

    status: int
    headers: Mapping[str, str]
    body: bytes


class WorkerClient(Protocol):
    """What the controller needs from an HTTP client."""

    async def request(
        self, method: str, url: str, body: bytes | None, headers: Mapping[str, str], timeout_s: float
    ) -> Response: ...

    def sweep(self) -> int: ...

    async def close(self) -> None: ...


class AiohttpWorkerClient:
    """``aiohttp.ClientSession`` over a pooled ``TCPConnector`` (``max_in_flight`` connections)."""

    def __init__(self, max_in_flight: int = 2048, keepalive_s: float = 3.0, connect_timeout_s: float = 5.0) -> None:
        """As :class:`~env_controller.workerhttp.WorkerHttp`."""
        self.max_in_flight = max_in_flight
        self.keepalive_s = float(keepalive_s)
        self.connect_timeout_s = float(connect_timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._closed = False

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=self.max_in_flight, limit_per_host=0, keepalive_timeout=self.keepalive_s)
            self._session = aiohttp.ClientSession(
                connector=connector, auto_decompress=False, skip_auto_headers=("User-Agent", "Accept-Encoding")
            )
        return self._session

    async def request(
        self, method: str, url: str, body: bytes | None, headers: Mapping[str, str], timeout_s: float
    ) -> Response:
        """Send one request and read the whole reply, within ``timeout_s`` (connect included)."""
        if self._closed:
            raise ConnectError("the worker HTTP client is closed")
        timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=self.connect_timeout_s)
        try:
            async with self._http().request(method, url, data=body, headers=headers, timeout=timeout) as resp:
                return Response(resp.status, resp.headers, await resp.read())
        except aiohttp.ConnectionTimeoutError:
            raise ConnectError(f"no connection within {self.connect_timeout_s:g} s") from None
        except aiohttp.ClientConnectorError as e:
            raise ConnectError(f"cannot connect: {e.strerror or e}") from None
        except TimeoutError:
            raise
        except (aiohttp.ClientError, OSError) as e:
            raise Disconnected(f"{type(e).__name__}: {e}") from None

    def sweep(self) -> int:
        """Nothing to do: the connector closes idle connections after ``keepalive_s`` itself."""
        return 0

    async def close(self) -> None:
        """Close every connection and refuse new requests."""
        self._closed = True
        if self._session is not None:
            await self._session.close()
            self._session = None


def make_worker_client(kind: str, max_in_flight: int, keepalive_s: float, connect_timeout_s: float) -> WorkerClient:
    """The client named ``kind`` (one of :data:`CLIENTS`)."""
    if kind == "aiohttp":
        return AiohttpWorkerClient(max_in_flight, keepalive_s, connect_timeout_s)
    if kind == "workerhttp":
        return WorkerHttp(max_in_flight, keepalive_s, connect_timeout_s)  # type: ignore[return-value]
    raise ValueError(f"worker client {kind!r}: expected one of {CLIENTS}")
