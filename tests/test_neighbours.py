"""Black-box: no client can hurt another (docs/design.md section 16). A hostile client with a
valid gateway key tries what a careless or hostile tenant would (raw bytes in the query, the
operator's account headers, redirects and non-JSON answers it provokes, slow generations)
beside a well-behaved one: nothing it does opens a circuit or picks the operator's settings."""

from __future__ import annotations

import json
import socket
import time

import pytest

from conftest import Gateway, call, metric_value, module_fake, second_fake, wait_until
from tinygw import errors
from tinygw.fake.upstream import Reply, json_reply, openai_stream_events, well_behaved
from tinygw.upstream.connection import encode_request

KEY = "gw-key-neighbours"
CHAT = "/v1/chat/completions"
FAILURES = 3  # PROVIDER_BREAKER_FAILURES here: a few requests would open a circuit

fake, fresh_fake = module_fake()
backup = second_fake("backup", scope="module")


@pytest.fixture(scope="module")
def gateway(fake, backup, tmp_path_factory):
    base = {"base_url": f"{fake.url}/v1", "api": "openai", "listing": False}
    config = {
        "providers": {
            "p": {**base, "api_key_env": "P_KEY"},
            "acct": {**base, "client_account_headers": True},
            "op": {
                **base,
                "client_account_headers": True,
                "headers": {"OpenAI-Project": "proj_operator"},
                "query": {"api-version": "2024-06-01"},
            },
            "quick": {**base, "first_byte_timeout_s": 0.3},
            # one provider per test that provokes failures, so that each test's circuits are its own
            "redir": base,
            "names": base,
            "html": base,
            "b": {"base_url": f"{backup.url}/v1", "api": "openai", "listing": False},
        },
        "models": {
            "m": {"targets": ["p:m"]},
            "acct-m": {"targets": ["acct:m"]},
            "op-m": {"targets": ["op:m"]},
            "with-backup": {"targets": ["p:m", "b:m"]},
            "redir-m": {"targets": ["redir:m"]},
            "redir-backup": {"targets": ["redir:m", "b:m"]},
            "html-m": {"targets": ["html:m"]},
            "html-backup": {"targets": ["html:m", "b:m"]},
            "long-generation": {"targets": ["quick:m"]},
            "bounded": {"targets": ["p:m"], "timeout_s": 0.3},
            "stalling": {"targets": ["p:m"], "stall_timeout_s": 0.3},
        },
    }
    env = {
        "TINYGW_API_KEYS": KEY,
        "P_KEY": "provider-key-p",
        "PROVIDER_BREAKER_FAILURES": str(FAILURES),
        "TINYGW_CLIENT_TIMEOUT_SECONDS": "1",
    }
    gw = Gateway(config, env, tmp_path_factory.mktemp("gw") / "gateway.log")
    yield gw
    gw.stop()


def auth(**extra: str) -> dict:
    return {"Authorization": f"Bearer {KEY}", **extra}


def chat(gateway: Gateway, model: str, headers: dict | None = None, query: str = "", **extra):
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}
    return call("POST", f"{gateway.url}{CHAT}{query}", body, headers=auth(**(headers or {})))


def open_circuits(gateway: Gateway, provider: str) -> float:
    return metric_value(gateway, "tinygw_circuit_open", provider=provider) or 0.0


def failures_counted(gateway: Gateway) -> list[dict]:
    status = json.loads(call("GET", f"{gateway.url}/status.json")[2])
    return [
        circuit
        for p in status["providers"]
        for circuit in p["circuits"]
        if circuit["consecutive_failures"] or circuit["state"] != "Circuit Closed"
    ]


def raw_request(gateway: Gateway, target: bytes, body: bytes) -> bytes:
    """One request on a raw socket, its target as given (http.client refuses raw bytes)."""
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=10) as s:
        s.sendall(
            b"POST %s HTTP/1.1\r\nhost: x\r\nauthorization: Bearer %s\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (target, KEY.encode(), len(body), body)
        )
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    return answer


# ---- what the client sends is the client's ---------------------------------------------


def test_raw_bytes_in_the_query_are_percent_encoded_and_never_a_provider_failure(gateway, fake):
    body = json.dumps({"model": "with-backup", "messages": []}).encode()
    for _ in range(2 * FAILURES):
        answer = raw_request(gateway, f"{CHAT}?a=é&b=日".encode(), body)
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    assert {r.path for r in fake.requests} == {"/v1/chat/completions?a=%C3%A9&b=%E6%97%A5"}
    assert open_circuits(gateway, "p") + open_circuits(gateway, "b") == 0 and failures_counted(gateway) == []
    assert chat(gateway, "m")[0] == 200


def test_a_head_that_cannot_be_encoded_is_the_clients_error_before_any_connection():
    with pytest.raises(errors.UnsendableRequest) as raised:
        encode_request(b"POST", b"/v1/x", [(b"host", b"h"), (b"content-length", b"0"), (b"x-a", b"a\x0bb")], b"")
    assert "headers" in str(raised.value) and "provider" not in str(raised.value)
    with pytest.raises(errors.UnsendableRequest, match="query string"):
        encode_request(b"POST", b"/v1/x?a=\xff", [(b"host", b"h"), (b"content-length", b"0")], b"")


def _mismatched_organization(request) -> Reply:
    """OpenAI's answer to a key that is not of the organization or project asked for."""
    if "openai-organization" in request.headers or "openai-project" in request.headers:
        return json_reply(401, {"error": {"message": "mismatched", "code": "mismatched_organization"}})
    return well_behaved("fake")(request)


def test_the_clients_account_headers_are_dropped_and_cannot_open_a_circuit(gateway, fake):
    fake.script = _mismatched_organization
    for _ in range(2 * FAILURES):
        status, _, _ = chat(gateway, "m", {"OpenAI-Organization": "org-evil", "OpenAI-Project": "proj-evil"})
        assert status == 200
    assert not any(name.startswith("openai-") for r in fake.requests for name, _ in r.header_lines)
    assert open_circuits(gateway, "p") == 0


def test_account_headers_a_provider_lets_through_are_the_clients_answer_not_a_failure(gateway, fake):
    fake.script = _mismatched_organization
    for _ in range(2 * FAILURES):
        status, _, body = chat(gateway, "acct-m", {"OpenAI-Organization": "org-evil"})
        assert status == 401 and json.loads(body)["error"]["code"] == "mismatched_organization"
    assert [r.headers["openai-organization"] for r in fake.requests] == ["org-evil"] * 2 * FAILURES
    assert open_circuits(gateway, "acct") == 0 and failures_counted(gateway) == []
    assert chat(gateway, "acct-m")[0] == 200  # the well-behaved neighbour


def test_client_headers_and_query_never_override_the_operators(gateway, fake):
    headers = {"OpenAI-Project": "proj_evil", "openai-PROJECT": "proj_evil2", "x-team": "mine"}
    status, _, _ = chat(gateway, "op-m", headers, query="?API-VERSION=evil&Api-Version=evil2&x=1")
    assert status == 200
    (request,) = fake.requests
    assert [v for k, v in request.header_lines if k == "openai-project"] == ["proj_operator"]
    assert request.headers["x-team"] == "mine"  # the client's own headers go on
    assert request.path == "/v1/chat/completions?api-version=2024-06-01&x=1"


# ---- what the provider answers is judged as the provider's --------------------------------


def test_a_redirect_is_a_failure_that_falls_back_and_never_reaches_the_client(gateway, fake, backup):
    fake.script = lambda r: Reply(status=302, headers=[("location", "https://elsewhere.example/")], body=b"moved")
    status, headers, body = chat(gateway, "redir-backup")
    assert status == 200 and len(backup.requests) == 1
    for _ in range(FAILURES - 1):
        status, headers, body = chat(gateway, "redir-m")
        assert status == 502 and headers.get("location") is None
        error = json.loads(body)["error"]
        assert (error["cause"], error["provider"]) == ("bad_response", "redir") and "redirect" in error["message"]
        assert b"moved" not in body
    assert open_circuits(gateway, "redir") == 1  # a wrong base_url is the provider's failure: its circuit opened
    assert metric_value(gateway, "tinygw_upstream_attempts_total", provider="redir", outcome="302") == FAILURES


def test_a_200_whose_body_is_not_json_is_a_failure(gateway, fake, backup):
    fake.script = lambda r: Reply(headers=[("content-type", "text/html")], body=b"<html>login</html>")
    backup_requests = len(backup.requests)
    status, _, body = chat(gateway, "html-backup")
    assert status == 200 and len(backup.requests) == backup_requests + 1
    fake.script = lambda r: Reply(headers=[("content-type", "application/json")], body=b"{not json")
    status, _, body = chat(gateway, "html-m")
    error = json.loads(body)["error"]
    assert (status, error["cause"]) == (502, "bad_response") and "not JSON" in error["message"]
    assert b"{not json" not in body and len(backup.requests) == backup_requests + 1


# ---- timeouts belong to the model ---------------------------------------------------------


def test_a_long_non_streamed_generation_is_bounded_by_timeout_s_not_first_byte(gateway, fake):
    """Providers send a non-streamed answer's head when generation ends: past the provider's
    first_byte_timeout_s (0.3 s), it is an answer, not a failure."""
    answer = well_behaved("fake")
    fake.script = lambda r: Reply(**{**_fields(answer(r)), "delay_seconds": 0.8})
    for _ in range(FAILURES):
        assert chat(gateway, "long-generation")[0] == 200
    assert open_circuits(gateway, "quick") == 0


def test_a_models_own_timeout_s_bounds_its_requests(gateway, fake):
    fake.script = lambda r: Reply(action="hang")
    started = time.monotonic()
    status, _, body = chat(gateway, "bounded")
    assert status == 504 and json.loads(body)["error"]["cause"] == "timeout"
    assert time.monotonic() - started < 5  # the model's 0.3 s, not the provider's 600 s


def test_a_stream_that_stalls_past_stall_timeout_s_ends_with_an_error_event(gateway, fake):
    events = openai_stream_events("m", ["one", " two"])
    fake.script = lambda r: Reply(
        headers=[("content-type", "text/event-stream")], chunks=[(0, events[0] + events[1]), (3, events[2])]
    )
    started = time.monotonic()
    status, _, body = chat(gateway, "stalling", stream=True)
    assert status == 200 and body.startswith(events[0] + events[1])
    assert b"event: error" in body and b"timeout" in body
    assert time.monotonic() - started < 2.5  # cut at the 0.3 s stall, not at the provider's 3 s pause
    assert metric_value(gateway, "tinygw_upstream_attempts_total", provider="p", outcome="200+timeout") == 1


# ---- a client's model names -------------------------------------------------------------


def test_junk_model_names_never_share_a_circuit_with_a_good_one(gateway, fake):
    """300 provider-qualified junk names, each a failure, fill the provider's table of
    circuits (256) and more; a good name a neighbour sends afterwards has a circuit of its
    own, and one that served before keeps its own."""

    def junk_fails(request):
        if request.json()["model"].startswith("junk-"):
            return json_reply(500, {"error": {"message": "no such model"}})
        return well_behaved("fake")(request)

    fake.script = junk_fails
    assert chat(gateway, "names/good")[0] == 200
    for n in range(300):
        assert chat(gateway, f"names/junk-{n}")[0] == 500
    assert chat(gateway, "names/good-new")[0] == 200  # a name never seen before: a fresh circuit
    assert chat(gateway, "names/good")[0] == 200
    assert open_circuits(gateway, "names") == 0  # no junk name failed often enough to open its own


# ---- a client that does not take its answer ------------------------------------------------


def test_a_client_that_does_not_read_its_stream_is_cut_and_its_connection_freed(gateway, fake):
    """The stream (8 MiB) outgrows what the server and the sockets buffer; the client takes
    none of it: after the client timeout (1 s here) its request ends (499, `client stalled`),
    the upstream connection is closed at once, and the provider is not blamed."""
    events = openai_stream_events("m", ["x" * 65536] * 128)
    fake.script = lambda r: Reply(headers=[("content-type", "text/event-stream")], chunks=[(0, e) for e in events])
    body = json.dumps({"model": "m", "stream": True, "messages": []}).encode()
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=10) as stalled:
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stalled.sendall(
            b"POST %s HTTP/1.1\r\nhost: x\r\nauthorization: Bearer %s\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (CHAT.encode(), KEY.encode(), len(body), body)
        )
        wait_until(lambda: fake.requests, what="the stream to start")
        (request,) = fake.requests
        wait_until(lambda: request.connection in fake.ended, seconds=10, what="the stalled stream's upstream closed")
        wait_until(lambda: '"client stalled"' in gateway.logs() and '"status":499' in gateway.logs(), what="its lines")
        records = gateway.log_records()
        (line,) = [r for r in records if r.get("msg") == "client stalled"]
        assert line["model"] == "m" and line["timeout_seconds"] == 1
        (access,) = [r for r in records if r.get("msg") == "request" and r.get("request_id") == line["request_id"]]
        assert access["status"] == 499
    fake.script = well_behaved("fake")
    assert chat(gateway, "m")[0] == 200  # the neighbour
    assert open_circuits(gateway, "p") == 0
    assert metric_value(gateway, "tinygw_upstream_attempts_total", provider="p", outcome="client_closed") == 1


def _fields(reply: Reply) -> dict:
    return {f: getattr(reply, f) for f in reply.__struct_fields__}
