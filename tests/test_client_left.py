"""A client that leaves while the gateway answers it: the request is still counted and
logged once, as a client that left (499, no error line), and the provider exchange it
caused is still counted and observed once (docs/design.md sections 4 and 7).

Granian (2.8.9) neither fails nor waits in `send` once a client is gone: a whole answer's
send returns an awaitable that is done at once, even after a reset, and a chunk sent to
a closed connection is dropped with an info line ("ASGI transport error"). So an OSError
in the gateway is the gateway's own (a metrics file that cannot grow, a file limit), and
is logged as its failure, never taken for a client that left. A send that waits while
the client reads nothing can happen on another ASGI server: the request's watch then
cancels it there. These tests play such a server, in process (`tinygw.api.proxied.handle`),
against a fake provider on loopback. The black-box test at the end holds what a real
gateway shows: a client that leaves while its body is read is logged once as 499, with
no error line."""

from __future__ import annotations

import asyncio
import json
import socket

import msgspec

from conftest import metric_in, provider, wait_until

MODEL_BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()


def _config(fake) -> dict:
    return {"providers": {"p": provider(fake)}, "models": {"m": {"targets": ["p:up"]}}}


def _metric(gateway, name: str, **labels: str) -> float:
    """The sum of the samples of `name` with `labels` in the worker's metrics, 0 if none."""
    return metric_in(gateway.metrics.render().decode(), name, **labels) or 0.0


def _proxied(fake, receive, send, content_length: bytes | None = None, env: dict | None = None):
    """Run one request to /v1/chat/completions through the app's `_proxy` on a gateway of
    its own; returns (the gateway, the access lines' fields) once it is over."""
    from tinygw import logs
    from tinygw.api import app, proxied
    from tinygw.config import environment
    from tinygw.worker.gateway import Gateway

    lines: list[dict] = []

    async def run():
        settings = environment.from_environ({"TINYGW_CONFIG": json.dumps(_config(fake)), **(env or {})})
        gateway = Gateway(settings)
        headers = [(b"content-type", b"application/json")]
        if content_length is not None:
            headers.append((b"content-length", content_length))
        scope = {
            "type": "http",
            "path": "/v1/chat/completions",
            "method": "POST",
            "headers": headers,
            "query_string": b"",
        }
        route = app.ROUTES["/v1/chat/completions"].route
        first = dict(reversed(headers))
        try:
            await asyncio.wait_for(proxied.handle(gateway, route, scope, receive, send, first, b"request-1"), 10)
        finally:
            await gateway.aclose()
        return gateway

    original = logs.access
    logs.access = lambda loop, path, query, agent, line: lines.append(msgspec.structs.asdict(line))
    try:
        return asyncio.run(run()), lines
    finally:
        logs.access = original


def _body_then_wait(body: bytes):
    """`receive`: the whole body, then nothing (the client stays)."""
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        if messages:
            return messages.pop()
        await asyncio.sleep(3600)

    return receive


async def _send_fails(message) -> None:
    raise OSError("the client left")


# ---- an error answer to a client that is gone --------------------------------------


def test_a_client_that_left_during_its_body_is_499_even_when_its_400_cannot_be_sent(fake):
    messages = [{"type": "http.disconnect"}, {"type": "http.request", "body": b"{", "more_body": True}]

    async def receive():
        return messages.pop()

    gateway, lines = _proxied(fake, receive, _send_fails)
    assert [line["status"] for line in lines] == [499]
    assert _metric(gateway, "tinygw_requests_total", status="499") == 1


def test_an_internal_error_whose_500_cannot_be_sent_is_logged_500_once_and_not_raised(fake, monkeypatch):
    from tinygw.worker import proxy

    async def broken(*args) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(proxy, "forward", broken)
    gateway, lines = _proxied(fake, _body_then_wait(MODEL_BODY), _send_fails)
    assert [line["status"] for line in lines] == [500]
    assert _metric(gateway, "tinygw_requests_total") == 1


def test_a_bug_while_an_error_is_answered_is_logged_by_the_gateway_not_raised_to_the_server(fake, monkeypatch, caplog):
    """Granian logs an exception that leaves the app at error, with its traceback and every
    message in its chain (a refusal's quotes the client's model): none must leave it."""
    from tinygw.api import app

    async def broken(*args) -> int:
        raise RuntimeError("a bug")

    monkeypatch.setattr(app, "send_error", broken)
    body = json.dumps({"model": "nope", "messages": []}).encode()
    gateway, lines = _proxied(fake, _body_then_wait(body), _send_fails)
    assert [line["status"] for line in lines] == [500]
    assert _metric(gateway, "tinygw_requests_total") == 1
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == [
        "error answer failed inside the gateway"
    ]


# ---- a held answer whose client leaves while it is sent -----------------------------


def test_a_held_answer_s_exchange_is_observed_once_when_its_client_leaves_as_it_is_sent(fake):
    """The provider answered (a small answer, held whole and judged); the client leaves
    while its answer goes out (the server's send waits: the client reads nothing). The
    request's watch cancels it there: the attempt is counted once, as the client's
    closing, and its first byte is observed once."""
    sending = asyncio.Event()
    messages = [{"type": "http.request", "body": MODEL_BODY, "more_body": False}]

    async def receive():
        if messages:
            return messages.pop()
        await sending.wait()  # the watch's receive: the client leaves once its answer is being sent
        return {"type": "http.disconnect"}

    async def send(message) -> None:
        sending.set()
        await asyncio.sleep(3600)  # the client reads nothing

    gateway, lines = _proxied(fake, receive, send)
    assert [line["status"] for line in lines] == [499]
    assert _metric(gateway, "tinygw_upstream_attempts_total", provider="p") == 1
    assert _metric(gateway, "tinygw_upstream_attempts_total", provider="p", outcome="client_closed") == 1
    assert _metric(gateway, "tinygw_upstream_first_byte_seconds_count", provider="p") == 1
    assert len(fake.requests) == 1


def test_a_held_answer_s_exchange_is_observed_once_when_it_reaches_its_client(fake):
    """The usual end, for contrast: one attempt, one first byte."""
    sent: list[dict] = []

    async def send(message) -> None:
        sent.append(message)

    gateway, lines = _proxied(fake, _body_then_wait(MODEL_BODY), send)
    assert [line["status"] for line in lines] == [200]
    assert _metric(gateway, "tinygw_upstream_attempts_total", provider="p", outcome="200") == 1
    assert _metric(gateway, "tinygw_upstream_first_byte_seconds_count", provider="p") == 1


def test_an_oserror_of_the_gateway_s_own_is_its_failure_not_a_client_that_left(fake, monkeypatch, caplog):
    """A metrics file that cannot grow raises an OSError after the client had its answer:
    the gateway's failure, logged; not a client that left (499, no error line)."""
    from tinygw.observe import metrics

    def cannot_grow(*args, **kwargs) -> None:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(metrics.Metrics, "count_attempt", cannot_grow)
    sent: list[dict] = []

    async def send(message) -> None:
        sent.append(message)

    gateway, lines = _proxied(fake, _body_then_wait(MODEL_BODY), send)
    assert [m.get("status") for m in sent if m["type"] == "http.response.start"] == [200]
    assert [line["status"] for line in lines] != [499]
    assert "request failed inside the gateway" in [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]


# ---- black-box: what a real gateway shows -------------------------------------------


def test_a_client_that_leaves_while_its_body_is_read_is_logged_once_as_499_without_an_error(fake, start_gateway):
    gateway = start_gateway(_config(fake))
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", gateway.port), timeout=10) as client:
            client.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100\r\n\r\n{"
            )

    def requests() -> list[dict]:
        return [r for r in gateway.log_records() if r.get("msg") == "request"]

    wait_until(lambda: len(requests()) >= 3, seconds=5, what="three access lines")
    assert [r["status"] for r in requests()] == [499, 499, 499]
    assert [r for r in gateway.log_records() if r.get("level") in ("error", "critical")] == []
    assert fake.requests == []
