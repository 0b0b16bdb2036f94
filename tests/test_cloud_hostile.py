"""Black-box: what a Bedrock or Vertex provider may not do to the gateway, and what the
gateway shows of them (docs/design.md section 18): a Google token endpoint that answers
a token no header can carry, answers too much, or takes its time; a short-lived token;
the status page of providers that have no listing; the receipts of the cloud shapes,
whose model is in the path. The fakes are test_clouds' (`clouds`)."""

from __future__ import annotations

import json
import time

import pytest
import test_clouds
from test_clouds import AUTH, BEDROCK_MODEL, MESSAGES, PROMPT, VERTEX_MODEL, Clouds, failures_of

from conftest import call
from tinygw.fake.upstream import Reply, json_reply

google_key, clouds = test_clouds.google_key, test_clouds.clouds  # its fakes, as fixtures here too


def token_reply(token: str, expires_in: float = 3599) -> Reply:
    return json_reply(200, {"access_token": token, "expires_in": expires_in, "token_type": "Bearer"})


ALONE_AND_WITH_A_FALLBACK = {
    "m": [f"vertex:{VERTEX_MODEL}"],
    "n": [f"vertex:{VERTEX_MODEL}", f"bedrock:{BEDROCK_MODEL}"],
}


def assert_a_credentials_failure(gateway, clouds: Clouds, words: str) -> None:
    """A request to vertex alone is a 502 `provider_credentials` whose message says `words`;
    one that may fall back does, and each counts against vertex; vertex is never sent one."""
    status, _, answer = call("POST", f"{gateway.url}{MESSAGES}", {"model": "m", **PROMPT}, AUTH)
    error = json.loads(answer)["error"]
    assert (status, error["cause"], error["provider"]) == (502, "provider_credentials", "vertex"), answer
    assert words in error["message"], error["message"]
    status, headers, _ = call("POST", f"{gateway.url}{MESSAGES}", {"model": "n", **PROMPT}, AUTH)
    assert status == 200 and headers["x-tinygw-attempts"] == "vertex:provider_credentials,bedrock:200"
    assert failures_of(gateway, "vertex") == 2
    assert not clouds.vertex.requests


# ---- the token endpoint's answer -------------------------------------------------------------


@pytest.mark.parametrize(
    "token,words",
    [
        ("ya29.good\r\nx-injected: 1", "outside visible ASCII"),
        ("ya29. with a space", "outside visible ASCII"),
        ("ya29.tök", "outside visible ASCII"),
        ("ya29." + "a" * 4092, "of 4097 characters (at most 4,096)"),
        ("", "an empty access token"),
    ],
    ids=["crlf", "space", "non-ascii", "4097-chars", "empty"],
)
def test_a_token_no_header_can_carry_is_the_providers_failure(start_gateway, clouds, token, words):
    clouds.google_answers(lambda r: token_reply(token))
    gateway = start_gateway(clouds.config(ALONE_AND_WITH_A_FALLBACK), **clouds.env())
    assert_a_credentials_failure(gateway, clouds, words)
    assert "ya29" not in gateway.logs()  # the token is never shown


def test_a_token_of_4096_visible_characters_is_used(start_gateway, clouds):
    token = "ya29." + "A" * 4091
    clouds.google_answers(lambda r: token_reply(token))
    gateway = start_gateway(clouds.config(ALONE_AND_WITH_A_FALLBACK), **clouds.env())
    status, _, answer = call("POST", f"{gateway.url}{MESSAGES}", {"model": "m", **PROMPT}, AUTH)
    assert status == 200, answer
    assert clouds.vertex.requests[0].headers["authorization"] == f"Bearer {token}"


def test_a_token_answer_over_64_kib_says_so(start_gateway, clouds):
    padding = "x" * (64 * 1024)
    clouds.google_answers(lambda r: json_reply(200, {"access_token": "ya29.ok", "expires_in": 3599, "pad": padding}))
    gateway = start_gateway(clouds.config(ALONE_AND_WITH_A_FALLBACK), **clouds.env())
    assert_a_credentials_failure(gateway, clouds, "answer is over 64 KiB")


# ---- the wait for a token ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "bound,stream",
    [({"timeout_s": 1}, False), ({"head_timeout_s": 1}, True)],
    ids=["total", "stream-head"],
)
def test_the_wait_for_a_token_is_bounded_by_the_attempts_own(start_gateway, clouds, bound, stream):
    clouds.google_answers(lambda r: Reply(action="hang"))
    config = clouds.config({"m": [f"vertex:{VERTEX_MODEL}"]})
    config["models"]["m"].update(bound)
    gateway = start_gateway(config, **clouds.env())
    started = time.monotonic()
    status, _, answer = call("POST", f"{gateway.url}{MESSAGES}", {"model": "m", "stream": stream, **PROMPT}, AUTH)
    waited = time.monotonic() - started
    error = json.loads(answer)["error"]
    assert (status, error["cause"]) == (502, "provider_credentials"), answer
    assert "no token within the attempt's 1 s" in error["message"], error["message"]
    assert 0.9 <= waited < 5, waited  # the endpoint's own bound is 30 s
    assert not clouds.vertex.requests


@pytest.mark.parametrize("expires_in", [60, 20])
def test_a_short_lived_token_is_used_for_half_its_life(start_gateway, clouds, expires_in):
    clouds.google_answers(lambda r: token_reply("ya29.short", expires_in))
    gateway = start_gateway(clouds.config({"m": [f"vertex:{VERTEX_MODEL}"]}), **clouds.env())
    for _ in range(3):
        status, _, answer = call("POST", f"{gateway.url}{MESSAGES}", {"model": "m", **PROMPT}, AUTH)
        assert status == 200, answer
    assert len(clouds.assertions) == 1  # one fetch, one signature: the token is kept


# ---- the status page -----------------------------------------------------------------------------


def test_the_status_page_shows_cloud_providers_without_a_listing_never_down(start_gateway, clouds):
    env = {**clouds.env(), "PROVIDER_LISTING_SECONDS": "60"}
    gateway = start_gateway(clouds.config({"m": [f"bedrock:{BEDROCK_MODEL}", f"vertex:{VERTEX_MODEL}"]}), **env)
    status, _, answer = call("POST", f"{gateway.url}{MESSAGES}", {"model": "m", **PROMPT}, AUTH)
    assert status == 200, answer
    page = json.loads(call("GET", f"{gateway.url}/status.json")[2])
    listings = {p["name"]: p["listing"] for p in page["providers"]}
    for cloud in ("bedrock", "vertex"):
        assert listings[cloud] == {"enabled": False, "up": None, "models": None}
    assert page["summary"]["providers_listing_down"] == []
    html = call("GET", f"{gateway.url}/status")[2].decode()
    assert "listing down" not in html and "every listing up" in html
    assert html.count("Listing: none for Claude on a cloud (its models are those configured)") == 2
    assert not [r for fake in (clouds.bedrock, clouds.vertex) for r in fake.requests if r.method == "GET"]


# ---- receipts of the cloud shapes ------------------------------------------------------------


def receipt_of(gateway, headers) -> dict:
    return json.loads(call("GET", f"{gateway.url}/v1/receipts/{headers['x-tinygw-receipt-id']}", headers=AUTH)[2])


def test_receipts_of_the_cloud_shapes_carry_the_model_of_the_path(start_gateway, clouds):
    config = clouds.config({"sonnet": [f"bedrock:{BEDROCK_MODEL}"], "claude-*": [f"vertex:{VERTEX_MODEL}"]})
    gateway = start_gateway(config, **clouds.env(), TINYGW_RECEIPTS="on")
    vertex = "/v1/projects/p/locations/l/publishers/anthropic/models/claude-sonnet-4-5"
    asked = [
        ("/model/sonnet/invoke", {"anthropic_version": "bedrock-2023-05-31"}, "sonnet", "bedrock"),
        ("/model/sonnet/invoke-with-response-stream", {"anthropic_version": "bedrock-2023-05-31"}, "sonnet", "bedrock"),
        (f"{vertex}:rawPredict", {"anthropic_version": "vertex-2023-10-16"}, "claude-sonnet-4-5", "vertex"),
        (
            f"{vertex}:streamRawPredict",
            {"anthropic_version": "vertex-2023-10-16", "stream": True},
            "claude-sonnet-4-5",
            "vertex",
        ),
        (MESSAGES, {"model": "sonnet"}, "sonnet", "bedrock"),
    ]
    for path, fields, model, provider in asked:
        status, headers, answer = call("POST", f"{gateway.url}{path}", {**fields, **PROMPT}, AUTH)
        assert status == 200, (path, answer)
        receipt = receipt_of(gateway, headers)
        assert (receipt["model"], receipt["provider"], receipt["status"]) == (model, provider, 200), (path, receipt)
