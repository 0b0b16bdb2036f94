"""One HTTP/1.1 connection to a provider: the fast path or h11, over a byte stream.

Every wait takes an absolute deadline (the event loop's monotonic clock) and a named
timeout to raise when it passes. h11's exceptions are translated here, once, into
tinygw.errors (the stream's own, OS and TLS ones, in tinygw.upstream.network).
A connection that saw any error, or whose response was not read to the end, is
closed and never reused.
"""

from __future__ import annotations

import re
import ssl
from typing import cast

import h11
import msgspec
from msgspec import Struct

from tinygw import errors
from tinygw.upstream import fastpath
from tinygw.upstream.network import Deadline, Stream, open_stream

# What a provider's answer that h11 refuses is called in an error: h11's own words name
# its internals (its events and states), which are no client's business.
NOT_HTTP = "the provider's answer is not valid HTTP/1.1"

# A response head larger than this is a protocol error, read by either parser.
MAX_HEAD_BYTES = fastpath.MAX_HEAD_BYTES
HEAD_TOO_LARGE = f"the response head is over {MAX_HEAD_BYTES} bytes"

Timeout = type[errors.UpstreamError]


class Connection:
    """One connection; each exchange on it takes the fast path (tinygw.upstream.fastpath) when
    it can, and h11 otherwise: a request the fast path cannot write, or an answer it
    hands off (h11 then gets every byte of the answer so far, and decides)."""

    __slots__ = ("_stream", "_h11", "_answer", "_request", "_heard", "idle_since", "closed", "has_news")

    def __init__(self, stream: Stream) -> None:
        self._stream = stream
        self._h11: h11.Connection | None = None  # the exchange's, when h11 reads it
        self._answer: fastpath.Answer | None = None  # the exchange's, when the fast path reads it (kept after its end)
        self._request: Encoded | None = None  # what was sent, to replay into h11 at a hand-off
        self._heard = False  # a byte of the exchange's answer has arrived (h11's reads, or a hand-off)
        self.idle_since = 0.0
        self.closed = False
        # True when an idle connection got data or was closed: it must not carry a request
        # (the provider closed it, or speaks out of turn): the byte stream's own check, which
        # the pool asks of each connection it takes.
        self.has_news = stream.has_news

    # ---- reuse ---------------------------------------------------------------------

    def ended_cleanly(self) -> bool:
        """True when the last answer ended exactly where its framing said (docs/design.md
        section 10), so that the connection may carry the next request. Bytes past its
        end (beyond a content-length, a body after a 204 or 304) in a parser's buffer
        would be read as the next request's answer: that connection is discarded."""
        answer = self._answer
        if answer is not None:  # the fast path's exchange: its answer says where it ended
            return answer.done and answer.keep_alive and not answer.leftover  # a closed one has news (has_news)
        parser = self._h11
        return (
            parser is not None
            and parser.our_state is h11.IDLE
            and parser.their_state is h11.IDLE
            and parser.trailing_data == (b"", False)
        )

    def rest(self, now: float) -> bool:
        """The exchange is over and the connection waits for the next request: from now
        on, a byte from the provider closes it (docs/design.md section 10). False, and
        closed, when it has news already (a byte or the end came after the answer)."""
        if self.has_news():
            self.close()
            return False
        self.idle_since = now
        self._stream.idle = True
        return True

    def _finish_cycle(self) -> None:
        parser = self._h11
        if parser is not None and parser.our_state is h11.DONE and parser.their_state is h11.DONE:
            parser.start_next_cycle()

    # ---- the exchange --------------------------------------------------------------

    def send_request(self, request: Encoded) -> bool:
        """Hand the request's bytes to the transport; True when its buffer is full and the
        caller must then `drain` (a usual request fits: no wait, no coroutine)."""
        self._request, self._heard = request, False
        if request.fast:
            self._h11, self._answer = None, fastpath.Answer()
        else:
            self._answer = None
            self._h11 = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD_BYTES)
            _h11_request_bytes(self._h11, request)  # the bytes of `request`: h11 learns what it sent
        try:
            return self._stream.write(request.data)
        except errors.WriteError:
            self.close()
            raise

    async def drain(self, deadline: float) -> None:
        """Wait until the request's bytes were taken by the transport (send_request)."""
        try:
            await self._stream.drain(deadline)
        except Deadline:
            self.close()
            raise errors.TotalTimeout("timed out while sending the request") from None
        except errors.WriteError:
            self.close()
            raise

    def _hand_off(self, eof: bool) -> None:
        """h11 takes over the answer the fast path could not read: it is told what was
        sent, and given every byte received so far."""
        self._h11 = parser = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD_BYTES)
        _h11_request_bytes(parser, cast(Encoded, self._request))  # the bytes went out: h11 learns what they were
        self._heard = True  # a hand-off comes after some bytes of the answer (receive_head)
        try:
            parser.receive_data(self._answer.raw() if self._answer is not None else b"")
            if eof:
                parser.receive_data(b"")
        except h11.RemoteProtocolError:
            self.close()
            raise errors.RemoteProtocolError(NOT_HTTP) from None
        self._answer = None

    async def receive_head(self, deadline: float, timeout: Timeout) -> tuple[int, list[tuple[bytes, bytes]]]:
        """Wait for the response head; informational (1xx) responses are skipped."""
        while (answer := self._answer) is not None:
            try:  # _read, inline: every exchange waits here for its answer (docs/performance.md)
                data = await self._stream.receive(deadline)
            except BaseException as e:
                self._read_failed(e, timeout)
                raise
            if data:
                self._heard = True
            else:
                self._no_answer()
                self._hand_off(eof=True)
                break
            try:
                head = answer.head(data)
            except fastpath.HandOff:
                self._hand_off(eof=False)
                break
            if head is not None:
                return head
        while True:
            event = await self._next_event(deadline, timeout)
            if isinstance(event, h11.Response):
                # h11 bounds a head that arrives in pieces (_next_event); one that it was
                # handed whole (the fast path's pieces, at once) is bounded here.
                if _head_bytes(event) > MAX_HEAD_BYTES:
                    self.close()
                    raise errors.RemoteProtocolError(HEAD_TOO_LARGE)
                return event.status_code, list(event.headers)  # h11's answers only: the slow path
            if not isinstance(event, h11.InformationalResponse):
                self.close()
                raise errors.RemoteProtocolError(f"expected a response head, got {type(event).__name__}")

    async def receive_data(self, deadline: float, timeout: Timeout) -> bytes | None:
        """The next piece of the response body (all that has arrived), or None at its end."""
        answer = self._answer
        if answer is not None:  # the fast path's: what it has, else read more
            while True:
                try:
                    data = answer.body()
                except fastpath.Malformed as e:
                    self.close()
                    raise errors.RemoteProtocolError(str(e)) from None
                if data:
                    return data
                if data is None:  # the end: the answer keeps where it ended (ended_cleanly)
                    return None
                await self._read_more(answer, deadline, timeout)
        event = await self._next_event(deadline, timeout)
        if isinstance(event, h11.Data):
            return bytes(event.data)
        if isinstance(event, h11.EndOfMessage):
            self._finish_cycle()
            return None
        self.close()
        raise errors.RemoteProtocolError(f"unexpected {type(event).__name__} in a response body")

    def whole_body(self, limit: int) -> bytes | None:
        """The response body at once, when the fast path has all of it already and it is
        at most `limit` bytes (the exchange then ends here); else None."""
        answer = self._answer
        return answer.whole_body(limit) if answer is not None else None

    async def _read_more(self, answer: fastpath.Answer, deadline: float, timeout: Timeout) -> None:
        more = await self._read(deadline, timeout)
        if not more:
            self.close()
            raise errors.RemoteProtocolError("peer closed connection without sending complete message body")
        answer.feed(more)

    async def _next_event(self, deadline: float, timeout: Timeout) -> h11.Event:
        parser = cast(h11.Connection, self._h11)  # the exchange is h11's once this is called
        while True:
            awaiting_head = parser.their_state is h11.SEND_RESPONSE  # (an error then sets it to ERROR)
            try:
                event = parser.next_event()
            except h11.RemoteProtocolError as e:
                self.close()
                # 431: what h11 holds of an event is over its bound; while a head is awaited, a head's
                too_large = e.error_status_hint == 431 and awaiting_head
                raise errors.RemoteProtocolError(HEAD_TOO_LARGE if too_large else NOT_HTTP) from None
            if event is not h11.NEED_DATA:
                if event is h11.PAUSED:  # cannot happen for a client between requests
                    self.close()
                    raise errors.RemoteProtocolError("the provider sent data out of turn")
                return cast(h11.Event, event)
            data = await self._read(deadline, timeout)
            if not data:
                self._no_answer()
            try:
                parser.receive_data(data)
            except h11.RemoteProtocolError:
                self.close()
                raise errors.RemoteProtocolError(NOT_HTTP) from None

    def _no_answer(self) -> None:
        """At the end of the stream: when not a byte of an answer came, the provider
        closed instead of answering, which is a connection error like a reset (it may be
        retried at once), not a protocol error."""
        if not self._heard:
            self.close()
            raise errors.ReadError("the provider closed the connection without answering")

    async def _read(self, deadline: float, timeout: Timeout) -> bytes:
        """Received bytes, or b"" at the end (h11 decides whether that end is clean)."""
        try:
            data = await self._stream.receive(deadline)
        except BaseException as e:
            self._read_failed(e, timeout)
            raise
        if data:
            self._heard = True
        return data

    def _read_failed(self, e: BaseException, timeout: Timeout) -> None:
        """A read failed (its deadline passed, a ReadError, or the caller cancelled): the
        connection is closed, never reused; a passed deadline is raised as `timeout`."""
        self.close()
        if isinstance(e, Deadline):
            raise timeout(_TIMEOUT_WORDS.get(timeout, "timed out")) from None

    def close(self) -> None:
        """Close the connection at once; safe to call twice."""
        self.closed = True
        self._stream.close()


class Encoded(Struct, frozen=True):
    """A request's head and body as they go on the wire (`data`), written by the fast
    path (`fast`) or by h11; with what they were made of, for h11 to learn at a
    hand-off what was sent."""

    data: bytes
    fast: bool
    method: bytes
    target: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes


def encode_request(method: bytes, target: bytes, headers: list[tuple[bytes, bytes]], body: bytes) -> Encoded:
    """The request's bytes, before any connection is taken: the fast path's, else h11's.
    What h11 cannot encode either is the client's (its query or one of its headers: the
    operator's were checked at start), raised as UnsendableRequest."""
    data = fastpath.encode_request(method, target, headers, body)
    if data is not None:
        return Encoded(data, True, method, target, headers, body)
    request = Encoded(b"", False, method, target, headers, body)
    try:
        data = _h11_request_bytes(h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD_BYTES), request)
    except h11.LocalProtocolError:  # h11's message quotes the header, which may be a key
        part = "query string" if not _VISIBLE_TARGET.fullmatch(target) else "headers"
        raise errors.UnsendableRequest(f"the request's {part} cannot be forwarded: not valid in HTTP/1.1") from None
    return msgspec.structs.replace(request, data=data)


_VISIBLE_TARGET = re.compile(rb"[\x21-\x7e]+")


def _h11_request_bytes(parser: h11.Connection, request: Encoded) -> bytes:
    data = parser.send(h11.Request(method=request.method, target=request.target, headers=request.headers)) or b""
    data += (parser.send(h11.Data(data=request.body)) or b"") if request.body else b""
    return data + (parser.send(h11.EndOfMessage()) or b"")


def _head_bytes(event: h11.Response) -> int:
    """The size of a response head as sent: status line, and each header with its
    separator and line end."""
    return 15 + len(event.reason) + sum(len(k) + len(v) + 4 for k, v in event.headers)


_TIMEOUT_WORDS = {
    errors.FirstByteTimeout: "no response head within first_byte_timeout_s",
    errors.TotalTimeout: "the exchange outlived timeout_s",
    errors.StallTimeout: "the stream paused longer than stall_timeout_s",
}


async def open_connection(
    host: str, port: int, ssl_context: ssl.SSLContext | None, timeout_seconds: float
) -> Connection:
    return Connection(await open_stream(host, port, ssl_context, timeout_seconds))
