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

from msgspec.structs import replace

from tinygw import logs
from tinygw.api import models, sealed
from tinygw.api.attestation import attestation_page
from tinygw.api.body import ClientLeft, ClientWatch, Refused, read_body
from tinygw.api.models import MODEL_PREFIX
from tinygw.api.pages import healthz, metrics, root
from tinygw.api.status import status_json, status_page
from tinygw.config import environment
from tinygw.config.settings import CLOUDS, DEFAULT_CLIENT
from tinygw.errors import ConfigError, EvidenceUnavailable, SealedBodyRefused, UnsendableRequest
from tinygw.protocol import wire
from tinygw.protocol.conversation import conversation_key
from tinygw.protocol.routing import Endpoint, Paths, Route, api_endpoint, cloud_endpoint, page_endpoint
from tinygw.protocol.wire import BadBody, read_head, send_error, with_usage_asked
from tinygw.resilience.limits import Refusal
from tinygw.worker import discovery, listener, proxy
from tinygw.worker.gateway import Gateway
from tinygw.worker.record import Record

# A proxied request starts watching for its client leaving this long after it came, or
# after its body was read when that took longer (a task waiting in receive() costs about
# a tenth of a quick request's CPU); until then its ClientWatch looks this often.
WATCH_AFTER_SECONDS = 0.05

# asyncio.current_task(loop): on Python 3.11 a Python function around the get of asyncio's own
# dict of current tasks, a frame per request for one lookup; from 3.12 on it is C.
if sys.version_info >= (3, 12):
    _current_task = asyncio.current_task
else:
    _current_task = asyncio.tasks._current_tasks.get  # type: ignore[attr-defined]


def app(scope, receive, send) -> Awaitable[None]:
    """The ASGI app: a plain function that returns the coroutine that answers, which the
    server awaits (a coroutine frame fewer on every request than awaiting it here).

    An HTTP request is dispatched here, after the checks every request passes before any
    handler runs, in this order: a route for the path (404), a method it takes (405), the
    gateway key (401)."""
    if scope["type"] != "http":
        return lifespan(scope, receive, send) if scope["type"] == "lifespan" else _ignore()
    gateway: Gateway = scope["state"]["gateway"]
    first = dict(reversed(scope["headers"]))  # each header's first value, for the few read by name
    request_id = gateway.request_ids.of(first.get(b"x-request-id"))
    endpoint = ROUTES.get(scope["path"]) or PATHS.match(scope["path"])  # exact first: no frame on the hot path
    if endpoint is None:
        not_found = 404, f"no route {scope['path']}; the routes are: {ROUTE_LIST}", "invalid_request_error", "not_found"
        return _refuse(gateway, None, scope, _with_request_id(send, request_id), first, request_id, not_found)
    route = endpoint.route
    exchange = None  # EHBP and receipts (tinygw.api.sealed): innermost, next to the server's send
    if route is not None and gateway.confidential is not None:
        exchange = sealed.exchange(gateway, route.path, scope, first, send)
        send = exchange.send
    if endpoint.anthropic_shaped(first):
        send = wire.anthropic_errors(send)
    if scope["method"] not in endpoint.methods:
        refusal = 405, f"{scope['path']} takes {endpoint.methods[0]}", "invalid_request_error", "method_not_allowed"
    elif endpoint.auth and (client := gateway.auth.client(scope["headers"])) is None:
        refusal = 401, "missing or wrong gateway key", "authentication_error", "invalid_api_key"
    elif route is not None:  # the hot path (every route asks for a key: `client` is its owner's name)
        return _proxy(gateway, route, scope, receive, send, first, request_id, client, exchange)  # type: ignore[arg-type]
    else:  # a row without a route is a page's (routing.page_endpoint)
        page: Awaitable[None] = endpoint.page(gateway, scope, _with_request_id(send, request_id))  # type: ignore[misc]
        return page
    return _refuse(gateway, route, scope, _with_request_id(send, request_id), first, request_id, refusal)


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
    # What the worker made to start lives as long as it does: the collector's full passes,
    # which hold the loop while they run, leave it out from now on (8.5 -> 2.8 ms each at
    # 32 connections: docs/performance.md). Collected first, so that no garbage of the
    # start is frozen with it for good.
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
    """A refused request: answered, written on the access log, and counted when its
    route is an API's (a bounded label; an unknown path is not one)."""
    status = await send_error(send, *refusal)
    if route is not None:
        gateway.metrics.count_request(route.path, "unknown", status, 0.0)
    logs.access(
        gateway.loop or asyncio.get_running_loop(),
        scope["path"],
        scope["query_string"],
        first.get(b"user-agent"),
        route=route.path if route is not None else None,
        model=None,
        status=status,
        worker=gateway.pid,
        request_id=request_id.decode(),
    )


def _with_request_id(send, request_id: bytes):
    """`send`, with `x-request-id` added to the answer's head (pages and refusals; a
    proxied answer gets it from its record, tinygw.worker.record)."""

    async def send_with_id(message) -> None:
        if message["type"] == "http.response.start":
            message["headers"] = [*message["headers"], (b"x-request-id", request_id)]
        await send(message)

    return send_with_id


async def _proxy(
    gateway: Gateway,
    route: Route,
    scope,
    receive,
    send,
    first: dict,
    request_id: bytes,
    client: str = DEFAULT_CLIENT,
    exchange=None,
) -> None:
    """A request to a proxied route (its gateway key checked at dispatch: that of `client`):
    admitted (within its client's limits, its body read within its bounds and opened when
    it is sealed, its model known on the route), then forwarded, cancelled
    if its client leaves (its attempt's upstream connection is then closed at once);
    counted and logged from its record, whatever ended it. `first` is its headers by name
    (each one's first value)."""
    loop = gateway.loop or asyncio.get_running_loop()
    record = Record(request_id, loop.time(), client)
    gateway.metrics.add_in_flight(1)
    settings = gateway.settings
    # _current_task(loop): the request's task (_proxy runs in it), which the watch cancels when its client leaves
    watch = ClientWatch(
        receive, _current_task(loop), loop, record, settings.client_timeout_seconds, WATCH_AFTER_SECONDS
    )
    try:
        try:
            refusal = gateway.clients.admit(client, gateway.clock())
            if refusal is not None:  # answered at once: no attempt, no circuit moved
                record.limited_by(refusal.limit)
                return await _answer_limited(gateway, send, record, refusal)
            record.admitted_in()
            body = await read_body(receive, first.get(b"content-length"), settings.max_body_bytes, watch)
            if exchange is not None:  # opened (or refused) before anything reads it
                body = await exchange.open(body, record)
            head = read_head(body, route.model_in(scope["path"]))  # a cloud shape's model is in its path
            model: str = head.model  # type: ignore[assignment]  # read_head refuses a body without one
            if exchange is not None:
                exchange.named(model)
            resolution = gateway.resolver.resolve(route, model)
            if resolution is None:
                raise Refused(404, f"the model {model!r} does not exist on {route.path}", "model_not_found")
            if exchange is not None and route.pattern is None:  # a sealed body's names (not a path's) concealed
                resolution = exchange.shown(resolution, gateway.breakers.by_target)
            record.resolved(resolution.model)
            inbound = proxy.Inbound(
                route=route,
                model=model,
                stream=head.stream is True if route.stream is None else route.stream,  # None: no `stream`
                body=body,
                headers=scope["headers"],
                query=scope["query_string"],
                request_id=request_id,
                # its target and key, when its conversation chooses them (decided per name, not per request)
                conversation=conversation_key(head, scope["headers"], client) if resolution.affinity else None,
            )
            if client in gateway.clients.charged:  # by its tokens: every answer is charged
                send = record.charging(send, body)
                inbound = _usage_asked(inbound)
            if settings.routing.debug:
                record.forwarding(gateway.breakers)
            await proxy.forward(gateway, inbound, resolution, send, record)
        finally:
            watch.stop()  # before any error answer below
    except Refused as e:  # read_body's, or an unknown model
        await _answer_error(send, record, e.status, str(e), "invalid_request_error", e.code)
        if isinstance(e, ClientLeft):
            record.client_left()
    except BadBody as e:  # read_head, or wire.rewrite_model for an attempt
        await _answer_error(send, record, 400, str(e), "invalid_request_error", "invalid_body")
    except UnsendableRequest as e:  # the client's head cannot be forwarded: found before any byte went out
        await _answer_error(send, record, 400, str(e), "invalid_request_error", "invalid_request")
    except SealedBodyRefused as e:  # an EHBP body that does not open: the protocol's error, in the clear
        await exchange.refuse(e, record)
    except Exception:  # an OSError too: Granian's send never raises one, so it is the gateway's own
        logs.log_exception("request failed inside the gateway", route=route.path)
        if not record.status:  # else the client sees its response end early
            await _answer_error(send, record, 500, "internal gateway error", "internal_error", "internal_error")
        record.failed()
    except asyncio.CancelledError:
        if not watch.took_back():  # not (only) the client's leaving: the server is stopping
            record.failed()
            raise
        record.client_left()
        if watch.stalled:  # it did not take its answer: cut, its upstream connection closed with the attempt
            logs.log(
                logging.WARNING,
                "client stalled",
                route=route.path,
                model=record.model,
                request_id=request_id.decode(),
                timeout_seconds=settings.client_timeout_seconds,
            )
    except BaseException:
        record.failed()
        raise
    finally:
        if exchange is not None:
            exchange.close()
        _account(gateway, route, scope, first, record, loop)


async def _answer_limited(gateway: Gateway, send, record: Record, refusal: Refusal) -> None:
    """429 for a request over its client's limit (docs/design.md section 16), saying which
    (`x-tinygw-limit`) and when a request would pass it (`Retry-After`)."""
    value = gateway.clients.clients[record.client].limits()[refusal.limit]
    message = f"the client {record.client!r} is over its {refusal.limit} ({value}); retry after {refusal.retry_after} s"
    limit_headers = ((b"retry-after", b"%d" % refusal.retry_after), (b"x-tinygw-limit", refusal.limit.encode()))
    await _answer_error(send, record, 429, message, "rate_limit_error", "rate_limit_exceeded", limit_headers)


async def _answer_error(
    send, record: Record, status: int, message: str, type_: str, code: str, headers: tuple = ()
) -> None:
    """Answer the client with an error of the gateway's own, whose head the record
    makes, as a proxied answer's (x-request-id, `headers`, and the debug headers once
    forwarding began). A failure while it is answered is the gateway's, logged here (the type only)
    and not raised (a cancellation is): the request is still counted and logged once, by
    _proxy."""

    async def send_with_head(message) -> None:
        if message["type"] == "http.response.start":
            message = record.head(message["status"], [*message["headers"], *headers])
        await send(message)

    try:
        await send_error(send_with_head, status, message, type_, code)
    except Exception:  # not raised: the server would log its traceback, messages (the client's text) and all
        logs.log_exception("error answer failed inside the gateway", model=record.model)
        record.failed()
    except BaseException:  # a cancellation (the server's: the watch is stopped): the gateway failed it
        record.failed()
        raise


def _account(gateway: Gateway, route, scope, first: dict, record: Record, loop: asyncio.AbstractEventLoop) -> None:
    """The request's metrics and access-log line, from its record."""
    duration = loop.time() - record.started_at
    target = record.target
    tokens = record.tokens
    prompt = completion = 0
    if tokens is None or target is None:  # no answer that reported its tokens was sent
        gateway.metrics.count_proxied(route.path, record.model, record.status, duration, None, 0, 0)
    else:
        prompt, completion = tokens.prompt, tokens.completion
        gateway.metrics.count_proxied(
            route.path, record.model, record.status, duration, target.provider, prompt, completion
        )
    estimated, charged_fields = (None, _NO_FIELDS) if record.charged_bytes is None else record.estimate()
    if record.limited is not None:
        gateway.metrics.count_limited(record.client, record.limited)
    else:
        if record.admitted:  # out of flight, its tokens charged to its client's minute
            charged = prompt + completion if estimated is None else estimated
            gateway.clients.finish(record.client, charged, gateway.clock())
        gateway.metrics.count_client(record.client, record.status, prompt, completion)
    if record.first_output_at is not None:
        gateway.metrics.observe_first_token(record.model, record.first_output_at - record.started_at)
    logs.access(
        loop,
        scope["path"],
        scope["query_string"],
        first.get(b"user-agent"),
        route=route.path,
        model=record.model,
        status=record.status,
        worker=gateway.pid,
        request_id=record.request_id.decode(),
        client=record.client,
        target=target.name if target else None,
        attempts=",".join(record.attempts),
        cut=record.cut,
        duration_ms=round(duration * 1000, 1),
        **charged_fields,
    )


# The routes whose streams report their usage only when the body asks for it
# (`stream_options.include_usage`): the gateway asks, for a client charged by its tokens.
USAGE_ASKED_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions"})
_NO_FIELDS: dict = {}


def _usage_asked(inbound: proxy.Inbound) -> proxy.Inbound:
    """`inbound`, for a client charged by its tokens: a stream of USAGE_ASKED_ROUTES asks
    for its usage if the client did not."""
    if inbound.stream and inbound.route.path in USAGE_ASKED_ROUTES and (body := with_usage_asked(inbound.body)):
        return replace(inbound, body=body, usage_asked=True)
    return inbound


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
