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
from tinygw.resilience.breaker import Outcome
from tinygw.resilience.outcome import Ending
from tinygw.trust.redact import Redactor
from tinygw.worker import frames
from tinygw.worker.record import Attempt, HeldAnswer, Record

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
        "_drop_usage",
        "_shape",
    )

    def __init__(
        self,
        response: Events,
        send: Send,
        record: Record,
        target: Target,
        loop: asyncio.AbstractEventLoop,
        redactor: Redactor,
        drop_usage: bool = False,
        shape: sse.Shape = sse.ANY,
    ) -> None:
        """`drop_usage`: the gateway asked for the usage that the client did not (to charge
        its tokens), so the chunk that only reports it is not relayed: whole events are
        sent, never a part of one. `shape`: the API of the stream's events, whose markers
        the scan after output looks for (sse.Shape; all known ones by default)."""
        self.state = State.HOLDING
        self._shape = shape
        self._drop_usage = drop_usage
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
            await (self._relaying_whole_events() if self._drop_usage else self._relaying())
        except errors.UpstreamError as e:
            if self.state is State.HOLDING:
                return Attempt(outcome.of_stream(Ending.BROKEN, output=False, error=e))
            return await self._end(Ending.BROKEN, e)
        return await self._end(self._ending())

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
        return Attempt(outcome.of_stream(self._ending(), output=False), answer=answer)

    def _headers(self) -> list[tuple[bytes, bytes]]:
        """The provider's headers that the client gets, its secrets redacted (tinygw.trust.redact)."""
        return self._redactor.headers(relay_headers(self._response.headers))

    def _answer(self, held: bytes, judged: outcome.Judgement = outcome.NO_OUTPUT) -> HeldAnswer:
        """The answer made of the events held (502, or the status `judged` gives a cloud's
        exception), sent if no other attempt is made."""
        headers = self._headers()
        if judged.retry_after_seconds:
            headers = [*headers, (b"retry-after", b"%d" % judged.retry_after_seconds)]
        return HeldAnswer(judged.status, headers, self._redactor.body(held))

    def _cloud_error(self, event: bytes) -> tuple[str, float, bytes] | None:
        """A leading exception of Bedrock's frames (`event`), which names its error, and
        when it came: since the request did, at least the attempt's own time."""
        events = self._response
        if isinstance(events, frames.Unwrapped) and events.exception_type is not None:
            return events.exception_type, self._loop.time() - self._record.started_at, event
        return None

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
                cloud_error = self._cloud_error(event)
                judged = outcome.of_stream(Ending.ERROR_EVENT, output=False, cloud_error=cloud_error)
                return Attempt(judged, answer=self._answer(b"".join(self._held) + block[:end], judged))
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
        if self._drop_usage:  # whole events only: the rest goes with the event it begins
            body = _without_usage_only(b"".join([*held, block]), self._shape)
        else:
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

    async def _relaying_whole_events(self) -> None:
        """RELAYING, for `drop_usage`: each read's complete events are sent, less the
        usage-only chunk; what is left when the provider ends the stream goes as it is."""
        next_chunk, send, pending = self._response.next_chunk, self._send, self._pending
        while (chunk := await next_chunk()) is not None:
            block = pending.feed(chunk)
            if block:
                block = self._scan_less_usage_only(block)
            if pending.size > MAX_HELD_BYTES:  # no event end in sight: stop looking
                taken = pending.take()
                self._read(taken)
                block += taken
            if block:
                await send({"type": "http.response.body", "body": block, "more_body": True})
        if rest := pending.take():
            await send({"type": "http.response.body", "body": rest, "more_body": True})

    def _scan(self, block: bytes, start: int = 0) -> None:
        """Read the events of `block[start:]` (complete events, sent on) that may end or fail
        the answer or report usage: one search of the bytes for the markers of the stream's
        shape finds them (sse.suspects)."""
        for event in sse.suspects(block, len(block), start, self._shape):
            self._read(event)

    def _scan_less_usage_only(self, block: bytes) -> bytes:
        """`_scan`, for `drop_usage`, in the same one look: `block` less the chunk that only
        reports the usage (which is read, and so counted, first)."""
        for event in sse.suspects(block, len(block), 0, self._shape):
            self._read(event)
            if usage.usage_only(event):
                block = block.replace(event, b"", 1)
        return block

    def _read(self, event: bytes) -> None:
        if sse.may_end_or_fail(event, self._shape):
            kind, done = sse.kind(event)
            self._finished |= done
            self._failed |= kind is sse.Kind.ERROR
        self._tokens.add(usage.of_event(event))

    # ---- the end -----------------------------------------------------------------------

    def _ending(self) -> Ending:
        """How the stream ended, when the provider closed it."""
        if self._failed:
            return Ending.ERROR_EVENT
        return Ending.FINISHED if self._finished else Ending.UNFINISHED

    async def _end(self, ending: Ending, error: errors.UpstreamError | None = None) -> Attempt:
        """The stream ended as `ending` after output: the client's stream is ended, cleanly
        after a finish, else with the provider's error event (relayed already) or one of
        the gateway's own."""
        judged = outcome.of_stream(ending, output=True, error=error)
        if judged.verdict.outcome is not Outcome.SUCCESS:
            self._record.was_cut()
        if ending is Ending.UNFINISHED:
            target = self._target
            logs.log(logging.WARNING, "stream cut", provider=target.provider, provider_model=target.shown_model)
        end = b""  # a clean end, or after the provider's own error event
        if ending in (Ending.UNFINISHED, Ending.BROKEN):
            why = f"failed mid-stream: {error}" if error is not None else "ended the stream without a finish"
            end = sse_error_event(f"the provider {why}", "provider_unavailable", cause=outcome.cause_of(ending, error))
        await self._send({"type": "http.response.body", "body": end})
        return Attempt(judged, committed=True)


def _without_usage_only(block: bytes, shape: sse.Shape) -> bytes:
    """`block`, complete events of `shape`'s API (read already), less the chunk that only
    reports the stream's usage."""
    for event in sse.suspects(block, len(block), 0, shape):
        if usage.usage_only(event):
            block = block.replace(event, b"", 1)
    return block
