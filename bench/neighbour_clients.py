"""The clients' side of `make bench-neighbours` (bench/neighbours.py): one keep-alive HTTP/1.1 exchange on
asyncio streams (the request written as raw bytes, so that a hostile client can send what http.client
refuses), a client's connection opened again after an error, a paced loop, and the event loop they run on.

Imported by bench/neighbours.py; imports no script.
"""

from __future__ import annotations

import asyncio
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: its library, however this is imported
from lib import HOST, PATH  # noqa: E402

REQUEST_TIMEOUT_SECONDS = 10  # a request of either client not answered by then is a failure


def request_bytes(payload: bytes, key: str, target: bytes = PATH.encode(), extra: bytes = b"") -> bytes:
    return (
        b"POST %s HTTP/1.1\r\nhost: %s\r\nauthorization: Bearer %s\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n%s\r\n%s" % (target, HOST.encode(), key.encode(), len(payload), extra, payload)
    )


async def exchange(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes
) -> tuple[int, bytes, bool]:
    """Send `request`, read its whole answer (content-length or chunked): (status, body, closes)."""
    writer.write(request)
    head = (await reader.readuntil(b"\r\n\r\n")).lower()
    status = int(head[9:12])
    i = head.find(b"\r\ncontent-length:")
    if i >= 0:
        j = head.find(b"\r\n", i + 2)
        answer = await reader.readexactly(int(head[i + 17 : j]))
    elif b"\r\ntransfer-encoding: chunked" in head:
        parts = []
        while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
            parts.append((await reader.readexactly(size + 2))[:-2])
        await reader.readuntil(b"\r\n")  # the last chunk's CRLF (no trailers here)
        answer = b"".join(parts)
    else:
        answer = await reader.read()
    return status, answer, b"\r\nconnection: close" in head


EXCHANGE_ERRORS = (OSError, EOFError, ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError)


class Client:
    """One client's keep-alive connection, opened again after an error or a `connection: close`."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def send(self, request: bytes) -> tuple[int, bytes]:
        """(status, body); status 0 when the exchange failed or took over REQUEST_TIMEOUT_SECONDS."""
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT_SECONDS):
                if self.streams is None:
                    self.streams = await asyncio.open_connection(HOST, self.port)
                    self.streams[1].get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                status, answer, closes = await exchange(*self.streams, request)
        except EXCHANGE_ERRORS as e:
            self.close()
            return 0, repr(e).encode()
        if closes:
            self.close()
        return status, answer

    def close(self) -> None:
        if self.streams is not None:
            self.streams[1].close()
            self.streams = None


async def paced(interval: float, offset: float, stop: asyncio.Event, step) -> None:
    """Call `step(n)` (a coroutine) every `interval` seconds from `offset`, never two at once, until
    `stop`; a step that overruns its slot is followed at once, without bursting to catch up."""
    loop = asyncio.get_running_loop()
    next_at, n = loop.time() + offset, 0
    while not stop.is_set():
        delay = next_at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
            if stop.is_set():
                return
        next_at = max(next_at + interval, loop.time())
        await step(n)
        n += 1


def run_loop(coroutine):
    """On uvloop where it is installed (tinygw's venv has it): the clients' own cost, as low as can be."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coroutine)
    return uvloop.run(coroutine)
