"""Fuzz tests (Hypothesis) of the pure parsers: `request.read_head`, `request.rewrite_model`,
`wire.forward_headers`, `wire.relay_headers`, `sse.split`, `sse.kind` and the scans a
stream's relay makes after output. tests/test_fuzz_gateway.py feeds the same inputs to a
real gateway process.

Seeds: tests/fuzz_corpus/ (its README says what the files are). The default profile is
small and derandomized (reproducible in CI); `make fuzz` runs `HYPOTHESIS_PROFILE=long`,
many more examples from a random seed. No example database is written (a failure prints
its `@reproduce_failure` blob instead).
"""

from __future__ import annotations

import json
import sys

import msgspec
import pytest
from hypothesis import assume, example, given
from hypothesis import strategies as st

from fuzz_strategies import (
    BODY_SEEDS,
    NOT_FORWARDED,
    REQUEST_NAMES,
    SSE_PIECES,
    SSE_SEEDS,
    TOKEN,
    UPSTREAMS,
    any_bodies,
    at_depth,
    canonical,
    data_events,
    deep_bodies,
    draw_cuts,
    header_lists,
    in_fresh_stack,
    json_bodies,
    named_in_connection,
    recursion_limit,
    seeded,
    sse_streams,
    stack_depth,
)
from tinygw.fake import events as fake
from tinygw.protocol import eventstream, request, sse, usage, wire

# ---- request bodies: the head, the model rewrite ------------------------------------------


@seeded(BODY_SEEDS)
@given(body=any_bodies)
@example(b"[" * 100_000)
@example(b'{"model":"gpt-x","x":' + b"[" * 100_000)
def test_read_head_raises_nothing_but_bad_body(body):
    try:
        head = request.read_head(body)
    except request.BadBody:
        return
    assert isinstance(head.model, str) and head.model
    assert len(head.model.encode()) <= 256
    assert head.stream is None or isinstance(head.stream, bool)


def check_rewrite(body: bytes, requested: str, upstream: str, extra_frames: int = 0) -> None:
    """`rewrite_model` as the gateway calls it, `extra_frames` deeper than `read_head`:
    the same document but for a top-level model of `upstream`, or BadBody for a document
    that cannot be decoded (a number out of range, nesting too deep)."""
    try:
        out = at_depth(extra_frames, request.rewrite_model, body, requested, upstream)
    except request.BadBody:
        with pytest.raises((msgspec.MsgspecError, RecursionError)):
            at_depth(extra_frames + 2, msgspec.json.decode, body)
        return
    if requested == upstream:
        assert out == body
    assert request.read_head(out).model == upstream  # msgspec's reading, or the standard library's (lone surrogates)
    with recursion_limit(20_000):  # Python's json, the oracle, reads deep documents too
        expected = json.loads(body)
        expected["model"] = upstream
        assert canonical(json.loads(out)) == canonical(expected), out


@given(body=json_bodies(), upstream=UPSTREAMS)
@example(b'{"model":"a","mod\\u0065l":"b"}', "x")
@example(b'{"mod\\u0065l":"a","tools":[{"model":"a"}]}', "x")
@example(b'{"x":{"model":"a"},"model":"b","model":"a"}', "x")
@example(b'{"model":"a","t":"\\"model\\": \\"a\\""}', "x")
@example(b'{"tools":[{"model":"a"}],"model":"a","n":123456789012345678901234567890}', "x")
def test_rewrite_model_changes_the_top_level_model_only(body, upstream):
    try:
        head = request.read_head(body)
    except request.BadBody:
        assume(False)
    check_rewrite(body, head.model, upstream)


# Nesting around this depth meets the recursion limit in a fresh thread's stack, where
# read_head may just pass while a call a few frames deeper does not.
LIMIT_DEPTH = sys.getrecursionlimit() - in_fresh_stack(stack_depth)


def read_then_rewrite(body: bytes, extra_frames: int) -> None:
    try:
        head = request.read_head(body)
    except request.BadBody:
        return
    check_rewrite(body, head.model, "upstream-gpt", extra_frames)


@given(data=st.data())
def test_deep_bodies_are_bad_body_or_rewritten_at_any_stack_depth(data):
    near = st.integers(max(0, LIMIT_DEPTH - 60), LIMIT_DEPTH + 10)
    body = data.draw(st.one_of(st.integers(0, 3000), near).flatmap(deep_bodies), label="body")
    extra = data.draw(st.integers(0, 40), label="extra frames")
    in_fresh_stack(read_then_rewrite, body, extra)


def test_every_depth_near_the_limit_is_bad_body_or_rewritten():
    """The draws above may miss the few depths where read_head passes and a deeper
    rewrite_model does not: every one of them, for a few call depths."""
    for depth in range(max(0, LIMIT_DEPTH - 60), LIMIT_DEPTH + 10):
        for extra in (1, 5, 20):
            body = b'{"model":"gpt-x","x":' + b"[" * depth + b"]" * depth + b"}"
            in_fresh_stack(read_then_rewrite, body, extra)


@pytest.mark.parametrize("path", BODY_SEEDS, ids=lambda p: p.name)
def test_corpus_bodies_read_and_rewritten(path):
    body = path.read_bytes()
    try:
        head = request.read_head(body)
    except request.BadBody:
        return
    for extra in range(0, 41, 4):
        check_rewrite(body, head.model, "upstream-gpt", extra)


# ---- headers ------------------------------------------------------------------------------


@given(headers=header_lists(st.sampled_from(REQUEST_NAMES) | TOKEN))
@example([(b"connection", b"X-Drop, Keep-Alive"), (b"x-drop", b"1"), (b"x-keep", b"2")])
@example([(b"connection", b"close"), (b"connection", b" x-a ,\tx-b"), (b"x-a", b""), (b"x-b", b"")])
def test_forward_headers_never_forward_credentials_framing_or_hop_by_hop(headers):
    out = wire.forward_headers(headers)
    dropped = {n.encode() for n in NOT_FORWARDED} | named_in_connection(headers)
    assert out == [(k, v) for k, v in headers if k not in dropped]


RELAYED = {b"content-type", b"x-request-id", b"request-id", b"retry-after", b"retry-after-ms", b"x-should-retry"}
RELAYED_PREFIXES = (b"x-ratelimit-", b"ratelimit", b"openai-", b"anthropic-")
NEVER_RELAYED = {b"set-cookie", b"location", b"strict-transport-security"}
NEVER_RELAYED_PREFIXES = (b"access-control-", b"x-tinygw-")
RESPONSE_NAMES = [
    "content-type",
    "x-request-id",
    "request-id",
    "retry-after",
    "retry-after-ms",
    "x-should-retry",
    "x-ratelimit-limit-requests",
    "x-ratelimit-remaining-tokens",
    "ratelimit-limit",
    "ratelimit-policy",
    "openai-processing-ms",
    "openai-organization",
    "openai-version",
    "anthropic-ratelimit-requests-limit",
    "anthropic-organization-id",
    "set-cookie",
    "set-cookie2",
    "location",
    "content-location",
    "strict-transport-security",
    "access-control-allow-origin",
    "access-control-allow-credentials",
    "x-tinygw-provider",
    "x-tinygw-attempts",
    "server",
    "date",
    "content-length",
    "content-encoding",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "via",
    "alt-svc",
    "cf-ray",
    "x-powered-by",
    "www-authenticate",
    "refresh",
    "link",
    "cache-control",
]


@given(headers=header_lists(st.sampled_from(RESPONSE_NAMES) | TOKEN))
@example(
    [
        (b"set-cookie", b"session=1"),
        (b"location", b"https://elsewhere"),
        (b"x-tinygw-provider", b"x"),
        (b"strict-transport-security", b"max-age=1"),
        (b"access-control-allow-origin", b"*"),
    ]
)
def test_relay_headers_only_relay_the_fixed_set(headers):
    # docs/design.md section 10: answers are relayed with a fixed set of headers (content-type, request ids,
    # rate-limit and retry headers, openai-*, anthropic-*), never the provider's cookies,
    # HSTS, CORS, redirect targets or x-tinygw-*.
    # The provider's x-request-id goes on as x-upstream-request-id (the gateway's is its own).
    out = [(b"x-request-id" if k == wire.UPSTREAM_REQUEST_ID else k, v) for k, v in wire.relay_headers(headers)]
    assert all(h in headers for h in out)
    for name, _ in out:
        assert name in RELAYED or name.startswith(RELAYED_PREFIXES), name
        assert name not in NEVER_RELAYED and not name.startswith(NEVER_RELAYED_PREFIXES), name


# ---- server-sent events ----------------------------------------------------------------------


def check_split(stream: bytes, cuts: list[int]) -> list[bytes]:
    """`sse.split` piece by piece as the proxy calls it is `sse.split` of the whole."""
    events, pending = sse.split(stream)
    assert b"".join(events) + pending == stream
    for event in events:
        assert event.endswith((b"\n\n", b"\r\r", b"\r\n\r\n"))
        assert sse.split(event[:-1]) == ([], event[:-1])  # it ends at the first blank line
    assert sse.split(pending) == ([], pending)
    got, rest = [], b""
    for start, end in zip([0, *cuts], [*cuts, len(stream)], strict=True):
        new, rest = sse.split(rest + stream[start:end])
        got += new
    assert (got, rest) == (events, pending)
    return events + [pending]


@given(stream=sse_streams, data=st.data())
def test_sse_split_piece_by_piece_is_split_whole(stream, data):
    check_split(stream, draw_cuts(data, len(stream)))


@pytest.mark.parametrize("path", SSE_SEEDS, ids=lambda p: p.name)
def test_corpus_streams_split_at_every_byte(path):
    stream = path.read_bytes()
    step = 1 if len(stream) < 1000 else 37  # every byte, unless that takes seconds
    for event in check_split(stream, list(range(1, len(stream), step))):
        sse.kind(event)
    for cut in range(0, len(stream) + 1, step):
        check_split(stream, [cut])


@seeded(SSE_SEEDS)
@given(event=sse_streams | data_events)
@example(b"data: " + b"[" * 100_000 + b"\n\n")
@example(b'data: {"choices":[{"delta":[],"finish_reason":null}]}\n\n')
@example(b'data: {"choices":[{"delta":{"content":"x"}}],"type":7}\n\n')
def test_sse_kind_never_raises(event):
    for frames in (0, 20):
        kind, done = at_depth(frames, sse.kind, event)
        assert isinstance(kind, sse.Kind) and isinstance(done, bool)


@given(st.binary(max_size=300))
@example(b'data: {"choices":[{"delta":{"content":"an \\"error\\""},"finish_reason":null}]}\n\n')
@example(b"event: error\ndata: {}\n\n")
@example(b'data: {"type":"message_delta","delta":{"stop_reason":"end_turn"}}\n\n')
def test_the_cheap_scan_never_misses_an_end_or_an_error(event):
    """After output, streams classify only events that the cheap scan flags."""
    event_kind, finished = sse.kind(event)
    if event_kind is sse.Kind.ERROR or finished:
        assert sse.may_end_or_fail(event)


@st.composite
def provider_events(draw) -> bytes:
    value = {}
    if draw(st.booleans()):
        value["type"] = draw(
            st.sampled_from(
                [
                    "message_delta",
                    "message_stop",
                    "error",
                    "response.completed",
                    "response.failed",
                    "content_block_delta",
                    "ping",
                    "message_start",
                ]
            )
        )
    if draw(st.booleans()):
        value["choices"] = [
            {
                "delta": {"content": draw(st.text(max_size=12))},
                "finish_reason": draw(st.sampled_from([None, "stop", "length", "tool_calls"])),
            }
        ]
    if draw(st.booleans()):
        value["delta"] = {"stop_reason": draw(st.sampled_from([None, "end_turn"])), "text": draw(st.text(max_size=8))}
    if draw(st.booleans()):
        value["error"] = draw(st.one_of(st.none(), st.text(max_size=8), st.just({"message": "x"})))
    separators = draw(st.sampled_from([(",", ":"), (", ", ": "), (",", " : ")]))
    name = draw(st.sampled_from([b"", b"event: error\n", b"event:error\n", b"event: message_delta\n"]))
    data = json.dumps(value, separators=separators, ensure_ascii=draw(st.booleans())).encode()
    if draw(st.booleans()):
        data = b"[DONE]"
    return name + b"data: " + data + draw(st.sampled_from([b"\n\n", b"\r\n\r\n"]))


@given(provider_events())
def test_the_cheap_scan_never_misses_an_end_or_an_error_in_provider_events(event):
    event_kind, finished = sse.kind(event)
    if event_kind is sse.Kind.ERROR or finished:
        assert sse.may_end_or_fail(event), event


def _regex_split(buffer: bytes) -> tuple[list[bytes], bytes]:
    """What `sse.split` does, the slow way: the reference for its shortcuts."""
    events, start = [], 0
    for match in sse._EVENT_END.finditer(buffer):
        events.append(buffer[start : match.end()])
        start = match.end()
    return events, buffer[start:]


SCAN_PIECES = [
    *SSE_PIECES,
    b'"usage"',
    b'"usage": {"completion_tokens": 1}',
    b'"usage":null',
    b'"finish_reason": "',
    b'"finish_reason":null',
    b'"stop_reason"\n:"',
    b'"finish_reason":',
    b"event: error",
    b"event:",
    b"response.failed",
    b"response.",
    b"message_stop",
    b"\n" * 17,
    b"\r\n" * 9,
    b" ",
    b"\t",
    b'"',
]
scan_streams = sse_streams | st.lists(st.sampled_from(SCAN_PIECES), max_size=24).map(b"".join)


@seeded(SSE_SEEDS)
@given(stream=scan_streams | data_events | provider_events())
@example(b'"finish_reason":\r\r"error"\n\n')  # a match spanning two events hides nothing
@example(b"\n\n\n")
def test_the_stream_scan_after_output_is_the_per_event_scan(stream):
    """Once output is sent, a stream's reads are scanned whole (sse.last_end,
    sse.suspects): the same split, and every event that the per-event scan would
    classify (maybe one more, never one that is not an event)."""
    events, rest = _regex_split(stream)
    assert sse.split(stream) == (events, rest)
    end = sse.last_end(stream)
    assert end == len(stream) - len(rest)
    found = sse.suspects(stream, end)
    wanted = [e for e in events if sse.may_end_or_fail(e) or usage.of_event(e) is not None]
    assert set(wanted) <= set(found) and all(e in events for e in found)
    remaining = iter(events)
    assert all(any(e == later for later in remaining) for e in found)  # in the stream's order


@given(stream=scan_streams | data_events | provider_events())
@example(b"data: x\n\n")
@example(b"data: x\r\n\n")
@example(b"data:\n\n\n")
def test_an_events_fields_are_read_as_line_by_line(stream):
    """sse._fields' shortcut for an event of one data line reads what its line-by-line
    reading does."""
    for event in [*sse.split(stream)[0], stream]:
        assert sse._fields(event) == sse._fields_line_by_line(event)


# ---- each API's own scan: its markers alone ------------------------------------------------


def _bedrock_events(frames: list[bytes]) -> list[bytes]:
    """Bedrock's frames as the relay reads them: Anthropic's events (tinygw.worker.frames)."""
    reader = eventstream.FrameReader()
    return [eventstream.event_of(frame) for data in frames for frame in reader.feed(data)]


_RESPONSES_ERRORS = [
    b'event: response.failed\ndata: {"type":"response.failed","response":{"status":"failed","error":{"code":"x"}}}\n\n',
    b'event: response.incomplete\ndata: {"type":"response.incomplete","response":{"status":"incomplete"}}\n\n',
    b'event: error\ndata: {"type":"error","code":"server_error","message":"boom","param":null}\n\n',
]
SHAPED_STREAMS = {
    "chat": [
        fake.openai_stream_events("m", ["a", " b"], include_usage=True),
        fake.completions_stream_events("m", ["a"], include_usage=True),
        fake.openai_tool_chunks("m", "f", "{}"),
        [*fake.openai_stream_events("m", ["a"])[:2], b'data: {"error": {"message": "boom", "type": "x"}}\n\n'],
    ],
    "responses": [
        fake.responses_stream_events("m", ["a", " b"]),
        fake.responses_tool_events("m", "f", "{}"),
        *([*fake.responses_stream_events("m", ["a"])[:5], e] for e in _RESPONSES_ERRORS),
    ],
    "messages": [
        fake.anthropic_stream_events("m", ["a", " b"]),
        fake.anthropic_tool_events("m", "f", "{}"),
        [*fake.anthropic_stream_events("m", ["a"])[:4], b'event: error\ndata: {"type":"error","error":{}}\n\n'],
        _bedrock_events(
            [
                *fake.bedrock_frames(fake.anthropic_stream_events("m", ["a"])[:4]),
                fake.bedrock_exception("throttlingException", "slow down"),
            ]
        ),
    ],
}
SHAPES = {"chat": sse.CHAT, "responses": sse.RESPONSES, "messages": sse.MESSAGES}


@pytest.mark.parametrize(("name", "stream"), [(n, s) for n, streams in SHAPED_STREAMS.items() for s in streams])
def test_a_shape_s_scan_finds_every_end_error_and_usage_of_its_api_s_events(name, stream):
    """Each API's streams (the fake provider's, and their error events) read with the markers
    of that API alone: every event that kind() says ends or fails the answer, or that reports
    usage, is found, and only events of the stream are."""
    shape = SHAPES[name]
    data = b"".join(stream)
    found = sse.suspects(data, len(data), 0, shape)
    judged = [e for e in stream if sse.kind(e)[0] is sse.Kind.ERROR or sse.kind(e)[1]]
    assert judged, "a stream ends or fails"
    assert all(sse.may_end_or_fail(e, shape) for e in judged)
    assert set(judged) | {e for e in stream if usage.of_event(e) is not None} <= set(found) <= set(stream)


def test_a_chat_chunk_that_neither_finishes_nor_reports_usage_is_not_read():
    """With `stream_options.include_usage` every chunk carries `"usage": null`: those that carry
    text alone are not read, only the finish, the usage and `[DONE]`."""
    stream = fake.openai_stream_events("m", ["a", " b"], include_usage=True)
    data = b"".join(stream)
    assert sse.suspects(data, len(data), 0, sse.CHAT) == stream[-3:]  # the finish, the usage, [DONE]
    assert all(b'"usage": null' in e for e in stream[:-3])


def test_each_streamed_route_s_shape_is_its_api_s():
    assert sse.shape_of("openai", "/chat/completions") is sse.CHAT
    assert sse.shape_of("openai", "/completions") is sse.CHAT
    assert sse.shape_of("openai", "/responses") is sse.RESPONSES
    for api in ("anthropic", "bedrock", "vertex"):  # Bedrock's frames are read as Anthropic's events
        assert sse.shape_of(api, "/v1/messages") is sse.MESSAGES


@st.composite
def shaped_events(draw) -> tuple[str, bytes]:
    """An event of one API, its fields and white space drawn: (the API, the event)."""
    name = draw(st.sampled_from(sorted(SHAPES)))
    reason = st.sampled_from([None, "stop", "length", "tool_calls", "end_turn"])
    value: dict = {}
    if name == "chat":
        value["choices"] = [{"delta": {"content": draw(st.text(max_size=8))}, "finish_reason": draw(reason)}]
    elif name == "responses":
        value["type"] = draw(
            st.sampled_from(
                ["response.created", "response.output_text.delta", "response.completed", "response.incomplete"]
                + ["response.failed", "error"]
            )
        )
    else:
        value["type"] = draw(st.sampled_from(["message_start", "content_block_delta", "message_delta", "message_stop"]))
        if value["type"] == "message_delta":
            value["delta"] = {"stop_reason": draw(reason)}
        value["type"] = draw(st.sampled_from([value["type"], "error"]))
    if draw(st.booleans()):
        value["error"] = draw(st.one_of(st.none(), st.text(max_size=8), st.just({"message": "x"})))
    if draw(st.booleans()):
        value["usage"] = draw(st.sampled_from([None, {"output_tokens": 1}]))
    separators = draw(st.sampled_from([(",", ":"), (", ", ": "), (",", " : ")]))
    data = json.dumps(value, separators=separators, ensure_ascii=draw(st.booleans())).encode()
    if name == "chat" and draw(st.booleans()):
        data = b"[DONE]"
    named = b"" if name == "chat" else b"event: %s\n" % value["type"].encode()
    return name, named + b"data: " + data + draw(st.sampled_from([b"\n\n", b"\r\n\r\n"]))


@given(st.lists(shaped_events(), min_size=1, max_size=6))
def test_a_shape_s_scan_never_misses_an_end_or_an_error_of_its_api(drawn):
    """An API's events, drawn, in a stream of that API's: its scan finds those that end or
    fail the answer or report usage."""
    name = drawn[0][0]
    stream = [event for api, event in drawn if api == name]
    data = b"".join(stream)
    found = sse.suspects(data, len(data), 0, SHAPES[name])
    for event in stream:
        kind, finished = sse.kind(event)
        if kind is sse.Kind.ERROR or finished:
            assert sse.may_end_or_fail(event, SHAPES[name]) and event in found, event
        if usage.of_event(event) is not None:
            assert event in found, event
