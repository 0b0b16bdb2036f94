"""Fuzz tests (Hypothesis) of what the gateway parses: request bodies, headers, streams.

First properties of the pure parsers (`wire.read_head`, `wire.rewrite_model`,
`wire.forward_headers`, `wire.relay_headers`, `sse.split`, `sse.kind`), then a real
gateway process fed generated requests over raw sockets: it never answers 500, never goes
down, and every error it answers itself is `{"error": {"message", "type", ...}}`.

Seeds: tests/fuzz_corpus/ (its README says what the files are). The default profile is
small and derandomized (reproducible in CI); `make fuzz` runs `HYPOTHESIS_PROFILE=long`,
many more examples from a random seed. No example database is written (a failure prints
its `@reproduce_failure` blob instead).
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import sys
import threading
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, assume, event, example, given, settings
from hypothesis import strategies as st

from conftest import Gateway
from tinygw.protocol import sse
from tinygw.protocol import wire
from tinygw.fake.upstream import FakeUpstream, Reply, json_reply, well_behaved

# Hypothesis' profiles ("default": few derandomized examples; "long": make fuzz) are
# registered in conftest.py, for this file and tests/test_fastpath.py alike.
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "default")
LONG = PROFILE != "default"

CORPUS = Path(__file__).resolve().parent / "fuzz_corpus"
BODY_SEEDS = sorted(CORPUS.glob("body-*"))
SSE_SEEDS = sorted(CORPUS.glob("sse-*"))
# What the test gateway below answers to some of the seeds.
CORPUS_STATUS = {
    "body-model-256-bytes.json": 200,
    "body-model-257-bytes.json": 400,
    "body-model-257-utf8-bytes.json": 400,
    "body-escaped-model-key.json": 200,
    "body-escaped-model-value.json": 200,
    "body-duplicate-model.json": 200,
    "body-duplicate-model-escaped.json": 200,
    "body-model-in-string.json": 200,
    "body-nested-model-key.json": 200,
    "body-huge-numbers.json": 200,
    "body-nested-model-huge-number.json": 400,
    "body-not-an-object.json": 400,
    "body-empty.json": 400,
}


def seeded(paths: list[Path]):
    """Every file in `paths` as an @example of the decorated one-argument test."""
    def decorate(test):
        for path in reversed(paths):
            test = example(path.read_bytes())(test)
        return test
    return decorate


def weighted(*choices: tuple[int, st.SearchStrategy]) -> st.SearchStrategy:
    """One of the strategies, each as often as its weight (one_of's choice is not even)."""
    return st.sampled_from([i for i, (weight, _) in enumerate(choices) for _ in range(weight)]).flatmap(
        lambda i: choices[i][1])


def at_depth(frames: int, function, *args):
    """`function(*args)` called `frames` Python frames deeper than here: the gateway reads a
    body's head in one place and rewrites it a few frames deeper, and msgspec's nesting
    bound is the interpreter's recursion limit, so the depth at which a call runs matters."""
    if frames <= 0:
        return function(*args)
    return at_depth(frames - 1, function, *args)


def stack_depth() -> int:
    frame, depth = sys._getframe(), 0
    while frame is not None:
        frame, depth = frame.f_back, depth + 1
    return depth


def in_fresh_stack(function, *args):
    """`function(*args)` in a new thread, whose stack starts the same every time: where a
    verdict depends on the stack depth, Hypothesis must get the same one when it replays a
    failing example (from elsewhere in its own stack)."""
    outcome = {}

    def run() -> None:
        try:
            outcome["value"] = function(*args)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            outcome["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


@contextmanager
def recursion_limit(limit: int):
    """For the test's own decoding of deep documents that the gateway accepted."""
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old, limit))
    try:
        yield
    finally:
        sys.setrecursionlimit(old)


# ---- JSON, written every way JSON may be written ----------------------------------------


class Obj:
    """A JSON object as written: its pairs in order, duplicate keys allowed."""

    def __init__(self, pairs: list) -> None:
        self.pairs = pairs

    def __repr__(self) -> str:
        return f"Obj({self.pairs!r})"


class Lit(str):
    """A JSON token written as is: numbers Python holds differently, escapes of lone surrogates."""


LITERALS = ["1e400", "-1e400", "1E-400", "-0", "-0.0", "0e0", "123456789012345678901234567890",
            "-12345678901234567890123456789e-5", "1.7976931348623157e308", "1.8e308", "5e-324",
            '"\\ud800"', '"\\udc00\\ud800"', '"\\u0000"', '"\\/"', '"\\ud83d\\ude00"']
TRICKY_STRINGS = ['"model": "gpt-x"', '\\"model\\": \\"x\\"', "model", '{"model":"x"}', "\u2028", "\x00",
                  "\r\n\r\n", "data: [DONE]\n\n", "caf\u00e9", "\U0001f600", "\\u0065"]
KEYS = st.sampled_from(["model", "stream", "messages", "content", "role", "tools", "type", "choices", "delta",
                        "error", "finish_reason", "text", "stop_reason"]) | st.text(max_size=8)
json_numbers = st.from_regex(r"-?(0|[1-9][0-9]{0,30})(\.[0-9]{1,20})?([eE][+-]?[0-9]{1,4})?", fullmatch=True)
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20), st.sampled_from(TRICKY_STRINGS),
    st.sampled_from(LITERALS).map(Lit), json_numbers.map(Lit),
)
values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.lists(st.tuples(KEYS, inner), max_size=4).map(Obj),
    max_leaves=12,
)
WHITESPACE = st.sampled_from(["", "", "", " ", "\n", "\t", "\r\n  "])
ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t", "\b": "\\b", "\f": "\\f"}


def _u_escape(char: str) -> str:
    code = ord(char)
    if code > 0xFFFF:
        code -= 0x10000
        return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04X}"
    return f"\\u{code:04x}"


@st.composite
def written(draw, value) -> str:
    """`value` as JSON text, with random whitespace and every kind of string escape."""

    def string(text: str) -> str:
        mode = draw(st.sampled_from(["plain", "ascii", "escaped", "mixed"]))
        if mode == "plain":
            return json.dumps(text, ensure_ascii=False)
        if mode == "ascii":
            return json.dumps(text)
        chance = draw(st.randoms(use_true_random=False)) if mode == "mixed" else None
        out = []
        for char in text:
            if chance is None or chance.random() < 0.5:
                out.append(_u_escape(char))
            elif char in ESCAPES:
                out.append(ESCAPES[char])
            elif ord(char) < 0x20:
                out.append(_u_escape(char))
            else:
                out.append(char)
        return '"' + "".join(out) + '"'

    def write(v) -> str:
        ws = draw(WHITESPACE)
        if isinstance(v, Lit):
            return str(v)
        if v is None:
            return "null"
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, int):
            return str(v)
        if isinstance(v, float):
            return repr(v)
        if isinstance(v, str):
            return string(v)
        if isinstance(v, list):
            return "[" + ws + ",".join(write(x) + draw(WHITESPACE) for x in v) + "]"
        return "{" + ws + ",".join(
            string(k) + draw(WHITESPACE) + ":" + draw(WHITESPACE) + write(x) + draw(WHITESPACE) for k, x in v.pairs
        ) + "}"

    return draw(WHITESPACE) + write(value) + draw(WHITESPACE)


UNIT_MODELS = st.one_of(st.text(min_size=1, max_size=30), st.sampled_from(["gpt-x", "oa/x", "m" * 256, "m" * 257]))
UPSTREAMS = st.one_of(st.text(min_size=1, max_size=30), st.sampled_from(["upstream-gpt", "gpt-x", 'q"x', "a\\b"]))


@st.composite
def request_documents(draw, models=UNIT_MODELS):
    """A request object with a model somewhere among its keys (others may be "model" too)."""
    pairs = draw(st.lists(st.tuples(KEYS, values), max_size=5))
    pairs.insert(draw(st.integers(0, len(pairs))), ("model", draw(models)))
    if draw(st.booleans()):
        pairs.insert(draw(st.integers(0, len(pairs))), ("stream", draw(st.booleans() | values)))
    return Obj(pairs)


def json_bodies(models=UNIT_MODELS):
    return request_documents(models).flatmap(written).map(lambda text: text.encode())


@st.composite
def mutated(draw, bodies):
    """A body with a few bytes inserted, deleted or replaced, or cut short."""
    body = bytearray(draw(bodies))
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(body)))
        operation = draw(st.sampled_from(["insert", "delete", "replace", "truncate"]))
        if operation == "insert":
            body[at:at] = draw(st.binary(min_size=1, max_size=4) | st.sampled_from([b'"', b"\\", b"{", b"]", b","]))
        elif operation == "delete":
            del body[at:at + draw(st.integers(1, 4))]
        elif operation == "replace" and at < len(body):
            body[at] = draw(st.integers(0, 255))
        else:
            del body[at:]
    return bytes(body)


NESTINGS = [(b"[", b"]"), (b'{"a":', b"}"), (b'[{"model":"m","a":', b"}]"), (b'{"model":', b"}"), (b'[{"b":[', b"]}]")]


@st.composite
def deep_bodies(draw, depth=None):
    depth = draw(st.integers(0, 3000)) if depth is None else depth
    opener, closer = draw(st.sampled_from(NESTINGS))
    closed = draw(st.sampled_from([True, True, True, False]))
    inner = opener * depth + b"1" + (closer * depth if closed else b"")
    if draw(st.booleans()):
        return b'{"model":"gpt-x","x":' + inner + b"}"
    return b'{"x":' + inner + b',"model":"gpt-x"}'


any_bodies = st.one_of(st.binary(max_size=512), json_bodies(), values.flatmap(written).map(str.encode),
                       mutated(json_bodies()), deep_bodies())


def canonical(value) -> str:
    """A JSON value as sorted JSON text: 1, 1.0 and true differ, and so do 0.0 and -0.0."""
    return json.dumps(value, sort_keys=True)


# ---- request bodies: the head, the model rewrite ------------------------------------------


@seeded(BODY_SEEDS)
@given(body=any_bodies)
@example(b"[" * 100_000)
@example(b'{"model":"gpt-x","x":' + b"[" * 100_000)
def test_read_head_raises_nothing_but_bad_body(body):
    try:
        head = wire.read_head(body)
    except wire.BadBody:
        return
    assert isinstance(head.model, str) and head.model
    assert len(head.model.encode()) <= 256
    assert head.stream is None or isinstance(head.stream, bool)


def check_rewrite(body: bytes, requested: str, upstream: str, extra_frames: int = 0) -> None:
    """`rewrite_model` as the gateway calls it, `extra_frames` deeper than `read_head`:
    the same document but for a top-level model of `upstream`, or BadBody for a document
    that cannot be decoded (a number out of range, nesting too deep)."""
    try:
        out = at_depth(extra_frames, wire.rewrite_model, body, requested, upstream)
    except wire.BadBody:
        with pytest.raises((msgspec.MsgspecError, RecursionError)):
            at_depth(extra_frames + 2, msgspec.json.decode, body)
        return
    if requested == upstream:
        assert out == body
    assert msgspec.json.decode(out, type=wire.RequestHead).model == upstream
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
        head = wire.read_head(body)
    except wire.BadBody:
        assume(False)
    check_rewrite(body, head.model, upstream)


# Nesting around this depth meets the recursion limit in a fresh thread's stack, where
# read_head may just pass while a call a few frames deeper does not.
LIMIT_DEPTH = sys.getrecursionlimit() - in_fresh_stack(stack_depth)


def read_then_rewrite(body: bytes, extra_frames: int) -> None:
    try:
        head = wire.read_head(body)
    except wire.BadBody:
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
        head = wire.read_head(body)
    except wire.BadBody:
        return
    for extra in range(0, 41, 4):
        check_rewrite(body, head.model, "upstream-gpt", extra)


# ---- headers ------------------------------------------------------------------------------

TOKEN = st.from_regex(r"[!#$%&'*+.^_`|~0-9a-z-]{1,16}", fullmatch=True)
HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection", "te",
              "trailer", "transfer-encoding", "upgrade"}
NOT_FORWARDED = HOP_BY_HOP | {"authorization", "x-api-key", "host", "content-length", "expect", "accept-encoding",
                              "x-request-id"}  # the gateway sends its own request id
REQUEST_NAMES = sorted(NOT_FORWARDED | {"content-type", "anthropic-version", "anthropic-beta", "openai-organization",
                                        "x-request-id", "cookie", "x-forwarded-for", "user-agent", "x-tinygw-debug"})
header_values = st.binary(max_size=40).map(lambda v: bytes(c for c in v if c == 9 or 32 <= c <= 126 or c >= 128)
                                           .strip(b" \t"))


@st.composite
def header_lists(draw, names):
    """Headers as Granian hands them over: lower-case names, values as sent; a Connection
    header names some of the others, in any case and spacing."""
    headers = []
    for _ in range(draw(st.integers(0, 10))):
        name = draw(names)
        if name == "connection":
            listed = draw(st.lists(names | TOKEN, min_size=1, max_size=4))
            listed = [n.upper() if draw(st.booleans()) else n for n in listed]
            value = draw(st.sampled_from([",", ", ", " ,\t"])).join(listed)
            headers.append((b"connection", value.encode()))
        else:
            headers.append((name.encode(), draw(header_values)))
    return headers


def _named_in_connection(headers) -> set[bytes]:
    return {t.strip().lower() for k, v in headers if k == b"connection" for t in v.split(b",")}


@given(headers=header_lists(st.sampled_from(REQUEST_NAMES) | TOKEN))
@example([(b"connection", b"X-Drop, Keep-Alive"), (b"x-drop", b"1"), (b"x-keep", b"2")])
@example([(b"connection", b"close"), (b"connection", b" x-a ,\tx-b"), (b"x-a", b""), (b"x-b", b"")])
def test_forward_headers_never_forward_credentials_framing_or_hop_by_hop(headers):
    out = wire.forward_headers(headers)
    dropped = {n.encode() for n in NOT_FORWARDED} | _named_in_connection(headers)
    assert out == [(k, v) for k, v in headers if k not in dropped]


RELAYED = {b"content-type", b"x-request-id", b"request-id", b"retry-after", b"retry-after-ms", b"x-should-retry"}
RELAYED_PREFIXES = (b"x-ratelimit-", b"ratelimit", b"openai-", b"anthropic-")
NEVER_RELAYED = {b"set-cookie", b"location", b"strict-transport-security"}
NEVER_RELAYED_PREFIXES = (b"access-control-", b"x-tinygw-")
RESPONSE_NAMES = ["content-type", "x-request-id", "request-id", "retry-after", "retry-after-ms", "x-should-retry",
                  "x-ratelimit-limit-requests", "x-ratelimit-remaining-tokens", "ratelimit-limit", "ratelimit-policy",
                  "openai-processing-ms", "openai-organization", "openai-version", "anthropic-ratelimit-requests-limit",
                  "anthropic-organization-id", "set-cookie", "set-cookie2", "location", "content-location",
                  "strict-transport-security", "access-control-allow-origin", "access-control-allow-credentials",
                  "x-tinygw-provider", "x-tinygw-attempts", "server", "date", "content-length", "content-encoding",
                  "transfer-encoding", "connection", "keep-alive", "via", "alt-svc", "cf-ray", "x-powered-by",
                  "www-authenticate", "refresh", "link", "cache-control"]


@given(headers=header_lists(st.sampled_from(RESPONSE_NAMES) | TOKEN))
@example([(b"set-cookie", b"session=1"), (b"location", b"https://elsewhere"), (b"x-tinygw-provider", b"x"),
          (b"strict-transport-security", b"max-age=1"), (b"access-control-allow-origin", b"*")])
def test_relay_headers_only_relay_the_fixed_set(headers):
    # SPEC: answers are relayed with a fixed set of headers (content-type, request ids,
    # rate-limit and retry headers, openai-*, anthropic-*), never the provider's cookies,
    # HSTS, CORS, redirect targets or x-tinygw-*.
    # The provider's x-request-id goes on as x-upstream-request-id (the gateway's is its own).
    out = [(b"x-request-id" if k == wire.UPSTREAM_REQUEST_ID else k, v) for k, v in wire.relay_headers(headers)]
    assert all(h in headers for h in out)
    for name, _ in out:
        assert name in RELAYED or name.startswith(RELAYED_PREFIXES), name
        assert name not in NEVER_RELAYED and not name.startswith(NEVER_RELAYED_PREFIXES), name


# ---- server-sent events ----------------------------------------------------------------------

SSE_PIECES = [b"data: ", b"data:", b"event: ", b"event: error\n", b"event:ping", b"id: 1", b": keep-alive", b"retry: 9",
              b"\n", b"\r", b"\r\n", b"\n\n", b"\r\r", b"\r\n\r\n", b"[DONE]", b" ", b"x", b"\xff", b"\x00",
              b'{"choices":[{"delta":{"content":"x"},"finish_reason":null}]}',
              b'{"choices":[{"delta":{},"finish_reason":"stop"}]}', b'{"choices":[{"delta":{"role":"assistant"}}]}',
              b'{"type":"message_stop"}', b'{"type":"ping"}', b'{"error":{"message":"x"}}', b'{"type":"error"}',
              b'{"type":"message_delta","delta":{"stop_reason":"end_turn"}}', b'{"type":"response.completed"}']
SSE_EVENTS = [b'data: {"choices":[{"delta":{"role":"assistant"},"finish_reason":null}]}\n\n',
              b'data: {"choices":[{"delta":{"content":"Hi"},"finish_reason":null}]}\n\n',
              b'data: {"choices":[{"delta":{},"finish_reason":"stop"}]}\n\n', b"data: [DONE]\n\n", b": ping\n\n",
              b'event: content_block_delta\ndata: {"type":"content_block_delta","delta":{"text":"x"}}\n\n',
              b'event: message_stop\ndata: {"type":"message_stop"}\n\n', b'data: {"error":{"message":"x"}}\n\n']
sse_streams = st.one_of(
    st.lists(st.sampled_from(SSE_PIECES) | st.binary(max_size=6), max_size=40).map(b"".join),
    st.binary(max_size=200),
    st.lists(st.sampled_from(SSE_EVENTS) | st.sampled_from(SSE_PIECES), max_size=12).map(b"".join),
)
EVENT_TYPES = ["message_start", "ping", "content_block_start", "content_block_delta", "content_block_stop",
               "message_delta", "message_stop", "error", "response.created", "response.completed",
               "response.failed", "response.output_text.delta"]
choices = st.builds(lambda delta, finish, text: Obj([("delta", delta), ("finish_reason", finish), ("text", text)]),
                    values | st.builds(lambda c: Obj([("content", c)]), values), values, values)
provider_values = st.builds(
    lambda kind, chs, error, delta: Obj([("type", kind), ("choices", chs), ("error", error), ("delta", delta)]),
    st.sampled_from(EVENT_TYPES) | values, st.lists(choices | values, max_size=3) | values, values,
    values | st.builds(lambda reason: Obj([("stop_reason", reason)]), values),
)
data_events = st.tuples(
    st.sampled_from([b"", b"event: error\n", b"event: message_delta\n", b"event:ping\r\n", b": c\n"]),
    (provider_values | values).flatmap(written).map(str.encode) | deep_bodies(),
    st.sampled_from([b"\n\n", b"\r\n\r\n", b"\r\r", b"\n", b""]),
).map(lambda t: t[0] + b"data: " + t[1].replace(b"\n", b"\ndata: ") + t[2])


def _cuts(data, length: int) -> list[int]:
    return sorted(data.draw(st.sets(st.integers(0, length), max_size=12), label="cuts"))


def check_split(stream: bytes, cuts: list[int]) -> list[bytes]:
    """`sse.split` piece by piece as the proxy calls it is `sse.split` of the whole."""
    events, pending = sse.split(stream)
    assert b"".join(events) + pending == stream
    for event in events:
        assert event.endswith((b"\n\n", b"\r\r", b"\r\n\r\n"))
        assert sse.split(event[:-1]) == ([], event[:-1])  # it ends at the first blank line
    assert sse.split(pending) == ([], pending)
    got, rest = [], b""
    for start, end in zip([0, *cuts], [*cuts, len(stream)]):
        new, rest = sse.split(rest + stream[start:end])
        got += new
    assert (got, rest) == (events, pending)
    return events + [pending]


@given(stream=sse_streams, data=st.data())
def test_sse_split_piece_by_piece_is_split_whole(stream, data):
    check_split(stream, _cuts(data, len(stream)))


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


# ---- a real gateway --------------------------------------------------------------------------

GATEWAY_KEY = "gw-fuzz-key-3e1d"
PROVIDER_KEY = "prov-fuzz-key-8a2b"
ANTHROPIC_KEY = "anth-fuzz-key-47cc"
MAX_BODY_BYTES = 65536
ALIASES = {"gpt-x": "upstream-gpt", "claude-x": "claude-upstream"}
SET_BY_GATEWAY = {"host", "content-length", "authorization", "x-api-key", "accept-encoding"}
CANNED = {"id": "x", "object": "chat.completion", "created": 0, "model": "m",
          "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "ok"}}]}


def robust(script):
    """The fake's script, or a canned answer for a body it cannot read (it is not under test)."""
    def answer(request):
        try:
            return script(request)
        except Exception:
            return json_reply(200, CANNED)
    return answer


class Live:
    """The module's gateway, and what its log said since the last look."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.port = gateway.port
        self._seen = 0

    def new_log_lines(self) -> list[str]:
        with open(self.gateway.log_path, "rb") as f:
            f.seek(self._seen)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self._seen += end
        return data[:end].decode(errors="replace").splitlines()


def fresh(live: Live, fake: FakeUpstream) -> None:
    """Before a black-box example: the well-behaved fake, no requests recorded, and what the
    gateway logged so far already looked at (by the check that follows the example before)."""
    fake.script = robust(well_behaved("fuzz"))
    fake.requests.clear()
    live.new_log_lines()


@pytest.fixture(scope="module")
def fake():
    upstream = FakeUpstream(robust(well_behaved("fuzz"))).start_in_thread()
    yield upstream
    upstream.stop_thread()


@pytest.fixture(scope="module")
def gateway(fake, tmp_path_factory):
    config = {
        "providers": {
            "oa": {"base_url": f"{fake.url}/v1", "api": "openai", "api_key_env": "OA_KEY"},
            "an": {"base_url": fake.url, "api": "anthropic", "api_key_env": "AN_KEY"},
        },
        "models": {"gpt-x": {"targets": ["oa:upstream-gpt"]}, "claude-x": {"targets": ["an:claude-upstream"]}},
        "routing": {"debug": True},  # the x-tinygw-* headers carry the client's model text
    }
    env = {
        "OA_KEY": PROVIDER_KEY, "AN_KEY": ANTHROPIC_KEY, "TINYGW_API_KEYS": GATEWAY_KEY,
        "TINYGW_MAX_BODY_BYTES": str(MAX_BODY_BYTES), "TINYGW_CLIENT_TIMEOUT_SECONDS": "3",
        "PROVIDER_LISTING_SECONDS": "0",
        "PROVIDER_BREAKER_FAILURES": "0",  # streams without output fail on purpose: no circuit may open
    }
    gw = Gateway(config, env, tmp_path_factory.mktemp("fuzz") / "gateway.log")
    yield Live(gw)
    gw.stop()


class Answer(msgspec.Struct):
    status: int
    headers: dict[str, str]
    body: bytes


def exchange(port: int, head: bytes, body: bytes, method: str, half_close: bool = False) -> Answer | None:
    """One request on a new connection; None when the gateway closed it without an answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as connection:
        try:
            connection.sendall(head + body)
            if half_close:  # the rest of a malformed body would never come
                connection.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # answered (and closed) before the whole request was read: read the answer
        response = http.client.HTTPResponse(connection, method=method)
        try:
            response.begin()
        except (http.client.RemoteDisconnected, ConnectionResetError):
            return None
        try:
            data = response.read()
        except http.client.IncompleteRead as e:  # an answer cut short is still an answer
            data = e.partial
        return Answer(response.status, {k.lower(): v for k, v in response.getheaders()}, data)


def request_head(method: str, target: str, headers: list[tuple[bytes, bytes]]) -> bytes:
    return (f"{method} {target} HTTP/1.1\r\n".encode() + b"Host: 127.0.0.1\r\n"
            + b"".join(k + b": " + v + b"\r\n" for k, v in headers) + b"\r\n")


def check_answer(live: Live, answer: Answer | None, method: str, what, strict_json: bool = True) -> None:
    """Never a 500; every error of the gateway's own is JSON `{"error": {"message", "type"}}`;
    the process is up, answers /healthz, and logged no error from inside itself."""
    if answer is not None:
        assert answer.status != 500, f"500 for {what!r}: {answer.body[:300]!r}"
        content_type = answer.headers.get("content-type", "")
        provider_stream = content_type.startswith("text/event-stream")  # a stream's events, passed through
        if answer.status >= 400 and not provider_stream and (strict_json or answer.body) and method != "HEAD":
            assert content_type.startswith("application/json"), f"{answer.status} {content_type!r} for {what!r}"
            error = json.loads(answer.body)["error"]
            assert isinstance(error["message"], str) and isinstance(error["type"], str), answer.body
    check_alive(live, what)


def check_alive(live: Live, what) -> None:
    process = live.gateway.process
    assert process.poll() is None, f"the gateway exited ({process.returncode}) after {what!r}:\n{live.gateway.logs()}"
    with urllib.request.urlopen(f"http://127.0.0.1:{live.port}/healthz", timeout=5) as r:
        assert r.status == 200
    for line in live.new_log_lines():
        assert '"level":"error"' not in line and '"level":"critical"' not in line and "Traceback" not in line, (
            f"after {what!r}: {line}")


def expected_upstream_model(model: str) -> str:
    return ALIASES.get(model) or model.partition("/")[2]


def check_forwarded(fake: FakeUpstream, body: bytes, client_headers: list[tuple[bytes, bytes]]) -> None:
    """What reached the provider: the model rewritten, no client key, nothing hop-by-hop."""
    [request] = fake.requests
    with recursion_limit(20_000):
        model = wire.read_head(body).model
        assert msgspec.json.decode(request.body, type=wire.RequestHead).model == expected_upstream_model(model)
    assert not any(GATEWAY_KEY in v for v in request.headers.values()), request.headers
    named = {n.decode("latin-1") for n in _named_in_connection([(k.lower(), v) for k, v in client_headers])}
    for name in (HOP_BY_HOP | named) - SET_BY_GATEWAY:
        assert name not in request.headers, (name, request.headers)


# What a client may send.

ROUTE_PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/messages"]
PAGE_PATHS = ["/healthz", "/v1/models", "/metrics", "/status", "/status.json", "/attestation"]
ODD_TARGETS = ["/", "*", "/v1", "/v1/chat/completions/", "//v1/chat/completions", "/V1/CHAT/COMPLETIONS",
               "/v1/chat%2Fcompletions", "/v1/chat/completions%00", "/%ff%fe", "/v1/chat/completions%zz",
               "http://127.0.0.1/v1/chat/completions", "/attestation?nonce=00", "/attestation?nonce=" + "ab" * 32]
QUERY = st.from_regex(r"[A-Za-z0-9._~!$&'()*+,;=:@/?%-]{0,40}", fullmatch=True)
route_targets = st.tuples(st.sampled_from(ROUTE_PATHS), weighted((2, st.none()), (1, QUERY))).map(
    lambda t: t[0] + ("" if t[1] is None else "?" + t[1]))
targets = weighted(  # mostly the proxied routes, whose bodies are parsed
    (16, route_targets), (2, st.sampled_from(PAGE_PATHS)), (1, st.sampled_from(ODD_TARGETS)),
    (1, st.from_regex(r"/[A-Za-z0-9._~!$&'()*+,;=:@/%-]{0,30}", fullmatch=True)),
)
methods = weighted((16, st.just("POST")), (3, st.sampled_from(["GET", "HEAD", "PUT", "DELETE", "OPTIONS", "PATCH"])),
                   (1, st.from_regex(r"[A-Z]{1,10}", fullmatch=True).filter(lambda m: m != "CONNECT")))
BLACK_BOX_MODELS = weighted(
    (6, st.sampled_from(["gpt-x", "claude-x", "oa/x", "an/claude-3", "oa/", "/x", "oa//x", "zz/x", "nope", "",
                         " gpt-x", "oa/" + "m" * 253, "oa/" + "m" * 254, "oa/" + "\u00e9" * 127,
                         "oa/a\r\nx-injected: 1"])),
    (1, st.text(max_size=40)),
    (3, st.tuples(st.sampled_from(["oa", "an", "zz", ""]), st.text(min_size=1, max_size=300)).map("/".join)),
)
client_header_names = (st.sampled_from(sorted(set(REQUEST_NAMES) - {"host", "content-length", "transfer-encoding"}))
                       | TOKEN)
CREDENTIALS = {
    "bearer": [(b"Authorization", f"Bearer {GATEWAY_KEY}".encode())],
    "x-api-key": [(b"x-api-key", GATEWAY_KEY.encode())],
    "none": [],
    "wrong": [(b"Authorization", b"Bearer nope")],
    "basic": [(b"Authorization", f"Basic {GATEWAY_KEY}".encode())],
}
request_bodies = weighted(
    (10, json_bodies(BLACK_BOX_MODELS)), (2, st.binary(max_size=300)), (2, mutated(json_bodies(BLACK_BOX_MODELS))),
    (2, deep_bodies()), (2, st.sampled_from([p.read_bytes() for p in BODY_SEEDS])),
    (1, st.integers(MAX_BODY_BYTES - 40, MAX_BODY_BYTES + 100).map(
        lambda n: b'{"model":"gpt-x","p":"' + b"x" * n + b'"}')),  # about the body limit
)


@st.composite
def chunked(draw, body: bytes) -> bytes:
    """`body` in valid chunked framing: random chunk sizes, hex case, extensions, trailers."""
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(body) - 1)), max_size=6))) if len(body) > 1 else []
    out = b""
    for start, end in zip([0, *cuts], [*cuts, len(body)]):
        if end > start:
            size = b"%x" % (end - start)
            size = size.upper() if draw(st.booleans()) else size
            out += b"0" * draw(st.integers(0, 2)) + size + draw(st.sampled_from([b"", b"", b";ext=1", b";a"])) + b"\r\n"
            out += body[start:end] + b"\r\n"
    return out + b"0\r\n" + draw(st.sampled_from([b"", b"", b"X-Trailer: 1\r\n"])) + b"\r\n"


@st.composite
def malformed_chunked(draw, body: bytes) -> bytes:
    framed = draw(chunked(body))
    how = draw(st.sampled_from(["size", "bigger", "smaller", "lf", "negative", "huge", "truncate", "garbage",
                                "no-crlf", "no-last-chunk", "space"]))
    size_end = framed.index(b"\r\n")
    if how == "size":
        return b"zz" + framed[size_end:]
    if how == "bigger":
        return b"%x" % (len(body) + draw(st.integers(1, 50))) + b"\r\n" + body + b"\r\n0\r\n\r\n"
    if how == "smaller" and len(body) > 1:
        return b"%x" % draw(st.integers(0, len(body) - 1)) + b"\r\n" + body + b"\r\n0\r\n\r\n"
    if how == "lf":
        return framed.replace(b"\r\n", b"\n")
    if how == "negative":
        return b"-1\r\n" + framed
    if how == "huge":
        return b"f" * draw(st.integers(16, 40)) + b"\r\n" + framed
    if how == "truncate":
        return framed[: draw(st.integers(0, len(framed) - 1))]
    if how == "garbage":
        at = draw(st.integers(0, len(framed)))
        return framed[:at] + draw(st.binary(min_size=1, max_size=8)) + framed[at:]
    if how == "no-crlf" and body:
        return b"%x" % len(body) + b"\r\n" + body + b"0\r\n\r\n"
    if how == "no-last-chunk":
        return framed[: -len(b"0\r\n\r\n")] if framed.endswith(b"0\r\n\r\n") else framed[:-2]
    return b"%x " % len(body) + b"\r\n" + body + b"\r\n0\r\n\r\n"  # a space after the size


@given(method=methods, target=targets,
       credentials=st.sampled_from(["bearer"] * 6 + ["x-api-key"] * 2 + ["none", "wrong", "basic"]),
       extra=header_lists(client_header_names), body=request_bodies,
       framing=st.sampled_from(["length"] * 5 + ["chunked"] * 2 + ["malformed"] * 2 + ["none"]), data=st.data())
def test_the_gateway_never_answers_500(gateway, fake, method, target, credentials, extra, body, framing, data):
    fresh(gateway, fake)
    upper = data.draw(st.lists(st.booleans(), min_size=len(extra), max_size=len(extra)), label="upper-case names")
    headers = CREDENTIALS[credentials] + [(k.upper() if u else k, v) for (k, v), u in zip(extra, upper)]
    if not any(k.lower() == b"content-type" for k, _ in headers):
        headers.append((b"Content-Type", b"application/json"))
    if framing == "length":
        framed = body
        headers.append((b"Content-Length", b"%d" % len(body)))
    elif framing == "none":
        framed = body = b""
    else:
        headers.append((b"Transfer-Encoding", b"chunked"))
        framed = data.draw(malformed_chunked(body) if framing == "malformed" else chunked(body), label="framed")
    what = (method, target, headers, framed)
    answer = exchange(gateway.port, request_head(method, target, headers), framed, method,
                      half_close=framing == "malformed")
    event(f"{framing}: {answer.status if answer else 'closed'}")
    if answer is not None and answer.status == 400:
        event(answer.body[:70].decode(errors="replace"))
    if framing != "malformed":
        assert answer is not None, f"no answer to {what!r}"
    check_answer(gateway, answer, method, what, strict_json=framing != "malformed")
    if answer is not None and answer.status == 200 and method == "POST" and target.partition("?")[0] in ROUTE_PATHS:
        check_forwarded(fake, body, headers)


MALFORMED_CHUNKED = [b"zz\r\n{}\r\n0\r\n\r\n", b"3\r\nabcdef\r\n0\r\n\r\n", b"-1\r\n\r\n", b"2\n{}\n0\n\n",
                     b"5\r\n{}\r\n0\r\n\r\n", b"f" * 20 + b"\r\n", b"3\r\nab"]


@pytest.mark.parametrize("framed", MALFORMED_CHUNKED, ids=lambda b: repr(b)[2:30])
def test_malformed_chunked_body_is_no_500(gateway, fake, framed):
    fresh(gateway, fake)
    headers = [(b"Authorization", f"Bearer {GATEWAY_KEY}".encode()), (b"Transfer-Encoding", b"chunked")]
    answer = exchange(gateway.port, request_head("POST", "/v1/chat/completions", headers), framed, "POST",
                      half_close=True)
    check_answer(gateway, answer, "POST", framed, strict_json=False)


def post(live: Live, body: bytes, path: str = "/v1/chat/completions") -> Answer | None:
    headers = [(b"Authorization", f"Bearer {GATEWAY_KEY}".encode()), (b"Content-Type", b"application/json"),
               (b"Content-Length", b"%d" % len(body))]
    return exchange(live.port, request_head("POST", path, headers), body, "POST")


def test_every_nesting_depth_near_the_recursion_limit(gateway, fake):
    """The gateway reads a body's head, then rewrites its model some frames deeper: at
    every depth the answer is 200 or 400, never 500 (sparse random depths miss the few
    in between, so every depth around the interpreter's limit is tried)."""
    fresh(gateway, fake)
    depths = range(0, 3001) if LONG else [0, 10, 100, 500, *range(850, 1051), 1500, 2000, 3000]
    wrong = []
    for depth in depths:
        for opener, closer in NESTINGS[:2] if LONG or depth not in range(850, 1051) else NESTINGS[:1]:
            body = b'{"model":"gpt-x","x":' + opener * depth + b"1" + closer * depth + b"}"
            fake.requests.clear()
            answer = post(gateway, body)
            if answer is None or answer.status not in (200, 400):
                wrong.append((depth, opener, answer and answer.status, answer and answer.body[:100]))
            elif answer.status == 400:
                assert json.loads(answer.body)["error"]["type"] == "invalid_request_error"
            else:
                check_forwarded(fake, body, [])
    gateway.new_log_lines()  # the 500s' log lines are in `wrong`
    assert not wrong, f"{len(wrong)} answers neither 200 nor 400: {wrong}"
    check_alive(gateway, "nesting")


@pytest.mark.parametrize("path", BODY_SEEDS, ids=lambda p: p.name)
def test_corpus_bodies_through_the_gateway(gateway, fake, path):
    fresh(gateway, fake)
    body = path.read_bytes()
    answer = post(gateway, body)
    assert answer is not None
    check_answer(gateway, answer, "POST", path.name)
    if path.name in CORPUS_STATUS:
        assert answer.status == CORPUS_STATUS[path.name], answer.body[:300]
    if answer.status == 200:
        check_forwarded(fake, body, [])


def stream_through(live: Live, fake: FakeUpstream, stream: bytes, cuts: list[int], cut_short: bool) -> int:
    """The provider streams `stream` in pieces; the client gets it relayed as it is (then at
    most an error event), or a 502 with the events, never a 500."""
    pieces = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)]) if b > a]
    fake.script = lambda request: Reply(headers=[("content-type", "text/event-stream")],
                                        chunks=[(0, p) for p in pieces], action="cut" if cut_short else "answer")
    answer = post(live, json.dumps({"model": "gpt-x", "stream": True}).encode())
    assert answer is not None
    check_answer(live, answer, "POST", (stream, cuts, cut_short))
    assert answer.status in (200, 502), answer.status
    if answer.status == 200:
        assert answer.body.startswith(stream)
        rest = answer.body[len(stream):]
        assert rest == b"" or (rest.startswith(b"event: error\ndata: ") and rest.endswith(b"\n\n")), rest
    return answer.status


@given(stream=sse_streams, cut_short=st.sampled_from([False, False, True]), data=st.data())
def test_any_provider_stream_is_relayed_or_502(gateway, fake, stream, cut_short, data):
    fresh(gateway, fake)
    event(f"status {stream_through(gateway, fake, stream, _cuts(data, len(stream)), cut_short)}")


@pytest.mark.parametrize("path", SSE_SEEDS, ids=lambda p: p.name)
def test_corpus_streams_through_the_gateway(gateway, fake, path):
    fresh(gateway, fake)
    stream = path.read_bytes()
    stream_through(gateway, fake, stream, list(range(7, len(stream), 7)), False)


@given(st.binary(max_size=300))
@example(b'data: {"choices":[{"delta":{"content":"an \\"error\\""},"finish_reason":null}]}\n\n')
@example(b'event: error\ndata: {}\n\n')
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
        value["type"] = draw(st.sampled_from(["message_delta", "message_stop", "error", "response.completed",
                                              "response.failed", "content_block_delta", "ping", "message_start"]))
    if draw(st.booleans()):
        value["choices"] = [{"delta": {"content": draw(st.text(max_size=12))},
                             "finish_reason": draw(st.sampled_from([None, "stop", "length", "tool_calls"]))}]
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


SCAN_PIECES = [*SSE_PIECES, b'"usage"', b'"finish_reason": "', b'"finish_reason":null', b'"stop_reason"\n:"',
               b'"finish_reason":', b"event: error", b"event:", b"response.failed", b"response.", b"message_stop",
               b"\n" * 17, b"\r\n" * 9, b" ", b"\t", b'"']
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
    wanted = [e for e in events if sse.may_end_or_fail(e) or b'"usage"' in e]
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
