"""One HTTP/1.1 connection to a provider: h11's state machine over an anyio stream.

Every wait takes an absolute deadline (anyio's clock) and a named timeout to raise
when it passes. Foreign exceptions are translated here, once, into tinygw.errors.
A connection that saw any error, or whose response was not read to the end, is
closed and never reused.
"""

from __future__ import annotations

import select
import ssl
import anyio
import anyio.abc
import anyio.streams.tls
import h11

from tinygw import errors

# Bytes asked of the socket per read. SSE chunks are small; a non-streamed answer
# arrives in a few reads of this size.
READ_SIZE = 64 * 1024

# A response head (status line and headers) larger than this is a protocol error.
# h11's own default is 16 KiB; providers add long rate-limit and trace headers.
MAX_HEAD_BYTES = 64 * 1024

_READ_FAILURES = (OSError, ssl.SSLError, anyio.BrokenResourceError, anyio.ClosedResourceError)

Timeout = type[errors.UpstreamError]


class Connection:
    __slots__ = ("_stream", "_socket", "_h11", "idle_since", "closed")

    def __init__(self, stream: anyio.abc.ByteStream) -> None:
        self._stream = stream
        self._socket = stream.extra(anyio.abc.SocketAttribute.raw_socket, None)
        self._h11 = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD_BYTES)
        self.idle_since = 0.0
        self.closed = False

    # ---- reuse ---------------------------------------------------------------------

    def is_idle(self) -> bool:
        """True when this connection may carry the next request."""
        if self.closed or self._h11.our_state is not h11.IDLE or self._h11.their_state is not h11.IDLE:
            return False
        # An idle connection that has something to read was closed by the provider
        # (or is speaking out of turn): either way it must not carry a request.
        if self._socket is not None:
            try:
                readable, _, _ = select.select([self._socket], [], [], 0)
            except (OSError, ValueError):
                return False
            return not readable
        return True

    def _finish_cycle(self) -> None:
        if self._h11.our_state is h11.DONE and self._h11.their_state is h11.DONE:
            self._h11.start_next_cycle()

    # ---- the exchange --------------------------------------------------------------

    async def send_request(
        self, method: bytes, target: bytes, headers: list[tuple[bytes, bytes]], body: bytes, deadline: float
    ) -> None:
        try:
            data = self._h11.send(h11.Request(method=method, target=target, headers=headers))
            data += self._h11.send(h11.Data(data=body)) if body else b""
            data += self._h11.send(h11.EndOfMessage())
        except h11.LocalProtocolError as e:  # our own bad header: a bug or a bad config value
            await self.aclose()
            raise errors.WriteError(f"could not encode the request: {e}") from None
        with anyio.CancelScope(deadline=deadline) as scope:
            try:
                await self._stream.send(data)
            except _READ_FAILURES as e:
                await self.aclose()
                raise errors.WriteError(_describe(e)) from None
        if scope.cancelled_caught:
            await self.aclose()
            raise errors.TotalTimeout("timed out while sending the request")

    async def receive_head(self, deadline: float, timeout: Timeout) -> tuple[int, list[tuple[bytes, bytes]]]:
        """Wait for the response head; informational (1xx) responses are skipped."""
        while True:
            event = await self._next_event(deadline, timeout)
            if isinstance(event, h11.Response):
                return event.status_code, event.headers
            if not isinstance(event, h11.InformationalResponse):
                await self.aclose()
                raise errors.RemoteProtocolError(f"expected a response head, got {type(event).__name__}")

    async def receive_data(self, deadline: float, timeout: Timeout) -> bytes | None:
        """The next piece of the response body, or None at its end."""
        event = await self._next_event(deadline, timeout)
        if isinstance(event, h11.Data):
            return bytes(event.data)
        if isinstance(event, h11.EndOfMessage):
            self._finish_cycle()
            return None
        await self.aclose()
        raise errors.RemoteProtocolError(f"unexpected {type(event).__name__} in a response body")

    async def _next_event(self, deadline: float, timeout: Timeout) -> h11.Event:
        while True:
            try:
                event = self._h11.next_event()
            except h11.RemoteProtocolError as e:
                await self.aclose()
                raise errors.RemoteProtocolError(str(e)) from None
            if event is not h11.NEED_DATA:
                if event is h11.PAUSED:  # cannot happen for a client between requests
                    await self.aclose()
                    raise errors.RemoteProtocolError("the provider sent data out of turn")
                return event
            data = await self._read(deadline, timeout)
            try:
                self._h11.receive_data(data)
            except h11.RemoteProtocolError as e:
                await self.aclose()
                raise errors.RemoteProtocolError(str(e)) from None

    async def _read(self, deadline: float, timeout: Timeout) -> bytes:
        with anyio.CancelScope(deadline=deadline) as scope:
            try:
                return await self._stream.receive(READ_SIZE)
            except anyio.EndOfStream:
                return b""  # h11 decides whether an end here is clean or a cut
            except _READ_FAILURES as e:
                await self.aclose()
                raise errors.ReadError(_describe(e)) from None
        if scope.cancelled_caught:
            await self.aclose()
            raise timeout(f"{_TIMEOUT_WORDS.get(timeout, 'timed out')}")
        raise AssertionError("unreachable")  # pragma: no cover

    async def aclose(self) -> None:
        """Close the connection; safe to call twice, and shielded from cancellation."""
        if self.closed:
            return
        self.closed = True
        with anyio.CancelScope(shield=True):
            try:
                await self._stream.aclose()
            except _READ_FAILURES:
                pass


_TIMEOUT_WORDS = {
    errors.FirstByteTimeout: "no response head within first_byte_timeout_s",
    errors.TotalTimeout: "the exchange outlived timeout_s",
}


def _describe(e: BaseException) -> str:
    """A short reason for an OS or TLS failure, without anything from the request."""
    if isinstance(e, ssl.SSLError):
        return f"TLS: {e.reason or type(e).__name__}"
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return type(e).__name__


async def open_connection(
    host: str, port: int, ssl_context: ssl.SSLContext | None, timeout_seconds: float
) -> Connection:
    """Connect (and handshake TLS when given a context) within one bound."""
    with anyio.move_on_after(timeout_seconds) as scope:
        try:
            stream: anyio.abc.ByteStream = await anyio.connect_tcp(host, port)
        except OSError as e:
            raise errors.ConnectError(f"connect to {host}:{port}: {_describe(e)}") from None
        if ssl_context is not None:
            try:
                stream = await anyio.streams.tls.TLSStream.wrap(
                    stream, hostname=host, ssl_context=ssl_context, standard_compatible=False
                )
            except _READ_FAILURES as e:
                with anyio.CancelScope(shield=True):
                    await stream.aclose()
                raise errors.ConnectError(f"TLS with {host}:{port}: {_describe(e)}") from None
        return Connection(stream)
    assert scope.cancelled_caught
    raise errors.ConnectTimeout(f"no connection to {host}:{port} within connect_timeout_s")

