"""Relaying a streamed answer (text/event-stream): first hold, then pass on.

Two states (docs/design.md section 4). HOLDING: the stream's leading events are held
back until one carries output, so that an error that comes first may still fall back;
an error event, a broken connection or an end without output is then a failure that
may fall back (the held events become a 502 answer, sent only if no other attempt is
made). RELAYING, from the first output on: every byte is passed on as it arrives, and
only the events that may end or fail the answer or report usage are read
(`sse.suspects`). Nothing is switched after output: a failure, an error event or an
end without a finish reason is a failure, and the client's stream ends with an SSE
error event, never as a clean end.

A piece is scanned for event ends only where it is new (`sse.Pending`): a provider
that sends a large event in tiny pieces costs the worker time in proportion to its
bytes, not to their square.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Awaitable, Callable, Iterable
from itertools import chain
from typing import Protocol

from tinygw import errors, logs
from tinygw.config.settings import Target
from tinygw.protocol import sse, usage
from tinygw.protocol.wire import relay_headers, sse_error_event
from tinygw.resilience import outcome
from tinygw.trust.redact import Redactor
from tinygw.worker.record import Answer, Attempt, Record

Send = Callable[[dict], Awaitable[None]]

# Leading events held back before output are bounded in bytes and in count: past either,
# they are sent on (the stream commits, docs/design.md section 10). An event without an end
# in sight is looked at (as an event) once it is MAX_HELD_BYTES large.
MAX_HELD_BYTES = 1024 * 1024
MAX_HELD_EVENTS = 4096


class Events(Protocol):
    """What a stream is read from: an upstream Response, or Bedrock's frames read as
    server-sent events (tinygw.worker.frames)."""

    headers: list[tuple[bytes, bytes]]

    def next_chunk(self) -> Awaitable[bytes | None]: ...


class State(enum.Enum):
    HOLDING = "holding"  # nothing sent yet: the events so far are held
    RELAYING = "relaying"  # output was sent: the answer is the client's


class Relay:
    """One streamed answer on its way to the client; `run()` relays it to its end."""

    __slots__ = (
        "state",
        "_redactor",
        "_response",
        "_send",
        "_record",
        "_target",
        "_loop",
        "_pending",
        "_held",
        "_held_bytes",
        "_held_events",
        "_tokens",
        "_finished",
        "_failed",
    )

    def __init__(
        self,
        response: Events,
        send: Send,
        record: Record,
        target: Target,
        loop: asyncio.AbstractEventLoop,
        redactor: Redactor,
    ) -> None:
        self.state = State.HOLDING
        self._redactor = redactor
        self._response = response
        self._send = send
        self._record = record
        self._target = target
        self._loop = loop
        self._pending = sse.Pending()  # bytes after the last complete event
        self._held: list[bytes] = []  # HOLDING: the events held back, a piece per read
        self._held_bytes = 0
        self._held_events = 0
        self._tokens = usage.Tokens()
        self._finished = False  # an event marked the answer's end
        self._failed = False  # RELAYING: an error event was relayed

    async def run(self) -> Attempt:
        """Relay the stream to its end: HOLDING until output, then RELAYING."""
        try:
            failure = await self._holding()
            if failure is not None:
                return failure
            await self._relaying()
        except errors.UpstreamError as e:
            if self.state is State.HOLDING:
                return Attempt(outcome.of_error(e), e.cause, error=e)
            return await self._end_with_error(f"the provider failed mid-stream: {e}", e.cause)
        return await self._end()

    # ---- HOLDING -----------------------------------------------------------------------

    async def _holding(self) -> Attempt | None:
        """None once output went out (the state is then RELAYING), else the failure
        that ended the stream before output."""
        next_chunk = self._response.next_chunk
        while (chunk := await next_chunk()) is not None:
            if (failure := await self._hold(chunk)) is not None:
                return failure
            if self.state is State.RELAYING:
                return None
        answer = self._answer(b"".join(self._held) + self._pending.take())
        return Attempt(outcome.ERROR_EVENT, "200+no_output", answer=answer)

    def _headers(self) -> list[tuple[bytes, bytes]]:
        """The provider's headers that the client gets, its secrets redacted (tinygw.trust.redact)."""
        return self._redactor.headers(relay_headers(self._response.headers))

    def _answer(self, held: bytes) -> Answer:
        """The 502 answer made of the events held, sent if no other attempt is made."""
        return Answer(502, self._headers(), self._redactor.body(held))

    async def _hold(self, chunk: bytes) -> Attempt | None:
        """Hold the events `chunk` completes, until one carries output or a bound is passed
        (then the held events go out: RELAYING); an Attempt when one is an error. What a
        read completes is held as one piece, not as an object per event: 4,096 events of
        a few bytes cost what their bytes cost."""
        pending = self._pending
        block = pending.feed(chunk)
        if pending.size > MAX_HELD_BYTES:  # no event end in sight: what came is looked at as an event
            block += pending.take()
            ends: Iterable[int] = chain(sse.ends(block), (len(block),))
        elif block:
            ends = sse.ends(block)
        else:
            return None
        start = 0
        for end in ends:
            if end <= start:  # the taken bytes were empty
                continue
            event = block[start:end]
            kind, done = sse.kind(event)
            if kind is sse.Kind.ERROR:
                return Attempt(
                    outcome.ERROR_EVENT, "200+error_event", answer=self._answer(b"".join(self._held) + block[:end])
                )
            self._held_events += 1
            self._held_bytes += end - start
            self._finished |= done
            self._tokens.add(usage.of_event(event))
            start = end
            if kind is sse.Kind.OUTPUT or self._held_bytes > MAX_HELD_BYTES or self._held_events > MAX_HELD_EVENTS:
                await self._commit(block, end)
                return None
        self._held.append(block)
        return None

    async def _commit(self, block: bytes, held_end: int) -> None:
        """Output arrived (or a bound was passed) at `held_end` of `block`, the events of the
        read that completed it: the held events, that block and the bytes after it go out,
        and the answer is the client's. The events of `block` after `held_end` are read
        as a relayed stream's are."""
        self.state = State.RELAYING
        record = self._record
        self._scan(block, held_end)
        await self._send(record.head(200, self._headers(), "200"))
        held, rest = self._held, self._pending.peek()
        body = b"".join([*held, block, rest]) if held or rest else block  # no copy of a lone block
        self._held = []
        await self._send({"type": "http.response.body", "body": body, "more_body": True})
        record.output(self._tokens, self._loop.time())  # counted from here on

    # ---- RELAYING ----------------------------------------------------------------------

    async def _relaying(self) -> None:
        next_chunk, send, pending = self._response.next_chunk, self._send, self._pending
        while (chunk := await next_chunk()) is not None:
            block = pending.feed(chunk)
            if block:
                self._scan(block)
            if pending.size > MAX_HELD_BYTES:  # no event end in sight: stop looking
                self._read(pending.take())
            await send({"type": "http.response.body", "body": chunk, "more_body": True})  # all that came, at once

    def _scan(self, block: bytes, start: int = 0) -> None:
        """Read the events of `block[start:]` (complete events, sent on) that may end or fail
        the answer or report usage: one look at the bytes finds them (sse.suspects)."""
        for event in sse.suspects(block, len(block), start):
            self._read(event)

    def _read(self, event: bytes) -> None:
        if sse.may_end_or_fail(event):
            kind, done = sse.kind(event)
            self._finished |= done
            self._failed |= kind is sse.Kind.ERROR
        self._tokens.add(usage.of_event(event))

    # ---- the end -----------------------------------------------------------------------

    async def _end(self) -> Attempt:
        """The provider ended the stream after output."""
        if self._failed:
            self._record.was_cut()
            await self._send({"type": "http.response.body", "body": b""})  # the provider's error event was relayed
            return Attempt(outcome.CUT, "200+error_event", committed=True)
        if not self._finished:
            target = self._target
            logs.log(logging.WARNING, "stream cut", provider=target.provider, provider_model=target.shown_model)
            return await self._end_with_error("the provider ended the stream without a finish", "cut")
        await self._send({"type": "http.response.body", "body": b""})
        return Attempt(outcome.SUCCESS, "200", committed=True)

    async def _end_with_error(self, message: str, cause: str) -> Attempt:
        self._record.was_cut()
        event = sse_error_event(message, "provider_unavailable", cause=cause)
        await self._send({"type": "http.response.body", "body": event})
        return Attempt(outcome.CUT, f"200+{cause}", committed=True)
