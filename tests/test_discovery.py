"""Black-box: model discovery, health checks of open circuits, and `/v1/models`.

A real tinygw process and a fake provider on loopback (docs/design.md sections 5 and 6).
Listings and health checks run every 0.2 s here; every wait polls with a deadline.
"""

from __future__ import annotations

import json
import re

import pytest

from conftest import call, metric_value, wait_until
from tinygw.fake.upstream import Reply, json_reply, well_behaved

GATEWAY_KEY = "gw-key-d1s0"
PROVIDER_KEY = "prov-key-6b7e"
ANTHROPIC_KEY = "anth-key-0c44"
FAST = {"PROVIDER_LISTING_SECONDS": "0.2", "PROVIDER_HEALTH_CHECK_SECONDS": "0.2"}


def config(fake) -> dict:
    return {
        "providers": {
            "oa": {"base_url": f"{fake.url}/v1", "api": "openai", "api_key_env": "OA_KEY"},
            "an": {"base_url": f"{fake.url}/an", "api": "anthropic", "api_key_env": "AN_KEY"},
            "quiet": {"base_url": f"{fake.url}/quiet", "api": "openai", "listing": False},
        },
        "models": {
            "gpt-x": {"targets": ["oa:upstream-gpt"]},
            "claude-x": {"targets": ["an:claude-upstream"]},
            "quiet-x": {"targets": ["quiet:q"]},
        },
    }


def start(start_gateway, fake, **env: str):
    return start_gateway(
        config(fake), OA_KEY=PROVIDER_KEY, AN_KEY=ANTHROPIC_KEY, TINYGW_API_KEYS=GATEWAY_KEY, **{**FAST, **env}
    )


def auth() -> dict:
    return {"Authorization": f"Bearer {GATEWAY_KEY}"}


def models(gw) -> dict[str, dict]:
    status, _, body = call("GET", f"{gw.url}/v1/models", headers=auth())
    assert status == 200, body
    document = json.loads(body)
    assert document["object"] == "list"
    return {m["id"]: m for m in document["data"]}


def chat(gw, model: str = "gpt-x"):
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    return call("POST", f"{gw.url}/v1/chat/completions", body, auth())


def metric(gw, name: str, **labels: str) -> float | None:
    return metric_value(gw, name, **labels)


def gets(fake, path: str, since: int = 0) -> list:
    return [r for r in fake.requests[since:] if r.method == "GET" and r.path == path]


def failing_listing(reply: Reply):
    """A provider whose chat works and whose model listing answers `reply`."""
    healthy = well_behaved("fake")
    return lambda request: reply if request.method == "GET" else healthy(request)


# ---- discovery -----------------------------------------------------------------------


def test_discovered_models_are_listed_as_provider_slash_model_and_available(fake, start_gateway):
    gw = start(start_gateway, fake)

    def both_discovered() -> dict | None:
        listed = models(gw)
        return listed if {"oa/fake-model", "an/fake-model"} <= listed.keys() else None

    listed = wait_until(both_discovered, what="both providers' models to be discovered")

    assert listed["oa/fake-model"] == {
        "id": "oa/fake-model",
        "object": "model",
        "created": 0,
        "owned_by": "oa",
        "availability": {"available": True, "retry_after": None},
    }
    assert listed["an/fake-model"]["owned_by"] == "an"
    for alias in ("gpt-x", "claude-x", "quiet-x"):
        assert listed[alias]["owned_by"] == "tinygw"
        assert listed[alias]["availability"] == {"available": True, "retry_after": None}
    assert not [m for m in listed if m.startswith("quiet/")]

    # Each provider is asked at its listing path with its own key; a provider with
    # `listing: false` is never asked, though every round asks all the others.
    wait_until(
        lambda: len(gets(fake, "/v1/models")) >= 2 and len(gets(fake, "/an/v1/models")) >= 2, what="two listing rounds"
    )
    assert gets(fake, "/v1/models")[0].headers["authorization"] == f"Bearer {PROVIDER_KEY}"
    anthropic = gets(fake, "/an/v1/models")[0].headers
    assert anthropic["x-api-key"] == ANTHROPIC_KEY and "anthropic-version" in anthropic
    assert not [r for r in fake.requests if r.path.startswith("/quiet")]
    assert metric(gw, "tinygw_listing_up", provider="oa") == 1
    assert metric(gw, "tinygw_listing_up", provider="quiet") is None

    status, _, body = chat(gw, "oa/fake-model")  # a discovered model can be asked for
    assert status == 200, body
    assert call("GET", f"{gw.url}/v1/models")[0] == 401
    assert PROVIDER_KEY not in gw.logs() and ANTHROPIC_KEY not in gw.logs()


@pytest.mark.parametrize(
    "reply",
    [
        json_reply(500, {"error": {"message": "listing is down"}}),
        json_reply(200, {"data": [{"name": "an entry without an id"}]}),
        Reply(status=200, headers=[("content-type", "application/json")], body=b"<html>not json</html>"),
        Reply(action="close"),
    ],
    ids=["500", "wrong-shape", "not-json", "connection-closed"],
)
def test_a_failing_listing_hides_discovered_models_and_never_touches_a_breaker(fake, start_gateway, reply):
    # One failure opens a circuit: were a failed listing counted, the chat after it
    # would get 503 (a success in between cannot hide it by resetting the count).
    gw = start(start_gateway, fake, PROVIDER_BREAKER_FAILURES="1")
    wait_until(lambda: "oa/fake-model" in models(gw), what="the first listing")
    assert chat(gw)[0] == 200  # oa:upstream-gpt's circuit is in use before the failures

    since = len(fake.requests)
    fake.script = failing_listing(reply)
    statuses = []

    def chat_until_six_listings() -> bool:
        statuses.append(chat(gw)[0])
        return len(gets(fake, "/v1/models", since)) >= 6

    wait_until(chat_until_six_listings, 15, "six failed listings of oa")
    assert statuses and set(statuses) == {200}
    assert chat(gw)[0] == 200
    listed = models(gw)
    assert not [m for m in listed if m.startswith("oa/")]
    assert "an/fake-model" not in listed  # `an` lists at the same fake: it fails too
    assert {"gpt-x", "claude-x", "quiet-x"} <= listed.keys()
    assert listed["gpt-x"]["availability"] == {"available": True, "retry_after": None}
    assert metric(gw, "tinygw_listing_up", provider="oa") == 0
    assert "tinygw_circuit_transitions_total{" not in call("GET", f"{gw.url}/metrics")[2].decode()
    failures = [r for r in gw.log_records() if r["msg"] == "provider listing failed" and r["provider"] == "oa"]
    assert failures and all(set(r) <= {"ts", "level", "logger", "msg", "provider", "status", "error"} for r in failures)

    # The loop outlives its failures: the models come back with the next good listing.
    fake.script = well_behaved("fake")
    wait_until(lambda: "oa/fake-model" in models(gw), what="the models to come back")
    assert metric(gw, "tinygw_listing_up", provider="oa") == 1


# ---- open circuits -------------------------------------------------------------------

BREAKER = {
    "PROVIDER_BREAKER_FAILURES": "2",
    "PROVIDER_BREAKER_OPEN_SECONDS": "300",
    "PROVIDER_RETRY_FAST_FAILURES": "false",
    "PROVIDER_LISTING_SECONDS": "0",  # every GET the fake sees is a health check
}


def everything_fails(request):
    return json_reply(500, {"error": {"message": "down", "type": "server_error"}})


def open_circuit(gw, fake) -> None:
    """Two 500s open the circuit of oa:upstream-gpt; the third request is refused."""
    fake.script = everything_fails
    assert [chat(gw)[0] for _ in range(2)] == [500, 500]
    status, headers, body = chat(gw)
    assert status == 503, body
    error = json.loads(body)["error"]
    assert (error["cause"], error["provider"], error["provider_model"]) == ("circuit_open", "oa", "upstream-gpt")
    assert int({k.lower(): v for k, v in headers.items()}["retry-after"]) >= 1


def test_an_alias_whose_only_circuit_is_open_is_unavailable_with_retry_after(fake, start_gateway):
    gw = start(start_gateway, fake, **BREAKER, PROVIDER_HEALTH_CHECK_SECONDS="0")
    open_circuit(gw, fake)

    listed = models(gw)
    availability = listed["gpt-x"]["availability"]
    assert availability["available"] is False
    assert isinstance(availability["retry_after"], int) and 1 <= availability["retry_after"] <= 300
    assert listed["claude-x"]["availability"] == {"available": True, "retry_after": None}
    assert listed["quiet-x"]["availability"] == {"available": True, "retry_after": None}


def quiet_fails(request):
    """Provider `quiet` answers 500 to everything; the others are healthy."""
    return everything_fails(request) if request.path.startswith("/quiet/") else well_behaved("fake")(request)


def test_a_passing_health_check_lets_an_open_circuit_probe_long_before_its_pause_ends(fake, start_gateway):
    gw = start(start_gateway, fake, **BREAKER)
    assert chat(gw)[0] == 200  # oa:upstream-gpt's circuit is in use, and closed

    # Only open circuits are checked. `quiet`'s circuit opens; once it has been checked,
    # a health round has certainly run (a round checks every provider at once), and it
    # did not check oa, whose circuit is closed.
    fake.script = quiet_fails
    assert [chat(gw, "quiet-x")[0] for _ in range(2)] == [500, 500]
    assert chat(gw, "quiet-x")[0] == 503
    wait_until(lambda: gets(fake, "/quiet/models"), what="a health check of quiet")
    assert gets(fake, "/v1/models") == []  # no circuit of oa is open: nothing to check
    open_circuit(gw, fake)

    # A failing health check changes nothing.
    wait_until(lambda: len(gets(fake, "/v1/models")) >= 3, what="three health checks of oa")
    check = gets(fake, "/v1/models")[0]
    assert check.headers["authorization"] == f"Bearer {PROVIDER_KEY}"
    assert not [r for r in fake.requests if r.method == "GET" and r.path not in ("/v1/models", "/quiet/models")]
    assert chat(gw)[0] == 503
    assert models(gw)["gpt-x"]["availability"]["available"] is False

    # A passing one moves the circuit to half-open: the next request is its probe,
    # within seconds of a 300 s pause.
    fake.script = well_behaved("fake")
    wait_until(lambda: chat(gw)[0] == 200, 10, "a request to pass again")
    assert models(gw)["gpt-x"]["availability"] == {"available": True, "retry_after": None}
    assert chat(gw)[0] == 200
    assert re.search(
        r'tinygw_circuit_transitions_total\{provider="oa",provider_model="upstream-gpt",'
        r'state="half_open"\} 1',
        call("GET", f"{gw.url}/metrics")[2].decode(),
    )
