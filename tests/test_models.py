"""Black-box: `/v1/models` and `/v1/models/{id}` with model patterns (docs/design.md section 6).

A pattern (`"claude-*": ["an:*"]`) is not a model's name: the list leaves it out and
shows the models of the provider's listing that it serves, by their own names; one
model (`/v1/models/{id}`) answers for any name a request may use, as the request would
be routed. A real gateway; the fake provider `an` lists `claude-4-model`.
"""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from conftest import Gateway, call, sdk_clients, second_fake, wait_until
from tinygw.fake.upstream import json_reply, well_behaved

GATEWAY_KEY = "gw-key-models"

listed = second_fake("claude-4", scope="module")  # its listing: claude-4-model
openai_client, anthropic_client = sdk_clients(GATEWAY_KEY)


def auth(extra: dict | None = None) -> dict:
    return {"Authorization": f"Bearer {GATEWAY_KEY}", **(extra or {})}


@pytest.fixture(scope="module")
def gateway(listed, tmp_path_factory):
    config = {
        "providers": {
            "an": {"base_url": listed.url, "api": "anthropic"},
            "oa": {"base_url": f"{listed.url}/v1", "api": "openai", "listing": False},
        },
        "models": {
            "claude-*": {"targets": ["an:*"]},
            "claude-exact": {"targets": ["an:claude-upstream"]},
            "gpt-*": {"targets": ["oa:*"]},
        },
    }
    env = {
        "TINYGW_API_KEYS": GATEWAY_KEY,
        "PROVIDER_BREAKER_FAILURES": "1",
        "PROVIDER_BREAKER_OPEN_SECONDS": "300",
        "PROVIDER_RETRY_FAST_FAILURES": "false",
        "PROVIDER_HEALTH_CHECK_SECONDS": "0",
    }
    gw = Gateway(config, env, tmp_path_factory.mktemp("gw") / "gateway.log")
    wait_until(lambda: "an/claude-4-model" in ids(gw), 10, "the listing of an")
    yield gw
    gw.stop()


@pytest.fixture(autouse=True)
def healthy(listed):
    listed.script = well_behaved("claude-4")
    yield


def ids(gateway) -> list[str]:
    return [m["id"] for m in json.loads(call("GET", f"{gateway.url}/v1/models", headers=auth())[2])["data"]]


def one(gateway, model_id: str, headers: dict | None = None) -> tuple[int, dict]:
    status, _, body = call("GET", f"{gateway.url}/v1/models/{model_id}", headers=auth(headers))
    return status, json.loads(body)


def test_the_list_leaves_patterns_out_and_shows_the_listed_models_they_serve(gateway):
    assert ids(gateway) == ["claude-exact", "claude-4-model", "an/claude-4-model"]
    for shape in (auth(), auth({"anthropic-version": "2023-06-01"})):
        body = call("GET", f"{gateway.url}/v1/models", headers=shape)[2].decode()
        assert "*" not in body


def test_the_listed_model_a_pattern_serves_is_one_a_request_may_name(gateway):
    [entry] = [
        m
        for m in json.loads(call("GET", f"{gateway.url}/v1/models", headers=auth())[2])["data"]
        if m["id"] == "claude-4-model"
    ]
    assert (entry["owned_by"], entry["availability"]) == ("tinygw", {"available": True, "retry_after": None})
    answer = anthropic_client(gateway).messages.create(
        model="claude-4-model", max_tokens=16, messages=[{"role": "user", "content": "hi"}]
    )
    assert answer.model == "claude-4-model"


@pytest.mark.parametrize("model_id", ["claude-opus-4-8", "claude-opus-4-8[1m]", "gpt-5-codex"])
def test_one_model_answers_for_a_name_a_pattern_serves(gateway, model_id):
    status, entry = one(gateway, model_id)
    assert status == 200, entry
    assert entry == {
        "id": model_id,
        "object": "model",
        "created": 0,
        "owned_by": "tinygw",
        "availability": {"available": True, "retry_after": None},
    }


def test_one_model_in_both_sdks(gateway):
    assert openai_client(gateway).models.retrieve("gpt-5").id == "gpt-5"
    claude = anthropic_client(gateway).models.retrieve("claude-sonnet-4-5")
    assert (claude.id, claude.type, claude.display_name) == ("claude-sonnet-4-5", "model", "claude-sonnet-4-5")


def test_one_model_answers_for_a_provider_qualified_name_no_listing_gave(gateway):
    status, entry = one(gateway, "oa/gpt-4o")  # oa lists nothing; a request to oa/gpt-4o is served
    assert status == 200 and (entry["id"], entry["owned_by"]) == ("oa/gpt-4o", "oa")
    assert one(gateway, "claude-exact")[1]["owned_by"] == "tinygw"


@pytest.mark.parametrize("model_id", ["mistral-large", "nope/model", "an/"])
def test_one_model_is_404_for_a_name_nothing_serves(gateway, model_id):
    status, body = one(gateway, model_id)
    assert status == 404 and body["error"]["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        openai_client(gateway).models.retrieve(model_id)
    with pytest.raises(anthropic.NotFoundError):
        anthropic_client(gateway).models.retrieve(model_id)


def test_one_model_by_a_pattern_shows_the_open_circuit_of_that_name(gateway, listed):
    listed.script = lambda r: json_reply(500, {"type": "error", "error": {"type": "api_error", "message": "down"}})
    messages = [{"role": "user", "content": "hi"}]
    body = {"model": "claude-broken", "max_tokens": 16, "messages": messages}
    assert call("POST", f"{gateway.url}/v1/messages", body, headers=auth())[0] == 500  # one failure opens it
    status, entry = one(gateway, "claude-broken")
    assert status == 200 and entry["availability"]["available"] is False
    assert 1 <= entry["availability"]["retry_after"] <= 300
    assert one(gateway, "claude-other")[1]["availability"]["available"] is True  # its own circuit
