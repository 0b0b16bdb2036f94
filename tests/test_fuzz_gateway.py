"""Black-box fuzz tests (Hypothesis): a real gateway process fed generated requests over
raw sockets, and generated provider streams through it. It never answers 500, never goes
down, and every error it answers itself is `{"error": {"message", "type", ...}}`.

The inputs come from tests/fuzz_strategies.py (shared with tests/test_fuzz_units.py, the
pure parsers' properties) and the seed corpus tests/fuzz_corpus/. The default profile is
small and derandomized (reproducible in CI); `make fuzz` runs `HYPOTHESIS_PROFILE=long`.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import urllib.request

import msgspec
import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from conftest import Gateway
from fuzz_strategies import (
    BODY_SEEDS,
    HOP_BY_HOP,
    NESTINGS,
    REQUEST_NAMES,
    SSE_SEEDS,
    TOKEN,
    deep_bodies,
    draw_cuts,
    header_lists,
    json_bodies,
    mutated,
    named_in_connection,
    recursion_limit,
    sse_streams,
    weighted,
)
from tinygw.fake.upstream import FakeUpstream, Reply, json_reply, well_behaved
from tinygw.protocol import request as request_body

# Hypothesis' profiles ("default": few derandomized examples; "long": make fuzz) are
# registered in conftest.py, for this file and tests/test_fastpath.py alike.
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "default")
LONG = PROFILE != "default"

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
    "body-lone-surrogate.json": 200,  # JSON by RFC 8259's grammar, which msgspec alone refuses
}


# ---- a real gateway --------------------------------------------------------------------------

GATEWAY_KEY = "gw-fuzz-key-3e1d"
PROVIDER_KEY = "prov-fuzz-key-8a2b"
ANTHROPIC_KEY = "anth-fuzz-key-47cc"
MAX_BODY_BYTES = 65536
ALIASES = {"gpt-x": "upstream-gpt", "claude-x": "claude-upstream"}
SET_BY_GATEWAY = {"host", "content-length", "authorization", "x-api-key", "accept-encoding"}
CANNED = {
    "id": "x",
    "object": "chat.completion",
    "created": 0,
    "model": "m",
    "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "ok"}}],
}


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
        "OA_KEY": PROVIDER_KEY,
        "AN_KEY": ANTHROPIC_KEY,
        "TINYGW_API_KEYS": GATEWAY_KEY,
        "TINYGW_MAX_BODY_BYTES": str(MAX_BODY_BYTES),
        "TINYGW_CLIENT_TIMEOUT_SECONDS": "3",
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
    return (
        f"{method} {target} HTTP/1.1\r\n".encode()
        + b"Host: 127.0.0.1\r\n"
        + b"".join(k + b": " + v + b"\r\n" for k, v in headers)
        + b"\r\n"
    )


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
            f"after {what!r}: {line}"
        )


def expected_upstream_model(model: str) -> str:
    return ALIASES.get(model) or model.partition("/")[2]


def check_forwarded(fake: FakeUpstream, body: bytes, client_headers: list[tuple[bytes, bytes]]) -> None:
    """What reached the provider: the model rewritten, no client key, nothing hop-by-hop."""
    [request] = fake.requests
    with recursion_limit(20_000):
        model = request_body.read_head(body).model
        assert request_body.read_head(request.body).model == expected_upstream_model(model)
    assert not any(GATEWAY_KEY in v for v in request.headers.values()), request.headers
    named = {n.decode("latin-1") for n in named_in_connection([(k.lower(), v) for k, v in client_headers])}
    for name in (HOP_BY_HOP | named) - SET_BY_GATEWAY:
        assert name not in request.headers, (name, request.headers)


# What a client may send.

ROUTE_PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/messages"]
PAGE_PATHS = ["/healthz", "/v1/models", "/metrics", "/status", "/status.json", "/attestation"]
ODD_TARGETS = [
    "/",
    "*",
    "/v1",
    "/v1/chat/completions/",
    "//v1/chat/completions",
    "/V1/CHAT/COMPLETIONS",
    "/v1/chat%2Fcompletions",
    "/v1/chat/completions%00",
    "/%ff%fe",
    "/v1/chat/completions%zz",
    "http://127.0.0.1/v1/chat/completions",
    "/attestation?nonce=00",
    "/attestation?nonce=" + "ab" * 32,
]
QUERY = st.from_regex(r"[A-Za-z0-9._~!$&'()*+,;=:@/?%-]{0,40}", fullmatch=True)
route_targets = st.tuples(st.sampled_from(ROUTE_PATHS), weighted((2, st.none()), (1, QUERY))).map(
    lambda t: t[0] + ("" if t[1] is None else "?" + t[1])
)
targets = weighted(  # mostly the proxied routes, whose bodies are parsed
    (16, route_targets),
    (2, st.sampled_from(PAGE_PATHS)),
    (1, st.sampled_from(ODD_TARGETS)),
    (1, st.from_regex(r"/[A-Za-z0-9._~!$&'()*+,;=:@/%-]{0,30}", fullmatch=True)),
)
methods = weighted(
    (16, st.just("POST")),
    (3, st.sampled_from(["GET", "HEAD", "PUT", "DELETE", "OPTIONS", "PATCH"])),
    (1, st.from_regex(r"[A-Z]{1,10}", fullmatch=True).filter(lambda m: m != "CONNECT")),
)
BLACK_BOX_MODELS = weighted(
    (
        6,
        st.sampled_from(
            [
                "gpt-x",
                "claude-x",
                "oa/x",
                "an/claude-3",
                "oa/",
                "/x",
                "oa//x",
                "zz/x",
                "nope",
                "",
                " gpt-x",
                "oa/" + "m" * 253,
                "oa/" + "m" * 254,
                "oa/" + "\u00e9" * 127,
                "oa/a\r\nx-injected: 1",
            ]
        ),
    ),
    (1, st.text(max_size=40)),
    (3, st.tuples(st.sampled_from(["oa", "an", "zz", ""]), st.text(min_size=1, max_size=300)).map("/".join)),
)
client_header_names = (
    st.sampled_from(sorted(set(REQUEST_NAMES) - {"host", "content-length", "transfer-encoding"})) | TOKEN
)
CREDENTIALS = {
    "bearer": [(b"Authorization", f"Bearer {GATEWAY_KEY}".encode())],
    "x-api-key": [(b"x-api-key", GATEWAY_KEY.encode())],
    "none": [],
    "wrong": [(b"Authorization", b"Bearer nope")],
    "basic": [(b"Authorization", f"Basic {GATEWAY_KEY}".encode())],
}
request_bodies = weighted(
    (10, json_bodies(BLACK_BOX_MODELS)),
    (2, st.binary(max_size=300)),
    (2, mutated(json_bodies(BLACK_BOX_MODELS))),
    (2, deep_bodies()),
    (2, st.sampled_from([p.read_bytes() for p in BODY_SEEDS])),
    (
        1,
        st.integers(MAX_BODY_BYTES - 40, MAX_BODY_BYTES + 100).map(
            lambda n: b'{"model":"gpt-x","p":"' + b"x" * n + b'"}'
        ),
    ),  # about the body limit
)


@st.composite
def chunked(draw, body: bytes) -> bytes:
    """`body` in valid chunked framing: random chunk sizes, hex case, extensions, trailers."""
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(body) - 1)), max_size=6))) if len(body) > 1 else []
    out = b""
    for start, end in zip([0, *cuts], [*cuts, len(body)], strict=True):
        if end > start:
            size = b"%x" % (end - start)
            size = size.upper() if draw(st.booleans()) else size
            out += b"0" * draw(st.integers(0, 2)) + size + draw(st.sampled_from([b"", b"", b";ext=1", b";a"])) + b"\r\n"
            out += body[start:end] + b"\r\n"
    return out + b"0\r\n" + draw(st.sampled_from([b"", b"", b"X-Trailer: 1\r\n"])) + b"\r\n"


@st.composite
def malformed_chunked(draw, body: bytes) -> bytes:
    framed = draw(chunked(body))
    how = draw(
        st.sampled_from(
            [
                "size",
                "bigger",
                "smaller",
                "lf",
                "negative",
                "huge",
                "truncate",
                "garbage",
                "no-crlf",
                "no-last-chunk",
                "space",
            ]
        )
    )
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


@given(
    method=methods,
    target=targets,
    credentials=st.sampled_from(["bearer"] * 6 + ["x-api-key"] * 2 + ["none", "wrong", "basic"]),
    extra=header_lists(client_header_names),
    body=request_bodies,
    framing=st.sampled_from(["length"] * 5 + ["chunked"] * 2 + ["malformed"] * 2 + ["none"]),
    data=st.data(),
)
def test_the_gateway_never_answers_500(gateway, fake, method, target, credentials, extra, body, framing, data):
    fresh(gateway, fake)
    upper = data.draw(st.lists(st.booleans(), min_size=len(extra), max_size=len(extra)), label="upper-case names")
    headers = CREDENTIALS[credentials] + [(k.upper() if u else k, v) for (k, v), u in zip(extra, upper, strict=True)]
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
    answer = exchange(
        gateway.port, request_head(method, target, headers), framed, method, half_close=framing == "malformed"
    )
    event(f"{framing}: {answer.status if answer else 'closed'}")
    if answer is not None and answer.status == 400:
        event(answer.body[:70].decode(errors="replace"))
    if framing != "malformed":
        assert answer is not None, f"no answer to {what!r}"
    check_answer(gateway, answer, method, what, strict_json=framing != "malformed")
    if answer is not None and answer.status == 200 and method == "POST" and target.partition("?")[0] in ROUTE_PATHS:
        check_forwarded(fake, body, headers)


MALFORMED_CHUNKED = [
    b"zz\r\n{}\r\n0\r\n\r\n",
    b"3\r\nabcdef\r\n0\r\n\r\n",
    b"-1\r\n\r\n",
    b"2\n{}\n0\n\n",
    b"5\r\n{}\r\n0\r\n\r\n",
    b"f" * 20 + b"\r\n",
    b"3\r\nab",
]


@pytest.mark.parametrize("framed", MALFORMED_CHUNKED, ids=lambda b: repr(b)[2:30])
def test_malformed_chunked_body_is_no_500(gateway, fake, framed):
    fresh(gateway, fake)
    headers = [(b"Authorization", f"Bearer {GATEWAY_KEY}".encode()), (b"Transfer-Encoding", b"chunked")]
    answer = exchange(
        gateway.port, request_head("POST", "/v1/chat/completions", headers), framed, "POST", half_close=True
    )
    check_answer(gateway, answer, "POST", framed, strict_json=False)


def post(live: Live, body: bytes, path: str = "/v1/chat/completions") -> Answer | None:
    headers = [
        (b"Authorization", f"Bearer {GATEWAY_KEY}".encode()),
        (b"Content-Type", b"application/json"),
        (b"Content-Length", b"%d" % len(body)),
    ]
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
    pieces = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True) if b > a]
    fake.script = lambda request: Reply(
        headers=[("content-type", "text/event-stream")],
        chunks=[(0, p) for p in pieces],
        action="cut" if cut_short else "answer",
    )
    answer = post(live, json.dumps({"model": "gpt-x", "stream": True}).encode())
    assert answer is not None
    check_answer(live, answer, "POST", (stream, cuts, cut_short))
    assert answer.status in (200, 502), answer.status
    if answer.status == 200:
        assert answer.body.startswith(stream)
        rest = answer.body[len(stream) :]
        assert rest == b"" or (rest.startswith(b"event: error\ndata: ") and rest.endswith(b"\n\n")), rest
    return answer.status


@given(stream=sse_streams, cut_short=st.sampled_from([False, False, True]), data=st.data())
def test_any_provider_stream_is_relayed_or_502(gateway, fake, stream, cut_short, data):
    fresh(gateway, fake)
    event(f"status {stream_through(gateway, fake, stream, draw_cuts(data, len(stream)), cut_short)}")


@pytest.mark.parametrize("path", SSE_SEEDS, ids=lambda p: p.name)
def test_corpus_streams_through_the_gateway(gateway, fake, path):
    fresh(gateway, fake)
    stream = path.read_bytes()
    stream_through(gateway, fake, stream, list(range(7, len(stream), 7)), False)
