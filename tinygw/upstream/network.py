"""The network backend of the upstream client: a byte stream on asyncio's transports.

Granian runs the app on an asyncio loop, so the stream is a plain asyncio Protocol.
Every wait ends at an absolute deadline on the loop's monotonic clock, enforced with a
timer (`loop.call_at`): a read's by the stream's one alarm, which outlives the read
(`Stream._set_alarm`), a drain's by one timer per wait. anyio's cancel scopes, which the
first version used, cost about a third of the gateway's CPU per request (see the closing
note of issue 2). Foreign exceptions are translated here into tinygw.errors.
"""

from __future__ import annotations

import asyncio
import math
import os
import ssl
import weakref
from collections import deque

from tinygw import errors

# What a provider's connection holds that the client has not taken. One read takes at
# most READ_BYTES (the stream gives the transport a buffer of its own: uvloop's would be
# 256 KiB), and reading is paused once more than HIGH_WATER_BYTES wait to be consumed; a
# TLS connection's layer below is given the same mark for what it has not decrypted, and
# takes one read of its own past it (open_stream). A stream's consumer gets all that came
# in one piece: the read handed to it, and what was read behind it before it ran (up to
# HIGH_WATER_BYTES + READ_BYTES), so no piece passed on is over 48 KiB. The server holds a
# few such pieces of an answer whose client does not read (Granian queues 4, its HTTP
# writer 64 KiB: tinygw.server's CLIENT_BUFFER_BYTES), which bounds what a client that
# never reads costs the gateway (docs/design.md section 17).
READ_BYTES = 16 * 1024
HIGH_WATER_BYTES = 16 * 1024

# Where the streams of a loop read: one buffer for all of them, because a loop runs one
# read at a time and buffer_updated copies what it read out at once. One a loop, since
# Granian may run its workers as threads of one process, each with a loop of its own.
_READ_BUFFERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, memoryview] = weakref.WeakKeyDictionary()


def _read_buffer(loop: asyncio.AbstractEventLoop) -> memoryview:
    into = _READ_BUFFERS.get(loop)
    if into is None:
        into = _READ_BUFFERS[loop] = memoryview(bytearray(READ_BYTES))
    return into


class Deadline(Exception):
    """A wait of this module reached its deadline (translated by the caller)."""


def _expire(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_exception(Deadline())


class Stream(asyncio.BufferedProtocol):
    # Set by connection_made, which create_connection calls before it returns the stream:
    # a stream is read, written and closed only once connected (open_stream).
    _transport: asyncio.Transport

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._into = _read_buffer(self._loop)  # where the transport reads (get_buffer)
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._eof = False
        self._lost: BaseException | None = None
        # A waiting read's, done when it wakes (with its data, None for an end, or an
        # exception); between reads a done one (`_no_read`) that holds nothing: a read
        # waits while its waiter is not done, and what it was given is not kept after.
        self._no_read: asyncio.Future[bytes | None] = self._loop.create_future()
        self._no_read.set_result(None)
        self._read_waiter = self._no_read
        self._read_deadline = 0.0  # the last read's
        self._alarm: asyncio.TimerHandle | None = None  # rings at _alarm_at (_set_alarm)
        self._alarm_at = math.inf
        self._write_waiter: asyncio.Future | None = None  # set when the transport's buffer first filled
        self._writing_paused = False  # the transport's buffer is full: a writer must drain
        self._reading_paused = False
        # Set while no request is outstanding (Connection.rest): a byte from the provider then
        # closes the stream at once, never to be read as the next request's answer.
        self.idle = False

    # ---- asyncio.Protocol --------------------------------------------------------------

    def connection_made(self, transport) -> None:
        self._transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._into

    def buffer_updated(self, nbytes: int) -> None:
        data = self._into[:nbytes].tobytes()
        waiter = self._read_waiter
        if not waiter.done():  # the usual read: a reader waits, and takes it as it is
            waiter.set_result(data)
            return
        if self.idle:  # the provider speaks out of turn: the connection is done
            self.close()
            return
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > HIGH_WATER_BYTES and not self._reading_paused:
            self._reading_paused = True
            self._transport.pause_reading()

    def eof_received(self) -> bool:
        self._eof = True
        self._wake_reader()
        return False  # let the transport close

    def connection_lost(self, exc: BaseException | None) -> None:
        self._eof = True
        self._lost = exc
        self._wake_reader()
        if self._alarm is not None:  # no read waits on a lost connection: the stream is not kept for it
            self._alarm.cancel()
            self._alarm, self._alarm_at = None, math.inf
        self.resume_writing()  # a writer waiting to drain wakes (drain then says why)

    def pause_writing(self) -> None:
        self._write_waiter = self._loop.create_future()
        self._writing_paused = True

    def resume_writing(self) -> None:
        self._writing_paused = False
        if self._write_waiter is not None and not self._write_waiter.done():
            self._write_waiter.set_result(None)

    def _wake_reader(self) -> None:
        if not self._read_waiter.done():
            self._read_waiter.set_result(None)

    # ---- a read's deadline -------------------------------------------------------------------

    def _set_alarm(self, when: float) -> None:
        """Ring at `when`. A read's deadline is kept by one alarm per connection, not by a
        timer per read (setting and cancelling one costs about 1.7 µs, a read or two a
        request): a read sets it only when it would ring too late for it (or none is set),
        and it is not cancelled when the read ends. When it rings (_ring), the read waiting
        then, if any, ends if its deadline has come, else the alarm is set for it."""
        if self._alarm is not None:
            self._alarm.cancel()
        self._alarm, self._alarm_at = self._loop.call_at(when, self._ring), when

    def _ring(self) -> None:
        rang_at = self._alarm_at
        self._alarm, self._alarm_at = None, math.inf
        waiter = self._read_waiter
        if waiter.done():  # no read waits: the next one sets the alarm again
            return
        if self._read_deadline <= rang_at:
            waiter.set_exception(Deadline())
        else:  # a read that began after the alarm was set, with a later deadline
            self._set_alarm(self._read_deadline)

    # ---- the stream ------------------------------------------------------------------------

    async def _wait(self, waiter: asyncio.Future, deadline: float) -> None:
        timer = self._loop.call_at(deadline, _expire, waiter)
        try:
            await waiter
        finally:
            timer.cancel()

    async def receive(self, deadline: float) -> bytes:
        """The bytes received so far, waiting for some until `deadline`; b"" at the end.

        Raises Deadline, or errors.ReadError when the connection broke."""
        chunks = self._chunks
        if not chunks and not self._eof:
            self._read_waiter = waiter = self._loop.create_future()
            self._read_deadline = deadline
            if deadline < self._alarm_at:  # the alarm would ring too late for this read, or none is set
                self._set_alarm(deadline)
            try:
                data: bytes | None = await waiter  # done when it returns or raises: no read waits then
            finally:  # an idle connection holds neither its last read's bytes nor its error
                self._read_waiter = self._no_read
            if data is not None:  # handed over by buffer_updated (never counted as buffered)
                if not chunks:
                    return data
                chunks.appendleft(data)  # more came before this reader ran: all of it, in order
        if chunks:
            data = b"".join(chunks)  # one chunk, the usual read, is returned as it is (no copy)
            chunks.clear()
            self._buffered = 0
            if self._reading_paused:
                self._reading_paused = False
                self._transport.resume_reading()
            return data
        if self._lost is not None:
            raise errors.ReadError(describe(self._lost))
        return b""

    def write(self, data: bytes) -> bool:
        """Hand `data` to the transport; True when the caller must then `drain` (the
        transport's buffer is full). Raises errors.WriteError when the connection is closed."""
        transport = self._transport
        if transport.is_closing():  # closing once lost, too
            raise errors.WriteError("the connection is closed")
        self.idle = False  # a request is outstanding: its answer is awaited
        transport.write(data)
        return self._writing_paused

    async def drain(self, deadline: float) -> None:
        """Wait until the transport's buffer has room again, until `deadline` (Deadline then)."""
        if self._write_waiter is not None:
            await self._wait(self._write_waiter, deadline)
        if self._lost is not None:
            raise errors.WriteError(describe(self._lost))

    def has_news(self) -> bool:
        """True when an idle connection got data or was closed: it must not be reused."""
        # The provider's end (eof) is news at once: a TLS transport is not closing until its
        # shutdown is done, a turn or two later. A plain one is closing from the end on.
        return self._eof or bool(self._chunks) or self._transport.is_closing()

    def close(self) -> None:
        """Close at once, dropping anything unsent. Safe to call twice."""
        if not self._transport.is_closing():
            self._transport.abort()


def describe(e: BaseException) -> str:
    """A short reason for an OS or TLS failure, without anything from the request."""
    if isinstance(e, ssl.SSLError):
        return f"TLS: {e.reason or type(e).__name__}"
    if isinstance(e, OSError) and e.errno:
        return os.strerror(e.errno)  # asyncio's own strerror quotes the address
    return type(e).__name__


async def open_stream(host: str, port: int, ssl_context: ssl.SSLContext | None, timeout_seconds: float) -> Stream:
    """Connect (and handshake TLS when given a context) within one bound."""
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(timeout_seconds):
            _, stream = await loop.create_connection(
                Stream, host, port, ssl=ssl_context, server_hostname=host if ssl_context else None
            )
    except TimeoutError:
        raise errors.ConnectTimeout("no connection within connect_timeout_s") from None
    except (OSError, ssl.SSLError) as e:  # the message reaches clients: no address in it
        raise errors.ConnectError(f"connect: {describe(e)}") from None
    except UnicodeError:  # a host name the resolver cannot encode (IDNA)
        raise errors.ConnectError("connect: the host name cannot be resolved") from None
    if ssl_context is not None:
        # The TLS layer reads on while the stream is paused, up to a mark of its own (256 KiB
        # in uvloop and asyncio): its mark is the stream's.
        stream._transport.set_read_buffer_limits(high=HIGH_WATER_BYTES)  # type: ignore[attr-defined]  # a TLS transport's
    return stream
