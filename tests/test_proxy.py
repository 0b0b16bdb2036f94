"""Black-box: a real tinygw process, the official SDKs and fake upstreams on loopback."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import pytest

from conftest import (
    Gateway,
    call,
    closed_port,
    metric_value,
    module_fake,
    sdk_clients,
    wait_until,
    wait_until_client_left,
)
from tinygw.fake.upstream import Reply, json_reply, openai_stream_events, sse_reply

GATEWAY_KEY = "gw-key-7f3a"
PROVIDER_KEY = "prov-key-91c2"
ANTHROPIC_KEY = "anth-key-55d0"


fake, fresh_fake = module_fake()


@pytest.fixture(scope="module")
def gateway(fake, tmp_path_factory):
    config = {
        "providers": {
            "oa": {
                "base_url": f"{fake.url}/v1",
                "api": "openai",
                "api_key_env": "OA_KEY",
                "headers": {"x-team": "blue"},
            },
            "an": {"base_url": fake.url, "api": "anthropic", "api_key_env": "AN_KEY"},
            "dead": {"base_url": f"http://127.0.0.1:{closed_port()}/v1", "api": "openai"},
            "slow": {"base_url": f"{fake.url}/v1", "api": "openai", "head_timeout_s": 0.5, "first_byte_timeout_s": 0.5},
        },
        "models": {
            "gpt-x": {"targets": ["oa:upstream-gpt"]},
            "claude-x": {"targets": ["an:claude-upstream"]},
            "dead-model": {"targets": ["dead:m"]},
            "slow-model": {"targets": ["slow:m"]},
        },
    }
    log = tmp_path_factory.mktemp("gw") / "gateway.log"
    gw = Gateway(
        config,
        {
            "OA_KEY": PROVIDER_KEY,
            "AN_KEY": ANTHROPIC_KEY,
            "TINYGW_API_KEYS": f"other,{GATEWAY_KEY}",
            "TINYGW_MAX_BODY_BYTES": "4096",
            "PROVIDER_LISTING_SECONDS": "0",
        },  # the tests count the fake's requests
        log,
    )
    yield gw
    gw.stop()


def auth(extra: dict | None = None) -> dict:
    return {"Authorization": f"Bearer {GATEWAY_KEY}", **(extra or {})}


openai_client, anthropic_client = sdk_clients(GATEWAY_KEY)


# ---- the SDKs -----------------------------------------------------------------------


def test_openai_sdk_chat(gateway, fake):
    answer = openai_client(gateway).chat.completions.create(model="gpt-x", messages=[{"role": "user", "content": "hi"}])
    assert answer.choices[0].message.content == "Hello from fake."
    assert answer.model == "upstream-gpt"
    [request] = fake.requests
    assert request.path == "/v1/chat/completions"
    assert request.json()["model"] == "upstream-gpt"
    assert request.json()["messages"] == [{"role": "user", "content": "hi"}]
    assert request.headers["authorization"] == f"Bearer {PROVIDER_KEY}"
    assert request.headers["x-team"] == "blue"


def test_openai_sdk_stream(gateway, fake):
    stream = openai_client(gateway).chat.completions.create(
        model="gpt-x", messages=[{"role": "user", "content": "hi"}], stream=True
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream)
    assert text == "Hello from fake."


def test_openai_sdk_stream_with_usage_is_relayed_and_counted(gateway, fake):
    before = metric_value(gateway, "tinygw_tokens_total", model="gpt-x", kind="completion") or 0
    chunks = list(
        openai_client(gateway).chat.completions.create(
            model="gpt-x",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello from fake."
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert all(c.usage is None for c in chunks[:-1])
    assert metric_value(gateway, "tinygw_tokens_total", model="gpt-x", kind="completion") == before + 4


def test_openai_sdk_completions_and_embeddings(gateway, fake):
    client = openai_client(gateway)
    assert client.completions.create(model="gpt-x", prompt="hi").choices[0].text == "Hello from fake."
    assert client.embeddings.create(model="gpt-x", input="hi").data[0].embedding == [0.5, 0.25, -0.125]
    assert [r.path for r in fake.requests] == ["/v1/completions", "/v1/embeddings"]


def test_anthropic_sdk_messages(gateway, fake):
    message = anthropic_client(gateway).messages.create(
        model="claude-x", max_tokens=16, messages=[{"role": "user", "content": "hi"}]
    )
    assert message.content[0].text == "Hello from fake."
    [request] = fake.requests
    assert request.path == "/v1/messages"
    assert request.json()["model"] == "claude-upstream"
    assert request.headers["x-api-key"] == ANTHROPIC_KEY
    assert "authorization" not in request.headers
    assert request.headers.get("anthropic-version")  # the client's own headers go on


def test_anthropic_sdk_stream(gateway, fake):
    with anthropic_client(gateway).messages.stream(
        model="claude-x", max_tokens=16, messages=[{"role": "user", "content": "hi"}]
    ) as stream:
        text = "".join(stream.text_stream)
    assert text == "Hello from fake."


def test_provider_qualified_model(gateway, fake):
    answer = openai_client(gateway).chat.completions.create(
        model="oa/some/model-7b", messages=[{"role": "user", "content": "hi"}]
    )
    assert answer.choices[0].message.content == "Hello from fake."
    assert fake.requests[0].json()["model"] == "some/model-7b"


def test_first_chunk_arrives_before_the_upstream_finishes(gateway, fake):
    gate = threading.Event()
    events = openai_stream_events("m", ["one", " two"])
    fake.script = lambda request: Reply(
        headers=[("content-type", "text/event-stream")],
        chunks=[(0, events[0]), (0, events[1]), (gate, events[2]), *[(0, e) for e in events[3:]]],
    )
    try:
        stream = openai_client(gateway).chat.completions.create(
            model="gpt-x", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        chunks = iter(stream)
        next(chunks)  # the role chunk
        assert next(chunks).choices[0].delta.content == "one"  # the upstream is held at the gate
        gate.set()
        rest = "".join(c.choices[0].delta.content or "" for c in chunks)
        assert rest == " two"
    finally:
        gate.set()


# ---- what is forwarded -----------------------------------------------------------------


def test_client_credentials_and_hop_by_hop_headers_are_not_forwarded(gateway, fake):
    # http.client, because urllib replaces the Connection header with its own.
    connection = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=10)
    connection.request(
        "POST",
        "/v1/chat/completions?trace=1",
        body=json.dumps({"model": "gpt-x", "messages": []}),
        headers={
            "x-api-key": GATEWAY_KEY,
            "Proxy-Authorization": "Basic abc",
            "Connection": "x-drop-me",
            "x-drop-me": "1",
            "x-keep-me": "2",
            "Content-Type": "application/json",
        },
    )
    assert connection.getresponse().status == 200
    connection.close()
    [request] = fake.requests
    assert request.path == "/v1/chat/completions?trace=1"
    assert request.headers["authorization"] == f"Bearer {PROVIDER_KEY}"
    assert "x-api-key" not in request.headers
    assert "proxy-authorization" not in request.headers
    assert "x-drop-me" not in request.headers
    assert request.headers["x-keep-me"] == "2"
    assert GATEWAY_KEY not in json.dumps(request.headers)


def test_body_is_forwarded_unchanged_but_for_the_model(gateway, fake):
    raw = b'{"messages": [{"role": "user", "content": "caf\\u00e9 \\"model\\": 1"}],  "model" : "gpt-x", "n": 1.50}'
    status, _, _ = call("POST", f"{gateway.url}/v1/chat/completions", raw, headers=auth())
    assert status == 200
    assert fake.requests[0].body == raw.replace(b'"gpt-x"', b'"upstream-gpt"')


def test_a_second_model_key_spelled_with_escapes_never_reaches_the_provider(gateway, fake):
    """`"mod\\u0065l"` is also the key `model`: a body with it and `"model"` names two models,
    of which the gateway reads the last (the alias it routes). The provider must get one
    `model`, the alias's upstream model, whichever duplicate its JSON parser would keep."""
    for raw in (
        b'{"mod\\u0065l": "gpt-other", "model": "gpt-x", "n": 1}',
        b'{"m\\u006fdel": "gpt-other", "messages": [], "model": "gpt-x"}',
    ):
        fake.requests.clear()
        status, _, _ = call("POST", f"{gateway.url}/v1/chat/completions", raw, headers=auth())
        assert status == 200
        sent = fake.requests[0].body
        models = json.loads(sent, object_pairs_hook=lambda pairs: [v for k, v in pairs if k == "model"])
        assert models == ["upstream-gpt"], sent


def test_provider_error_is_passed_through(gateway, fake):
    fake.script = lambda r: json_reply(
        400,
        {"error": {"message": "bad temperature", "type": "invalid_request_error"}},
        headers=[("x-request-id", "abc")],
    )
    status, headers, body = call("POST", f"{gateway.url}/v1/chat/completions", {"model": "gpt-x"}, headers=auth())
    assert status == 400
    assert json.loads(body)["error"]["message"] == "bad temperature"
    assert headers.get("x-upstream-request-id") == "abc"


# ---- the gateway's own errors ------------------------------------------------------------


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"x-api-key": "wrong"}, {"Authorization": f"Basic {GATEWAY_KEY}"}],
)
def test_missing_or_wrong_gateway_key_is_401(gateway, fake, headers):
    status, _, body = call("POST", f"{gateway.url}/v1/chat/completions", {"model": "gpt-x"}, headers=headers)
    assert status == 401
    assert json.loads(body)["error"]["type"] == "authentication_error"
    assert fake.requests == []


@pytest.mark.parametrize("body", [b"not json", b"[1,2]", b'{"messages": []}', b'{"model": 7}', b'{"model": ""}'])
def test_bad_body_is_400(gateway, fake, body):
    status, _, answer = call("POST", f"{gateway.url}/v1/chat/completions", body, headers=auth())
    assert status == 400
    assert json.loads(answer)["error"]["type"] == "invalid_request_error"
    assert fake.requests == []


def test_json_that_cannot_be_re_encoded_is_400_not_500(gateway, fake):
    body = b'{"tools": [{"model": "x"}], "model": "gpt-x", "t": 1e400}'
    status, _, answer = call("POST", f"{gateway.url}/v1/chat/completions", body, headers=auth())
    assert status == 400
    assert json.loads(answer)["error"]["type"] == "invalid_request_error"


def test_provider_qualified_models_share_one_metric_series(gateway, fake):
    for name in ("oa/free-form-1", "oa/free-form-2"):
        assert call("POST", f"{gateway.url}/v1/chat/completions", {"model": name}, headers=auth())[0] == 200
    metrics = call("GET", f"{gateway.url}/metrics")[2].decode()
    assert 'model="oa/*",status="200"} ' in metrics
    requests = [line for line in metrics.splitlines() if line.startswith("tinygw_requests_total")]
    assert not any("free-form" in line for line in requests)  # circuits are per model, capped per provider


def test_body_over_the_limit_is_413(gateway, fake):
    big = {"model": "gpt-x", "messages": [{"role": "user", "content": "x" * 5000}]}
    status, _, answer = call("POST", f"{gateway.url}/v1/chat/completions", big, headers=auth())
    assert status == 413
    assert json.loads(answer)["error"]["type"] == "invalid_request_error"
    assert fake.requests == []


def test_body_over_the_limit_without_content_length_is_413(gateway, fake):
    def chunks():
        yield b'{"model": "gpt-x", "pad": "'
        for _ in range(10):
            yield b"x" * 1000
        yield b'"}'

    connection = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=10)
    connection.request(
        "POST",
        "/v1/chat/completions",
        body=chunks(),
        encode_chunked=True,
        headers=auth({"Transfer-Encoding": "chunked", "Content-Type": "application/json"}),
    )
    response = connection.getresponse()
    assert response.status == 413
    assert json.loads(response.read())["error"]["type"] == "invalid_request_error"
    connection.close()
    assert fake.requests == []


@pytest.mark.parametrize(
    "model,path",
    [
        ("nope", "/v1/chat/completions"),
        ("claude-x", "/v1/chat/completions"),
        ("gpt-x", "/v1/messages"),
        ("zz/model", "/v1/chat/completions"),
    ],
)
def test_unknown_model_is_404(gateway, fake, model, path):
    status, _, body = call("POST", f"{gateway.url}{path}", {"model": model}, headers=auth())
    assert status == 404
    error = json.loads(body)["error"]
    # On an Anthropic route the error has Anthropic's shape and type name (docs/api.md).
    expected = "not_found_error" if path.startswith("/v1/messages") else "invalid_request_error"
    assert (error["type"], error["code"]) == (expected, "model_not_found")


def test_refused_connection_is_502_connect_error(gateway):
    status, _, body = call("POST", f"{gateway.url}/v1/chat/completions", {"model": "dead-model"}, headers=auth())
    assert status == 502
    error = json.loads(body)["error"]
    assert (error["type"], error["cause"], error["provider"], error["provider_model"]) == (
        "provider_unavailable",
        "connect_error",
        "dead",
        "m",
    )
    assert b"127.0.0.1" not in body  # no upstream address reaches clients


def test_no_head_of_a_stream_in_time_is_504_timeout(gateway, fake):
    fake.script = lambda r: Reply(action="hang")
    started = time.monotonic()
    status, _, body = call(
        "POST", f"{gateway.url}/v1/chat/completions", {"model": "slow-model", "stream": True}, headers=auth()
    )
    assert status == 504
    error = json.loads(body)["error"]
    assert (error["type"], error["cause"]) == ("provider_unavailable", "timeout")
    assert time.monotonic() - started < 5  # the 0.5 s bound, not the client's 10 s
    wait_until(lambda: fake.peer_closed >= 1, what="the gateway to close the hung connection")


def test_stream_cut_by_the_upstream_ends_with_an_error_event(gateway, fake):
    events = openai_stream_events("m", ["one", " two"])
    fake.script = lambda r: sse_reply(events[:3], cut=True)
    status, headers, body = call(
        "POST", f"{gateway.url}/v1/chat/completions", {"model": "gpt-x", "stream": True}, headers=auth()
    )
    assert status == 200
    assert body.startswith(events[0] + events[1] + events[2])
    assert b"event: error\ndata: " in body
    assert b"[DONE]" not in body


def chat_request(body: bytes) -> bytes:
    """A whole chat request as its bytes, for a client on a raw socket."""
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
        + GATEWAY_KEY.encode()
        + b"\r\nContent-Type: application/json\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )


def test_client_leaving_mid_stream_closes_the_upstream(gateway, fake):
    gate = threading.Event()
    events = openai_stream_events("m", ["one", " two"])
    fake.script = lambda r: Reply(
        headers=[("content-type", "text/event-stream")], chunks=[(0, events[0]), (0, events[1]), (gate, events[2])]
    )
    try:
        with socket.create_connection(("127.0.0.1", gateway.port), timeout=5) as client:
            body = json.dumps({"model": "gpt-x", "stream": True}).encode()
            client.sendall(chat_request(body))
            received = b""
            while b'"one"' not in received:
                received += client.recv(65536)
        wait_until(lambda: fake.peer_closed >= 1, seconds=3, what="the upstream connection to be closed")
    finally:
        gate.set()


def test_client_leaving_a_quick_request_still_closes_the_upstream(gateway, fake):
    """A request watches for its client leaving only from 50 ms in (tinygw.api.app): a
    client that sends its request and leaves at once is still noticed, its hung
    attempt ended (499, not the provider's timeout) and the provider's connection closed."""
    fake.script = lambda r: Reply(action="hang")
    body = json.dumps({"model": "gpt-x", "messages": [{"role": "user", "content": "leave-at-once"}]}).encode()
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=5) as client:
        client.sendall(chat_request(body))
        wait_until(lambda: len(fake.requests) >= 1, seconds=3, what="the request to reach the provider")
    wait_until_client_left(gateway, fake)


# ---- other routes ----------------------------------------------------------------------------


def test_healthz_models_and_metrics(gateway, fake):
    assert call("GET", f"{gateway.url}/healthz")[2] == b'{"status":"ok"}'
    status, _, body = call("GET", f"{gateway.url}/v1/models", headers=auth())
    assert status == 200
    ids = {m["id"] for m in json.loads(body)["data"]}
    assert {"gpt-x", "claude-x"} <= ids
    assert call("GET", f"{gateway.url}/v1/models")[0] == 401
    call("POST", f"{gateway.url}/v1/chat/completions", {"model": "gpt-x"}, headers=auth())
    metrics = call("GET", f"{gateway.url}/metrics")[2].decode()
    assert 'tinygw_requests_total{route="/v1/chat/completions",model="gpt-x",status="200"}' in metrics


def test_wrong_method_and_unknown_path(gateway):
    assert call("GET", f"{gateway.url}/v1/chat/completions", headers=auth())[0] == 405
    status, _, body = call("GET", f"{gateway.url}/nope")
    assert status == 404 and json.loads(body)["error"]["type"] == "invalid_request_error"


def test_a_wrong_method_is_told_the_methods_its_route_takes(gateway):
    """A 405 says which methods the route takes (RFC 9110: a 405 MUST carry `Allow`), before
    the key is asked for, on an API's route and on a page's, in each API's error shape."""
    for method, path, allowed in (
        ("GET", "/v1/chat/completions", "POST"),
        ("GET", "/v1/messages", "POST"),
        ("POST", "/metrics", "GET, HEAD"),
        ("DELETE", "/v1/models", "GET, HEAD"),
    ):
        status, headers, body = call(method, f"{gateway.url}{path}", b"" if method == "POST" else None)
        assert status == 405, path
        assert headers["allow"] == allowed, path
        assert json.loads(body)["error"]["type"] == "invalid_request_error", path


def test_no_key_in_logs(gateway):
    logs = gateway.logs()
    for secret in (GATEWAY_KEY, PROVIDER_KEY, ANTHROPIC_KEY):
        assert secret not in logs
    assert any(r.get("msg") == "request" for r in gateway.log_records())


def test_without_configured_clients_no_client_is_counted(gateway):
    """A gateway whose configuration names no client pays for none: no client series, no clients table."""
    call("POST", f"{gateway.url}/v1/chat/completions", {"model": "gpt-x"}, headers=auth())
    assert metric_value(gateway, "tinygw_client_requests_total") is None
    assert json.loads(call("GET", f"{gateway.url}/status.json")[2])["clients"] == []
