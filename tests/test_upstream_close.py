"""A provider that reads the request and closes without answering (docs/design.md
section 13): a connection error, retried once at once as a reset is, and no library's
own message in the error body."""

from __future__ import annotations

import json

from conftest import call, metric_value, provider
from tinygw.fake.upstream import Reply, well_behaved

CHAT = "/v1/chat/completions"


def config(fake) -> dict:
    return {
        "providers": {"p": provider(fake)},
        "models": {"m": {"targets": ["p:x"]}},
        "routing": {"debug": True},
    }


def test_a_close_without_an_answer_is_retried_at_once(fake, start_gateway):
    answer = well_behaved("fake")
    seen = []

    def script(request):
        seen.append(request)
        return Reply(action="close") if len(seen) == 1 else answer(request)

    fake.script = script
    gateway = start_gateway(config(fake))
    for stream in (False, True):
        seen.clear()
        status, headers, body = call("POST", f"{gateway.url}{CHAT}", {"model": "m", "stream": stream})
        assert status == 200, body
        assert headers["x-tinygw-attempts"] == "p:connect_error,p:200"
    assert metric_value(gateway, "tinygw_provider_retries_total", reason="transient_retry") == 2


def test_a_provider_that_always_closes_is_a_connect_error_in_words_of_ours(fake, start_gateway):
    fake.script = lambda request: Reply(action="close")
    gateway = start_gateway(config(fake))
    for stream in (False, True):
        status, _, body = call("POST", f"{gateway.url}{CHAT}", {"model": "m", "stream": stream})
        error = json.loads(body)["error"]
        assert status == 502 and error["cause"] == "connect_error", body
        assert "closed the connection without answering" in error["message"]
        for h11_words in ("peer closed", "Peer closed", "incomplete", "ConnectionClosed", "h11"):
            assert h11_words not in error["message"]
