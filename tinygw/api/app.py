"""The ASGI application: lifespan, the one route table (ROUTES, at the end) and its
dispatch, where path, method and gateway key are checked before any handler runs, and
the checks made before any attempt.

Pure ASGI: `app(scope, receive, send)`. The lifespan builds the Gateway from the
environment and puts it in the lifespan state, which Granian hands to every request;
a bad configuration fails the startup, which stops the worker. Per-request state is
kept in locals only.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import sys
from collections.abc import Awaitable

from tinygw import logs
from tinygw.api import models, proxied, sealed
from tinygw.api.attestation import attestation_page
from tinygw.api.models import MODEL_PREFIX
from tinygw.api.pages import healthz, metrics, root
from tinygw.api.status import status_json, status_page
from tinygw.config import environment
from tinygw.config.settings import CLOUDS
from tinygw.errors import ConfigError, EvidenceUnavailable
from tinygw.protocol import wire
from tinygw.protocol.routing import Endpoint, Paths, Route, api_endpoint, cloud_endpoint, page_endpoint
from tinygw.protocol.wire import send_error
from tinygw.worker import discovery, listener
from tinygw.worker.gateway import Gateway


def app(scope, receive, send) -> Awaitable[None]:
    """The ASGI app: a plain function that returns the coroutine that answers, which the
    server awaits.

    An HTTP request is dispatched here, after the checks every request passes before any
    handler runs, in this order: a route for the path (404), a method it takes (405), the
    gateway key (401)."""
    if scope["type"] != "http":
        return lifespan(scope, receive, send) if scope["type"] == "lifespan" else _ignore()
    gateway: Gateway = scope["state"]["gateway"]
    first = dict(reversed(scope["headers"]))  # each header's first value, for the few read by name
    request_id = gateway.request_ids.of(first.get(b"x-request-id"))
    endpoint = ROUTES.get(scope["path"]) or PATHS.match(scope["path"])  # exact first, then the templates
    if endpoint is None:
        not_found = 404, f"no route {scope['path']}; the routes are: {ROUTE_LIST}", "invalid_request_error", "not_found"
        return _refuse(gateway, None, scope, send, first, request_id, not_found)
    route = endpoint.route
    exchange = None  # EHBP and receipts (tinygw.api.sealed): innermost, next to the server's send
    if route is not None and gateway.confidential is not None:
        exchange = sealed.exchange(gateway, route.path, scope, first, send)
        send = exchange.send
    if endpoint.anthropic_shaped(first):
        send = wire.anthropic_errors(send)
    if scope["method"] not in endpoint.methods:
        refusal = 405, f"{scope['path']} takes {endpoint.methods[0]}", "invalid_request_error", "method_not_allowed"
        send = wire.with_headers(send, [(b"allow", ", ".join(endpoint.methods).encode())])
    elif endpoint.auth and (client := gateway.auth.client(scope["headers"])) is None:
        refusal = 401, "missing or wrong gateway key", "authentication_error", "invalid_api_key"
    elif route is not None:  # the hot path (every route asks for a key: `client` is its owner's name)
        return proxied.handle(gateway, route, scope, receive, send, first, request_id, client, exchange)  # type: ignore[arg-type]
    else:  # a row without a route is a page's (routing.page_endpoint)
        with_id = wire.with_headers(send, [(b"x-request-id", request_id)])
        page: Awaitable[None] = endpoint.page(gateway, scope, with_id)  # type: ignore[misc]
        return page
    return _refuse(gateway, route, scope, send, first, request_id, refusal)


async def _ignore() -> None:
    """Any other scope (a websocket): not served."""


async def lifespan(scope, receive, send) -> None:
    message = await receive()
    if message["type"] != "lifespan.startup":  # the server speaks ASGI lifespan otherwise
        raise RuntimeError(f"lifespan: expected lifespan.startup, got {message['type']}")
    try:
        settings = environment.from_environ()
        logs.configure(settings.log_level)
        gateway = Gateway(settings)
    except ConfigError as e:
        print(f"tinygw: configuration error: {e}", file=sys.stderr, flush=True)
        await send({"type": "lifespan.startup.failed", "message": str(e)})
        return
    except Exception as e:  # whatever it is, a worker without a gateway must not serve
        print(f"tinygw: startup failed: {type(e).__name__}", file=sys.stderr, flush=True)
        await send({"type": "lifespan.startup.failed", "message": type(e).__name__})
        return
    scope["state"]["gateway"] = gateway
    if settings.routing.debug:
        logs.log(logging.WARNING, "routing.debug is on: responses carry x-tinygw-* debug headers")
    logs.log(logging.INFO, "worker started", pid=os.getpid(), config_sha256=settings.config_sha256())
    background = [
        *discovery.start(gateway),
        asyncio.create_task(_hash_artifact(gateway), name="artifact"),
        asyncio.create_task(listener.bound_unsent(settings.port, settings.workers), name="listener"),
    ]
    # What the worker made to start lives as long as it does: frozen, it is left out of the
    # collector's passes from now on (docs/performance.md, speed choices). Collected first,
    # so that no garbage of the start is frozen with it for good.
    gc.collect()
    gc.freeze()
    await send({"type": "lifespan.startup.complete"})
    message = await receive()
    await discovery.stop(background)
    await gateway.aclose()
    logs.flush()
    await send({"type": "lifespan.shutdown.complete"})


async def _hash_artifact(gateway: Gateway) -> None:
    """The frozen executable's digests, for `tinygw_build_info` and /attestation: hashed
    off the loop once the worker serves (~40 ms for the artifact), not before."""
    try:
        sha256, _ = await gateway.artifact_hashes()
    except EvidenceUnavailable:
        return
    if sha256:
        gateway.metrics.set_artifact_sha256(sha256)


# ---- requests ------------------------------------------------------------------------


async def _refuse(
    gateway: Gateway,
    route: Route | None,
    scope,
    send,
    first: dict[bytes, bytes],
    request_id: bytes,
    refusal: tuple[int, str, str, str],
) -> None:
    """A refused request: answered (with its `x-request-id`), written on the access log,
    and counted when its route is an API's (a bounded label; an unknown path is not one)."""
    status = await send_error(wire.with_headers(send, [(b"x-request-id", request_id)]), *refusal)
    if route is not None:
        gateway.metrics.count_request(route.path, "unknown", status, 0.0)
    logs.access(
        gateway.loop or asyncio.get_running_loop(),
        scope["path"],
        scope["query_string"],
        first.get(b"user-agent"),
        logs.RequestLine(
            route=route.path if route is not None else None,
            model=None,
            status=status,
            worker=gateway.pid,
            request_id=request_id.decode(),
        ),
    )


MODEL_ROUTE = f"{MODEL_PREFIX}{{id}}"
RECEIPT_ROUTE = f"{sealed.RECEIPT_PREFIX}{{id}}"
VERTEX_MODELS = "/v1/projects/{project}/locations/{location}/publishers/anthropic/models"
# The one route table: every path the gateway answers.
ROUTES: dict[str, Endpoint] = dict(
    [
        api_endpoint("/v1/chat/completions", "openai", "/chat/completions"),
        api_endpoint("/v1/completions", "openai", "/completions"),
        api_endpoint("/v1/embeddings", "openai", "/embeddings"),
        api_endpoint("/v1/responses", "openai", "/responses"),
        api_endpoint("/v1/messages", "anthropic", "/v1/messages", reaches=("anthropic", *CLOUDS)),
        api_endpoint("/v1/messages/count_tokens", "anthropic", "/v1/messages/count_tokens"),
        page_endpoint("/v1/models", models.model_list, auth=True, both_shapes=True),
        page_endpoint(MODEL_ROUTE, models.one_model, auth=True, both_shapes=True),  # any path under MODEL_PREFIX
        page_endpoint("/", root),
        page_endpoint("/healthz", healthz),
        page_endpoint("/metrics", metrics),
        page_endpoint("/status", status_page),
        page_endpoint("/status.json", status_json),
        page_endpoint("/attestation", attestation_page),
        page_endpoint(sealed.KEYS_PATH, sealed.hpke_keys_page),
        page_endpoint(RECEIPT_ROUTE, sealed.receipt_page, auth=True),  # any path under sealed.RECEIPT_PREFIX
        # Claude as the clouds serve it (docs/design.md section 18): the model in the path
        cloud_endpoint("/model/{model}/invoke", "bedrock", stream=False),
        cloud_endpoint("/model/{model}/invoke-with-response-stream", "bedrock", stream=True),
        cloud_endpoint(f"{VERTEX_MODELS}/{{model}}:rawPredict", "vertex", stream=False),
        cloud_endpoint(f"{VERTEX_MODELS}/{{model}}:streamRawPredict", "vertex", stream=True),
    ]
)
PATHS = Paths(ROUTES)  # a path's row: exactly, or by the first template it matches
# Named in the 404 for an unknown path, so that a client learns what there is.
ROUTE_LIST = ", ".join(f"{e.methods[0]} {path}" for path, e in ROUTES.items())
