"""Black-box: what real clients need from the gateway (docs/api.md, docs/clients.md):
model patterns, errors in each API's own shape, the base URL's probe, the access
log's request line, and the gateway key checked at dispatch for every route."""

from __future__ import annotations

import asyncio
import json

import anthropic
import pytest

from conftest import Gateway, call, closed_port, metric_value, module_fake, sdk_clients, wait_until
from tinygw.config import environment
from tinygw.errors import ConfigError
from tinygw.fake.upstream import Reply, anthropic_stream_events, json_reply

GATEWAY_KEY = "gw-key-clients"
ANTHROPIC_KEY = "anth-key-clients"
ANTHROPIC_TYPES = {
    "invalid_request_error",
    "authentication_error",
    "permission_error",
    "not_found_error",
    "request_too_large",
    "rate_limit_error",
    "api_error",
    "overloaded_error",
    "timeout_error",
}

fake, fresh_fake = module_fake()
_, anthropic_client = sdk_clients(GATEWAY_KEY)


@pytest.fixture(scope="module")
def gateway(fake, tmp_path_factory):
    config = {
        "providers": {
            "an": {"base_url": fake.url, "api": "anthropic", "api_key_env": "AN_KEY", "listing": False},
            "oa": {"base_url": f"{fake.url}/v1", "api": "openai", "listing": False},
            "down": {"base_url": f"http://127.0.0.1:{closed_port()}", "api": "anthropic", "listing": False},
            "slow": {"base_url": fake.url, "api": "anthropic", "listing": False, "head_timeout_s": 0.5},
        },
        "models": {
            "claude-*": {"targets": ["an:*"]},
            "claude-opus-*": {"targets": ["an:opus-pinned"]},
            "claude-exact": {"targets": ["an:exact-upstream"]},
            "gpt-*": {"targets": ["oa:*"]},
            "claude-down": {"targets": ["down:x"]},
            "claude-slow": {"targets": ["slow:x"]},
        },
    }
    log = tmp_path_factory.mktemp("gw") / "gateway.log"
    gw = Gateway(
        config,
        {
            "AN_KEY": ANTHROPIC_KEY,
            "TINYGW_API_KEYS": GATEWAY_KEY,
            "TINYGW_MAX_BODY_BYTES": "4000",
            "PROVIDER_BREAKER_FAILURES": "1",
            "PROVIDER_HEALTH_CHECK_SECONDS": "0",
        },
        log,
    )
    yield gw
    gw.stop()


def auth(extra: dict | None = None) -> dict:
    return {"x-api-key": GATEWAY_KEY, "anthropic-version": "2023-06-01", **(extra or {})}


def message(model: str, **extra) -> dict:
    return {"model": model, "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}], **extra}


# ---- model patterns ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "requested,upstream",
    [
        ("claude-sonnet-4-5", "claude-sonnet-4-5"),  # "claude-*" -> an:*: the name as sent
        ("claude-opus-4-8", "opus-pinned"),  # the longer pattern wins
        ("claude-exact", "exact-upstream"),  # an exact alias beats any pattern
    ],
)
def test_a_pattern_serves_the_names_it_matches(gateway, fake, requested, upstream):
    status, _, body = call("POST", f"{gateway.url}/v1/messages", message(requested), headers=auth())
    assert status == 200, body
    assert fake.requests[-1].json()["model"] == upstream


def test_a_pattern_is_the_label_of_its_requests(gateway, fake):
    for name in ("claude-haiku-9", "claude-haiku-10"):
        assert call("POST", f"{gateway.url}/v1/messages", message(name), headers=auth())[0] == 200
    assert metric_value(gateway, "tinygw_requests_total", model="claude-*", route="/v1/messages") >= 2
    assert metric_value(gateway, "tinygw_requests_total", model="claude-haiku-9") is None
    lines = wait_until(
        lambda: [r for r in gateway.log_records() if r.get("msg") == "request" and r.get("model") == "claude-*"],
        5,
        "the access lines",
    )
    assert not [r for r in gateway.log_records() if r.get("model") in ("claude-haiku-9", "claude-haiku-10")]
    assert lines


def test_a_target_of_star_has_no_circuit_of_its_own(gateway):
    """`an:*` is a circuit per name as sent, made by the first attempt; never one named `*`."""
    assert metric_value(gateway, "tinygw_circuit_open", provider="an", provider_model="*") is None
    assert metric_value(gateway, "tinygw_circuit_open", provider="an", provider_model="exact-upstream") == 0


def test_a_pattern_serves_only_its_own_api(gateway):
    status, _, body = call(
        "POST",
        f"{gateway.url}/v1/chat/completions",
        {"model": "claude-x"},
        headers={"Authorization": f"Bearer {GATEWAY_KEY}"},
    )
    assert status == 404 and json.loads(body)["error"]["code"] == "model_not_found"


@pytest.mark.parametrize(
    "models,where",
    [
        ({"a*b": {"targets": ["p:m"]}}, "$.models.a*b"),
        ({"a**": {"targets": ["p:m"]}}, "$.models.a**"),
        ({"claude-*": {"targets": ["p:claude-*"]}}, "$.models.claude-*.targets[0]"),
    ],
)
def test_a_misplaced_star_stops_the_start(models, where):
    document = {"providers": {"p": {"base_url": "http://127.0.0.1:1", "api": "anthropic"}}, "models": models}
    with pytest.raises(ConfigError) as raised:
        environment.from_environ({"TINYGW_CONFIG": json.dumps(document)})
    assert where in str(raised.value)


# ---- errors in each API's shape ----------------------------------------------------------


def anthropic_error(body: bytes) -> dict:
    document = json.loads(body)
    assert document["type"] == "error" and set(document) == {"type", "error"}, document
    assert document["error"]["type"] in ANTHROPIC_TYPES and document["error"]["message"]
    return document["error"]


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
@pytest.mark.parametrize(
    "body,headers,status,kind,code",
    [
        (message("claude-x"), {"anthropic-version": "2023-06-01"}, 401, "authentication_error", "invalid_api_key"),
        (b"{not json", None, 400, "invalid_request_error", "invalid_body"),
        (message("nope"), None, 404, "not_found_error", "model_not_found"),
        (message("claude-x", pad="x" * 5000), None, 413, "request_too_large", "request_too_large"),
    ],
)
def test_anthropic_routes_answer_errors_in_anthropic_shape(gateway, path, body, headers, status, kind, code):
    answered, _, text = call("POST", f"{gateway.url}{path}", body, headers=auth() if headers is None else headers)
    assert answered == status
    error = anthropic_error(text)
    assert (error["type"], error["code"]) == (kind, code)


def test_wrong_method_on_an_anthropic_route(gateway):
    status, _, body = call("GET", f"{gateway.url}/v1/messages", headers=auth())
    assert status == 405 and anthropic_error(body)["type"] == "invalid_request_error"


def test_provider_failures_keep_the_gateway_fields_in_anthropic_shape(gateway):
    status, _, body = call("POST", f"{gateway.url}/v1/messages", message("claude-down"), headers=auth())
    assert status == 502
    error = anthropic_error(body)
    assert (error["type"], error["cause"], error["provider"], error["provider_model"]) == (
        "api_error",
        "connect_error",
        "down",
        "x",
    )
    status, headers, body = call("POST", f"{gateway.url}/v1/messages", message("claude-down"), headers=auth())
    assert status == 503 and int(headers["Retry-After"]) >= 1
    error = anthropic_error(body)
    assert (error["type"], error["cause"], error["provider"]) == ("overloaded_error", "circuit_open", "down")


def test_the_gateways_timeout_is_anthropics_timeout_error(gateway, fake):
    fake.script = lambda r: Reply(action="hang")
    status, _, body = call("POST", f"{gateway.url}/v1/messages", message("claude-slow", stream=True), headers=auth())
    assert status == 504
    error = anthropic_error(body)
    assert (error["type"], error["cause"], error["provider"]) == ("timeout_error", "timeout", "slow")


def test_the_anthropic_sdk_reads_the_gateway_errors(gateway):
    client = anthropic_client(gateway)
    with pytest.raises(anthropic.NotFoundError) as raised:
        client.messages.create(model="nope", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert raised.value.body["type"] == "error" and raised.value.body["error"]["type"] == "not_found_error"


def test_the_model_list_errs_in_the_shape_it_answers_in(gateway):
    """With `anthropic-version` the model list is Anthropic's, and so are its errors."""
    status, _, body = call("GET", f"{gateway.url}/v1/models/nope", headers=auth())
    assert status == 404 and anthropic_error(body)["type"] == "not_found_error"
    status, _, body = call("GET", f"{gateway.url}/v1/models?limit=0", headers=auth())
    assert status == 400 and anthropic_error(body)["code"] == "invalid_query"
    status, _, body = call("GET", f"{gateway.url}/v1/models", headers={"anthropic-version": "2023-06-01"})
    assert status == 401 and anthropic_error(body)["type"] == "authentication_error"
    status, _, body = call("GET", f"{gateway.url}/v1/models/nope", headers={"x-api-key": GATEWAY_KEY})
    assert status == 404 and json.loads(body)["error"]["type"] == "invalid_request_error"


def test_a_provider_error_passes_through_as_it_is(gateway, fake):
    sent = {"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}}
    fake.script = lambda r: json_reply(429, sent)
    status, _, body = call("POST", f"{gateway.url}/v1/messages", message("claude-exact"), headers=auth())
    assert status == 429 and json.loads(body) == sent


def test_a_cut_anthropic_stream_ends_with_an_anthropic_error_event(gateway, fake):
    events = anthropic_stream_events("m", ["Hel", "lo"])[:4]  # message_start ... the first text delta
    fake.script = lambda r: Reply(
        headers=[("content-type", "text/event-stream")], chunks=[(0, e) for e in events], action="cut"
    )
    status, _, body = call("POST", f"{gateway.url}/v1/messages", message("claude-exact", stream=True), headers=auth())
    assert status == 200
    last = body.decode().strip().split("\n\n")[-1]
    assert last.startswith("event: error\ndata: ")
    assert anthropic_error(last.partition("data: ")[2].encode())["type"] == "api_error"


def test_openai_routes_keep_openai_shape(gateway):
    status, _, body = call(
        "POST",
        f"{gateway.url}/v1/chat/completions",
        {"model": "nope"},
        headers={"Authorization": f"Bearer {GATEWAY_KEY}"},
    )
    assert status == 404
    assert json.loads(body)["error"]["type"] == "invalid_request_error"
    status, _, body = call("POST", f"{gateway.url}/v1/chat/completions", {"model": "gpt-x"})
    assert status == 401 and json.loads(body)["error"]["type"] == "authentication_error"


# ---- the base URL, the access log --------------------------------------------------------


@pytest.mark.parametrize("method", ["GET", "HEAD"])
def test_the_base_url_answers_200_without_a_key(gateway, method):
    status, headers, body = call(method, f"{gateway.url}/")
    assert status == 200
    assert headers["x-request-id"]
    if method == "GET":
        assert json.loads(body) == {"name": "tinygw", "status": "ok"}
    else:
        assert body == b""
    assert GATEWAY_KEY.encode() not in body and ANTHROPIC_KEY.encode() not in body


def test_the_request_line_has_the_query_and_the_user_agent(gateway):
    agent = "claude-cli/2.1 (external, cli) " + "x" * 400
    query = "beta=true&key=sk-secret-1&api_key=sk-secret-2&X-Api-Key=sk-secret-3&access_token=sk-secret-4&limit=3"
    call("POST", f"{gateway.url}/v1/messages?{query}", message("claude-x"), headers=auth({"User-Agent": agent}))
    call("GET", f"{gateway.url}/v1/v1/messages?token=sk-secret-5", headers={"User-Agent": "lost-client/1"})

    def lines():
        return [r for r in gateway.log_records() if r.get("msg") == "request"]

    wait_until(lambda: any(r.get("status") == 404 and r.get("route") is None for r in lines()), 5, "the 404's line")
    proxied = [r for r in lines() if r.get("path", "").startswith("/v1/messages?beta")][-1]
    assert proxied["path"] == "/v1/messages?beta=true&key=***&api_key=***&X-Api-Key=***&access_token=***&limit=3"
    assert proxied["user_agent"] == agent[:200]
    lost = [r for r in lines() if r.get("status") == 404 and r.get("route") is None][-1]
    assert (lost["path"], lost["user_agent"]) == ("/v1/v1/messages?token=***", "lost-client/1")
    assert "sk-secret" not in gateway.logs()


# ---- auth at dispatch, one route table ---------------------------------------------------


def test_every_route_of_the_table_that_asks_for_a_key_refuses_without_one(gateway):
    from tinygw.api import app

    public = {"/", "/healthz", "/metrics", "/status", "/status.json", "/attestation", "/.well-known/hpke-keys"}
    assert {path for path, e in app.ROUTES.items() if not e.auth} == public
    for path, endpoint in app.ROUTES.items():
        url = f"{gateway.url}{path.replace('{id}', 'claude-x')}"
        status, _, _ = call(endpoint.methods[0], url, message("claude-x") if endpoint.route else None)
        assert (status == 401) == endpoint.auth, path


def test_a_new_route_cannot_forget_the_key(monkeypatch):
    """The key is checked by the dispatcher, not by the handlers: a handler that does
    not look at it is still behind it."""
    from tinygw.api import app
    from tinygw.worker.gateway import Gateway as TinyGateway

    called = []

    async def careless(gateway, scope, send) -> None:
        called.append(True)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"secret"})

    monkeypatch.setitem(app.ROUTES, "/careless", app.Endpoint(("GET",), True, page=careless))
    settings = environment.from_environ({"TINYGW_API_KEYS": "k1", "TINYGW_CONFIG": "{}"})
    sent = []

    async def send(message) -> None:
        sent.append(message)

    async def run() -> None:
        gateway = TinyGateway(settings)
        scope = {"type": "http", "path": "/careless", "method": "GET", "headers": [], "query_string": b""}
        await app.app({**scope, "state": {"gateway": gateway}}, None, send)
        await gateway.aclose()

    asyncio.run(run())
    assert sent[0]["status"] == 401 and not called
