"""A request's body, read within its bounds: the size limit, and the client timeout
between its messages (docs/design.md section 10)."""

from __future__ import annotations

import asyncio


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


async def receive_within(receive, timeout_seconds: float, task: asyncio.Task):
    """`await receive()` in `task`, or Refused 408 after `timeout_seconds`. asyncio.timeout's
    work with the task at hand: asyncio's own looks the loop up twice (two getpid(2)
    on Python 3.11), for each request."""
    expired = []

    def expire() -> None:
        expired.append(True)
        task.cancel()

    timer = task.get_loop().call_later(timeout_seconds, expire)
    try:
        message = await receive()
        if expired:  # the timer fired as the message came: as asyncio.timeout, take the cancel back
            task.uncancel()
        return message
    except asyncio.CancelledError:
        if expired and task.uncancel() == 0:
            raise Refused(408, f"no byte of the request body for {timeout_seconds:g} s", "request_timeout") from None
        raise
    finally:
        timer.cancel()


async def read_body(receive, declared: bytes | None, limit: int, timeout_seconds: float, task: asyncio.Task) -> bytes:
    """The whole request body (its `content-length` header said `declared`). Refused
    413 when it is over `limit` bytes, 408 when `timeout_seconds` pass without a byte of
    it (docs/design.md section 10); ClientLeft when the client leaves before its end."""
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    message = await receive_within(receive, timeout_seconds, task)
    if message["type"] == "http.disconnect":
        raise ClientLeft
    body: bytes = message.get("body", b"")
    if not message.get("more_body") and len(body) <= limit:
        return body  # the usual request: all of its body in one message
    parts = []
    size = 0
    while True:
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            await _discard_body(receive, message, timeout_seconds, task)
            raise _too_large(limit)
        parts.append(chunk)
        if not message.get("more_body"):
            return b"".join(parts)
        message = await receive_within(receive, timeout_seconds, task)
        if message["type"] == "http.disconnect":
            raise ClientLeft


def _too_large(limit: int) -> Refused:
    return Refused(413, f"request body over {limit} bytes", "request_too_large")


# After a body goes over the limit, up to this much more of it is read and dropped
# so that the client, still sending, gets its 413 rather than a broken pipe.
DISCARD_BYTES = 1024 * 1024


async def _discard_body(receive, message, timeout_seconds: float, task: asyncio.Task) -> None:
    discarded = 0
    while message.get("more_body") and discarded < DISCARD_BYTES:
        try:
            message = await receive_within(receive, timeout_seconds, task)
        except Refused:  # 408: the client stopped sending
            return
        if message["type"] == "http.disconnect":
            raise ClientLeft
        discarded += len(message.get("body", b""))
