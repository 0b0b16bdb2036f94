"""Black-box: breakers, fallbacks, the quick retry, key rotation and stream hold-back,
through a real gateway process against fake providers that misbehave on purpose."""

from __future__ import annotations

import json
import socket
import threading

import pytest

from conftest import call, closed_port, metric_value, provider, second_fake, wait_until
from tinygw.fake.upstream import FakeUpstream, Reply, json_reply, openai_stream_events, sse_reply, well_behaved

CHAT = "/v1/chat/completions"


def chats(fake: FakeUpstream) -> list:
    return [r for r in fake.requests if r.path.endswith("/chat/completions")]


def messages(gateway, text: str) -> list[dict]:
    return [r for r in gateway.log_records() if r.get("msg") == text]


fallback = second_fake("fallback")


def bad_gateway(request):
    return json_reply(502, {"error": {"message": "upstream down", "type": "server_error"}})


def test_five_quick_502s_open_the_circuit_and_the_sixth_gets_503(fake, start_gateway):
    fake.script = bad_gateway
    gateway = start_gateway(
        {"providers": {"qwen": provider(fake)}, "models": {"m": {"targets": ["qwen:Qwen3"]}}},
        PROVIDER_RETRY_FAST_FAILURES="false",
    )
    for _ in range(5):
        assert call("POST", f"{gateway.url}{CHAT}", {"model": "m"})[0] == 502
    status, headers, body = call("POST", f"{gateway.url}{CHAT}", {"model": "m"})
    assert status == 503
    error = json.loads(body)["error"]
    assert (error["type"], error["cause"], error["provider"], error["provider_model"]) == (
        "provider_unavailable",
        "circuit_open",
        "qwen",
        "Qwen3",
    )
    assert 25 <= int(headers["Retry-After"]) <= 30
    assert len(chats(fake)) == 5  # the sixth never reached the provider
    [opened] = messages(gateway, "provider circuit opened")
    assert (opened["provider"], opened["provider_model"], opened["failures"]) == ("qwen", "Qwen3", 5)
    assert metric_value(gateway, "tinygw_circuit_open", provider="qwen", provider_model="Qwen3") == 1
    assert (
        metric_value(gateway, "tinygw_circuit_transitions_total", provider="qwen", provider_model="Qwen3", state="open")
        == 1
    )


def test_four_failures_and_a_success_do_not_open(fake, start_gateway):
    answers = iter([502, 502, 502, 502, 200, 502, 502, 502, 502, 200])
    fake.script = lambda r: json_reply(next(answers), {"ok": True})
    gateway = start_gateway(
        {"providers": {"p": provider(fake)}, "models": {"m": {"targets": ["p:x"]}}},
        PROVIDER_RETRY_FAST_FAILURES="false",
    )
    statuses = [call("POST", f"{gateway.url}{CHAT}", {"model": "m"})[0] for _ in range(10)]
    assert statuses == [502] * 4 + [200] + [502] * 4 + [200]
    assert messages(gateway, "provider circuit opened") == []


def test_once_open_the_primary_is_skipped_and_every_request_goes_to_the_fallback(fake, fallback, start_gateway):
    fake.script = bad_gateway
    gateway = start_gateway(
        {
            "providers": {"primary": provider(fake), "backup": provider(fallback)},
            "models": {"m": {"targets": ["primary:x", "backup:y"]}},
        }
    )
    for _ in range(8):
        status, _, body = call("POST", f"{gateway.url}{CHAT}", {"model": "m"})
        assert status == 200 and json.loads(body)["model"] == "y"
    assert len(chats(fake)) == 5  # five failures opened it; after that it was skipped
    assert len(chats(fallback)) == 8
    assert (
        metric_value(gateway, "tinygw_provider_retries_total", provider="backup", provider_model="y", reason="fallback")
        == 5
    )


def test_a_quick_502_is_retried_once_and_the_caller_gets_the_answer(fake, start_gateway):
    answers = iter([502, 200])
    fake.script = lambda r: json_reply(next(answers), {"choices": [], "model": "x"})
    gateway = start_gateway({"providers": {"p": provider(fake)}, "models": {"m": {"targets": ["p:x"]}}})
    status, _, _ = call("POST", f"{gateway.url}{CHAT}", {"model": "m"})
    assert status == 200
    assert len(chats(fake)) == 2
    [retry] = messages(gateway, "retrying provider after a quick failure")
    assert (retry["provider"], retry["provider_model"], retry["failure"]) == ("p", "x", "502")
    assert (
        metric_value(
            gateway, "tinygw_provider_retries_total", provider="p", provider_model="x", reason="transient_retry"
        )
        == 1
    )


def test_a_refused_connection_is_retried_once_then_502(start_gateway):
    gateway = start_gateway(
        {
            "providers": {"p": {"base_url": f"http://127.0.0.1:{closed_port()}/v1", "api": "openai", "listing": False}},
            "models": {"m": {"targets": ["p:x"]}},
        }
    )
    status, _, body = call("POST", f"{gateway.url}{CHAT}", {"model": "m"})
    assert status == 502 and json.loads(body)["error"]["cause"] == "connect_error"
    [record] = wait_until(lambda: messages(gateway, "request"), what="the access log line")
    assert record["attempts"] == "p:connect_error,p:connect_error"


@pytest.mark.parametrize("status", [500, 400, 429])
def test_500_400_and_429_are_not_retried(fake, start_gateway, status):
    fake.script = lambda r: json_reply(status, {"error": {"message": "no", "type": "x"}})
    gateway = start_gateway(
        {"providers": {"p": provider(fake)}, "models": {"m": {"targets": ["p:x"]}}}, PROVIDER_BREAKER_FAILURES="2"
    )
    statuses = [call("POST", f"{gateway.url}{CHAT}", {"model": "m"})[0] for _ in range(3)]
    opened = messages(gateway, "provider circuit opened")
    if status == 500:  # a failure: counted (two open it), never quickly retried
        assert statuses == [500, 500, 503]
        assert len(chats(fake)) == 2 and len(opened) == 1
    else:  # the client's own mistake, or a rate limit: not counted
        assert statuses == [status] * 3
        assert len(chats(fake)) == 3 and opened == []
    assert messages(gateway, "retrying provider after a quick failure") == []


def test_400_does_not_fall_back(fake, fallback, start_gateway):
    fake.script = lambda r: json_reply(400, {"error": {"message": "bad", "type": "invalid_request_error"}})
    gateway = start_gateway(
        {"providers": {"a": provider(fake), "b": provider(fallback)}, "models": {"m": {"targets": ["a:x", "b:y"]}}}
    )
    assert call("POST", f"{gateway.url}{CHAT}", {"model": "m"})[0] == 400
    assert chats(fallback) == []


def test_canceled_clients_are_not_counted(fake, start_gateway):
    gate = threading.Event()
    fake.script = lambda r: Reply(headers=[("content-type", "application/json")], chunks=[(gate, b"{}")])
    gateway = start_gateway(
        {"providers": {"p": provider(fake)}, "models": {"m": {"targets": ["p:x"]}}}, PROVIDER_BREAKER_FAILURES="1"
    )
    try:
        for n in range(1, 4):
            with socket.create_connection(("127.0.0.1", gateway.port), timeout=5) as client:
                body = b'{"model": "m"}'
                client.sendall(
                    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
                )
                wait_until(lambda n=n: len(chats(fake)) == n, what="the request to reach the provider")
            wait_until(lambda n=n: fake.peer_closed == n, what="the gateway to close the upstream")
    finally:
        gate.set()
    fake.script = well_behaved()
    assert call("POST", f"{gateway.url}{CHAT}", {"model": "m"})[0] == 200
    assert messages(gateway, "provider circuit opened") == []


def test_a_200_carrying_an_error_is_a_failure_and_falls_back(fake, fallback, start_gateway):
    fake.script = lambda r: json_reply(200, {"error": {"message": "model overloaded", "type": "server_error"}})
    gateway = start_gateway(
        {
            "providers": {"a": provider(fake), "b": provider(fallback)},
            "models": {"m": {"targets": ["a:x", "b:y"]}, "solo": {"targets": ["a:x"]}},
        },
        PROVIDER_RETRY_FAST_FAILURES="false",
    )
    assert call("POST", f"{gateway.url}{CHAT}", {"model": "m"})[0] == 200
    status, _, body = call("POST", f"{gateway.url}{CHAT}", {"model": "solo"})
    assert status == 502 and json.loads(body)["error"]["message"] == "model overloaded"


def test_a_429_moves_to_the_next_key_which_the_first_key_rests_for(fake, start_gateway):
    def script(request):
        if request.headers["authorization"] == "Bearer key-one":
            return json_reply(429, {"error": {"message": "slow down"}}, headers=[("retry-after", "60")])
        return well_behaved()(request)

    fake.script = script
    gateway = start_gateway(
        {"providers": {"p": provider(fake, api_key_env=["K1", "K2"])}, "models": {"m": {"targets": ["p:x"]}}},
        K1="key-one",
        K2="key-two",
    )
    for _ in range(3):
        assert call("POST", f"{gateway.url}{CHAT}", {"model": "m"})[0] == 200
    used = [r.headers["authorization"] for r in chats(fake)]
    assert used == ["Bearer key-one", "Bearer key-two", "Bearer key-two", "Bearer key-two"]
    assert (
        metric_value(gateway, "tinygw_provider_retries_total", provider="p", provider_model="x", reason="key_rotation")
        == 1
    )


def test_an_error_event_before_output_falls_back(fake, fallback, start_gateway):
    events = openai_stream_events("x", ["never"])
    error = b'data: {"error": {"message": "overloaded", "type": "server_error"}}\n\n'
    fake.script = lambda r: sse_reply([events[0], error])
    gateway = start_gateway(
        {"providers": {"a": provider(fake), "b": provider(fallback)}, "models": {"m": {"targets": ["a:x", "b:y"]}}}
    )
    status, _, body = call("POST", f"{gateway.url}{CHAT}", {"model": "m", "stream": True})
    assert status == 200
    assert b"Hello" in body and b"overloaded" not in body and body.endswith(b"data: [DONE]\n\n")
    assert len(chats(fallback)) == 1


def test_an_error_after_output_ends_the_clients_stream_with_an_error_event(fake, fallback, start_gateway):
    events = openai_stream_events("x", ["partial"])
    fake.script = lambda r: sse_reply(events[:2], cut=True)
    gateway = start_gateway(
        {"providers": {"a": provider(fake), "b": provider(fallback)}, "models": {"m": {"targets": ["a:x", "b:y"]}}}
    )
    status, _, body = call("POST", f"{gateway.url}{CHAT}", {"model": "m", "stream": True})
    assert status == 200
    assert b"partial" in body and b"event: error\ndata: " in body and b"[DONE]" not in body
    assert chats(fallback) == []  # nothing is switched once output was sent
    [record] = wait_until(lambda: messages(gateway, "request"), what="the access log line")
    assert record["cut"] is True


def test_every_target_open_is_503_naming_the_soonest_probe(fake, fallback, start_gateway):
    fake.script = bad_gateway
    fallback.script = bad_gateway
    gateway = start_gateway(
        {"providers": {"a": provider(fake), "b": provider(fallback)}, "models": {"m": {"targets": ["a:x", "b:y"]}}},
        PROVIDER_BREAKER_FAILURES="1",
        PROVIDER_RETRY_FAST_FAILURES="false",
        PROVIDER_BREAKER_OPEN_SECONDS="100",
    )
    assert call("POST", f"{gateway.url}{CHAT}", {"model": "m"})[0] == 502  # a fails, b fails: both open
    status, headers, body = call("POST", f"{gateway.url}{CHAT}", {"model": "m"})
    assert status == 503 and json.loads(body)["error"]["cause"] == "circuit_open"
    assert 90 <= int(headers["Retry-After"]) <= 100
    assert len(chats(fake)) == 1 and len(chats(fallback)) == 1


def test_max_attempts_1_means_no_retry(fake, start_gateway):
    fake.script = bad_gateway
    gateway = start_gateway(
        {"providers": {"p": provider(fake)}, "models": {"m": {"targets": ["p:x"]}}, "routing": {"max_attempts": 1}}
    )
    assert call("POST", f"{gateway.url}{CHAT}", {"model": "m"})[0] == 502
    assert len(chats(fake)) == 1
    assert messages(gateway, "retrying provider after a quick failure") == []


def test_no_quick_retry_into_a_circuit_that_just_opened(fake, start_gateway):
    fake.script = bad_gateway
    gateway = start_gateway(
        {"providers": {"p": provider(fake)}, "models": {"m": {"targets": ["p:x"]}}}, PROVIDER_BREAKER_FAILURES="1"
    )
    assert call("POST", f"{gateway.url}{CHAT}", {"model": "m"})[0] == 502
    assert len(chats(fake)) == 1
    assert messages(gateway, "retrying provider after a quick failure") == []


def test_401_from_the_provider_counts_and_falls_back(fake, fallback, start_gateway):
    fake.script = lambda r: json_reply(401, {"error": {"message": "bad key", "type": "authentication_error"}})
    gateway = start_gateway(
        {"providers": {"a": provider(fake), "b": provider(fallback)}, "models": {"m": {"targets": ["a:x", "b:y"]}}},
        PROVIDER_BREAKER_FAILURES="1",
    )
    assert call("POST", f"{gateway.url}{CHAT}", {"model": "m"})[0] == 200
    assert len(messages(gateway, "provider circuit opened")) == 1


def test_a_429_http_date_rests_the_key(fake, start_gateway):
    import time
    from email.utils import formatdate

    def script(request):
        if request.headers["authorization"] == "Bearer key-one":
            later = formatdate(time.time() + 120, usegmt=True)  # wall clock: what an HTTP-date is written in
            return json_reply(429, {"error": {"message": "slow down"}}, headers=[("retry-after", later)])
        return well_behaved()(request)

    fake.script = script
    gateway = start_gateway(
        {"providers": {"p": provider(fake, api_key_env=["K1", "K2"])}, "models": {"m": {"targets": ["p:x"]}}},
        K1="key-one",
        K2="key-two",
    )
    for _ in range(3):
        assert call("POST", f"{gateway.url}{CHAT}", {"model": "m"})[0] == 200
    assert [r.headers["authorization"] for r in chats(fake)].count("Bearer key-one") == 1


def test_a_stream_that_ends_without_output_falls_back(fake, fallback, start_gateway):
    events = openai_stream_events("x", ["never"])
    fake.script = lambda r: sse_reply([events[0]])  # a role chunk, then a clean end
    gateway = start_gateway(
        {
            "providers": {"a": provider(fake), "b": provider(fallback)},
            "models": {"m": {"targets": ["a:x", "b:y"]}, "solo": {"targets": ["a:x"]}},
        },
        PROVIDER_RETRY_FAST_FAILURES="false",
    )
    status, _, body = call("POST", f"{gateway.url}{CHAT}", {"model": "m", "stream": True})
    assert status == 200 and b"Hello" in body
    assert len(chats(fallback)) == 1
    assert call("POST", f"{gateway.url}{CHAT}", {"model": "solo", "stream": True})[0] == 502


def test_an_error_event_before_output_on_the_last_attempt_is_502(fake, start_gateway):
    error = b'data: {"error": {"message": "overloaded", "type": "server_error"}}\n\n'
    fake.script = lambda r: sse_reply([error])
    gateway = start_gateway({"providers": {"a": provider(fake)}, "models": {"m": {"targets": ["a:x"]}}})
    status, _, body = call("POST", f"{gateway.url}{CHAT}", {"model": "m", "stream": True})
    assert status == 502 and b"overloaded" in body


def test_a_stream_without_a_finish_ends_with_an_error_event_and_counts(fake, start_gateway):
    events = openai_stream_events("x", ["partial"])
    fake.script = lambda r: sse_reply(events[:2])  # output, then a clean end without a finish
    gateway = start_gateway(
        {"providers": {"a": provider(fake)}, "models": {"m": {"targets": ["a:x"]}}}, PROVIDER_BREAKER_FAILURES="1"
    )
    status, _, body = call("POST", f"{gateway.url}{CHAT}", {"model": "m", "stream": True})
    assert status == 200 and b"partial" in body and body.rstrip().endswith(b"}")
    assert b"event: error\ndata: " in body
    assert call("POST", f"{gateway.url}{CHAT}", {"model": "m", "stream": True})[0] == 503
    assert messages(gateway, "stream cut")


def test_a_stream_whose_head_never_comes_falls_back_after_head_timeout_s_not_first_byte(fake, fallback, start_gateway):
    """A provider that takes the connection and never answers: a streamed answer's head
    comes at once from every real provider, so the wait for it is `head_timeout_s`, not
    `first_byte_timeout_s` (120 s): the next target answers, and no quick retry is made."""
    fake.script = lambda r: Reply(action="hang")
    gateway = start_gateway(
        {
            "providers": {"hung": provider(fake, head_timeout_s=0.5), "fb": provider(fallback)},
            "models": {"m": {"targets": ["hung:x", "fb:y"]}, "alone": {"targets": ["hung:x"]}},
            "routing": {"debug": True},
        }
    )
    status, headers, body = call("POST", f"{gateway.url}{CHAT}", {"model": "m", "stream": True})
    assert (status, headers["x-tinygw-attempts"]) == (200, "hung:timeout,fb:200"), body
    status, headers, body = call("POST", f"{gateway.url}{CHAT}", {"model": "alone", "stream": True})
    assert (status, headers["x-tinygw-attempts"]) == (504, "hung:timeout"), body  # a timeout is not retried
    assert len(chats(fake)) == 2


def test_a_model_s_head_timeout_s_is_over_its_provider_s(fake, start_gateway):
    fake.script = lambda r: Reply(action="hang")
    gateway = start_gateway(
        {
            "providers": {"hung": provider(fake)},  # the default, 30 s
            "models": {"m": {"targets": ["hung:x"], "head_timeout_s": 0.5}},
        }
    )
    status, _, body = call("POST", f"{gateway.url}{CHAT}", {"model": "m", "stream": True})
    assert (status, json.loads(body)["error"]["cause"]) == (504, "timeout")


TOO_LONG = {
    "error": {
        "message": "This model's maximum context length is 8192 tokens.",
        "type": "invalid_request_error",
        "code": "context_length_exceeded",
    }
}


def test_a_prompt_too_long_for_the_first_target_goes_on_to_the_context_fallback(fake, fallback, start_gateway):
    fake.script = lambda r: json_reply(400, TOO_LONG)
    gateway = start_gateway(
        {
            "providers": {"short": provider(fake), "long": provider(fallback)},
            "models": {
                "m": {"targets": ["short:small"], "context_fallback": ["big"]},
                "big": {"targets": ["long:large"]},
                "plain": {"targets": ["short:small"]},
            },
            "routing": {"debug": True},
        }
    )
    for _ in range(6):  # more than PROVIDER_BREAKER_FAILURES: a prompt too long is no verdict on the provider
        status, headers, body = call("POST", f"{gateway.url}{CHAT}", {"model": "m"})
        assert (status, headers["x-tinygw-attempts"]) == (200, "short:400,long:200"), body
        assert json.loads(fallback.requests[-1].body)["model"] == "large"
    status, headers, body = call("POST", f"{gateway.url}{CHAT}", {"model": "plain"})  # none configured: as before
    assert (status, headers["x-tinygw-attempts"], json.loads(body)) == (400, "short:400", TOO_LONG)
    assert metric_value(gateway, "tinygw_circuit_transitions_total") is None
    status_json = json.loads(call("GET", f"{gateway.url}/status.json")[2])
    assert all(c["consecutive_failures"] == 0 for p in status_json["providers"] for c in p["circuits"])


def test_an_anthropic_prompt_too_long_goes_on_to_a_context_fallback_target(fake, fallback, start_gateway):
    too_long = {"type": "error", "error": {"type": "invalid_request_error", "message": "prompt is too long: 9 > 8"}}
    fake.script = lambda r: json_reply(400, too_long)
    an = {"api": "anthropic", "listing": False}
    gateway = start_gateway(
        {
            "providers": {"short": {**an, "base_url": fake.url}, "long": {**an, "base_url": fallback.url}},
            "models": {"claude": {"targets": ["short:sonnet"], "context_fallback": ["long:sonnet-1m"]}},
            "routing": {"debug": True},
        }
    )
    body = {"model": "claude", "max_tokens": 8, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    status, headers, answer = call("POST", f"{gateway.url}/v1/messages", body)
    assert (status, headers["x-tinygw-attempts"]) == (200, "short:400,long:200"), answer
    assert json.loads(fallback.requests[-1].body)["model"] == "sonnet-1m"
