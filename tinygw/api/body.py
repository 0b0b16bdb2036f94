"""A request's body, read within its bounds: the size limit, and the client timeout
between its messages (docs/design.md section 10)."""

from __future__ import annotations

import asyncio


class ClientLeft(Exception):
    """The client disconnected while the gateway was still reading its request."""


async def receive_within(receive, timeout_seconds: float, task: asyncio.Task):
    """`await receive()` in `task`, or TimeoutError after `timeout_seconds`. asyncio.timeout's
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
            raise TimeoutError from None
        raise
    finally:
        timer.cancel()


async def read_body(receive, headers, limit: int, timeout_seconds: float, task: asyncio.Task) -> bytes | None:
    """The whole request body, or None when it is over `limit` bytes. Raises
    TimeoutError when `timeout_seconds` pass without a byte of it (docs/design.md section 10)."""
    declared = dict(reversed(headers)).get(b"content-length")  # wire.header, without the call
    if declared is not None and declared.isdigit() and int(declared) > limit:
        return None
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
            return None
        parts.append(chunk)
        if not message.get("more_body"):
            return b"".join(parts)
        message = await receive_within(receive, timeout_seconds, task)
        if message["type"] == "http.disconnect":
            raise ClientLeft


# After a body goes over the limit, up to this much more of it is read and dropped
# so that the client, still sending, gets its 413 rather than a broken pipe.
DISCARD_BYTES = 1024 * 1024


async def _discard_body(receive, message, timeout_seconds: float, task: asyncio.Task) -> None:
    discarded = 0
    while message.get("more_body") and discarded < DISCARD_BYTES:
        try:
            message = await receive_within(receive, timeout_seconds, task)
        except TimeoutError:
            return
        if message["type"] == "http.disconnect":
            raise ClientLeft
        discarded += len(message.get("body", b""))
