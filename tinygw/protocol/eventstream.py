"""AWS's event stream (`application/vnd.amazon.eventstream`), the framing of Bedrock's
streamed answers (docs/design.md section 18): a sans-I/O frame reader, as sse.py is
for server-sent events, and what each frame carries.

A frame (a "message") is: its total length and its headers' length (4 bytes each, big
endian), the CRC32 of those 8 bytes, the headers, the payload, and the CRC32 of all
that came before. Both CRCs are checked: a frame whose CRC does not match is a stream
cut or corrupted on the way, never read as an event. Bedrock's frames carry one
Anthropic event each, as base64 JSON in the payload's `bytes`; `:message-type`
`exception` is an error (`:exception-type` names it, the payload has its `message`).
"""

from __future__ import annotations

import base64
import binascii
import struct
import zlib

import msgspec
from msgspec import Struct

CONTENT_TYPE = b"application/vnd.amazon.eventstream"

_PRELUDE = struct.Struct(">II")
PRELUDE_BYTES = 12  # the two lengths and their CRC
CRC_BYTES = 4
MIN_FRAME_BYTES = PRELUDE_BYTES + CRC_BYTES
# AWS's own bounds on a message and on its headers (the eventstream specification's).
MAX_FRAME_BYTES = 16 * 1024 * 1024
MAX_HEADERS_BYTES = 128 * 1024

# Header value types (the specification's numbers) and the sizes of the fixed-size ones.
_BOOL_TRUE, _BOOL_FALSE, _BYTE, _SHORT, _INT, _LONG, _BYTES, _STRING, _TIMESTAMP, _UUID = range(10)
_FIXED = {_BYTE: 1, _SHORT: 2, _INT: 4, _LONG: 8, _TIMESTAMP: 8, _UUID: 16}


class BadFrame(ValueError):
    """The stream does not hold a valid frame here: a CRC that does not match, a length
    out of bounds, or headers that do not parse. The provider's fault (or the network's)."""


class Frame(Struct, frozen=True):
    headers: dict[str, str]  # string-valued headers (`:message-type` and the like); others are skipped
    payload: bytes
    raw: bytes  # the frame's bytes as they came

    @property
    def is_exception(self) -> bool:
        return self.headers.get(":message-type") in ("exception", "error")


def _headers(data: bytes) -> dict[str, str]:
    headers: dict[str, str] = {}
    i = 0
    try:
        while i < len(data):
            name_length = data[i]
            name = data[i + 1 : i + 1 + name_length].decode()
            kind = data[i + 1 + name_length]
            i += 2 + name_length
            if kind in (_BOOL_TRUE, _BOOL_FALSE):
                continue
            if kind in _FIXED:
                i += _FIXED[kind]
                continue
            if kind not in (_BYTES, _STRING):
                raise BadFrame(f"a header of unknown type {kind}")
            (length,) = struct.unpack_from(">H", data, i)
            value = data[i + 2 : i + 2 + length]
            i += 2 + length
            if kind == _STRING:
                headers[name] = value.decode()
    except (IndexError, struct.error, UnicodeDecodeError):
        raise BadFrame("the frame's headers do not parse") from None
    if i != len(data):
        raise BadFrame("the frame's headers do not parse")
    return headers


class FrameReader:
    """A stream's bytes as they come: `feed` returns the frames they complete, and holds
    the rest. Raises BadFrame where the stream stops being frames: at once, or, when the
    same bytes completed good frames before it, at the next `feed` or `close` (the good
    frames are the stream's)."""

    __slots__ = ("_buffer", "_broken")

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._broken: BadFrame | None = None

    def close(self) -> None:
        """The stream ended: BadFrame if it did not end where a frame does."""
        if self._broken is not None:
            raise self._broken
        if self._buffer:
            raise BadFrame("the stream ended inside a frame")

    @property
    def pending(self) -> int:
        """Bytes held of a frame not yet complete."""
        return len(self._buffer)

    def feed(self, data: bytes) -> list[Frame]:
        if self._broken is not None:
            raise self._broken
        frames: list[Frame] = []
        try:
            self._frames(data, frames)
        except BadFrame as e:
            if not frames:
                raise
            self._broken = e
        return frames

    def _frames(self, data: bytes, frames: list[Frame]) -> None:
        """Append to `frames` those that the bytes held and `data` complete."""
        buffer = self._buffer
        buffer += data
        start = 0
        try:
            while (frame := _frame_at(buffer, start)) is not None:
                frames.append(frame)
                start += len(frame.raw)
        finally:
            del buffer[:start]  # what was read as frames


def _frame_at(buffer: bytearray, start: int) -> Frame | None:
    """The frame that begins at `start` of `buffer`, or None while it is incomplete."""
    if len(buffer) - start < PRELUDE_BYTES:
        return None
    total, headers_length = _PRELUDE.unpack_from(buffer, start)
    (prelude_crc,) = struct.unpack_from(">I", buffer, start + 8)
    if zlib.crc32(buffer[start : start + 8]) != prelude_crc:
        raise BadFrame("a frame's prelude CRC does not match")
    if not MIN_FRAME_BYTES <= total <= MAX_FRAME_BYTES or headers_length > min(
        MAX_HEADERS_BYTES, total - MIN_FRAME_BYTES
    ):
        raise BadFrame("a frame's lengths are out of bounds")
    if len(buffer) - start < total:
        return None
    end = start + total
    (message_crc,) = struct.unpack_from(">I", buffer, end - CRC_BYTES)
    if zlib.crc32(buffer[start : end - CRC_BYTES]) != message_crc:
        raise BadFrame("a frame's message CRC does not match")
    body = start + PRELUDE_BYTES
    headers = _headers(bytes(buffer[body : body + headers_length]))
    return Frame(headers, bytes(buffer[body + headers_length : end - CRC_BYTES]), bytes(buffer[start:end]))


def encode_frame(headers: dict[str, str], payload: bytes) -> bytes:
    """A frame of string headers and `payload`, CRCs and all."""
    encoded = b"".join(
        bytes([len(name.encode())])
        + name.encode()
        + bytes([_STRING])
        + struct.pack(">H", len(value.encode()))
        + value.encode()
        for name, value in headers.items()
    )
    total = PRELUDE_BYTES + len(encoded) + len(payload) + CRC_BYTES
    prelude = _PRELUDE.pack(total, len(encoded))
    message = prelude + struct.pack(">I", zlib.crc32(prelude)) + encoded + payload
    return message + struct.pack(">I", zlib.crc32(message))


# ---- what a Bedrock frame carries -------------------------------------------------------

_CHUNK_HEADERS = {":event-type": "chunk", ":content-type": "application/json", ":message-type": "event"}


class _Chunk(Struct):
    bytes: str = ""


class _Typed(Struct):
    type: str = ""


class _Message(Struct):
    message: str = ""


_decode_chunk = msgspec.json.Decoder(_Chunk)
_decode_typed = msgspec.json.Decoder(_Typed)
_decode_message = msgspec.json.Decoder(_Message)
_encode = msgspec.json.Encoder()


def exception_type(frame: Frame) -> str:
    """The name an exception frame gives its error (`throttlingException`)."""
    return frame.headers.get(":exception-type") or frame.headers.get(":error-code") or "exception"


def event_of(frame: Frame) -> bytes:
    """The Anthropic event a Bedrock frame carries, as a server-sent event (`event:
    NAME`, `data: JSON`, a blank line). An exception frame is an `error` event; a frame
    that carries no event is BadFrame."""
    if frame.is_exception:
        name = exception_type(frame)
        try:
            message = _decode_message.decode(frame.payload).message
        except (msgspec.MsgspecError, RecursionError):
            message = ""
        error = {"type": "error", "error": {"type": name, "message": message or name}}
        return b"event: error\ndata: " + _encode.encode(error) + b"\n\n"
    try:
        data = base64.b64decode(_decode_chunk.decode(frame.payload).bytes, validate=True)
        kind = _decode_typed.decode(data).type
    except (msgspec.MsgspecError, binascii.Error, RecursionError):
        raise BadFrame("a frame that carries no event") from None
    if b"\n" in data or b"\r" in data:  # JSON's own white space: one line, so that it is one SSE data line
        data = _encode.encode(msgspec.json.decode(data))
    return b"event: " + (kind or "message").encode() + b"\ndata: " + data + b"\n\n"


def chunk_frame(event_json: bytes) -> bytes:
    """A Bedrock frame carrying one Anthropic event (its JSON)."""
    return encode_frame(_CHUNK_HEADERS, _encode.encode({"bytes": base64.b64encode(event_json).decode()}))


def exception_frame(exception_type: str, message: str) -> bytes:
    """A Bedrock exception frame (`:message-type` exception), as Bedrock ends a failed stream."""
    headers = {":exception-type": exception_type, ":content-type": "application/json", ":message-type": "exception"}
    return encode_frame(headers, _encode.encode({"message": message}))
