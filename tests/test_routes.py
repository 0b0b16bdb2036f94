"""Black-box: the routes that SDKs call besides chat and messages (docs/design.md section 3):
the Responses API, count_tokens, one model, Anthropic-shaped listings, and the 404
that names the routes. A real tinygw process, the official SDKs, a fake provider."""

from __future__ import annotations

import datetime
import json

import anthropic
import openai
import pytest

from conftest import Gateway, call, module_fake, sdk_clients, wait_until
from tinygw.fake.upstream import responses_stream_events, sse_reply, well_behaved
from tinygw.protocol import sse

GATEWAY_KEY = "gw-key-routes"
PROVIDER_KEY = "prov-key-routes"
ANTHROPIC_KEY = "anth-key-routes"


fake, fresh_fake = module_fake()


@pytest.fixture(scope="module")
def gateway(fake, tmp_path_factory):
    config = {
        "providers": {
            "oa": {"base_url": f"{fake.url}/a/v1", "api": "openai", "api_key_env": "OA_KEY"},
            "ob": {"base_url": f"{fake.url}/b/v1", "api": "openai", "listing": False},
            "an": {"base_url": fake.url, "api": "anthropic", "api_key_env": "AN_KEY"},
        },
        "models": {
            "gpt-x": {"targets": ["oa:upstream-gpt"]},
            "gpt-two": {"targets": ["oa:first", "ob:second"]},
            "claude-x": {"targets": ["an:claude-upstream"]},
        },
    }
    log = tmp_path_factory.mktemp("gw") / "gateway.log"
    gw = Gateway(config, {"OA_KEY": PROVIDER_KEY, "AN_KEY": ANTHROPIC_KEY, "TINYGW_API_KEYS": GATEWAY_KEY}, log)
    wait_until(lambda: "oa/fake-model" in _ids(gw) and "an/fake-model" in _ids(gw), 10, "the listings")
    yield gw
    gw.stop()


def _ids(gateway) -> list[str]:
    return [m["id"] for m in json.loads(call("GET", f"{gateway.url}/v1/models", headers=auth())[2])["data"]]


def auth(extra: dict | None = None) -> dict:
    return {"Authorization": f"Bearer {GATEWAY_KEY}", **(extra or {})}


openai_client, anthropic_client = sdk_clients(GATEWAY_KEY)


def posts(fake) -> list:
    return [r for r in fake.requests if r.method == "POST"]


# ---- the Responses API ----------------------------------------------------------------


def test_responses_create(gateway, fake):
    response = openai_client(gateway).responses.create(model="gpt-x", input="hi")
    assert response.output_text == "Hello from fake."
    assert response.model == "upstream-gpt"
    [request] = posts(fake)
    assert request.path == "/a/v1/responses"
    assert request.json() == {"model": "upstream-gpt", "input": "hi"}
    assert request.headers["authorization"] == f"Bearer {PROVIDER_KEY}"


def test_responses_create_streamed(gateway, fake):
    stream = openai_client(gateway).responses.create(model="gpt-x", input="hi", stream=True)
    events = list(stream)
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello from fake."
    assert events[0].type == "response.created"
    assert events[-1].type == "response.completed"
    assert events[-1].response.output_text == "Hello from fake."


def _responses_stream_failing_before_output(kind: str) -> list[bytes]:
    events = responses_stream_events("first", ["never"])[:4]  # created, in_progress, item and part added
    if kind == "response.failed":
        failed = {
            "type": "response.failed",
            "sequence_number": 4,
            "response": {"id": "resp_fake", "status": "failed", "error": {"code": "server_error", "message": "boom"}},
        }
        return [*events, f"event: response.failed\ndata: {json.dumps(failed)}\n\n".encode()]
    error = {"type": "error", "sequence_number": 4, "code": "server_error", "message": "boom", "param": None}
    return [*events, f"event: error\ndata: {json.dumps(error)}\n\n".encode()]


@pytest.mark.parametrize("kind", ["response.failed", "error"])
def test_responses_stream_failing_before_output_falls_back(gateway, fake, kind):
    healthy = well_behaved("second")
    fake.script = lambda r: (
        sse_reply(_responses_stream_failing_before_output(kind)) if r.path.startswith("/a/") else healthy(r)
    )
    stream = openai_client(gateway).responses.create(model="gpt-two", input="hi", stream=True)
    events = list(stream)
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello from second."
    assert [e.type for e in events].count("response.created") == 1  # the failed attempt's events were held
    assert [r.path for r in posts(fake)] == ["/a/v1/responses", "/b/v1/responses"]


def test_responses_stream_cut_after_output_ends_with_an_error_event(gateway, fake):
    events = responses_stream_events("upstream-gpt", ["one", " two"])
    fake.script = lambda r: sse_reply(events[:6], cut=True)  # up to the second delta, then the connection drops
    status, headers, body = call(
        "POST", f"{gateway.url}/v1/responses", {"model": "gpt-x", "input": "hi", "stream": True}, headers=auth()
    )
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    assert body.startswith(b"".join(events[:6]))
    assert body.endswith(b"\n\n") and b"event: error\ndata: " in body[len(b"".join(events[:6])) :]
    assert b"response.completed" not in body


def test_responses_events_are_classified():
    events = {json.loads(sse._fields(e)[1])["type"]: e for e in responses_stream_events("m", ["a"])}
    assert sse.kind(events["response.created"]) == (sse.Kind.PREAMBLE, False)
    assert sse.kind(events["response.output_item.added"]) == (sse.Kind.PREAMBLE, False)
    assert sse.kind(events["response.content_part.added"]) == (sse.Kind.PREAMBLE, False)
    assert sse.kind(events["response.output_text.delta"]) == (sse.Kind.OUTPUT, False)
    assert sse.kind(events["response.completed"]) == (sse.Kind.OUTPUT, True)
    call_item = b'data: {"type": "response.output_item.added", "item": {"type": "function_call", "name": "f"}}\n\n'
    assert sse.kind(call_item) == (sse.Kind.OUTPUT, False)  # a tool call is the model's output
    incomplete = b'event: response.incomplete\ndata: {"type": "response.incomplete", "response": {}}\n\n'
    assert sse.kind(incomplete) == (sse.Kind.OUTPUT, True) and sse.may_end_or_fail(incomplete)
    failed = b'data: {"type": "response.failed", "response": {"error": {"code": "x"}}}\n\n'
    assert sse.kind(failed) == (sse.Kind.ERROR, False) and sse.may_end_or_fail(failed)


def test_responses_with_an_anthropic_model_is_404(gateway, fake):
    with pytest.raises(openai.NotFoundError) as raised:
        openai_client(gateway).responses.create(model="claude-x", input="hi")
    assert raised.value.code == "model_not_found"
    assert posts(fake) == []


# ---- count_tokens ------------------------------------------------------------------------


def test_anthropic_count_tokens(gateway, fake):
    messages = [{"role": "user", "content": "how many tokens are these"}]
    counted = anthropic_client(gateway).messages.count_tokens(model="claude-x", messages=messages)
    assert counted.input_tokens == len(json.dumps(messages).split())
    [request] = posts(fake)
    assert request.path == "/v1/messages/count_tokens"
    assert request.json()["model"] == "claude-upstream"
    assert request.headers["x-api-key"] == ANTHROPIC_KEY
    assert request.headers.get("anthropic-version")


def test_count_tokens_with_an_openai_model_is_404(gateway, fake):
    with pytest.raises(anthropic.NotFoundError):
        anthropic_client(gateway).messages.count_tokens(model="gpt-x", messages=[{"role": "user", "content": "x"}])
    assert posts(fake) == []


# ---- models ----------------------------------------------------------------------------------


def test_openai_models_retrieve(gateway):
    client = openai_client(gateway)
    model = client.models.retrieve("gpt-x")
    assert (model.id, model.object, model.owned_by) == ("gpt-x", "model", "tinygw")
    assert model.availability == {"available": True, "retry_after": None}
    discovered = client.models.retrieve("oa/fake-model")  # sent as oa%2Ffake-model
    assert (discovered.id, discovered.owned_by) == ("oa/fake-model", "oa")
    status, _, body = call("GET", f"{gateway.url}/v1/models/oa/fake-model", headers=auth())
    assert status == 200 and json.loads(body)["id"] == "oa/fake-model"


def test_models_retrieve_unknown_is_404_model_not_found(gateway):
    with pytest.raises(openai.NotFoundError) as raised:
        openai_client(gateway).models.retrieve("nope/nothing")
    assert raised.value.code == "model_not_found"
    assert raised.value.body["type"] == "invalid_request_error"


def test_models_retrieve_needs_the_gateway_key_and_get(gateway):
    assert call("GET", f"{gateway.url}/v1/models/gpt-x")[0] == 401
    assert call("POST", f"{gateway.url}/v1/models/gpt-x", {}, headers=auth())[0] == 405


def test_anthropic_models_list(gateway):
    client = anthropic_client(gateway)
    models = list(client.models.list())
    assert [m.id for m in models] == _ids(gateway)
    claude = next(m for m in models if m.id == "claude-x")
    assert (claude.type, claude.display_name) == ("model", "claude-x")
    assert claude.created_at == datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)
    assert claude.availability == {"available": True, "retry_after": None}  # tinygw's own field is kept
    assert [m.id for m in client.models.list(limit=1)] == _ids(gateway)  # the SDK follows the pages
    assert client.models.retrieve("claude-x").display_name == "claude-x"


def test_anthropic_models_pages(gateway):
    ids = _ids(gateway)
    headers = auth({"anthropic-version": "2023-06-01"})
    first = json.loads(call("GET", f"{gateway.url}/v1/models?limit=2", headers=headers)[2])
    assert [m["id"] for m in first["data"]] == ids[:2]
    assert (first["has_more"], first["first_id"], first["last_id"]) == (True, ids[0], ids[1])
    rest = json.loads(call("GET", f"{gateway.url}/v1/models?limit=1000&after_id={ids[1]}", headers=headers)[2])
    assert [m["id"] for m in rest["data"]] == ids[2:] and rest["has_more"] is False
    before = json.loads(call("GET", f"{gateway.url}/v1/models?before_id={ids[2]}&limit=1", headers=headers)[2])
    assert [m["id"] for m in before["data"]] == [ids[1]] and before["has_more"] is True
    assert call("GET", f"{gateway.url}/v1/models?limit=0", headers=headers)[0] == 400
    plain = json.loads(call("GET", f"{gateway.url}/v1/models?limit=1", headers=auth())[2])
    assert plain["object"] == "list" and len(plain["data"]) == len(ids)  # OpenAI's shape has no pages


# ---- unknown paths ----------------------------------------------------------------------------


def test_unknown_path_lists_the_routes(gateway):
    status, _, body = call("POST", f"{gateway.url}/v1/chat/completion", {"model": "gpt-x"}, headers=auth())
    assert status == 404
    error = json.loads(body)["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "not_found")
    for route in (
        "POST /v1/chat/completions",
        "POST /v1/responses",
        "POST /v1/messages/count_tokens",
        "GET /v1/models",
        "GET /v1/models/{id}",
        "GET /healthz",
    ):
        assert route in error["message"]
