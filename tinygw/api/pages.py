"""The gateway's small pages: the base URL, liveness and metrics."""

from __future__ import annotations

from tinygw.protocol.wire import send_json
from tinygw.worker import discovery
from tinygw.worker.gateway import Gateway


async def root(gateway: Gateway, scope, send) -> None:
    """GET and HEAD /: clients probe the base URL before their first call. Nothing
    here tells more than that a tinygw answers."""
    await send_json(send, {"name": "tinygw", "status": "ok"})


async def healthz(gateway: Gateway, scope, send) -> None:
    await send_json(send, {"status": "ok"})


async def metrics(gateway: Gateway, scope, send) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")],
        }
    )
    clients = gateway.clients.in_flight(gateway.clock()) if gateway.clients is not None else {}
    body = gateway.metrics.render(clients, gateway.circuits_open_until(), discovery.listings_up(gateway))
    await send({"type": "http.response.body", "body": body})
