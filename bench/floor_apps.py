"""The servers that bench/floor.py measures beside tinygw: what the stack costs before any
of tinygw's own logic. Not part of tinygw; loopback only.

- `hello`: Granian's ASGI interface answering the upstream's chat body itself (no upstream).
- `pool_app`: Granian's ASGI interface, each request's body forwarded with tinygw's own
  upstream pool (tinygw.upstream.pool) to the instant upstream, the answer sent back: nothing else.
- `python bench/floor_apps.py PORT UPSTREAM_PORT`: the same forwarding on one thread, a
  uvloop server with no Granian (instant_upstream.py's way of finding a request's end).

The upstream's port comes from FLOOR_UPSTREAM_PORT (Granian) or argv (the uvloop server).
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tinygw, from this tree
sys.path.insert(0, str(Path(__file__).resolve().parent))

from instant_upstream import _CHAT  # noqa: E402 - the same chat answer as the upstream's

from tinygw.config.settings import Origin  # noqa: E402
from tinygw.upstream.pool import Pool, Timeouts  # noqa: E402

_CHAT_PATH = b"/v1/chat/completions"
_REQUEST_HEADERS = [(b"content-type", b"application/json")]
_pool: Pool | None = None


def _pool_for(port: int) -> Pool:
    global _pool
    if _pool is None:
        _pool = Pool(
            Origin("http", "127.0.0.1", port, "/v1"),
            max_connections=256,
            timeouts=Timeouts(5, 30, 60),
            ssl_context=None,
            loop=asyncio.get_running_loop(),
        )
    return _pool


async def _lifespan(receive, send) -> None:
    await receive()
    await send({"type": "lifespan.startup.complete"})
    await receive()
    await send({"type": "lifespan.shutdown.complete"})


async def hello(scope, receive, send) -> None:
    if scope["type"] == "lifespan":
        await _lifespan(receive, send)
        return
    await receive()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": _CHAT})


async def pool_app(scope, receive, send) -> None:
    if scope["type"] == "lifespan":
        await _lifespan(receive, send)
        return
    body = (await receive())["body"]
    response = await _pool_for(int(os.environ["FLOOR_UPSTREAM_PORT"])).request(
        b"POST", _CHAT_PATH, _REQUEST_HEADERS, body
    )
    data = await response.read()
    await send(
        {
            "type": "http.response.start",
            "status": response.status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(data))],
        }
    )
    await send({"type": "http.response.body", "body": data})


class _Forwarding(asyncio.Protocol):
    """HTTP/1.1 keep-alive with content-length bodies, as wrk sends them; one request at a time."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            return
        head = bytes(self.buffer[:end]).lower()
        i = head.find(b"\r\ncontent-length:")
        j = head.find(b"\r\n", i + 2)
        length = int(head[i + 17 : j if j >= 0 else len(head)]) if i >= 0 else 0
        if len(self.buffer) < end + 4 + length:
            return
        body = bytes(self.buffer[end + 4 : end + 4 + length])
        del self.buffer[: end + 4 + length]
        asyncio.get_running_loop().create_task(self._forward(body))

    async def _forward(self, body: bytes) -> None:
        response = await _pool_for(self.upstream_port).request(b"POST", _CHAT_PATH, _REQUEST_HEADERS, body)
        data = await response.read()
        self.transport.write(
            b"HTTP/1.1 %d OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
            % (response.status, len(data))
            + data
        )


async def _serve(port: int, upstream_port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Forwarding(upstream_port), "127.0.0.1", port, backlog=4096)
    print(server.sockets[0].getsockname()[1], flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    import uvloop

    uvloop.run(_serve(int(sys.argv[1]), int(sys.argv[2])))
