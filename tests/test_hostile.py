"""docs/design.md section 10, black-box: a real gateway against providers and clients that
misbehave on purpose. Each test here failed on the code before the fix it guards."""

from __future__ import annotations

import gzip
import hashlib
import http.client
import json
import socket
import threading
import time
import zlib

import pytest

from conftest import call, module_fake, second_fake, wait_until, wait_until_client_left
from tinygw.fake.upstream import Reply, openai_stream_events, well_behaved

MiB = 1024 * 1024


fake, fresh_fake = module_fake()


backup = second_fake("backup", scope="module")


@pytest.fixture(scope="module")
def gateway(fake, backup, tmp_path_factory):
    from conftest import Gateway

    config = {
        "providers": {
            # one connection: every request reuses the connection the last one left
            "one": {"base_url": f"{fake.url}/v1", "api": "openai", "max_connections": 1, "listing": False},
            "backup": {"base_url": f"{backup.url}/v1", "api": "openai", "listing": False},
        },
        "models": {
            "m": {"targets": ["one:up"]},
            "with-fallback": {"targets": ["one:up", "backup:b"]},
        },
    }
    process = Gateway(config, {"PROVIDER_BREAKER_FAILURES": "0"}, tmp_path_factory.mktemp("hostile") / "gw.log")
    yield process
    process.stop()


def chat(gateway, model="m", stream=False, text="hi", timeout=10):
    return call(
        "POST",
        f"{gateway.url}/v1/chat/completions",
        {"model": model, "stream": stream, "messages": [{"role": "user", "content": text}]},
        timeout=timeout,
    )


def raw_response(status_line: str, headers: list[str], body: bytes) -> bytes:
    return ("\r\n".join([status_line, *headers]) + "\r\n\r\n").encode() + body


def request_records(gateway) -> list[dict]:
    return [r for r in gateway.log_records() if r.get("msg") == "request"]


def request_record(gateway, target: str) -> dict:
    """The access-log line of the request that went to `target` (written just after
    the answer, so it is waited for); tests give each request an upstream model of
    its own (`one/<name>`) to find it."""
    return wait_until(
        lambda: [r for r in request_records(gateway) if r["target"] == target], what=f"the access log line of {target}"
    )[-1]


# ---- a connection is reused only when its answer ended where its framing said -------


def test_bytes_past_content_length_never_reach_the_next_client(gateway, fake):
    smuggled = raw_response(
        "HTTP/1.1 200 OK", ["content-type: application/json", "content-length: 26"], b'{"answer": "alice-private"}'
    )
    first = (
        raw_response("HTTP/1.1 200 OK", ["content-type: application/json", "content-length: 12"], b'{"ok":"one"}')
        + smuggled
    )  # bytes past the declared length
    fake.script = lambda r: Reply(action="raw", body=first) if b"alice" in r.body else well_behaved("fake")(r)

    status, _, body = chat(gateway, text="from alice")
    assert (status, body) == (200, b'{"ok":"one"}')

    status, _, body = chat(gateway, text="from bob")
    assert status == 200
    assert b"alice-private" not in body
    assert json.loads(body)["choices"][0]["message"]["content"] == "Hello from fake."
    assert fake.requests[-1].connection != fake.requests[-2].connection  # discarded, not reused


def test_a_body_after_204_is_discarded_with_its_connection(gateway, fake):
    answer = raw_response("HTTP/1.1 204 No Content", [], b'{"secret": "bob"}')
    fake.script = lambda r: Reply(action="raw", body=answer) if b"first" in r.body else well_behaved("fake")(r)

    status, _, body = chat(gateway, text="first")
    assert (status, body) == (204, b"")

    status, _, body = chat(gateway, model="one/after-204", text="second")
    assert status == 200 and b"secret" not in body
    assert request_record(gateway, "one:after-204")["attempts"] == "one:200"  # no protocol error, no retry
    assert fake.requests[-1].connection != fake.requests[-2].connection


def test_bytes_a_provider_sends_between_requests_close_the_idle_connection(gateway, fake):
    """A provider that speaks while no request is outstanding (here: a second answer,
    written a moment after the first) has its connection closed when the bytes come,
    before the next request, which gets its own answer on a new connection."""
    gate = threading.Event()
    first = raw_response("HTTP/1.1 200 OK", ["content-type: application/json", "content-length: 12"], b'{"ok":"one"}')
    unasked = raw_response("HTTP/1.1 200 OK", ["content-length: 22"], b'{"answer": "unasked"}')
    fake.script = lambda r: Reply(action="raw", body=first, chunks=[(gate, unasked)])
    assert chat(gateway, text="first")[::2] == (200, b'{"ok":"one"}')
    wait_until(lambda: fake.open_connections == 1, what="the idle connection")
    fake.script = well_behaved("fake")
    gate.set()
    wait_until(lambda: fake.open_connections == 0, what="the gateway to close the connection the provider spoke on")
    accepted = fake.accepted
    status, _, body = chat(gateway, model="one/after-unasked", text="second")
    assert status == 200 and json.loads(body)["choices"][0]["message"]["content"] == "Hello from fake."
    assert request_record(gateway, "one:after-unasked")["attempts"] == "one:200"
    assert fake.accepted == accepted + 1


def test_a_response_head_over_64_KiB_is_refused_and_called_so(gateway, fake):
    filler = [f"x-filler-{i}: {'v' * 1000}" for i in range(100)]  # ~100 KiB
    head = raw_response("HTTP/1.1 200 OK", ["content-type: application/json", "content-length: 2", *filler], b"{}")
    fake.script = lambda r: Reply(action="raw", body=head)
    status, _, body = chat(gateway)
    error = json.loads(body)["error"]
    assert status == 502 and error["cause"] == "protocol_error"
    assert "the response head is over 65536 bytes" in error["message"]


# A run of spaces that a pattern could split between two of its parts, before a byte
# that ends the match: a backtracking regex tries every split (60,000 spaces: ~4 s of the
# worker's loop, every other request waiting). Taken whole, it costs one pass.
RUN = 60_000
NOT_SECONDS = 2.0


def test_a_head_with_a_long_run_of_spaces_is_read_in_one_pass_not_seconds(gateway, fake):
    spaces = " " * RUN
    # obs-text after the spaces: h11 takes the line, the fast path hands the head to it
    head = raw_response("HTTP/1.1 200 OK", ["content-type: application/json", "content-length: 2"], b"{}")
    head = head.replace(b"\r\n\r\n", f"\r\nx-trace:{spaces}".encode() + b"\x80\r\n\r\n", 1)
    fake.script = lambda r: Reply(action="raw", body=head)
    started = time.monotonic()
    status, _, body = chat(gateway, model="one/long-spaces")
    took = time.monotonic() - started
    assert (status, body) == (200, b"{}")
    assert took < NOT_SECONDS, f"the head took {took:.1f} s"


def test_a_chunk_size_line_with_a_long_run_of_spaces_is_refused_in_one_pass(gateway, fake):
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
    line = b"2;" + b" " * RUN + b"\n{}\r\n0\r\n\r\n"  # a bare LF ends it: malformed
    fake.script = lambda r: Reply(action="raw", body=head + line)
    started = time.monotonic()
    status, _, body = chat(gateway, model="one/long-chunk-line")
    took = time.monotonic() - started
    assert status == 502 and json.loads(body)["error"]["cause"] == "protocol_error"
    assert took < NOT_SECONDS, f"the chunk line took {took:.1f} s"


# ---- only a fixed set of the provider's headers reaches the client -----------------

HOSTILE_HEADERS = [
    ("set-cookie", "session=provider-cookie"),
    ("strict-transport-security", "max-age=63072000"),
    ("access-control-allow-origin", "*"),
    ("location", "https://evil.example/"),
    ("x-tinygw-provider", "forged"),
    ("x-powered-by", "provider"),
    ("x-request-id", "req-1"),
    ("x-ratelimit-remaining-requests", "99"),
    ("openai-processing-ms", "12"),
    ("anthropic-ratelimit-requests-limit", "50"),
    ("retry-after-ms", "10"),
]
RELAYED = {
    "content-type",
    "x-request-id",
    "x-ratelimit-remaining-requests",
    "openai-processing-ms",
    "anthropic-ratelimit-requests-limit",
    "retry-after-ms",
}


@pytest.mark.parametrize("stream", [False, True])
def test_only_a_fixed_set_of_provider_headers_reaches_the_client(gateway, fake, stream):
    def script(request):
        reply = well_behaved("fake")(request)
        reply.headers = [*reply.headers, *HOSTILE_HEADERS]
        return reply

    fake.script = script
    status, headers, _ = chat(gateway, stream=stream)
    assert status == 200
    names = {k.lower() for k in headers.keys()}
    provider_names = {k for k, _ in HOSTILE_HEADERS} | {"content-type"}
    assert names & provider_names == RELAYED
    assert headers["x-upstream-request-id"] == "req-1"  # the provider's; x-request-id is the gateway's
    assert headers["x-request-id"] != "req-1"


# ---- compressed answers despite accept-encoding: identity -------------------------


@pytest.mark.parametrize(
    "coding,compress",
    [("gzip", gzip.compress), ("deflate", zlib.compress), ("deflate", lambda b: zlib.compress(b)[2:-4])],
)  # raw deflate
def test_a_compressed_answer_is_decoded(gateway, fake, coding, compress):
    document = {"id": "x", "choices": [{"message": {"content": "compressed " * 1000}}]}
    fake.script = lambda r: Reply(
        headers=[("content-type", "application/json"), ("content-encoding", coding)],
        body=compress(json.dumps(document).encode()),
    )
    status, headers, body = chat(gateway)
    assert status == 200 and "content-encoding" not in {k.lower() for k in headers.keys()}
    assert json.loads(body) == document
    assert fake.requests[-1].headers["accept-encoding"] == "identity"


def test_a_compressed_stream_is_decoded(gateway, fake):
    events = openai_stream_events("up", ["zipped", " words"])
    whole = gzip.compress(b"".join(events))
    pieces = [whole[i : i + 17] for i in range(0, len(whole), 17)]
    fake.script = lambda r: Reply(
        headers=[("content-type", "text/event-stream"), ("content-encoding", "gzip")], chunks=[(0, p) for p in pieces]
    )
    status, _, body = chat(gateway, stream=True)
    assert status == 200 and body == b"".join(events)


@pytest.mark.parametrize(
    "coding,body",
    [("br", b"\x0b\x02\x80{}\x03"), ("gzip", b"not gzip at all"), ("deflate", b'{"plain": "json, labelled deflate"}')],
)
def test_an_answer_that_cannot_be_decoded_is_502(gateway, fake, coding, body):
    fake.script = lambda r: Reply(
        headers=[("content-type", "application/json"), ("content-encoding", coding)], body=body
    )
    status, headers, answer = chat(gateway)
    assert status == 502 and json.loads(answer)["error"]["cause"] == "protocol_error"
    assert headers["content-type"] == "application/json"


# ---- large answers are relayed as they arrive ---------------------------------------


def test_a_large_answer_reaches_the_client_before_it_has_all_arrived(gateway, fake):
    gate = threading.Event()
    first, rest = b'{"data": "' + b"a" * (3 * MiB), b"b" * MiB + b'"}'
    fake.script = lambda r: Reply(headers=[("content-type", "application/json")], chunks=[(0, first), (gate, rest)])
    connection = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=10)
    try:
        connection.request(
            "POST",
            "/v1/chat/completions",
            json.dumps({"model": "m", "messages": []}),
            {"content-type": "application/json"},
        )
        response = connection.getresponse()  # the head came while the provider is held at the gate
        assert response.status == 200
        assert response.read(2 * MiB) == first[: 2 * MiB]
        gate.set()
        body = first[: 2 * MiB] + response.read()
    finally:
        gate.set()
        connection.close()
    assert hashlib.sha256(body).digest() == hashlib.sha256(first + rest).digest()


def test_a_large_answer_cut_midway_ends_incomplete_and_counts_as_a_failure(gateway, fake):
    fake.script = lambda r: Reply(
        headers=[("content-type", "application/json")], chunks=[(0, b'{"data": "' + b"a" * 2 * MiB)], action="cut"
    )
    connection = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=10)
    try:
        connection.request(
            "POST",
            "/v1/chat/completions",
            json.dumps({"model": "one/cut-large", "messages": []}),
            {"content-type": "application/json"},
        )
        response = connection.getresponse()
        assert response.status == 200
        with pytest.raises(http.client.IncompleteRead):
            response.read()
    finally:
        connection.close()
    record = request_record(gateway, "one:cut-large")
    assert record["attempts"] == "one:200+cut" and record["cut"] is True


def test_a_large_error_answer_falls_back_or_is_passed_through_whole(gateway, fake):
    big_error = json.dumps({"error": {"message": "x" * 2 * MiB, "type": "server_error"}}).encode()
    fake.script = lambda r: Reply(
        status=500, headers=[("content-type", "application/json")], chunks=[(0, big_error[:MiB]), (0, big_error[MiB:])]
    )
    status, _, body = chat(gateway, model="with-fallback")
    assert status == 200 and b"backup" in body

    status, _, body = chat(gateway, model="m")
    assert status == 500 and body == big_error


# ---- hostile request bodies ---------------------------------------------------------


def test_deeply_nested_json_is_400(gateway):
    for body in (
        b'{"model": "m", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}",
        b'{"x": ' + b"[" * 5000 + b"]" * 5000 + b', "model": "m"}',
    ):
        status, _, answer = call("POST", f"{gateway.url}/v1/chat/completions", body)
        assert status == 400 and json.loads(answer)["error"]["type"] == "invalid_request_error"
    assert call("GET", f"{gateway.url}/healthz")[0] == 200


LONE_SURROGATES = [
    # JSON.stringify of a string cut inside an emoji (Node writes the half as an escape)
    b'{"model": "m", "messages": [{"role": "user", "content": "a cut emoji \\ud83d"}]}',
    b'{"messages": [{"role": "user", "content": "\\udc00 then \\ud83d\\ude00"}], "model": "m", "stream": false}',
    # a second "model" key, nested: the body is re-encoded (in meaning) with the upstream model
    b'{"model": "m", "metadata": {"model": "\\ud83d"}, "messages": []}',
]


@pytest.mark.parametrize("body", LONE_SURROGATES, ids=["in the prompt", "low and high", "nested model"])
def test_a_lone_surrogate_escape_is_valid_json_and_forwarded(gateway, fake, body):
    """RFC 8259's grammar allows `"\\ud83d"` alone; msgspec refuses to decode it (before:
    400 "not valid JSON"). The provider gets the body as it was sent, its model rewritten."""
    status, _, answer = call("POST", f"{gateway.url}/v1/chat/completions", body)
    assert status == 200, answer
    received = fake.requests[-1].body
    if b'"metadata"' in body:
        assert json.loads(received) == {**json.loads(body), "model": "up"}
    else:
        assert received == body.replace(b'"model": "m"', b'"model": "up"')  # byte-exact but for the model


def test_a_model_name_holding_a_lone_surrogate_is_400(gateway, fake):
    body = b'{"model": "one/x\\ud83d", "messages": []}'
    status, _, answer = call("POST", f"{gateway.url}/v1/chat/completions", body)
    assert status == 400 and json.loads(answer)["error"]["type"] == "invalid_request_error"
    assert not fake.requests


def test_a_model_over_256_bytes_is_400(gateway, fake):
    status, _, body = chat(gateway, model="one/" + "x" * 252)  # 256 bytes: served
    assert status == 200 and fake.requests[-1].json()["model"] == "x" * 252
    status, _, body = chat(gateway, model="one/" + "x" * 253)
    assert status == 400 and "256" in json.loads(body)["error"]["message"]
    status, _, body = chat(gateway, model="one/" + "é" * 127)  # 258 bytes, 131 characters
    assert status == 400


def test_a_malformed_chunked_body_is_400_in_openai_shape(gateway):
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=10) as client:
        client.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\nZZ\r\n{}\r\n0\r\n\r\n"
        )
        answer = b""
        while chunk := client.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400")
    assert json.loads(body)["error"]["type"] == "invalid_request_error"


# ---- idle, slow and flooding clients --------------------------------------------------


def small_config(fake) -> dict:
    return {
        "providers": {"p": {"base_url": f"{fake.url}/v1", "api": "openai", "listing": False}},
        "models": {"m": {"targets": ["p:up"]}},
    }


def test_a_body_sent_too_slowly_is_408(fake, start_gateway):
    gateway = start_gateway(small_config(fake), TINYGW_CLIENT_TIMEOUT_SECONDS="0.5")
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=10) as client:
        client.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n{"
        )  # and then nothing
        answer = b""
        while chunk := client.recv(65536):  # the gateway answers, then closes
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408")
    assert json.loads(body)["error"]["code"] == "request_timeout"


def _send_slowly(client: socket.socket, body: bytes, pause_seconds: float) -> None:
    """A chat request whose body goes in four parts, `pause_seconds` apart: the client's
    pace is what these tests are about (no state is waited for)."""
    client.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    )
    step = -(-len(body) // 4)
    for i in range(0, len(body), step):
        time.sleep(pause_seconds)
        client.sendall(body[i : i + step])


def test_a_body_sent_slowly_but_steadily_is_forwarded(fake, start_gateway):
    """The client timeout is between the body's messages (docs/design.md section 10), not
    for the whole body: parts that each come within it make a request that is answered,
    however long the body takes in all (here 4 x 0.3 s against a 0.5 s timeout)."""
    gateway = start_gateway(small_config(fake), TINYGW_CLIENT_TIMEOUT_SECONDS="0.5")
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "steady " * 20}]}).encode()
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=10) as client:
        _send_slowly(client, body, 0.3)
        response = http.client.HTTPResponse(client)
        response.begin()
        assert response.status == 200, response.read()
    assert json.loads(fake.requests[-1].body)["messages"][0]["content"] == "steady " * 20


def test_a_client_that_leaves_after_a_slow_body_still_closes_the_upstream(fake, start_gateway):
    """A body that takes longer than the first look for a client that leaves (tinygw.api.body.ClientWatch)
    is still followed by that watch: the client leaves while its provider hangs, and the
    provider's connection is closed, the request logged as 499."""
    gateway = start_gateway(small_config(fake))
    fake.script = lambda r: Reply(action="hang")
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "slow-then-leave"}]}).encode()
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=10) as client:
        _send_slowly(client, body, 0.1)
        wait_until(lambda: len(fake.requests) >= 1, seconds=3, what="the request to reach the provider")
    wait_until_client_left(gateway, fake)


def test_thousands_of_idle_and_slow_clients_do_not_stop_the_gateway(fake, start_gateway):
    """2,000 idle connections and 100 requests whose bodies never finish, against a
    gateway started with the common default soft limit of 1,024 open files."""
    gateway = start_gateway(small_config(fake), soft_open_files=1024)
    held = []
    try:
        for _ in range(2000):
            held.append(socket.create_connection(("127.0.0.1", gateway.port), timeout=10))
        for _ in range(100):
            slow = socket.create_connection(("127.0.0.1", gateway.port), timeout=10)
            slow.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b'Content-Length: 1000\r\n\r\n{"model": '
            )
            held.append(slow)
        assert call("GET", f"{gateway.url}/healthz", timeout=1)[0] == 200
        status, _, body = chat(gateway, timeout=1)
        assert status == 200 and b"Hello from fake." in body
    finally:
        for connection in held:
            connection.close()


def test_a_second_gateway_cannot_start_on_a_port_one_serves(fake, start_gateway, tmp_path):
    import subprocess

    from conftest import gateway_command

    first = start_gateway(small_config(fake))
    second = subprocess.run([*gateway_command(), "serve"], env=first.env, capture_output=True, text=True, timeout=20)
    assert second.returncode == 2
    assert "TINYGW_PORT" in second.stderr and str(first.port) in second.stderr
    assert chat(first)[0] == 200


def test_a_chunk_size_line_that_never_ends_is_refused_not_held(fake, start_gateway):
    """A provider that sends a chunk-size line without end must not make the worker hold
    it until the exchange times out: past h11's bound it is a protocol error."""
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
    fake.script = lambda r: Reply(action="raw", body=head + b"1;" + b"x" * (200 * 1024))  # and then nothing
    config = small_config(fake)
    config["providers"]["p"]["timeout_s"] = 5
    gateway = start_gateway(config)
    status, _, body = chat(gateway, model="m", timeout=20)
    assert status == 502 and json.loads(body)["error"]["cause"] == "protocol_error"


def test_a_client_that_leaves_during_a_large_answer_frees_its_connection_slot():
    """In-process (the moment must be exact): the client's send fails while a >1 MiB
    answer is relayed; the provider's connection slot must come back every time."""
    import asyncio

    from tinygw.api import app, proxied
    from tinygw.config import environment
    from tinygw.worker.gateway import Gateway as TinyGateway

    answer = b"x" * (4 * MiB)

    async def provider(reader, writer):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(
                    next(
                        v
                        for k, _, v in (line.partition(b":") for line in head.split(b"\r\n"))
                        if k.lower() == b"content-length"
                    )
                )
                await reader.readexactly(length)
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(answer)
                )
                for i in range(0, len(answer), 65536):
                    writer.write(answer[i : i + 65536])
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass

    async def run() -> list[int]:
        server = await asyncio.start_server(provider, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"
        settings = environment.from_environ(
            {
                "TINYGW_CONFIG": json.dumps(
                    {
                        "providers": {"p": {"base_url": url, "api": "openai", "max_connections": 2, "listing": False}},
                        "models": {"m": {"targets": ["p:m"]}},
                    }
                )
            }
        )
        gateway = TinyGateway(settings)
        pool, free = gateway.upstreams["p"].pool, []
        for _ in range(3):
            messages = [{"type": "http.request", "body": b'{"model": "m"}', "more_body": False}]
            sent = []

            async def receive(messages=messages):
                if messages:
                    return messages.pop()
                await asyncio.sleep(3600)

            async def send(message, sent=sent):
                sent.append(message)
                if len(sent) == 3:  # the first MiB went out; the client is gone
                    raise OSError("the client left")

            scope = {
                "type": "http",
                "path": "/v1/chat/completions",
                "method": "POST",
                "headers": [(b"content-type", b"application/json")],
                "query_string": b"",
            }
            route = app.ROUTES["/v1/chat/completions"].route
            first = dict(reversed(scope["headers"]))  # the headers by name, as app() gives them
            await asyncio.wait_for(proxied.handle(gateway, route, scope, receive, send, first, b"request-1"), 10)
            free.append(pool._free_slots)
        server.close()
        return free

    assert asyncio.run(run()) == [2, 2, 2]


def test_a_client_that_sends_its_body_late_in_one_piece_and_leaves_is_noticed(fake, start_gateway):
    """The head, then 0.3 s later the whole body in one write (one message: past the
    watch's first look, its timer then waits for the body's deadline, 30 s): the watch
    for the client leaving starts when the body is read, so leaving while the provider
    hangs closes the provider's connection and is logged 499 within seconds."""
    gateway = start_gateway(small_config(fake))
    fake.script = lambda r: Reply(action="hang")
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "late-then-leave"}]}).encode()
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=10) as client:
        client.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body)
        )
        time.sleep(0.3)  # the client's pace is what this test is about
        client.sendall(body)
        wait_until(lambda: len(fake.requests) >= 1, seconds=3, what="the request to reach the provider")
    wait_until_client_left(gateway, fake)


def test_a_content_length_padded_with_thousands_of_zeros_is_forwarded_not_a_500(fake, start_gateway):
    """HTTP allows leading zeros in Content-Length, and the server passes 5,000 of them
    on; Python's int() refuses a number that long (a 500 and an error line per request,
    before). Such a length is read as the body comes, within the body limit."""
    gateway = start_gateway(small_config(fake))
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "zeros"}]}).encode()
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=10) as client:
        client.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %s%d\r\n\r\n%s" % (b"0" * 5000, len(body), body)
        )
        response = http.client.HTTPResponse(client)
        response.begin()
        assert response.status == 200, response.read()
    assert "request failed inside the gateway" not in gateway.logs()
