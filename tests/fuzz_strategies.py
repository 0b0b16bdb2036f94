"""What the fuzz tests generate: JSON written every way JSON may be written, request
bodies (valid, mutated, deeply nested), header lists, server-sent event streams, and the
seed corpus (tests/fuzz_corpus/, its README says what the files are).

Shared by tests/test_fuzz_units.py (the pure parsers) and tests/test_fuzz_gateway.py (a
real gateway process); Hypothesis' profiles are registered in conftest.py.
"""

from __future__ import annotations

import json
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

from hypothesis import example
from hypothesis import strategies as st

CORPUS = Path(__file__).resolve().parent / "fuzz_corpus"
BODY_SEEDS = sorted(CORPUS.glob("body-*"))
SSE_SEEDS = sorted(CORPUS.glob("sse-*"))


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
        lambda i: choices[i][1]
    )


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


class Lit:
    """A JSON token written as is: numbers Python holds differently, escapes of lone surrogates.
    (Not a str subclass: as one, Hypothesis failed to replay the strings it drew, with
    `KeyError: Lit` and FlakyStrategyDefinition in test_rewrite_model_changes_the_top_level_model_only.)"""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return f"Lit({self.text!r})"


LITERALS = [
    "1e400",
    "-1e400",
    "1E-400",
    "-0",
    "-0.0",
    "0e0",
    "123456789012345678901234567890",
    "-12345678901234567890123456789e-5",
    "1.7976931348623157e308",
    "1.8e308",
    "5e-324",
    '"\\ud800"',
    '"\\udc00\\ud800"',
    '"\\u0000"',
    '"\\/"',
    '"\\ud83d\\ude00"',
]
TRICKY_STRINGS = [
    '"model": "gpt-x"',
    '\\"model\\": \\"x\\"',
    "model",
    '{"model":"x"}',
    "\u2028",
    "\x00",
    "\r\n\r\n",
    "data: [DONE]\n\n",
    "caf\u00e9",
    "\U0001f600",
    "\\u0065",
]
KEYS = st.sampled_from(
    [
        "model",
        "stream",
        "messages",
        "content",
        "role",
        "tools",
        "type",
        "choices",
        "delta",
        "error",
        "finish_reason",
        "text",
        "stop_reason",
    ]
) | st.text(max_size=8)
json_numbers = st.from_regex(r"-?(0|[1-9][0-9]{0,30})(\.[0-9]{1,20})?([eE][+-]?[0-9]{1,4})?", fullmatch=True)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
    st.sampled_from(TRICKY_STRINGS),
    st.sampled_from(LITERALS).map(Lit),
    json_numbers.map(Lit),
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.lists(st.tuples(KEYS, inner), max_size=4).map(Obj),
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
            return v.text
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
        return (
            "{"
            + ws
            + ",".join(
                string(k) + draw(WHITESPACE) + ":" + draw(WHITESPACE) + write(x) + draw(WHITESPACE) for k, x in v.pairs
            )
            + "}"
        )

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
            del body[at : at + draw(st.integers(1, 4))]
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


any_bodies = st.one_of(
    st.binary(max_size=512),
    json_bodies(),
    values.flatmap(written).map(str.encode),
    mutated(json_bodies()),
    deep_bodies(),
)


def canonical(value) -> str:
    """A JSON value as sorted JSON text: 1, 1.0 and true differ, and so do 0.0 and -0.0."""
    return json.dumps(value, sort_keys=True)


# ---- headers ------------------------------------------------------------------------------

TOKEN = st.from_regex(r"[!#$%&'*+.^_`|~0-9a-z-]{1,16}", fullmatch=True)
# Written out here, not imported from tinygw.headers: the test must catch an entry the code loses.
HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
}
NOT_FORWARDED = HOP_BY_HOP | {
    "authorization",
    "x-api-key",
    "host",
    "content-length",
    "expect",
    "accept-encoding",
    "x-request-id",
}  # the gateway sends its own request id
REQUEST_NAMES = sorted(
    NOT_FORWARDED
    | {
        "content-type",
        "anthropic-version",
        "anthropic-beta",
        "openai-organization",
        "x-request-id",
        "cookie",
        "x-forwarded-for",
        "user-agent",
        "x-tinygw-debug",
    }
)
header_values = st.binary(max_size=40).map(
    lambda v: bytes(c for c in v if c == 9 or 32 <= c <= 126 or c >= 128).strip(b" \t")
)


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


def named_in_connection(headers) -> set[bytes]:
    return {t.strip().lower() for k, v in headers if k == b"connection" for t in v.split(b",")}


# ---- server-sent events ----------------------------------------------------------------------

SSE_PIECES = [
    b"data: ",
    b"data:",
    b"event: ",
    b"event: error\n",
    b"event:ping",
    b"id: 1",
    b": keep-alive",
    b"retry: 9",
    b"\n",
    b"\r",
    b"\r\n",
    b"\n\n",
    b"\r\r",
    b"\r\n\r\n",
    b"[DONE]",
    b" ",
    b"x",
    b"\xff",
    b"\x00",
    b'{"choices":[{"delta":{"content":"x"},"finish_reason":null}]}',
    b'{"choices":[{"delta":{},"finish_reason":"stop"}]}',
    b'{"choices":[{"delta":{"role":"assistant"}}]}',
    b'{"type":"message_stop"}',
    b'{"type":"ping"}',
    b'{"error":{"message":"x"}}',
    b'{"type":"error"}',
    b'{"type":"message_delta","delta":{"stop_reason":"end_turn"}}',
    b'{"type":"response.completed"}',
]
SSE_EVENTS = [
    b'data: {"choices":[{"delta":{"role":"assistant"},"finish_reason":null}]}\n\n',
    b'data: {"choices":[{"delta":{"content":"Hi"},"finish_reason":null}]}\n\n',
    b'data: {"choices":[{"delta":{},"finish_reason":"stop"}]}\n\n',
    b"data: [DONE]\n\n",
    b": ping\n\n",
    b'event: content_block_delta\ndata: {"type":"content_block_delta","delta":{"text":"x"}}\n\n',
    b'event: message_stop\ndata: {"type":"message_stop"}\n\n',
    b'data: {"error":{"message":"x"}}\n\n',
]
sse_streams = st.one_of(
    st.lists(st.sampled_from(SSE_PIECES) | st.binary(max_size=6), max_size=40).map(b"".join),
    st.binary(max_size=200),
    st.lists(st.sampled_from(SSE_EVENTS) | st.sampled_from(SSE_PIECES), max_size=12).map(b"".join),
)
EVENT_TYPES = [
    "message_start",
    "ping",
    "content_block_start",
    "content_block_delta",
    "content_block_stop",
    "message_delta",
    "message_stop",
    "error",
    "response.created",
    "response.completed",
    "response.failed",
    "response.output_text.delta",
]
choices = st.builds(
    lambda delta, finish, text: Obj([("delta", delta), ("finish_reason", finish), ("text", text)]),
    values | st.builds(lambda c: Obj([("content", c)]), values),
    values,
    values,
)
provider_values = st.builds(
    lambda kind, chs, error, delta: Obj([("type", kind), ("choices", chs), ("error", error), ("delta", delta)]),
    st.sampled_from(EVENT_TYPES) | values,
    st.lists(choices | values, max_size=3) | values,
    values,
    values | st.builds(lambda reason: Obj([("stop_reason", reason)]), values),
)
data_events = st.tuples(
    st.sampled_from([b"", b"event: error\n", b"event: message_delta\n", b"event:ping\r\n", b": c\n"]),
    (provider_values | values).flatmap(written).map(str.encode) | deep_bodies(),
    st.sampled_from([b"\n\n", b"\r\n\r\n", b"\r\r", b"\n", b""]),
).map(lambda t: t[0] + b"data: " + t[1].replace(b"\n", b"\ndata: ") + t[2])


def draw_cuts(data, length: int) -> list[int]:
    return sorted(data.draw(st.sets(st.integers(0, length), max_size=12), label="cuts"))
