"""Bedrock's streamed answers (`application/vnd.amazon.eventstream`) through the relay
(docs/design.md section 18).

The relay (tinygw.worker.relay) reads server-sent events: its commit point, its error
events, its usage. `Unwrapped` is a Bedrock answer read as those: each frame, its CRCs
checked, becomes the Anthropic event it carries (an exception frame an `error` event).
On `/v1/messages` that is what the client gets. On the Bedrock route the client gets
frames: `rewrapped` sends, for each event the relay sends on, the very frame it came
from, and for an event of the gateway's own (the error that ends a cut stream) a new
exception frame. A frame whose CRC does not match is a cut stream (RemoteProtocolError).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable

import msgspec

from tinygw import errors
from tinygw.protocol import eventstream
from tinygw.protocol.eventstream import BadFrame, FrameReader
from tinygw.upstream.pool import Response

Send = Callable[[dict], Awaitable[None]]

_SSE = (b"content-type", b"text/event-stream")
# The exception a cut stream ends with on the Bedrock route: Bedrock's own name for a
# stream that failed on the way.
CUT_EXCEPTION = "modelStreamErrorException"


class Unwrapped:
    """A Bedrock stream as the relay reads it: `headers` (its content type that of
    server-sent events) and `next_chunk`, the events of the frames that each read completes."""

    __slots__ = ("headers", "keep_frames", "frames", "exception_type", "_response", "_reader")

    def __init__(self, response: Response, keep_frames: bool) -> None:
        self._response = response
        self._reader = FrameReader()
        self.headers = [(k, v) for k, v in response.headers if k != b"content-type"] + [_SSE]
        self.keep_frames = keep_frames  # the Bedrock route: frames are what the client gets
        self.frames: deque[bytes] = deque()  # the frames of the events handed out, not yet sent on
        self.exception_type: str | None = None  # the name of the last exception frame read

    async def next_chunk(self) -> bytes | None:
        """The events of the next read that completes a frame, or None at the stream's end."""
        while True:
            chunk = await self._response.next_chunk()
            try:
                if chunk is None:
                    self._reader.close()
                    return None
                frames = self._reader.feed(chunk)
                events = b"".join(eventstream.event_of(frame) for frame in frames)
            except BadFrame as e:
                await self._response.aclose()
                raise errors.RemoteProtocolError(f"the provider's event stream is corrupt: {e}") from None
            if frames:
                for frame in frames:
                    if frame.is_exception:
                        self.exception_type = eventstream.exception_type(frame)
                if self.keep_frames:
                    self.frames.extend(frame.raw for frame in frames)
                return events


def rewrapped(send: Send, unwrapped: Unwrapped) -> Send:
    """`send`, for the Bedrock route: the answer's content type is the event stream's,
    and each event the relay sends (the events of `unwrapped`, whole, in order, then any
    of the gateway's own) goes out as its frame."""

    async def send_frames(message: dict) -> None:
        if message["type"] == "http.response.start":
            headers = [(k, v) for k, v in message["headers"] if k != b"content-type"]
            message = {**message, "headers": [*headers, (b"content-type", eventstream.CONTENT_TYPE)]}
        elif body := message.get("body"):
            out = []
            for event in body.split(b"\n\n")[:-1]:  # each event (one data line) ends with the blank line
                if unwrapped.frames:
                    out.append(unwrapped.frames.popleft())
                else:  # the gateway's own: the error that ends a cut stream
                    out.append(eventstream.exception_frame(CUT_EXCEPTION, _message_of(event)))
            message = {**message, "body": b"".join(out)}
        await send(message)

    return send_frames


def _message_of(event: bytes) -> str:
    """The message of an error event of the gateway's own, for the frame that replaces it."""
    try:
        error = msgspec.json.decode(event.partition(b"data: ")[2]).get("error")
        return str(error.get("message") or "the stream failed")
    except (msgspec.MsgspecError, AttributeError, RecursionError):
        return "the stream failed"
