"""The two apps of bench/interfaces.py: the same bare relay of a streamed answer, on Granian's
ASGI interface (`asgi_app`) and on its RSGI interface (`rsgi_app`).

Each request is sent on to the paced upstream (its port in BENCH_UPSTREAM_PORT) through
tinygw's own upstream pool, and each piece of the answer's body is sent on as it comes, one
server send per upstream read, as tinygw's relay does. Nothing else of the gateway runs:
no routing, no circuit, no event scan, no access log. What differs between the two apps is
the server interface alone.
"""

from __future__ import annotations

import os

from tinygw.config.settings import Origin
from tinygw.upstream.pool import Pool, Timeouts

PATH = b"/v1/chat/completions"
HEADERS = [(b"content-type", b"application/json")]
TIMEOUTS = Timeouts(connect_seconds=10.0, first_byte_seconds=60.0, total_seconds=600.0)
_pool: Pool | None = None


def pool() -> Pool:
    global _pool
    if _pool is None:  # made on the worker's loop, at its first request
        origin = Origin("http", "127.0.0.1", int(os.environ["BENCH_UPSTREAM_PORT"]), "")
        _pool = Pool(origin, max_connections=65536, timeouts=TIMEOUTS)
    return _pool


async def asgi_app(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    answer = await pool().request(b"POST", PATH, HEADERS, body)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    while (chunk := await answer.next_chunk()) is not None:
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


async def rsgi_app(scope, protocol) -> None:
    body = await protocol()
    answer = await pool().request(b"POST", PATH, HEADERS, body)
    transport = protocol.response_stream(200, [("content-type", "text/event-stream")])
    while (chunk := await answer.next_chunk()) is not None:
        await transport.send_bytes(chunk)
