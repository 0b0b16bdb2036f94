"""A proxied request's client: its body, read within its bounds (the size limit, and the
client timeout between its messages: docs/design.md section 10), and the watch that
cancels the request when the client leaves, both on one timer (ClientWatch)."""

from __future__ import annotations

import asyncio
import enum

from tinygw.resilience.breaker import IllegalTransition
from tinygw.worker.record import Record


class Refused(Exception):
    """A request the gateway answers itself, before forwarding it: `status`, an error
    `code`, and the exception's message."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class ClientLeft(Refused):
    """The client disconnected while the gateway was still reading its request. Granian
    reports a malformed chunked body the same way: it is answered 400 (a client that
    really left will not read it), and counted as a client that left, which is what it
    most often is."""

    def __init__(self) -> None:
        super().__init__(400, "the request body is incomplete or its chunked framing is malformed", "invalid_body")


class _Key(enum.Enum):
    """An enum whose pairs key TRANSITIONS, looked up as every request moves: a member is
    hashed as the one object it is (docs/performance.md), as it compares."""

    __hash__ = object.__hash__


class Phase(_Key):
    """Where a ClientWatch is in its request's life."""

    BODY = "body"  # the body is being read; the first look has not come
    BODY_LOOKED = "body_looked"  # the body is being read, past the first look: the timer waits for its deadline
    BODY_READ = "body_read"  # the body was read before the first look: a quick request, so far
    ANSWER = "answer"  # a task waits for the client to leave; the timer looks at the sends to it
    TIMED_OUT = "timed_out"  # no message of the body for the client timeout: the request's task cancelled
    TOLD = "told"  # read_body was told of the timeout (timed_out), once
    LEFT = "left"  # the client left during the answer: the request's task cancelled
    STALLED = "stalled"  # a send waited past the client timeout: the request's task cancelled


class Event(_Key):
    LOOK = "look"  # the first look, or a later one while the body is read
    READ = "read"  # the body's last message came
    EXPIRED = "expired"  # a look found the client timeout passed during the body
    ASKED = "asked"  # read_body asked whether the timeout cancelled the request
    GONE = "gone"  # the client disconnected
    STALL = "stall"  # a send to the client waited longer than the client timeout


TRANSITIONS: dict[tuple[Phase, Event], Phase] = {
    (Phase.BODY, Event.LOOK): Phase.BODY_LOOKED,
    (Phase.BODY, Event.READ): Phase.BODY_READ,
    (Phase.BODY_LOOKED, Event.LOOK): Phase.BODY_LOOKED,
    (Phase.BODY_LOOKED, Event.READ): Phase.ANSWER,
    (Phase.BODY_LOOKED, Event.EXPIRED): Phase.TIMED_OUT,
    (Phase.BODY_READ, Event.LOOK): Phase.ANSWER,
    # the timeout's cancellation and the body's last message in one turn of the loop: cancelled all the same
    (Phase.TIMED_OUT, Event.READ): Phase.TIMED_OUT,
    (Phase.TIMED_OUT, Event.ASKED): Phase.TOLD,
    (Phase.ANSWER, Event.GONE): Phase.LEFT,
    (Phase.ANSWER, Event.STALL): Phase.STALLED,
    (Phase.LEFT, Event.STALL): Phase.STALLED,
    (Phase.STALLED, Event.GONE): Phase.STALLED,
}


class ClientWatch:
    """A proxied request's one timer over its client, from the request's start; its
    `phase` moves by TRANSITIONS only (any other move raises).

    While the body is read (`waiting_since`: the loop's time when the wait for its next
    message began), the timer looks `every_seconds` in, then when that wait could be
    over (each message moves that on: a client that sends its body slowly costs the
    worker a wake-up per client timeout, not one every `every_seconds`); when it is over,
    it cancels the request's task, at its wait for the message, and read_body refuses
    the request 408. Once the body is read (`body_read`), a task waits for the client to
    leave, and cancels the request's task when it does: from the first look, or at once
    when the body took longer. A quick request is over before the first look: it does
    without that task and its pending receive() in the server. (The client timeout, at
    least 0.1 s, is longer than `every_seconds`.)"""

    _loop: asyncio.AbstractEventLoop  # set by the first look
    _watcher: asyncio.Task | None = None
    phase = Phase.BODY  # where every watch starts; each move sets its own

    def __init__(
        self,
        receive,
        task: asyncio.Task,
        loop: asyncio.AbstractEventLoop,
        record: Record,
        timeout_seconds: float,
        every_seconds: float,
    ) -> None:
        self._task = task
        self._record = record  # from its start; its `sending_since`: a send to the client waits since then
        self._timeout_seconds = timeout_seconds
        self.waiting_since = record.started_at
        self._timer = loop.call_later(every_seconds, self._look, loop, receive)

    @property
    def stalled(self) -> bool:
        """A send to the client waited longer than the client timeout: it was cut."""
        return self.phase is Phase.STALLED

    def _move(self, event: Event) -> Phase:
        new = TRANSITIONS.get((self.phase, event))
        if new is None:
            raise IllegalTransition(f"{event.value} in phase {self.phase.value}")
        self.phase = new
        return new

    def _look(self, loop: asyncio.AbstractEventLoop, receive) -> None:
        if self._move(Event.LOOK) is Phase.ANSWER:  # the body was read before the first look
            self._watch_answer(loop, receive)
            return
        self._loop = loop  # for body_read's watch: kept by the look, which a quick request never has
        left = self.waiting_since + self._timeout_seconds - loop.time()
        if left > 0:  # not over yet: looked at again when it could be
            self._timer = loop.call_later(left, self._look, loop, receive)
            return
        self._move(Event.EXPIRED)
        self._task.cancel()

    def body_read(self, receive) -> None:
        """The body is read. After the first look the timer waits for the body's
        deadline: the watch over the answer starts now instead."""
        if self._move(Event.READ) is Phase.ANSWER:
            self._timer.cancel()
            self._watch_answer(self._loop, receive)

    def _watch_answer(self, loop: asyncio.AbstractEventLoop, receive) -> None:
        """While the request is answered: a task waits for the client to leave, and the
        timer looks at the sends to it (_look_at_send)."""
        self._watcher = loop.create_task(self._watch(receive))
        self._timer = loop.call_later(self._timeout_seconds, self._look_at_send, loop)

    def _look_at_send(self, loop: asyncio.AbstractEventLoop) -> None:
        """A client that has not taken a send within the client timeout is cut: the
        request's task is cancelled at that send (docs/design.md section 16). Else the
        timer looks again when the send now waiting could time out, or a timeout on."""
        since, now = self._record.sending_since, loop.time()
        if since is not None and now - since >= self._timeout_seconds:
            self._move(Event.STALL)
            self._task.cancel()
            return
        self._timer = loop.call_at((now if since is None else since) + self._timeout_seconds, self._look_at_send, loop)

    async def _watch(self, receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self._move(Event.GONE)
        self._task.cancel()

    def timed_out(self) -> float | None:
        """Called with the task cancelled while the body was read: the client timeout when
        it did it (the cancellation is then taken back), else None. Its answer is given
        once: asked again, after a cancellation from elsewhere too, it is None."""
        if self.phase is not Phase.TIMED_OUT:
            return None
        self._move(Event.ASKED)
        if self._task.uncancel() > 0:
            return None
        return self._timeout_seconds

    def took_back(self) -> bool:
        """Called with the task cancelled after the body was read: True when the client's
        leaving (or its stalling: `stalled`) did it (the cancellation is then taken back),
        False when it came (also) from elsewhere."""
        if self.phase not in (Phase.LEFT, Phase.STALLED) or self._task.cancelling() > 1:
            return False
        self._task.uncancel()
        return True

    def stop(self) -> None:
        self._timer.cancel()
        if self._watcher is not None:
            self._watcher.cancel()


async def read_body(receive, declared: bytes | None, limit: int, watch: ClientWatch) -> bytes:
    """The whole request body (its `content-length` header said `declared`), timed by
    `watch`. Refused 413 when it is over `limit` bytes, 408 when the client timeout
    passes without a message of it (docs/design.md section 10); ClientLeft when the
    client leaves before its end."""
    # -1: none (chunked), or too long to be a length: read as it comes, and bounded as it does
    length = int(declared) if declared is not None and declared.isdigit() and len(declared) <= 18 else -1
    if length > limit:
        raise _too_large(limit)
    try:
        message = await receive()  # timed since the request came
        body: bytes | None = message.get("body")
        if body is None:  # the client left (or, rarely, a request message without a body)
            if message["type"] == "http.disconnect":
                raise ClientLeft
            body = b""
        # Granian's first message says `more_body` even when it holds the whole body, and
        # asking for the empty last one costs a round trip to its thread. A body of its
        # declared length is whole: the server gives a request no byte past it.
        if (size := len(body)) <= limit and (size == length or not message.get("more_body")):
            watch.body_read(receive)
            return body  # the usual request: all of its body in one message
        return await _read_rest(receive, message, limit, watch)
    except asyncio.CancelledError:
        timeout_seconds = watch.timed_out()
        if timeout_seconds is None:
            raise
        # raised as it is made: an exception kept in a local here would hold this frame (and
        # the request's receive) in a cycle, and the server would close the connection late
        raise _too_slow(timeout_seconds) from None


async def _read_rest(receive, message, limit: int, watch: ClientWatch) -> bytes:
    """The body whose first message, `message`, was not all of it (or was over `limit`)."""
    loop = asyncio.get_running_loop()
    parts = []
    size = 0
    while True:
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            await _discard_body(receive, message, watch, loop)
            raise _too_large(limit)
        parts.append(chunk)
        if not message.get("more_body"):
            watch.body_read(receive)
            return b"".join(parts)
        watch.waiting_since = loop.time()
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientLeft


def _too_slow(timeout_seconds: float) -> Refused:
    return Refused(408, f"no byte of the request body for {timeout_seconds:g} s", "request_timeout")


def _too_large(limit: int) -> Refused:
    return Refused(413, f"request body over {limit} bytes", "request_too_large")


# After a body goes over the limit, up to this much more of it is read and dropped
# so that the client, still sending, gets its 413 rather than a broken pipe.
DISCARD_BYTES = 1024 * 1024


async def _discard_body(receive, message, watch: ClientWatch, loop: asyncio.AbstractEventLoop) -> None:
    discarded = 0
    while message.get("more_body") and discarded < DISCARD_BYTES:
        watch.waiting_since = loop.time()
        try:
            message = await receive()
        except asyncio.CancelledError:
            if watch.timed_out() is None:
                raise
            return  # the client stopped sending: its 413 goes out now
        if message["type"] == "http.disconnect":
            raise ClientLeft
        discarded += len(message.get("body", b""))
