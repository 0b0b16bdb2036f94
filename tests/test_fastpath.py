"""The upstream client's fast path against h11, its authority (tinygw.upstream.fastpath).

Random responses, well-formed and mutated, split at random points, are read by both.
The fast path must give what h11 gives (status, headers, body, where the answer ends,
whether the connection may be reused, or a protocol error), or hand the answer to h11
before its head is taken: never a silent difference.
"""

from __future__ import annotations

import h11
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tinygw.upstream.fastpath import Answer, HandOff, Malformed, encode_request

MAX_HEAD = 64 * 1024
# Pure and quick: more examples than the profile's default, never fewer.
MANY = settings(max_examples=max(1_000, settings.default.max_examples))
REQUEST = (b"POST", b"/v1/chat/completions", [(b"host", b"up"), (b"content-length", b"2")], b"{}")


def by_h11(pieces: list[bytes], eof: bool) -> tuple:
    connection = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD)
    method, target, headers, body = REQUEST
    connection.send(h11.Request(method=method, target=target, headers=headers))
    connection.send(h11.Data(data=body))
    connection.send(h11.EndOfMessage())
    head, data, ended = None, b"", False
    try:
        for piece in [*pieces, *([b""] if eof else [])]:
            connection.receive_data(piece)
            while (event := connection.next_event()) is not h11.NEED_DATA:
                if isinstance(event, h11.InformationalResponse):
                    continue
                if isinstance(event, h11.Response):
                    head = (event.status_code, [(k, v) for k, v in event.headers])
                elif isinstance(event, h11.Data):
                    data += bytes(event.data)
                elif isinstance(event, h11.EndOfMessage):
                    ended = True
                    break
                elif isinstance(event, h11.ConnectionClosed):
                    break
            if ended:
                break
    except h11.RemoteProtocolError:
        return ("error",)
    if not ended:
        return ("incomplete", head, data)
    # What the client would do next: reuse the connection only if h11 allows it and
    # nothing came past the answer's end in what was fed.
    leftover = b"".join(pieces)  # bytes fed after the end are in h11's buffer
    reusable = connection.their_state is h11.DONE and connection.our_state is h11.DONE
    if reusable:
        connection.start_next_cycle()
        trailing, closed = connection.trailing_data
        reusable = not trailing and not closed
    del leftover
    return ("ended", head, data, reusable)


def by_fast_path(pieces: list[bytes], eof: bool) -> tuple:
    answer = Answer()
    head, data = None, b""
    try:
        for piece in pieces:
            if head is None:  # as the connection reads a head: each read given to head()
                head = answer.head(piece)
                if head is None:
                    continue
            else:
                answer.feed(piece)
            while (part := answer.body()) is not None:
                if part == b"":
                    break
                data += part
            if answer.done:
                return ("ended", head, data, answer.keep_alive and not answer.leftover)
        if head is None:
            raise HandOff  # an end before the head: h11 says what it is
    except HandOff:
        if head is not None:
            raise AssertionError("a hand-off after the head was taken") from None
        return ("handoff",)
    except Malformed:
        return ("error",)
    if eof:
        return ("error",)  # an end inside a content-length or chunked body
    return ("incomplete", head, data)


def agree(raw: bytes, cuts: list[int], eof: bool) -> None:
    points = sorted({c % (len(raw) + 1) for c in cuts} | {0, len(raw)})
    pieces = [raw[a:b] for a, b in zip(points, points[1:], strict=False) if b > a]
    fast = by_fast_path(pieces, eof)
    if fast == ("handoff",):
        return
    assert fast == by_h11(pieces, eof), (raw, pieces)


# ---- responses --------------------------------------------------------------------------

token = st.text("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_", min_size=1, max_size=12)
value = st.text('abcdefghijklmnopqrstuvwxyz0123456789 ,;=/-:."', max_size=20)


@st.composite
def responses(draw) -> bytes:
    status = draw(st.sampled_from([200, 200, 200, 201, 204, 304, 400, 429, 500, 502, 503, 100, 101]))
    version = draw(st.sampled_from([b"HTTP/1.1", b"HTTP/1.1", b"HTTP/1.1", b"HTTP/1.0"]))
    reason = draw(st.sampled_from([b" OK", b"", b" Bad Gateway", b" ", b"  x"]))
    body = draw(st.binary(max_size=300))
    framing = draw(st.sampled_from(["length", "length", "chunked", "chunked", "none", "both", "length2", "te-other"]))
    headers = [(draw(token).encode(), draw(value).encode().strip()) for _ in range(draw(st.integers(0, 4)))]
    headers = [(k, v) for k, v in headers if k.lower() not in (b"content-length", b"transfer-encoding")]
    if draw(st.booleans()):
        headers.append(
            (
                draw(st.sampled_from([b"Connection", b"connection"])),
                draw(st.sampled_from([b"close", b"keep-alive", b"Close", b"x, close"])),
            )
        )
    if framing in ("length", "both", "length2"):
        headers.append((draw(st.sampled_from([b"Content-Length", b"content-length"])), str(len(body)).encode()))
    if framing == "length2":
        headers.append((b"content-length", str(len(body)).encode()))
    if framing in ("chunked", "both"):
        headers.append((b"Transfer-Encoding", draw(st.sampled_from([b"chunked", b"Chunked", b"chunked "]))))
    if framing == "te-other":
        headers.append((b"transfer-encoding", b"gzip, chunked"))
    sep = draw(st.sampled_from([b": ", b":", b":  ", b":\t"]))
    head = version + b" " + str(status).encode() + reason + b"\r\n"
    head += b"".join(k + sep + v + b"\r\n" for k, v in headers) + b"\r\n"
    if framing in ("chunked", "both"):
        out, rest = b"", body
        while rest:
            n = draw(st.integers(1, max(1, len(rest))) | st.integers(1, 8))  # streams: many small chunks
            ext = draw(st.sampled_from([b"", b"", b";name=value", b" ", b";x"]))
            size = draw(st.sampled_from([b"%x", b"%X", b"%04x"])) % n
            out += size + ext + b"\r\n" + rest[:n] + b"\r\n"
            rest = rest[n:]
        out += b"0\r\n" + draw(st.sampled_from([b"", b"", b"x-trailer: 1\r\n", b"bad trailer\r\n"])) + b"\r\n"
        body = out
    extra = draw(st.sampled_from([b"", b"", b"", b"HTTP/1.1 200 OK\r\n\r\n", b"x"]))
    return head + body + extra


def mutate(raw: bytes, data) -> bytes:
    raw = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 3))):
        if not raw:
            break
        at = data.draw(st.integers(0, len(raw) - 1))
        how = data.draw(st.sampled_from(["flip", "delete", "insert", "lf", "cr"]))
        if how == "flip":
            raw[at] ^= 1 << data.draw(st.integers(0, 7))
        elif how == "delete":
            del raw[at]
        elif how == "insert":
            raw.insert(at, data.draw(st.integers(0, 255)))
        else:
            raw.insert(at, 10 if how == "lf" else 13)
    return bytes(raw)


@MANY
@given(responses(), st.lists(st.integers(0, 2000), max_size=8), st.booleans())
@example(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n", [], False)
@example(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nokEXTRA", [], False)
@example(b"HTTP/1.1 200 OK\ncontent-length: 2\n\nok", [], False)
@example(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2;x\r\nok\r\n0\r\nt: 1\r\n\r\n", [30, 31], False)
@example(b"HTTP/1.1 204 No Content\r\n\r\n{}", [], False)
@example(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1;" + b"x" * 70_000, [100, 5000], False)
@example(b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\nx: " + b"v" * 70_000 + b"\r\n\r\nx", [50], False)
@example(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + b"0" * 21 + b"1\r\nx\r\n", [], False)
@example(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n2\r\nokXX1\r\nx\r\n0\r\n\r\n", [], False)
@example(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n2\r\nok\r\n1\r\nx\r0\r\n\r\n", [], False)
@example(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1;a\rb\r\nx\r\n1\t\r\ny\r\n0\r\n\r\n", [], False)
@example(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + b"0" * 19 + b"1\r\nx\r\n000\r\n\r\n", [], False)
@example(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1 x\r\nx\r\n0\r\n\r\n", [], False)
# Read from the head's last CRLF: a blank line before the first size line is no footer.
@example(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n\r\n2\r\nok\r\n0\r\n\r\n", [], False)
# A chunk's data cut short, the last chunk's line at a read's end, a footer and a line in pieces.
@example(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n", [48, 57, 60], False)
@example(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n3\r\nabc\r\n0\r\n\r\n", [53, 56], False)
@example(b"HTTP/1.1 200 OK\r\nConnection: keep-alive, Close\r\nconnection: x\r\ncontent-length: 0\r\n\r\n", [], False)
def test_well_formed_and_odd_responses_agree(raw, cuts, eof):
    agree(raw, cuts, eof)


@MANY
@given(responses(), st.lists(st.integers(0, 2000), max_size=8), st.booleans(), st.data())
def test_mutated_responses_agree(raw, cuts, eof, data):
    agree(mutate(raw, data), cuts, eof)


@MANY
@given(st.binary(max_size=200), st.lists(st.integers(0, 300), max_size=5))
def test_random_bytes_agree(raw, cuts):
    agree(b"HTTP/1.1 200 OK\r\n" + raw, cuts, False)


# ---- requests ---------------------------------------------------------------------------


# Pieces that make a header almost valid: a colon or space in a name, line ends,
# framing and Host headers of the request's own.
HEADER_PIECES = [
    b"a",
    b"x-y",
    b":",
    b": ",
    b" ",
    b"\t",
    b"\r",
    b"\n",
    b"\r\n",
    b"\x00",
    b"\xff",
    b"Host",
    b"content-length",
    b"Transfer-Encoding",
    b"chunked",
    b"0",
    b"3",
]
header_bytes = st.binary(max_size=10) | st.lists(st.sampled_from(HEADER_PIECES), max_size=4).map(b"".join)


@given(st.lists(st.tuples(header_bytes.filter(bool), header_bytes), max_size=4), st.binary(max_size=50))
@example([(b"a: ", b"b")], b"")  # splits at the wrong colon if names were not checked
@example([(b"Transfer-Encoding", b"chunked")], b"")
@example([(b"a", b"b\r\nc: d")], b"")
def test_a_request_is_written_as_h11_writes_it_or_left_to_h11(headers, body):
    headers = [(b"host", b"up"), *headers, (b"content-length", str(len(body)).encode())]
    fast = encode_request(b"POST", b"/v1/x", headers, body)
    connection = h11.Connection(h11.CLIENT)
    try:
        expected = connection.send(h11.Request(method=b"POST", target=b"/v1/x", headers=headers))
        expected += connection.send(h11.Data(data=body)) if body else b""
        expected += connection.send(h11.EndOfMessage())
    except h11.LocalProtocolError:
        assert fast is None  # h11 refuses it: the fast path never writes it either
        return
    if fast is not None:
        # h11 lower-cases nothing it sends: the same bytes, byte for byte
        assert fast == expected


def whole_and_stepwise(raw: bytes, limit: int) -> tuple:
    """whole_body(limit) on one answer, body() step by step on another: what each ended with."""
    whole, stepwise = Answer(), Answer()
    try:
        for answer in (whole, stepwise):
            answer.feed(raw)
            if answer.head() is None:
                return ()
    except (HandOff, Malformed):
        return ()
    data = whole.whole_body(limit)
    if data is None:
        return ()
    parts = []
    while (part := stepwise.body()) is not None:
        if part == b"":
            return ("stepwise wanted more",)
        parts.append(part)
    return (data, whole.done, whole.leftover, whole.keep_alive), (
        b"".join(parts),
        stepwise.done,
        stepwise.leftover,
        stepwise.keep_alive,
    )


@MANY
@given(responses(), st.integers(0, 400))
@example(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nokEXTRA", 2)
@example(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n", 0)
def test_a_whole_body_taken_at_once_is_what_the_steps_give(raw, limit):
    """Response.read_upto's shortcut: an answer taken whole ends as read step by step."""
    result = whole_and_stepwise(raw, limit)
    if result:
        whole, stepwise = result
        assert whole == stepwise and len(whole[0]) <= limit
