"""A proxied request's client: its body, read within its bounds (the size limit, and the
client timeout between its messages: docs/design.md section 10), and the watch that
cancels the request when the client leaves, both on one timer (ClientWatch)."""

from __future__ import annotations

import asyncio

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


class ClientWatch:
    """A proxied request's one timer over its client, from the request's start.

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

    waiting_since: float | None  # None once the body is read
    expired_after: float | None = None  # the client timeout, once it passed during the body
    looked = False  # the first look came while the body was still being read
    stalled = False  # a send to the client waited longer than the client timeout
    _loop: asyncio.AbstractEventLoop  # set by that look
    _timeout_seconds: float  # the client timeout, set by the first look
    _watcher: asyncio.Task | None = None
    _left = False

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
        self.waiting_since = record.started_at
        self._timer = loop.call_later(every_seconds, self._look, loop, receive, timeout_seconds)

    def _look(self, loop: asyncio.AbstractEventLoop, receive, timeout_seconds: float) -> None:
        if self.waiting_since is None:  # the body was read before the first look
            self._watch_answer(loop, receive, timeout_seconds)
            return
        self.looked = True
        # for body_read's watch: kept by the look, which a quick request never has
        self._loop, self._timeout_seconds = loop, timeout_seconds
        left = self.waiting_since + timeout_seconds - loop.time()
        if left > 0:  # not over yet: looked at again when it could be
            self._timer = loop.call_later(left, self._look, loop, receive, timeout_seconds)
            return
        self.expired_after = timeout_seconds
        self._task.cancel()

    def body_read(self, receive) -> None:
        """The body is read. After the first look the timer waits for the body's
        deadline: the watch over the answer starts now instead."""
        self.waiting_since = None
        if self.looked:
            self._timer.cancel()
            self._watch_answer(self._loop, receive, self._timeout_seconds)

    def _watch_answer(self, loop: asyncio.AbstractEventLoop, receive, timeout_seconds: float) -> None:
        """While the request is answered: a task waits for the client to leave, and the
        timer looks at the sends to it (_look_at_send)."""
        self._timeout_seconds = timeout_seconds
        self._watcher = loop.create_task(self._watch(receive))
        self._timer = loop.call_later(timeout_seconds, self._look_at_send, loop)

    def _look_at_send(self, loop: asyncio.AbstractEventLoop) -> None:
        """A client that has not taken a send within the client timeout is cut: the
        request's task is cancelled at that send (docs/design.md section 16). Else the
        timer looks again when the send now waiting could time out, or a timeout on."""
        since, now = self._record.sending_since, loop.time()
        if since is not None and now - since >= self._timeout_seconds:
            self.stalled = True
            self._task.cancel()
            return
        self._timer = loop.call_at((now if since is None else since) + self._timeout_seconds, self._look_at_send, loop)

    async def _watch(self, receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self._left = True
        self._task.cancel()

    def timed_out(self) -> float | None:
        """Called with the task cancelled while the body was read: the client timeout when
        it did it (the cancellation is then taken back), else None. Its answer is given
        once: asked again, after a cancellation from elsewhere too, it is None."""
        expired, self.expired_after = self.expired_after, None
        if expired is None or self._task.uncancel() > 0:
            return None
        return expired

    def took_back(self) -> bool:
        """Called with the task cancelled after the body was read: True when the client's
        leaving (or its stalling: `stalled`) did it (the cancellation is then taken back),
        False when it came (also) from elsewhere."""
        if not (self._left or self.stalled) or self._task.cancelling() > 1:
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
