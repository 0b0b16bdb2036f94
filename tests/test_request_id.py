"""Request ids: every answer carries `x-request-id` (the client's when sane, else a new
one), the access-log line names it, and the provider gets it; the provider's own id
comes back as `x-upstream-request-id`. Black-box, a real gateway process."""

from __future__ import annotations

import http.client
import json
import re

import pytest

from conftest import Gateway, call, closed_port, module_fake, wait_until
from tinygw.config import environment
from tinygw.errors import ConfigError
from tinygw.fake.upstream import well_behaved
from tinygw.protocol import wire

GATEWAY_KEY = "gw-key-rid"
NEW_ID = re.compile(r"[0-9a-f]{16}")


fake, fresh_fake = module_fake()


@pytest.fixture(scope="module")
def gateway(fake, tmp_path_factory):
    config = {
        "providers": {
            "oa": {"base_url": f"{fake.url}/v1", "api": "openai"},
            "dead": {"base_url": f"http://127.0.0.1:{closed_port()}/v1", "api": "openai"},
        },
        "models": {"gpt-x": {"targets": ["oa:upstream-gpt"]}, "dead-model": {"targets": ["dead:m"]}},
        "routing": {"debug": True},
    }
    log = tmp_path_factory.mktemp("gw") / "gateway.log"
    gw = Gateway(
        config, {"TINYGW_API_KEYS": GATEWAY_KEY, "PROVIDER_LISTING_SECONDS": "0", "TINYGW_MAX_BODY_BYTES": "1000"}, log
    )
    yield gw
    gw.stop()


def chat(gateway, request_id: str | None = None, stream: bool = False, model: str = "gpt-x"):
    headers = {"Authorization": f"Bearer {GATEWAY_KEY}"}
    if request_id is not None:
        headers["X-Request-Id"] = request_id
    return call("POST", f"{gateway.url}/v1/chat/completions", {"model": model, "stream": stream}, headers=headers)


def access_line(gateway, request_id: str) -> dict:
    return wait_until(
        lambda: next(
            (r for r in gateway.log_records() if r.get("msg") == "request" and r.get("request_id") == request_id), None
        ),
        what="the request's access-log line",
    )


def test_a_sane_client_id_is_kept_logged_and_forwarded(gateway, fake):
    given = "Client-42.retry:1_a"
    status, headers, _ = chat(gateway, given)
    assert status == 200
    assert headers.get_all("x-request-id") == [given]
    [request] = fake.requests
    assert request.headers["x-request-id"] == given
    assert access_line(gateway, given)["status"] == 200


def test_without_a_client_id_a_new_one_is_made(gateway, fake):
    ids = []
    for _ in range(2):
        status, headers, _ = chat(gateway)
        assert status == 200
        [answered] = headers.get_all("x-request-id")
        assert NEW_ID.fullmatch(answered)
        ids.append(answered)
    assert ids[0] != ids[1]
    assert [r.headers["x-request-id"] for r in fake.requests] == ids
    assert access_line(gateway, ids[1])["model"] == "gpt-x"


@pytest.mark.parametrize("given", ["has space", "x" * 129, 'quote"d', "semi;colon", "new\u00e9", "{json}"])
def test_an_insane_client_id_is_replaced(gateway, fake, given):
    connection = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=10)
    body = json.dumps({"model": "gpt-x"}).encode()
    connection.putrequest("POST", "/v1/chat/completions")
    for name, value in (
        ("Authorization", f"Bearer {GATEWAY_KEY}"),
        ("Content-Type", "application/json"),
        ("Content-Length", str(len(body))),
    ):
        connection.putheader(name, value)
    connection.putheader("X-Request-Id", given.encode("utf-8"))
    connection.endheaders(body)
    response = connection.getresponse()
    response.read()
    connection.close()
    assert response.status == 200
    answered = response.getheader("x-request-id")
    assert NEW_ID.fullmatch(answered)
    [request] = fake.requests
    assert request.headers["x-request-id"] == answered


def test_the_longest_sane_id_is_kept(gateway):
    given = "a" * 128
    assert chat(gateway, given)[1]["x-request-id"] == given


@pytest.mark.parametrize("stream", [False, True])
def test_the_providers_id_comes_back_as_x_upstream_request_id(gateway, fake, stream):
    def script(request):
        reply = well_behaved("fake")(request)
        reply.headers = [*reply.headers, ("x-request-id", "req_provider_7")]
        return reply

    fake.script = script
    status, headers, _ = chat(gateway, "mine-1", stream=stream)
    assert status == 200
    assert headers.get_all("x-request-id") == ["mine-1"]
    assert headers["x-upstream-request-id"] == "req_provider_7"
    assert headers["x-tinygw-attempts"] == "oa:200"  # the debug headers are still there


@pytest.mark.parametrize(
    "method,path,body,authorized,status",
    [
        ("GET", "/healthz", None, False, 200),
        ("GET", "/metrics", None, False, 200),
        ("GET", "/status.json", None, False, 200),
        ("GET", "/v1/models", None, True, 200),
        ("GET", "/v1/models/gpt-x", None, True, 200),
        ("GET", "/v1/models/nope", None, True, 404),
        ("GET", "/nope", None, False, 404),
        ("GET", "/v1/chat/completions", None, True, 405),
        ("POST", "/v1/chat/completions", {"model": "gpt-x"}, False, 401),
        ("POST", "/v1/chat/completions", b"not json", True, 400),
        ("POST", "/v1/chat/completions", {"model": "nope"}, True, 404),
        ("POST", "/v1/chat/completions", {"model": "gpt-x", "pad": "x" * 2000}, True, 413),
        ("POST", "/v1/chat/completions", {"model": "dead-model"}, True, 502),
    ],
)
def test_every_answer_carries_a_request_id(gateway, method, path, body, authorized, status):
    headers = {"Authorization": f"Bearer {GATEWAY_KEY}"} if authorized else {}
    answered_status, answered, _ = call(
        method, f"{gateway.url}{path}", body, headers={**headers, "x-request-id": "r-1"}
    )
    assert answered_status == status
    assert answered.get_all("x-request-id") == ["r-1"]
    answered_status, answered, _ = call(method, f"{gateway.url}{path}", body, headers=headers)
    assert answered_status == status
    assert NEW_ID.fullmatch(answered["x-request-id"])


def test_request_id_rule():
    ids = wire.RequestIds()
    assert ids.of(b"a.b:c-d_9") == b"a.b:c-d_9"
    assert ids.of(b"a" * 128) == b"a" * 128
    for bad in (b"", b"a" * 129, b"a b", b"a\tb", b"a/b", b"\xc3\xa9", b"a\r\nb"):
        assert NEW_ID.fullmatch(ids.of(bad).decode())
    assert NEW_ID.fullmatch(ids.of(None).decode())


def test_a_provider_header_may_not_set_the_request_id():
    document = {
        "providers": {"p": {"base_url": "http://127.0.0.1:1", "api": "openai", "headers": {"X-Request-Id": "fixed"}}}
    }
    with pytest.raises(ConfigError, match=r"headers\.X-Request-Id"):
        environment.from_environ({"TINYGW_CONFIG": json.dumps(document)})


def test_new_request_ids_do_not_repeat_across_draws_or_workers():
    first, second = wire.RequestIds(), wire.RequestIds()  # two workers' gateways
    ids = [ids.of(None) for ids in (first, second) for _ in range(3 * wire.IDS_PER_DRAW + 1)]
    assert len(set(ids)) == len(ids)
    assert all(NEW_ID.fullmatch(i.decode()) for i in ids)


def test_a_request_id_is_drawn_even_when_another_thread_took_the_new_ones(monkeypatch):
    # Free-threaded workers share their gateway's ids: between this draw and its pop,
    # another thread may take them all.
    drawn = wire.RequestIds._draw

    def drawn_and_taken(self) -> None:
        drawn(self)
        self._unused.clear()

    monkeypatch.setattr(wire.RequestIds, "_draw", drawn_and_taken)
    assert NEW_ID.fullmatch(wire.RequestIds().of(None).decode())
