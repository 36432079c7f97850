"""The connection cap every HTTP server of the project has (``max_connections``), checked the same way for each."""
from __future__ import annotations

import asyncio
import json
import logging
from typing import Any


async def check_connection_cap(port: int, cap: int, caplog: Any, health_path: str) -> None:
    """With ``cap`` connections open on ``port`` (one of them served by aiohttp: HTTP/1.0 keep-alive is not plain),
    one more is answered 503 and closed, twice, with one log line naming ``max_connections``; once one closes, a
    request to ``health_path`` is served again."""
    held = []
    try:
        for i in range(cap):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            if i == 0:
                writer.write(f"GET {health_path} HTTP/1.0\r\nConnection: keep-alive\r\n\r\n".encode())
                assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)).startswith(b"HTTP/1.")
            held.append(writer)
        for _ in range(2):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            refused = await asyncio.wait_for(reader.read(), 5)  # answered before any request, then closed
            writer.close()
            assert refused.startswith(b"HTTP/1.1 503 Service Unavailable\r\n"), refused
            assert json.loads(refused.split(b"\r\n\r\n", 1)[1]) == {
                "error": f"the server has {cap} connections open, its cap; retry later", "status": 503}
        lines = [r for r in caplog.records if f"max_connections={cap}" in r.getMessage()]
        assert len(lines) == 1 and "new connections are answered 503" in lines[0].getMessage()
        assert lines[0].levelno == logging.WARNING
        held.pop().close()
        await asyncio.sleep(0.2)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(f"GET {health_path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n".encode())
        reply = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        assert reply.startswith(b"HTTP/1.1 200"), reply
    finally:
        for w in held:
            w.close()
