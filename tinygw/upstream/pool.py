"""A keep-alive connection pool per provider, and the streamed response it hands out.

Which connection serves a request is decided synchronously (`_take_idle`); waits are
bounded by the provider's connect, first-byte and total timeouts. A response holds
its connection until it is read to the end (the connection goes back to the pool) or
closed early (the connection is discarded: a partial read, an error or a client that
left never leaves a half-read connection behind).
"""

from __future__ import annotations

import asyncio
import resource
import ssl
from collections import deque
from collections.abc import Awaitable, Callable
from operator import itemgetter

import certifi
from msgspec import Struct

from tinygw import errors
from tinygw.config.settings import Origin
from tinygw.upstream.connection import Connection, encode_request, open_connection
from tinygw.upstream.decoding import Decoder, decoder_for

# A connection idle longer than this is closed instead of reused. Servers close idle
# keep-alive connections on their own clock (uvicorn, which vLLM and many OpenAI-
# compatible servers run on, after 5 s); staying under that keeps us from sending a
# request on a connection the provider is closing at the same moment.
IDLE_SECONDS = 4.0


# A provider's credentials made for one request, from the head as it will be written
# (Host and Content-Length included) and the body, waited for at most the seconds given:
# AWS's signature, Google's token (tinygw.worker.credentials). Returns the head to write;
# raises ProviderCredentials.
Authorize = Callable[[bytes, bytes, list[tuple[bytes, bytes]], bytes, float], Awaitable[list[tuple[bytes, bytes]]]]

# What `read()` takes whole when no smaller limit is given (model listings pass their
# own). The proxy never reads an answer whole: it holds at most 1 MiB of it (proxy.py).
MAX_RESPONSE_BYTES = 16 * 1024 * 1024

_NAME_OF = itemgetter(0)


# Open files a worker keeps for itself beyond its connections (its listening socket, the
# log, the metric store's maps, TLS and configuration files).
RESERVED_FILES = 256


def connection_budget(open_files: int) -> int:
    """Connections of each kind a worker may hold with `open_files` (its open-file limit):
    half of the files beyond RESERVED_FILES for its clients' connections, half for its
    providers'. A request holds one client connection and at most one provider connection
    at a time, so no provider needs more than half (docs/configuration.md)."""
    return max(0, open_files - RESERVED_FILES) // 2


def default_max_connections(open_files: int) -> int:
    """A provider's `max_connections` when the configuration leaves it out: the budget, within
    the field's bounds (64 to 65536): 9,872 with the usual hard limit of 20,000, and at least
    4,096 from 8,448 open files on."""
    return max(64, min(65536, connection_budget(open_files)))


def open_file_limit() -> int:
    """The soft limit on open files now in force (`tinygw serve` raised it to the hard one)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


class Timeouts(Struct, frozen=True):
    """The bounds of one exchange (docs/design.md section 16): a provider's, or a model's
    where it sets its own. The head of a non-streamed answer comes when generation is
    done, so its wait is bounded by `total_seconds` alone; a stream's head by
    `head_seconds` (it comes at once: the tokens come later), the first byte of its body
    by `first_byte_seconds` from the head, and each pause between reads after that by
    `stall_seconds`."""

    connect_seconds: float
    first_byte_seconds: float
    total_seconds: float
    stall_seconds: float = 120.0
    pool_seconds: float = 10.0  # the wait for a free connection, past which the target is busy
    head_seconds: float = 30.0


class UpstreamRequest(Struct, frozen=True):
    """One request to a provider, as a value; the pool writes its Host and
    Content-Length (`Pool.send`), and its credentials when the provider's are made per
    request (the pool's `authorize`)."""

    method: bytes
    target: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    timeouts: Timeouts
    stream: bool = False  # a streamed answer is asked for (its first byte and stalls are bounded)


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
        loop: asyncio.AbstractEventLoop | None = None,
        on_wait: Callable[[int, float | None], None] | None = None,
        authorize: Authorize | None = None,
    ) -> None:
        """`on_wait(change, waited)` is told when a request starts to wait for a connection
        (change 1, waited None) and when its wait ends (change -1, the seconds it waited).
        `authorize`, when given, makes each request's credentials from its final head."""
        self._authorize = authorize
        self._loop = loop  # the worker's (tinygw.worker.gateway); None: the running loop's (docs/performance.md)
        self.origin = origin
        self.timeouts = timeouts
        self._ssl = ssl_context if origin.scheme == "https" else None
        default_port = 443 if origin.scheme == "https" else 80
        host = f"[{origin.host}]" if ":" in origin.host else origin.host
        # The Host line of every request, made once
        self.host_header = (b"host", (host if origin.port == default_port else f"{host}:{origin.port}").encode())
        self.max_connections = max_connections
        # Connection slots: a count, and the requests waiting for one, first come first
        # served (asyncio.Semaphore's rules).
        self._free_slots = max_connections
        self._waiting: deque[asyncio.Future] = deque()
        self._idle: deque[Connection] = deque()
        self._on_wait = on_wait

    def _take_idle(self, now: float) -> Connection | None:
        """The most recently used connection that may still carry a request; the idle
        ones found expired or closed by the provider on the way are closed."""
        idle = self._idle
        while idle and now - idle[0].idle_since > IDLE_SECONDS:
            idle.popleft().close()
        while idle:
            connection = idle.pop()
            if not connection.has_news():  # neither closed by the provider nor spoken to meanwhile
                return connection
            connection.close()
        return None

    async def request(self, method: bytes, path: bytes, headers: list[tuple[bytes, bytes]], body: bytes) -> Response:
        """`send` a request within the pool's own timeouts (listings, health checks)."""
        return await self.send(UpstreamRequest(method, path, headers, body, self.timeouts))

    async def send(self, request: UpstreamRequest) -> Response:
        """Send one request and wait for the response head; the body is read later. Its
        bytes are made first, with Host and Content-Length: a request that cannot be
        encoded (UnsendableRequest, the client's) takes no connection."""
        body = request.body
        head = [self.host_header, (b"content-length", b"%d" % len(body)), *request.headers]
        timeouts = request.timeouts
        loop = self._loop or asyncio.get_running_loop()
        now = loop.time()
        deadline = now + timeouts.total_seconds
        if self._authorize is not None:  # signed as it will be written (before any slot is taken)
            # a wait for them (a token's fetch) is the attempt's: within its head's bound for a
            # stream, and within its total, which it counts against
            seconds = timeouts.total_seconds
            if request.stream:
                seconds = min(seconds, timeouts.head_seconds)
            head = await self._authorize(request.method, request.target, head, body, seconds)
            now = loop.time()
        encoded = encode_request(request.method, request.target, head, body)
        if self._free_slots:
            self._free_slots -= 1
        else:
            await self._wait_for_slot(min(now + timeouts.pool_seconds, deadline), loop)
            now = loop.time()
        connection = None
        try:
            connection = self._take_idle(now)
            if connection is None:
                connection = await self._connect(min(timeouts.connect_seconds, deadline - now))
                now = loop.time()
            if connection.send_request(encoded):
                await connection.drain(deadline)
                now = loop.time()
            # a stream's head is bounded from the send's time: nothing waited since `now` was read
            if request.stream and (head_by := now + timeouts.head_seconds) < deadline:
                status, response_headers = await connection.receive_head(head_by, errors.HeadTimeout)
            else:  # a non-streamed answer's head comes when it is generated: bounded by the total alone
                status, response_headers = await connection.receive_head(deadline, errors.TotalTimeout)
            # The usual answer has no content-encoding: nothing to decode
            decoder = decoder_for(response_headers) if b"content-encoding" in map(_NAME_OF, response_headers) else None
        except BaseException:
            if connection is not None:
                connection.close()
            self._release_slot()
            raise
        if request.stream:  # the body's first byte is waited for from the head, its pauses after it
            first_byte = (timeouts.first_byte_seconds, errors.FirstByteTimeout, timeouts.stall_seconds)
            return Response(status, response_headers, self, connection, deadline, decoder, *first_byte)
        return Response(status, response_headers, self, connection, deadline, decoder)

    async def _connect(self, seconds: float) -> Connection:
        origin = self.origin
        return await open_connection(origin.host, origin.port, self._ssl, seconds)

    def now(self) -> float:
        return (self._loop or asyncio.get_running_loop()).time()

    def _give_back(self, connection: Connection, reusable: bool) -> None:
        """The exchange on `connection` is over: it waits for the next request when its
        answer ended exactly where its framing said and nothing came after it, else it is
        closed. While it waits, a byte from the provider closes it (Connection.rest);
        whether the provider closed it is checked when it is taken (`_take_idle`)."""
        if reusable and connection.ended_cleanly():
            if connection.rest((self._loop or asyncio.get_running_loop()).time()):
                self._idle.append(connection)
        else:
            connection.close()
        self._release_slot()

    async def _wait_for_slot(self, deadline: float, loop: asyncio.AbstractEventLoop) -> None:
        """Wait in line for a slot until `deadline` (PoolTimeout then). A slot given back
        goes straight to the first in line (_release_slot)."""
        waiter = loop.create_future()
        self._waiting.append(waiter)
        started = loop.time()
        if self._on_wait is not None:
            self._on_wait(1, None)
        try:
            async with asyncio.timeout_at(deadline):
                await waiter
        except BaseException as e:
            if waiter.done() and not waiter.cancelled():  # handed a slot as it gave up: passed on
                self._release_slot()
            else:
                waiter.cancel()  # _release_slot skips it
            if isinstance(e, TimeoutError):
                raise errors.PoolTimeout(f"all of its {self.max_connections} connections stayed busy") from None
            raise
        finally:
            if self._on_wait is not None:
                self._on_wait(-1, loop.time() - started)

    def _release_slot(self) -> None:
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self._free_slots += 1

    async def aclose(self) -> None:
        while self._idle:
            self._idle.pop().close()


class Response(Struct):
    """A response whose head has arrived. Read its body, or close it: both free the slot.

    The body comes decoded: a gzip or deflate `content-encoding` is undone here."""

    status: int
    headers: list[tuple[bytes, bytes]]
    _pool: Pool
    _connection: Connection
    _deadline: float
    _decoder: Decoder | None
    # A stream's: the longest wait for the next read (the first byte's, then a pause's,
    # `_then_seconds`), and the error that ends it.
    _stall_seconds: float | None = None
    _stall_error: type[errors.UpstreamError] = errors.StallTimeout
    _then_seconds: float | None = None
    _done: bool = False

    async def next_chunk(self) -> bytes | None:
        """The next piece of the body as it arrives, or None once it has ended."""
        if self._done:
            return None
        decoder = self._decoder
        try:
            if decoder is not None and (piece := decoder.pending()):
                return piece
            connection, deadline = self._connection, self._deadline
            if self._stall_seconds is not None and (stalled := self._pool.now() + self._stall_seconds) < deadline:
                data = await connection.receive_data(stalled, self._stall_error)
                if self._then_seconds is not None:  # the first byte came: pauses are bounded from now on
                    self._stall_seconds, self._then_seconds = self._then_seconds, None
                    self._stall_error = errors.StallTimeout
            else:
                data = await connection.receive_data(deadline, errors.TotalTimeout)
            if decoder is not None:
                if data is None:
                    decoder.finish()
                else:
                    data = decoder.feed(data)
        except BaseException:
            await self.aclose()
            raise
        if data is None:
            self._done = True
            self._pool._give_back(self._connection, reusable=True)
        return data

    def whole_body(self, limit: int) -> bytes | None:
        """The whole body at once, without a wait, when all of it came with the head and
        it is at most `limit` bytes (the usual answer): the response is then done. Else
        None, and nothing was taken: `read_upto` reads it."""
        if self._decoder is not None or self._done:
            return None
        connection = self._connection
        data = connection.whole_body(limit)
        if data is not None:
            self._done = True
            self._pool._give_back(connection, True)
        return data

    async def read_upto(self, limit: int) -> tuple[bytes, bool]:
        """The body's first bytes, until its end or until more than `limit` bytes
        arrived; and whether the body has ended. The rest is read with next_chunk."""
        data = self.whole_body(limit)
        if data is not None:
            return data, True
        parts: list[bytes] = []
        size = 0
        while size <= limit:
            chunk = await self.next_chunk()
            if chunk is None:
                return b"".join(parts), True
            parts.append(chunk)
            size += len(chunk)
        return b"".join(parts), False

    async def read(self, limit: int = MAX_RESPONSE_BYTES) -> bytes:
        """The whole body; over `limit` bytes the response is dropped instead."""
        data, ended = await self.read_upto(limit)
        if not ended:
            await self.aclose()
            raise errors.ResponseTooLarge(f"the answer is over {limit} bytes")
        return data

    async def aclose(self) -> None:
        """Drop the response. An unfinished body discards its connection. Safe twice."""
        if self._done:
            return
        self._done = True
        self._pool._give_back(self._connection, reusable=False)
