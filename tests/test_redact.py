"""A provider's answer never shows the client the operator's secrets (docs/design.md section
15): the Redactor alone, and black-box, a gateway before a provider that echoes what it was
sent (a self-hosted server's error, a debugging proxy) beside one that does not."""

from __future__ import annotations

import json

import pytest

from conftest import call, metric_value, provider, second_fake, wait_until
from tinygw.fake.upstream import Reply, json_reply, sse_reply
from tinygw.trust.redact import REDACTED, Redactor

KEY = "sk-provider-key-5c1d"
TOKEN = "team-token-77a0"
QUERY_SECRET = "q/secret+value=9"  # percent-encoded when sent: q%2Fsecret%2Bvalue%3D9
SECRETS = (KEY, TOKEN, QUERY_SECRET, "q%2Fsecret%2Bvalue%3D9")


# ---- the Redactor --------------------------------------------------------------------------


def redactor(*secrets: str) -> tuple[Redactor, list[int]]:
    found: list[int] = []
    return Redactor(secrets, found.append), found


def test_an_answer_without_a_secret_is_returned_as_it_is():
    r, found = redactor(KEY, TOKEN)
    body = b'{"choices": []}'
    headers = [(b"content-type", b"application/json")]
    assert r.body(body) is body and r.headers(headers) is headers and found == []


def test_every_place_of_every_secret_is_replaced_and_counted():
    r, found = redactor(KEY, TOKEN, QUERY_SECRET)
    body = f'{{"error": "bad key {KEY} (Bearer {KEY}), token {TOKEN}, url ?key=q%2Fsecret%2Bvalue%3D9"}}'.encode()
    assert r.body(body) == b'{"error": "bad key [redacted] (Bearer [redacted]), token [redacted], url ?key=[redacted]"}'
    headers = [(b"content-type", b"application/json"), (b"x-ratelimit-echo", f"Bearer {KEY}".encode())]
    assert r.headers(headers) == [(b"content-type", b"application/json"), (b"x-ratelimit-echo", b"Bearer [redacted]")]
    assert found == [4, 1]


def test_a_secret_holding_another_is_replaced_whole():
    r, _ = redactor("abcdefgh", "abcdefgh-longer")
    assert r.body(b"x abcdefgh-longer y abcdefgh") == b"x [redacted] y [redacted]"


def test_a_secret_shorter_than_8_bytes_is_not_looked_for():
    r, found = redactor("short")
    assert r.body(b"a short answer") == b"a short answer" and found == []
    assert "short" not in repr(r) and REDACTED == b"[redacted]"


# ---- black-box: a provider that echoes what it was sent ----------------------------------------


def echo(request) -> str:
    """What a debugging server says back: the request's line and headers."""
    return f"{request.method} {request.path} " + " ".join(f"{k}: {v}" for k, v in request.headers.items())


def config(fake, honest) -> dict:
    return {
        "providers": {
            "echo": provider(
                fake,
                api_key_env="ECHO_KEY",
                headers={"x-team-token": {"env": "TEAM_TOKEN"}},
                query={"key": {"env": "QUERY_SECRET"}},
            ),
            "honest": provider(honest, api_key_env="HONEST_KEY"),
        },
        "models": {"m": {"targets": ["echo:x"]}, "h": {"targets": ["honest:x"]}},
    }


honest = second_fake("honest")


@pytest.fixture
def gateway(fake, honest, start_gateway):
    return start_gateway(
        config(fake, honest),
        ECHO_KEY=KEY,
        TEAM_TOKEN=TOKEN,
        QUERY_SECRET=QUERY_SECRET,
        HONEST_KEY="honest-key-0b9e",
    )


def assert_no_secret(data: bytes | str) -> None:
    text = data if isinstance(data, str) else data.decode("utf-8", "replace")
    for secret in SECRETS:
        assert secret not in text, secret


def test_a_provider_error_that_echoes_the_request_reaches_the_client_redacted(fake, gateway):
    fake.script = lambda r: json_reply(400, {"error": {"message": f"bad request: {echo(r)}"}})
    status, headers, body = call("POST", f"{gateway.url}/v1/chat/completions", {"model": "m", "messages": []})
    assert status == 400
    message = json.loads(body)["error"]["message"]
    assert f"authorization: Bearer {REDACTED.decode()}" in message and f"x-team-token: {REDACTED.decode()}" in message
    assert "?key=[redacted]" in message
    assert_no_secret(body)
    assert metric_value(gateway, "tinygw_secret_redactions_total", provider="echo") == 3
    warning = wait_until(
        lambda: [r for r in gateway.log_records() if r.get("msg") == "provider answer held a secret"],
        what="the redaction's warning",
    )
    assert warning[0]["provider"] == "echo"
    assert_no_secret(gateway.logs())

    status, _, body = call("POST", f"{gateway.url}/v1/chat/completions", {"model": "h", "messages": []})
    assert status == 200 and json.loads(body)["choices"][0]["message"]["content"]  # the honest provider's, untouched
    assert metric_value(gateway, "tinygw_secret_redactions_total", provider="honest") is None


@pytest.mark.parametrize("stream", [False, True], ids=["answer", "stream"])
def test_a_relayed_header_that_echoes_a_secret_is_redacted(fake, gateway, stream):
    def script(request):
        reply = (
            sse_reply([b'data: {"choices":[{"delta":{"content":"hi"},"finish_reason":"stop"}]}\n\n'])
            if stream
            else (json_reply(200, {"choices": [{"message": {"content": "hi"}}]}))
        )
        reply.headers.append(("x-ratelimit-debug", request.headers["authorization"]))
        reply.headers.append(("openai-debug", f"token={TOKEN}"))
        return reply

    fake.script = script
    status, headers, body = call(
        "POST", f"{gateway.url}/v1/chat/completions", {"model": "m", "stream": stream, "messages": []}
    )
    assert status == 200 and b"hi" in body
    assert headers["x-ratelimit-debug"] == "Bearer [redacted]" and headers["openai-debug"] == "token=[redacted]"
    assert_no_secret(str(dict(headers)))


def test_an_answer_too_large_to_hold_has_its_held_first_part_redacted(fake, gateway):
    """An answer over 1 MiB is relayed as it comes: its first MiB (held to be judged) is
    redacted; what follows is not looked at (docs/design.md section 15)."""
    big = json.dumps({"echo": KEY, "data": "x" * (2 * 1024 * 1024)}).encode()
    fake.script = lambda r: Reply(headers=[("content-type", "application/json")], chunks=[(0, big)])
    status, _, body = call("POST", f"{gateway.url}/v1/chat/completions", {"model": "m", "messages": []})
    assert status == 200 and body.startswith(b'{"echo": "[redacted]"') and len(body) > 2 * 1024 * 1024
    assert_no_secret(body)
