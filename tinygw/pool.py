"""A keep-alive connection pool per provider, and the streamed response it hands out.

Which connection serves a request is decided synchronously (`_take_idle`); waits are
bounded by the provider's connect, first-byte and total timeouts. A response holds
its connection until it is read to the end (the connection goes back to the pool) or
closed early (the connection is discarded: a partial read, an error or a client that
left never leaves a half-read connection behind).
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque

import certifi
from msgspec import Struct

from tinygw import errors
from tinygw.settings import Origin
from tinygw.connection import Connection, open_connection

# A connection idle longer than this is closed instead of reused. Servers close idle
# keep-alive connections on their own clock (uvicorn, which vLLM and many OpenAI-
# compatible servers run on, after 5 s); staying under that keeps us from sending a
# request on a connection the provider is closing at the same moment.
IDLE_SECONDS = 4.0


# A non-streamed answer is read whole before it is sent on; past this size it is
# refused (502) instead. Large enough for a full batch of 2,048 embeddings of 3,072
# dimensions as JSON, small enough that a few at once cannot exhaust a worker.
MAX_RESPONSE_BYTES = 256 * 1024 * 1024


class Timeouts(Struct, frozen=True):
    connect_seconds: float
    first_byte_seconds: float
    total_seconds: float


def tls_context() -> ssl.SSLContext:
    """Verify providers against the CA bundle shipped with tinygw, never the host's."""
    context = ssl.create_default_context(cafile=certifi.where())
    context.set_alpn_protocols(["http/1.1"])
    return context


class Pool:
    def __init__(
        self,
        origin: Origin,
        *,
        max_connections: int,
        timeouts: Timeouts,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.origin = origin
        self.timeouts = timeouts
        self._ssl = ssl_context if origin.scheme == "https" else None
        default_port = 443 if origin.scheme == "https" else 80
        host = f"[{origin.host}]" if ":" in origin.host else origin.host
        self._host_header = (host if origin.port == default_port else f"{host}:{origin.port}").encode()
        self.max_connections = max_connections
        self._slots = asyncio.Semaphore(max_connections)
        self._idle: deque[Connection] = deque()

    def _take_idle(self, now: float) -> tuple[Connection | None, list[Connection]]:
        """The most recently used connection that may still carry a request, and the
        idle ones found expired or closed by the provider on the way (to be closed)."""
        stale = []
        while self._idle and now - self._idle[0].idle_since > IDLE_SECONDS:
            stale.append(self._idle.popleft())
        while self._idle:
            connection = self._idle.pop()
            if connection.is_idle():
                return connection, stale
            stale.append(connection)
        return None, stale

    async def request(
        self, method: bytes, path: bytes, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> Response:
        """Send one request and wait for the response head; the body is read later."""
        t = self.timeouts
        loop = asyncio.get_running_loop()
        deadline = loop.time() + t.total_seconds
        if self._slots.locked():
            try:
                async with asyncio.timeout_at(deadline):
                    await self._slots.acquire()
            except TimeoutError:
                raise errors.PoolTimeout(f"all {self.max_connections} connections stayed busy") from None
        else:
            await self._slots.acquire()  # returns at once
        connection = None
        try:
            now = loop.time()
            connection, stale = self._take_idle(now)
            for old in stale:
                old.close()
            if connection is None:
                connection = await open_connection(
                    self.origin.host, self.origin.port, self._ssl, min(t.connect_seconds, deadline - now)
                )
            head = [(b"host", self._host_header), (b"content-length", b"%d" % len(body)), *headers]
            await connection.send_request(method, path, head, body, deadline)
            first_byte = loop.time() + t.first_byte_seconds
            if first_byte < deadline:
                status, response_headers = await connection.receive_head(first_byte, errors.FirstByteTimeout)
            else:
                status, response_headers = await connection.receive_head(deadline, errors.TotalTimeout)
        except BaseException:
            if connection is not None:
                connection.close()
            self._slots.release()
            raise
        return Response(self, connection, status, response_headers, deadline)

    def _give_back(self, connection: Connection, reusable: bool) -> None:
        if reusable and connection.is_idle():
            connection.idle_since = asyncio.get_running_loop().time()
            self._idle.append(connection)
        else:
            connection.close()
        self._slots.release()

    async def aclose(self) -> None:
        while self._idle:
            self._idle.pop().close()


class Response:
    """A response whose head has arrived. Read its body, or close it: both free the slot."""

    __slots__ = ("status", "headers", "_pool", "_connection", "_deadline", "_done")

    def __init__(
        self, pool: Pool, connection: Connection, status: int, headers: list[tuple[bytes, bytes]], deadline: float
    ) -> None:
        self.status = status
        self.headers = headers
        self._pool = pool
        self._connection = connection
        self._deadline = deadline
        self._done = False

    async def next_chunk(self) -> bytes | None:
        """The next piece of the body as it arrives, or None once it has ended."""
        if self._done:
            return None
        try:
            data = await self._connection.receive_data(self._deadline, errors.TotalTimeout)
        except BaseException:
            await self.aclose()
            raise
        if data is None:
            self._done = True
            self._pool._give_back(self._connection, reusable=True)
        return data

    async def read(self, limit: int = MAX_RESPONSE_BYTES) -> bytes:
        """The whole body; over `limit` bytes the response is dropped instead."""
        parts = []
        size = 0
        while (chunk := await self.next_chunk()) is not None:
            size += len(chunk)
            if size > limit:
                await self.aclose()
                raise errors.ResponseTooLarge(f"the answer is over {limit} bytes")
            parts.append(chunk)
        return b"".join(parts)

    async def aclose(self) -> None:
        """Drop the response. An unfinished body discards its connection. Safe twice."""
        if self._done:
            return
        self._done = True
        self._pool._give_back(self._connection, reusable=False)
