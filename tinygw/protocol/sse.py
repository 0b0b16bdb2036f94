"""Server-sent events as the gateway reads them: where events end, and what they carry.

The gateway holds back a stream's leading events until one carries model output
(docs/design.md section 4), so that an error that comes first can still fall back. `kind()`
tells the three apart for OpenAI (chat and completions chunks, the Responses API) and
Anthropic events; an event it does not know counts as output, so nothing unknown is
ever held back. Once output is sent, a stream's reads are searched for the markers of its
API alone (`Shape`, a table per API), and only the events that hold one are judged.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterator

import msgspec
from msgspec import Struct

from tinygw.protocol import usage

# Events end at a blank line; SSE allows \n, \r\n and \r line ends.
_EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")
_LINE_ENDS = re.compile(rb"[\r\n]*")

_decode = msgspec.json.Decoder()

_ANTHROPIC_PREAMBLE = {"message_start", "ping", "content_block_start", "content_block_stop"}
# The Responses API: a message item and its content part are announced empty before
# their text (`response.output_text.delta`) comes; any other item (a function call, a
# reasoning or tool item) is the model's output. `response.incomplete` ends an answer
# cut short by its own limit (max_output_tokens), as a finish reason "length" does.
_RESPONSES_PREAMBLE = {"response.created", "response.in_progress", "response.queued", "response.content_part.added"}
_RESPONSES_END = {"response.completed", "response.incomplete"}
_OUTPUT_FIELDS = ("content", "reasoning_content", "reasoning", "tool_calls", "function_call", "refusal")


_USAGE = usage.USAGE_OBJECT.pattern  # an event that reports usage (`"usage": null` does not)
_NOTHING = re.compile(rb"(?!)")


class Shape(Struct, frozen=True):
    """The API whose events a stream carries, and its table: the bytes without which one of
    its events can neither end an answer nor report an error (`kind()` judges the events
    that hold one), as regexes. After output, only events that hold a marker, or a usage
    object (`"usage": {`), are read (docs/design.md section 4). Inside a JSON string a
    quote is escaped, so `"error"` and `"finish_reason": "` are structure. The `quoted`
    markers begin with a quote: they are one regex, whose search goes from quote to quote
    (one of other alternatives too tries every byte: three times as long over a chat chunk);
    `plain` ones are looked for on their own."""

    name: str
    quoted: tuple[bytes, ...]
    plain: tuple[bytes, ...] = ()
    # Compiled once, when the shape is made (whatever is passed here is replaced): the
    # suspects' searches (the quoted markers and a usage object; the plain ones), and the ends'
    # and failures' alone.
    suspect: tuple[re.Pattern[bytes], ...] = ()
    end_or_fail: re.Pattern[bytes] = _NOTHING

    def __post_init__(self) -> None:
        quoted = re.compile(b"|".join((*self.quoted, _USAGE)))
        plain = (re.compile(b"|".join(self.plain)),) if self.plain else ()
        msgspec.structs.force_setattr(self, "suspect", (quoted, *plain))
        msgspec.structs.force_setattr(self, "end_or_fail", re.compile(b"|".join((*self.quoted, *self.plain))))


_ERROR, _DONE = rb'"error"', rb"\[DONE\]"  # an error (a field, or a `type`); OpenAI's last event
# OpenAI's chat completions and completions.
CHAT = Shape("chat", (rb'"finish_reason"\s*:\s*"', _ERROR), (_DONE,))
# OpenAI's Responses API and Anthropic's messages (Claude on Bedrock and Vertex too): an
# error event of these carries `"type": "error"` in its data.
RESPONSES = Shape("responses", (rb'"response\.(?:completed|incomplete|failed|error)"', _ERROR))
MESSAGES = Shape("messages", (rb'"stop_reason"\s*:\s*"', rb'"message_stop"', _ERROR))
# A stream of none known: the markers of all of them, and an `error` event whatever its data says.
ANY = Shape(
    "any",
    tuple(dict.fromkeys(m for shape in (CHAT, RESPONSES, MESSAGES) for m in shape.quoted)),
    (_DONE, rb"event:\s*error"),
)


def shape_of(api: str, upstream_path: str) -> Shape:
    """The shape of the streams of a route of `api` ("openai", "anthropic", "bedrock" or "vertex":
    tinygw.protocol.routing.Route), whose upstream path is `upstream_path`."""
    if api != "openai":
        return MESSAGES  # Bedrock's frames are read as Anthropic's events (tinygw.worker.frames)
    return RESPONSES if upstream_path == "/responses" else CHAT


def may_end_or_fail(event: bytes, shape: Shape = ANY) -> bool:
    """False when `kind(event)` is surely (OUTPUT or PREAMBLE, not finished), for an event
    of `shape`: the cheap scan that streams use once output has been sent."""
    return shape.end_or_fail.search(event) is not None


def suspects(block: bytes, end: int, start: int = 0, shape: Shape = ANY) -> list[bytes]:
    """The events of `block[start:end]` (complete events; `start` where one begins) that
    may end or fail the answer or report usage, for a stream of `shape`, in order: those of
    `[e for e in split(block[start:end])[0] if may_end_or_fail(e, shape) or usage.of_event(e)]`,
    and any where a match begins that spans into the next event (a false alarm: kind() tells).
    One search of the bytes for the shape's markers finds them (the usual read holds none),
    instead of a look at each event."""
    for pattern in shape.suspect:
        if pattern.search(block, start, end) is not None:
            return _cut_out(block, start, end, shape.suspect)
    return []


def _cut_out(block: bytes, start: int, end: int, patterns: tuple[re.Pattern[bytes], ...]) -> list[bytes]:
    """suspects(), where a marker is: each hit's event, cut out around it; the search goes
    on from its end."""
    found = []
    while (hit := _first_hit(block, start, end, patterns)) >= 0:
        boundary = _EVENT_END.search(block, hit, end)
        done = boundary.end() if boundary is not None else end
        found.append(block[_event_start(block, hit) : done])
        start = done
    return found


def _first_hit(block: bytes, start: int, end: int, patterns: tuple[re.Pattern[bytes], ...]) -> int:
    """Where the first match of one of `patterns` in `block[start:end]` begins; -1 if none does."""
    first = -1
    for pattern in patterns:
        match = pattern.search(block, start, end)
        if match is not None and (first < 0 or match.start() < first):
            first = match.start()
    return first


def last_end(buffer: bytes) -> int:
    """Where the last complete event of `buffer` ends (0 when none has): the same as
    `len(b"".join(split(buffer)[0]))`, without cutting the events out."""
    return _event_start(buffer, len(buffer))


def _event_start(buffer: bytes, pos: int) -> int:
    """The end of the last event boundary (as `split` finds them) before `pos`, which
    is `len(buffer)` or a byte that is neither CR nor LF. A boundary is all CRs and
    LFs: `split`'s scan starts afresh at the beginning of each run of them, so the
    last run holding a boundary is scanned alone, from its start to its end (the
    event after it, often a long incomplete one, holds no boundary)."""
    last = buffer.rfind(b"\n\n", 0, pos)
    after = max(last, 0)  # only a later boundary of another kind matters
    if buffer.find(b"\r", after, pos) >= 0:  # as the other kinds hold a CR
        last = max(last, buffer.rfind(b"\r\r", after, pos), buffer.rfind(b"\r\n\r\n", after, pos))
    if last < 0:
        return 0
    low = max(0, last - 16)
    run = low + len(buffer[low:last].rstrip(b"\r\n"))
    if run == low and low:  # a longer run of line ends
        run = len(buffer[:last].rstrip(b"\r\n"))
    start = 0
    ends = _LINE_ENDS.match(buffer, last, pos)  # always a match: `*` takes an empty run too
    for match in _EVENT_END.finditer(buffer, run, ends.end() if ends else pos):
        start = match.end()
    return start


# The pieces that Pending holds as they came; later ones are appended to one bytearray.
_SEPARATE_PARTS = 16


class Pending:
    """A stream's bytes since its last complete event, as they come: `feed` returns the
    events each piece completes. Only a piece's own bytes (and the 3 held before them,
    where an event end may begin) are looked at for an end, and held pieces are joined
    once, when an event ends: a stream costs time in proportion to its bytes, however
    small the pieces a provider sends it in. Past _SEPARATE_PARTS pieces, the rest are
    gathered in one bytearray: a megabyte sent a byte at a time is held in about a
    megabyte, not in an object per byte. What `feed` returns, joined, is what `split` of
    everything fed returns as events."""

    __slots__ = ("_parts", "size", "_tail")

    def __init__(self) -> None:
        self._parts: list[bytes | bytearray] = []
        self.size = 0  # bytes held
        self._tail = b""  # the last (up to 3) bytes held: an event end may begin there

    def feed(self, piece: bytes) -> bytes:
        """The complete events that `piece` ends, in one block (b"" when none); the
        bytes after them are held."""
        if not self._parts:
            if piece[-2:] == b"\n\n" and piece[-3:-2] not in b"\r\n":  # the usual read: whole events
                return piece
            data = piece
        elif _has_end(self._tail + piece[:3]) or _has_end(piece):
            self._parts.append(piece)
            data = b"".join(self._parts)
            self._parts.clear()
            self.size = 0
        else:
            self._hold(piece)
            return b""
        end = last_end(data)
        if end == len(data):
            return data
        self._tail = b""
        self._hold(data[end:] if end else data)
        return data[:end]

    def _hold(self, piece: bytes) -> None:
        parts = self._parts
        if len(parts) < _SEPARATE_PARTS:
            parts.append(piece)
        elif isinstance(parts[-1], bytearray):
            parts[-1] += piece
        else:
            parts.append(bytearray(piece))
        self.size += len(piece)
        self._tail = (self._tail + piece[-3:])[-3:]

    def peek(self) -> bytes:
        """The bytes held, left held."""
        parts = self._parts
        if not parts:
            return b""
        if len(parts) > 1 or isinstance(parts[0], bytearray):
            parts[:] = [b"".join(parts)]
        return parts[0]  # type: ignore[return-value]  # bytes: joined above

    def take(self) -> bytes:
        """The bytes held, no longer held: an event end that begins in them is no longer looked for."""
        data = self.peek()
        self._parts.clear()
        self.size = 0
        self._tail = b""
        return data


def _has_end(data: bytes) -> bool:
    """Does `data` hold an event end (or the bytes of one, which `split` may see otherwise)?"""
    return b"\n\n" in data or (b"\r" in data and (b"\r\r" in data or b"\r\n\r\n" in data))


class Kind(enum.Enum):
    PREAMBLE = "preamble"  # carries no output: role-only chunks, message_start, ping
    OUTPUT = "output"
    ERROR = "error"


def split(buffer: bytes) -> tuple[list[bytes], bytes]:
    """Complete events (each with its blank-line ending, where `ends` finds it) and the
    incomplete rest."""
    events = []
    start = 0
    for end in ends(buffer):
        events.append(buffer[start:end])
        start = end
    return events, buffer[start:]


def ends(buffer: bytes) -> Iterator[int]:
    """Where each complete event of `buffer` ends, in order, without a list of the events
    (a held stream of tiny events costs no object per event: tinygw.worker.relay)."""
    if b"\r" not in buffer:  # the usual line ends: bytes.find does what the regex would
        end = buffer.find(b"\n\n")
        while end >= 0:
            yield end + 2
            end = buffer.find(b"\n\n", end + 2)
        return
    for match in _EVENT_END.finditer(buffer):
        yield match.end()


def _fields(event: bytes) -> tuple[bytes, bytes]:
    """An event's name (`event:`) and data (its `data:` lines, joined by LF)."""
    if event.startswith(b"data:") and event.find(b"\n") == len(event) - 2 and b"\r" not in event:
        return b"", event[5:-2].removeprefix(b" ")  # one data line, then the blank line: most events
    return _fields_line_by_line(event)


def _fields_line_by_line(event: bytes) -> tuple[bytes, bytes]:
    name = b""
    data = []
    for line in event.splitlines():
        if line.startswith(b"event:"):
            name = line[6:].strip()
        elif line.startswith(b"data:"):
            data.append(line[5:].removeprefix(b" "))
    return name, b"\n".join(data)


def kind(event: bytes) -> tuple[Kind, bool]:
    """What `event` carries, and whether it marks the end of the answer (a finish
    reason, `[DONE]`, `message_stop`, `response.completed`, `response.incomplete`)."""
    name, data = _fields(event)
    if name == b"error":
        return Kind.ERROR, False
    if not data:
        return Kind.PREAMBLE, False  # a comment or keep-alive
    if data.strip() == b"[DONE]":
        return Kind.OUTPUT, True
    try:
        value = _decode.decode(data)
    except (msgspec.MsgspecError, RecursionError):  # nested too deeply: not judged
        return Kind.OUTPUT, False
    if not isinstance(value, dict):
        return Kind.OUTPUT, False
    if value.get("error") is not None:
        return Kind.ERROR, False
    kind_name = value.get("type")
    if isinstance(kind_name, str):
        if kind_name == "error" or kind_name in ("response.failed", "response.error"):
            return Kind.ERROR, False
        if kind_name in _ANTHROPIC_PREAMBLE or kind_name in _RESPONSES_PREAMBLE:
            return Kind.PREAMBLE, False
        if kind_name == "message_stop" or kind_name in _RESPONSES_END:
            return Kind.OUTPUT, True
        if kind_name == "response.output_item.added":
            item = value.get("item")
            return (Kind.PREAMBLE if isinstance(item, dict) and item.get("type") == "message" else Kind.OUTPUT), False
        if kind_name == "message_delta":
            delta = value.get("delta")
            return Kind.OUTPUT, isinstance(delta, dict) and delta.get("stop_reason") is not None
    choices = value.get("choices")
    if isinstance(choices, list):
        output = finished = False
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            if choice.get("finish_reason") is not None:
                output = finished = True
            delta = choice.get("delta")
            if not isinstance(delta, dict):
                delta = {}
            if any(delta.get(f) for f in _OUTPUT_FIELDS) or choice.get("text"):
                output = True
        return (Kind.OUTPUT if output else Kind.PREAMBLE), finished
    return Kind.OUTPUT, False
