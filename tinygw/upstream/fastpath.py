"""A fast path for the upstream client's common exchanges, with h11 as the authority.

h11 costs about 40 µs a request (writing the request, parsing the answer), a quarter
of the gateway's own CPU per request. Most answers have one of two simple shapes: a
`content-length` body (non-streamed answers) or a `chunked` one (streams). This module
writes requests and parses such answers itself, sans-I/O, and is strict: whatever it
does not fully understand (another HTTP version, 1xx, 204/304, a head with obs-fold,
bare LF or non-ASCII bytes, a body delimited by the connection's close, both or
neither framing header, trailers) it hands to h11, with the same bytes, and h11
decides. A differential test (tests/test_fastpath.py) feeds random and mutated byte
streams, split at random points, to both, and requires the same result or a hand-off.

Limits follow h11's: a head over `MAX_HEAD_BYTES` goes to h11 (which refuses it);
chunk sizes are 1 to 20 hex digits, chunk extensions are skipped, trailing OWS in a
chunk header is allowed; a trailer section with fields is read by h11 itself.
"""

from __future__ import annotations

import enum
import operator
import re
from itertools import compress

import h11

_NAME_OF = operator.itemgetter(0)

# Header names are tokens; the values that the fast path reads and writes are visible
# ASCII with inner spaces, no leading or trailing space (a stricter subset of h11's).
_NAME = rb"[-!#$%&'*+.^_`|~0-9a-zA-Z]+"
_FIELD_VALUE = rb"(?:[\x21-\x7e](?:[\x20-\x7e]*[\x21-\x7e])?)?"

# What the fast path writes: a target of visible ASCII, and headers of the shape above,
# each first written `name NUL value CRLF` to be checked (encode_request).
_TARGET = re.compile(rb"[\x21-\x7e]+")
_CHECKED_LINE = b"%s\x00%s\r\n"
_CHECKED_LINES = re.compile(rb"(?:" + _NAME + rb"\x00" + _FIELD_VALUE + rb"\r\n)*")
# A framing or Host line among the checked lines, lowered; a content-length with its value.
_FRAMING_LINE = re.compile(rb"\n(host\x00|content-length\x00[^\r]*|transfer-encoding\x00)")

# What the fast path reads: HTTP/1.1, a 3-digit status of 200 and up but 204 and 304
# (which have no body whatever their headers say: h11 reads those), a reason of
# visible ASCII and spaces; header lines `name: value` with optional spaces or tabs
# around the value; CRLF everywhere. A head but its last CRLF is split at its header
# lines (`_HEADER_LINE.split`, one pass): it is one the fast path reads when what comes
# before the first is a status line and nothing comes between or after them; then no CR
# or LF stands alone in it. A header line starts after an LF: tried only there, a line
# that is not one is passed over in one step, not tried again from each of its bytes.
# Every run of spaces, tabs or extension bytes is taken whole (possessive: `*+`), never
# given back byte by byte: in these patterns giving bytes back can make no match that
# the whole run does not, and a provider's head or chunk line of 60,000 spaces before a
# bad byte costs one pass over it, not one per space (seconds of the loop, before).
_STATUS_LINE = re.compile(rb"HTTP/1\.1 (?!204|304)([2-5][0-9]{2})(?: [\x20-\x7e]*)?\r\n")
_HEADER_LINE = re.compile(rb"(?<=\n)(" + _NAME + rb"):[ \t]*+(" + _FIELD_VALUE + rb")[ \t]*+\r\n")
# The split's parts: [status line, name, value, between, name, value, between, ...]
_NAMES, _VALUES, _BETWEEN = slice(1, None, 3), slice(2, None, 3), slice(3, None, 3)
_VALUE_OF = operator.itemgetter(1)
# A `connection` header's token `close`, among others.
_CLOSE = re.compile(rb"(?:^|,)[ \t]*close[ \t]*(?:,|$)", re.IGNORECASE)
# A chunk-size line with the CRLF before it, which ends the chunk before it (or the head, for
# the first: a chunked body is read from the head's last CRLF): its size in group 1, 1 to 20
# hex digits as h11 allows (more cannot match: what follows the digits is `;`, OWS or the
# CRLF), an extension that runs to the line's end (any byte but the CRLF, as h11's `;.*`),
# OWS. It never spans a CRLF, so where a line is complete it matches exactly that line, or
# the line is malformed. The one pattern of both of `Answer._chunks`' loops.
_SIZE_LINE = re.compile(rb"\r\n([0-9A-Fa-f]{1,20})(?:;[^\r\n]*+(?:\r(?!\n)[^\r\n]*+)*+)?[ \t]*+\r\n")
_LENGTH = re.compile(rb"[0-9]{1,18}")  # a plain content-length; a longer one goes to h11 (which allows 20)

# A response head (status line and headers) larger than this is a protocol error.
# h11's own default is 16 KiB; providers add long rate-limit and trace headers.
MAX_HEAD_BYTES = 64 * 1024


class _Reading(enum.Enum):
    """Where a chunked body's reading is (`Answer._state`): each read goes on from there."""

    LINE = "line"  # at the CRLF that ends a chunk's data (or the head), then a chunk-size line
    DATA = "data"  # inside a chunk's data (`_chunk_left` bytes to come)
    TRAILER = "trailer"  # after the last chunk: at the empty line that ends the body, or a trailer
    FIELDS = "fields"  # in a trailer section with fields, which h11 reads (_TrailerReader)
    END = "end"  # the body has ended: what follows is past the answer


_IN_CHUNKS = (_Reading.LINE, _Reading.DATA)  # the chunks are still being read


class HandOff(Exception):
    """This answer is not one the fast path fully understands: h11 must read it."""


class Malformed(Exception):
    """The answer breaks HTTP/1.1 where h11 would refuse it too (a protocol error)."""


def encode_request(method: bytes, target: bytes, headers: list[tuple[bytes, bytes]], body: bytes) -> bytes | None:
    """The request's bytes, or None when a header is not plainly valid (h11 then
    encodes it, and judges it). The caller has put `content-length` in `headers`."""
    # Each header as a line `name NUL value CRLF`: NUL is in no valid name or value, so a
    # line that matches has its one NUL where its name ends; and the line ends counted
    # say that no header holds a line end of its own. All headers are checked at once.
    lines = b"".join(map(_CHECKED_LINE.__mod__, headers))  # map: no Python step per header
    if lines.count(b"\n") != len(headers) or not _CHECKED_LINES.fullmatch(lines) or not _TARGET.fullmatch(target):
        return None
    # Framing and Host as h11 requires them (one Host, one content-length, the body's, no
    # transfer-encoding), else h11 says what is wrong: a line starts after an LF only, and
    # its name ends at its NUL. Found in one pass over a lowered copy (a regex that ignores
    # case is slower than lowering), each content-length with its value.
    found = _FRAMING_LINE.findall((b"\n" + lines).lower())
    if sorted(found) != [b"content-length\x00%d" % len(body), b"host\x00"]:
        return None
    return b"%s %s HTTP/1.1\r\n%s\r\n%s" % (method, target, lines.replace(b"\x00", b": "), body)


class Answer:
    """One answer, parsed as its bytes arrive: `feed(data)`, then `head()` until it
    returns (status, headers) (or `head(data)`), then `body()` until it returns None (the end).

    Raises HandOff (only before the head is returned: `raw()` then gives every byte
    fed so far, for h11) or Malformed. After the end, `leftover` holds bytes that came
    past the answer's end, and `keep_alive` says whether the provider may reuse the
    connection. Every byte is looked at a bounded number of times, however the
    provider splits its answer (a head or a chunk-size line sent a byte at a time, a
    read of tiny chunks),
    and nothing is held beyond h11's own bounds (a head or a chunk-size line of at
    most `MAX_HEAD_BYTES`)."""

    # Where an answer starts; each is set on the answer itself when it changes (one per
    # request: class-level defaults save setting each one, and an __init__: an answer is
    # made in C).
    _in_head = True  # until the head is taken
    # The head's bytes while it comes in pieces, joined as they come (each byte copied
    # once), and all of them at a hand-off (raw()); None else.
    _head: bytes | bytearray | None = None
    _scanned = 0  # bytes of _head already checked for bare CR/LF and the head's end
    _find_from = 0  # where the head's end may be: it may straddle reads
    _buffer = b""  # the body's bytes not yet consumed
    _remaining = 0  # content-length bytes still to come
    _chunked = False
    _chunk_left = 0  # bytes of the current chunk still to come
    _state = _Reading.LINE  # chunked: where the body's reading is
    # An unfinished chunk-size line at the buffer's start (after the CRLF before it): how
    # many of its bytes are known to hold no CRLF (a line trickled a byte a read is searched once, not once a read).
    _line_checked = 0
    _trailer: _TrailerReader | None = None
    keep_alive = True
    leftover = b""
    done = False

    def feed(self, data: bytes) -> None:
        if self._in_head:
            self._pieces().extend(data)
        elif self._state is _Reading.FIELDS and self._trailer is not None:
            self._trailer.feed(data)
        else:
            self._buffer = self._buffer + data if self._buffer else data

    def raw(self) -> bytes:
        return bytes(self._head) if self._head is not None else b""

    def head(self, more: bytes = b"") -> tuple[int, list[tuple[bytes, bytes]]] | None:
        """(status, headers with lower-case names), or None until the head has arrived;
        `more` is fed first (one call per read while the head comes)."""
        # Only a head within the bound is found; one that ends past it has more bytes than
        # the bound, which _check_partial_head hands to h11 (it refuses it).
        if self._head is None and (end := more.find(b"\r\n\r\n", 0, MAX_HEAD_BYTES)) >= 0:
            received = more  # the usual head: all of it in one read
        else:
            buffer = self._pieces()
            buffer += more
            end = buffer.find(b"\r\n\r\n", self._find_from, MAX_HEAD_BYTES)
            if end < 0:
                self._check_partial_head()
                return None
            received, self._head = bytes(buffer), None  # not held for the rest
        parts = _HEADER_LINE.split(received[: end + 2])
        status = _STATUS_LINE.fullmatch(parts[0])
        if status is None or any(parts[_BETWEEN]):
            raise self._handing_off(received)
        headers = list(zip(map(bytes.lower, parts[_NAMES]), parts[_VALUES], strict=True))  # lowered in C
        # How the body is delimited: one plain content-length, or chunked alone; and
        # whether the connection may be reused. Anything else goes to h11 (HandOff).
        fields = dict(headers)
        connection = fields.get(b"connection", b"keep-alive")
        if len(fields) != len(headers):  # a name given twice: one framing header at most, every `connection` value
            names = list(map(_NAME_OF, headers))
            if names.count(b"content-length") > 1 or names.count(b"transfer-encoding") > 1:
                raise self._handing_off(received)
            connection = b",".join(compress(map(_VALUE_OF, headers), map(b"connection".__eq__, names)))  # in C
        if connection != b"keep-alive":
            self.keep_alive = _CLOSE.search(connection) is None
        if b"transfer-encoding" in fields:
            if b"content-length" in fields or fields[b"transfer-encoding"] != b"chunked":
                raise self._handing_off(received)
            self._chunked = True
            end -= 2  # its body is read from the head's last CRLF, which comes before its first size line
        elif _LENGTH.fullmatch(length := fields.get(b"content-length", b"")):
            self._remaining = int(length)
        else:
            raise self._handing_off(received)  # no framing (read until close), odd values
        self._buffer, self._in_head = received[end + 4 :], False
        return int(status[1]), headers

    def _handing_off(self, received: bytes) -> HandOff:
        """The HandOff for a head that came whole: its bytes are kept for raw() (h11 reads them)."""
        self._head = received
        return HandOff()

    def _pieces(self) -> bytearray:
        """The head's bytes so far, for a head that comes in pieces, to be joined in place."""
        if isinstance(self._head, bytearray):
            return self._head
        self._head = pieces = bytearray(self._head or b"")
        return pieces

    def _check_partial_head(self) -> None:
        """The head has not ended yet. HandOff on a bare LF or CR in the bytes fed since
        the last call (h11 has rules of its own for those: it may see a head's end there)
        or a head over the bound."""
        buffer = self._pieces()
        scanned = self._scanned
        # Counted from the CR before the new bytes, if any.
        region = buffer[scanned - 1 if scanned and buffer[scanned - 1] == 13 else scanned :]
        crlf = region.count(b"\r\n")
        tail_cr = region.endswith(b"\r")  # may be the CR of a CRLF still coming
        if region.count(b"\n") != crlf or region.count(b"\r") - tail_cr != crlf:
            raise HandOff
        self._scanned = scanned = len(buffer) - 1 if tail_cr else len(buffer)
        self._find_from = max(scanned - 3, 0)
        if len(buffer) > MAX_HEAD_BYTES:
            raise HandOff

    def body(self) -> bytes | None:
        """The body bytes available now (b"" when more must be fed), None at its end."""
        if self.done:
            return None
        if self._chunked:
            return self._chunked_body()
        if self._remaining == 0:
            self._finish(self._buffer)
            return None
        data = self._buffer[: self._remaining]
        self._buffer = self._buffer[len(data) :]
        self._remaining -= len(data)
        return data

    def whole_body(self, limit: int) -> bytes | None:
        """The whole body, which ends the answer, when it is a content-length body of at
        most `limit` bytes that has all arrived; else None, and nothing is taken."""
        buffer, remaining = self._buffer, self._remaining
        if self._chunked or self.done or remaining > limit:
            return None
        if len(buffer) != remaining:  # not the usual answer, all of `buffer` and nothing past it
            if len(buffer) < remaining:  # not all of it came yet
                return None
            buffer, self.leftover = buffer[:remaining], buffer[remaining:]
        self.done, self._buffer = True, b""  # _finish, inline
        return buffer

    def _chunked_body(self) -> bytes | None:
        buffer, state = self._buffer, self._state
        if state is _Reading.LINE and buffer == b"\r\n" or state is _Reading.DATA and not buffer:
            return b""  # all was taken (but the CRLF that ends the last chunk): more must be fed
        out: list[bytes] = []
        pos = 0
        if state in _IN_CHUNKS:
            pos = self._chunks(buffer, out)
        if self._state not in _IN_CHUNKS:
            buffer, pos = self._after_last_chunk(buffer, pos)
            if self._state is _Reading.END and not out:  # the end is returned by the call after the data
                self._finish(buffer[pos:])
                return None
        self._buffer = buffer[pos:]
        return b"".join(out)

    def _chunks(self, buffer: bytes, out: list[bytes]) -> int:
        """Take the chunks' data in `buffer` into `out`, up to the last chunk (then the
        state is TRAILER) or to where more must be fed; returns the position reached.
        Whole chunks, the usual read of a stream, are taken by the quick loop; what it
        leaves (a line or a footer in pieces, the last chunk, a malformed line) is taken
        step by step by the careful one."""
        if self._state is _Reading.LINE and not self._line_checked:
            pos, state = self._quick(buffer, out)
            if state is not _Reading.LINE or pos == len(buffer) - 2 and buffer.endswith(b"\r\n"):  # the usual end
                self._state = state
                return pos
            return self._careful(buffer, pos, out)
        return self._careful(buffer, 0, out)

    def _quick(self, buffer: bytes, out: list[bytes]) -> tuple[int, _Reading]:
        """Whole chunks from the buffer's start, each a match of its footer and the next
        one's size line at once, then its data: where that ends and the state there. A
        chunk whose data is not all here is taken as far as it came (DATA); the loop
        stops at a line it does not match whole (LINE), or after the last chunk's line
        (TRAILER)."""
        line, append, length = _SIZE_LINE.match, out.append, len(buffer)
        match, pos = line(buffer), 0
        while match is not None:
            start = match.end()
            pos = start + int(match[1], 16)  # past the chunk's data
            if pos == start:  # the last chunk
                return pos, _Reading.TRAILER
            append(buffer[start:pos])  # its data, or as much of it as came
            match = line(buffer, pos)  # None past the buffer's end
        if pos > length:
            self._chunk_left = pos - length
            return length, _Reading.DATA
        return pos, _Reading.LINE

    def _careful(self, buffer: bytes, pos: int, out: list[bytes]) -> int:
        """Take the chunks from `pos` step by step, as h11 does: a chunk's data as it
        comes, its footer and the next size line each checked once all of it is here
        (a line trickled a byte a read is searched for its end once, not once a read)."""
        state, checked = self._state, self._line_checked
        while True:
            if state is _Reading.DATA:
                data = buffer[pos : pos + self._chunk_left]
                out.append(data)
                pos += len(data)
                self._chunk_left -= len(data)
                if self._chunk_left:
                    break
                state = _Reading.LINE
            footer = buffer[pos : pos + 2]  # LINE: the CRLF that ends the chunk before
            if footer != b"\r\n"[: len(footer)]:
                raise Malformed("malformed chunk footer")
            if buffer.find(b"\r\n", pos + 2 + checked) < 0:  # the line is not all here
                if len(buffer) - pos - 2 > MAX_HEAD_BYTES:  # h11's bound on a line
                    raise Malformed("a chunk-size line over the limit")
                self._line_checked = max(len(buffer) - pos - 3, 0)  # its last byte may be a CRLF's CR
                break
            checked = self._line_checked = 0
            if (match := _SIZE_LINE.match(buffer, pos)) is None:
                raise Malformed("illegal chunk header")
            pos, self._chunk_left = match.end(), int(match[1], 16)
            state = _Reading.DATA if self._chunk_left else _Reading.TRAILER
            if state is _Reading.TRAILER:
                break
        self._state = state
        return pos

    def _after_last_chunk(self, buffer: bytes, pos: int) -> tuple[bytes, int]:
        """After the last chunk: the empty line, or a trailer section that h11 reads.
        Returns what is left to read and where (past the end once the state is END)."""
        if self._state is _Reading.TRAILER:
            if len(buffer) - pos < 2:
                return buffer, pos
            if buffer[pos : pos + 2] == b"\r\n":
                self._state = _Reading.END
                return buffer, pos + 2
            self._state = _Reading.FIELDS
            self._trailer = _TrailerReader()
            self._trailer.feed(buffer[pos:])
            buffer, pos = b"", 0
        if self._state is _Reading.FIELDS and self._trailer is not None:
            rest = self._trailer.end()
            if rest is None:
                return buffer, pos
            self._state = _Reading.END
            return rest, 0
        return buffer, pos

    def _finish(self, rest: bytes) -> None:
        self.done = True
        self.leftover = rest
        self._buffer = b""
        return None


class _TrailerReader:
    """A chunked body's trailer fields, read by h11: it is given the end of a chunked
    body (the last chunk's header) and then the provider's bytes as they come."""

    def __init__(self) -> None:
        self._h11 = h11.Connection(h11.CLIENT)
        self._h11.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))
        self._h11.send(h11.EndOfMessage())
        self._h11.receive_data(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n0\r\n")

    def feed(self, data: bytes) -> None:
        self._h11.receive_data(data)

    def end(self) -> bytes | None:
        """The bytes past the trailer once it has ended, else None (more must come)."""
        try:
            while (event := self._h11.next_event()) is not h11.NEED_DATA:
                if isinstance(event, h11.EndOfMessage):
                    return self._h11.trailing_data[0]
        except h11.RemoteProtocolError:  # h11's words name its internals
            raise Malformed("malformed trailer") from None
        return None
