"""The ASGI application: lifespan, routes, and the checks made before any attempt.

Pure ASGI: `app(scope, receive, send)`. The lifespan builds the Gateway from the
environment and puts it in the lifespan state, which Granian hands to every request;
a bad configuration fails the startup, which stops the worker. Per-request state is
kept in locals only.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from urllib.parse import parse_qs, quote

import msgspec

from tinygw import config, discovery, logs, proxy, wire
from tinygw.attestation import artifact_digests, attestation_page
from tinygw.errors import ConfigError, EvidenceUnavailable
from tinygw.gateway import Gateway
from tinygw.routing import ROUTES, resolve
from tinygw.status import status_json, status_page
from tinygw.wire import JSON_HEADERS, BadBody, error_body, header, read_head

_encode = msgspec.json.Encoder()

# The status logged and counted for a request whose client left before its answer
# (nginx's convention; never sent, there is nobody to send it to).
CLIENT_CLOSED = 499


class ClientLeft(Exception):
    """The client disconnected while the gateway was still reading its request."""


async def app(scope, receive, send) -> None:
    kind = scope["type"]
    if kind == "http":
        await handle(scope["state"]["gateway"], scope, receive, send)
    elif kind == "lifespan":
        await lifespan(scope, receive, send)


async def lifespan(scope, receive, send) -> None:
    message = await receive()
    assert message["type"] == "lifespan.startup"
    try:
        settings = config.from_environ()
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
    background = [*discovery.start(gateway), asyncio.create_task(_hash_artifact(gateway), name="artifact")]
    await send({"type": "lifespan.startup.complete"})
    message = await receive()
    await discovery.stop(background)
    await gateway.aclose()
    await send({"type": "lifespan.shutdown.complete"})


async def _hash_artifact(gateway: Gateway) -> None:
    """The frozen executable's digests, for `tinygw_build_info` and /attestation: hashed
    off the loop once the worker serves (~40 ms for the artifact), not before."""
    try:
        gateway.artifact_digests = await asyncio.to_thread(artifact_digests)
    except EvidenceUnavailable:
        return
    if gateway.artifact_digests[0]:
        gateway.metrics.set_artifact_sha256(gateway.artifact_digests[0])


# ---- requests ------------------------------------------------------------------------


async def handle(gateway: Gateway, scope, receive, send) -> None:
    path = scope["path"]
    method = scope["method"]
    request_id = wire.request_id(scope["headers"])
    route = ROUTES.get(path)
    if route is not None and method == "POST":  # the hot path: its answers get the id in _proxy
        await _proxy(gateway, route, scope, receive, send, request_id)
        return
    send = _with_request_id(send, request_id)
    if route is not None:
        if method != "POST":
            await _error(send, 405, f"{path} takes POST", "invalid_request_error", "method_not_allowed")
    elif path in _PAGES or path.startswith(MODEL_PREFIX):
        if method not in ("GET", "HEAD"):
            await _error(send, 405, f"{path} takes GET", "invalid_request_error", "method_not_allowed")
            return
        if path in _PAGES:
            await _PAGES[path](gateway, scope, send)
        else:
            await _model(gateway, scope, send, path[len(MODEL_PREFIX):])
    else:
        await _error(send, 404, f"no route {path}; the routes are: {ROUTE_LIST}", "invalid_request_error",
                     "not_found")


def _with_request_id(send, request_id: bytes):
    """`send`, with `x-request-id` added to the answer's head (pages and refusals; a
    proxied request's answer gets it in _proxy's own wrapper)."""
    async def send_with_id(message) -> None:
        if message["type"] == "http.response.start":
            message["headers"] = [*message["headers"], (b"x-request-id", request_id)]
        await send(message)

    return send_with_id


async def _proxy(gateway: Gateway, route, scope, receive, send, request_id: bytes = b"") -> None:
    request_id = request_id or wire.new_request_id()
    loop = gateway.loop or asyncio.get_running_loop()
    started = loop.time()
    headers = scope["headers"]
    model = "unknown"
    status = 500
    result = proxy.Result(status=0)
    response_started = False
    forwarding = False  # debug headers describe attempts: only once there may be some
    id_header = (b"x-request-id", request_id)

    async def send_tracked(message) -> None:
        nonlocal response_started
        if message["type"] == "http.response.start":
            response_started = True
            if forwarding and gateway.settings.routing.debug:
                message["headers"] = [*message["headers"], id_header, *_debug_headers(gateway, result)]
            else:
                message["headers"] = [*message["headers"], id_header]
        await send(message)

    gateway.metrics.add_in_flight(1)
    try:
        if not gateway.auth.allows(headers):
            status = await _error(send_tracked, 401, "missing or wrong gateway key", "authentication_error", "invalid_api_key")
            return
        try:
            body = await _read_body(receive, headers, gateway.settings.max_body_bytes,
                                    gateway.settings.client_timeout_seconds, loop)
        except ClientLeft:
            # Granian reports a malformed chunked body the same way as a client that
            # left: answer 400 (a client that really left will not read it), and count
            # it as a client that left, which is what it most often is.
            await _error(send_tracked, 400, "the request body is incomplete or its chunked framing is malformed",
                         "invalid_request_error", "invalid_body")
            status = CLIENT_CLOSED
            return
        except TimeoutError:
            limit = gateway.settings.client_timeout_seconds
            status = await _error(send_tracked, 408, f"no byte of the request body for {limit:g} s",
                                  "invalid_request_error", "request_timeout")
            return
        if body is None:
            limit = gateway.settings.max_body_bytes
            status = await _error(
                send_tracked, 413, f"request body over {limit} bytes", "invalid_request_error", "request_too_large"
            )
            return
        head = read_head(body)
        resolution = resolve(gateway.settings, route, head.model)
        if resolution is None:
            message = f"the model {head.model!r} does not exist on {route.path}"
            status = await _error(send_tracked, 404, message, "invalid_request_error", "model_not_found")
            return
        model = resolution.model
        inbound = proxy.Inbound(
            route=route,
            model=head.model,
            stream=bool(head.stream),
            body=body,
            headers=headers,
            query=scope.get("query_string", b""),
            request_id=request_id,
        )
        # The client leaving cancels this task, and with it the attempt: its upstream
        # connection is closed at once.
        task = asyncio.current_task(loop)
        client_left: list[bool] = []
        watcher = loop.create_task(_cancel_when_client_leaves(receive, task, client_left))
        forwarding = True
        try:
            await proxy.forward(gateway, inbound, resolution, send_tracked, result)
            status = result.status
        except asyncio.CancelledError:
            if not client_left or task.cancelling() > 1:  # also cancelled from elsewhere
                raise
            task.uncancel()
            status = CLIENT_CLOSED
        finally:
            watcher.cancel()
    except BadBody as e:
        status = await _error(send_tracked, 400, str(e), "invalid_request_error", "invalid_body")
    except ClientLeft:
        status = CLIENT_CLOSED
    except Exception:
        logs.log_exception("request failed inside the gateway", route=route.path)
        if not response_started:  # else the client sees its response end early
            status = await _error(send_tracked, 500, "internal gateway error", "internal_error", "internal_error")
    finally:
        metrics = gateway.metrics
        metrics.add_in_flight(-1)
        metrics.count_request(route.path, model, status, loop.time() - started)
        if result.tokens is not None and result.target is not None:
            metrics.count_tokens(result.target.provider, model, result.tokens.prompt, result.tokens.completion)
        if result.first_output_at is not None:
            metrics.observe_first_token(model, result.first_output_at - started)
        logs.access(
            route=route.path,
            model=model,
            status=status,
            worker=gateway.pid,
            request_id=request_id.decode(),
            target=str(result.target) if result.target else None,
            attempts=",".join(result.attempts),
            cut=result.cut,
            duration_ms=round((loop.time() - started) * 1000, 1),
        )


def _debug_headers(gateway: Gateway, result: proxy.Result) -> list[tuple[bytes, bytes]]:
    """SPEC section 7's x-tinygw-* headers, only with `routing.debug` on. The circuit's
    state is the one when the answer started (a probe's verdict comes after)."""
    attempts = [*result.attempts, *([result.current] if result.current else [])]
    headers = [(b"x-tinygw-attempts", _header_value(",".join(attempts)))]
    if result.target is not None:
        circuit = gateway.breakers.circuit(result.target.provider, result.target.upstream_model)
        headers += [
            (b"x-tinygw-provider", _header_value(result.target.provider)),
            (b"x-tinygw-provider-model", _header_value(result.target.upstream_model)),
            (b"x-tinygw-circuit", circuit.state().value.encode()),
        ]
    return headers


def _header_value(text: str) -> bytes:
    """Visible ASCII as is, anything else percent-encoded: a provider-qualified model
    is the client's own text, and a line break in a header would break the response."""
    return quote(text, safe="".join(chr(c) for c in range(0x21, 0x7F) if chr(c) != "%")).encode()


async def _cancel_when_client_leaves(receive, task: asyncio.Task, client_left: list[bool]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    client_left.append(True)
    task.cancel()


async def _receive_within(receive, timeout_seconds: float, loop: asyncio.AbstractEventLoop):
    """`await receive()`, or TimeoutError after `timeout_seconds`. asyncio.timeout's
    work with the loop at hand: asyncio's own looks the loop up twice (two getpid(2)
    on Python 3.11), for each request."""
    task = asyncio.current_task(loop)
    expired = []

    def expire() -> None:
        expired.append(True)
        task.cancel()

    timer = loop.call_later(timeout_seconds, expire)
    try:
        message = await receive()
        if expired:  # the timer fired as the message came: as asyncio.timeout, take the cancel back
            task.uncancel()
        return message
    except asyncio.CancelledError:
        if expired and task.uncancel() == 0:
            raise TimeoutError from None
        raise
    finally:
        timer.cancel()


async def _read_body(receive, headers, limit: int, timeout_seconds: float,
                     loop: asyncio.AbstractEventLoop) -> bytes | None:
    """The whole request body, or None when it is over `limit` bytes. Raises
    TimeoutError when `timeout_seconds` pass without a byte of it (SPEC section 10)."""
    declared = header(headers, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        return None
    parts = []
    size = 0
    while True:
        message = await _receive_within(receive, timeout_seconds, loop)
        if message["type"] == "http.disconnect":
            raise ClientLeft
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            await _discard_body(receive, message, timeout_seconds, loop)
            return None
        parts.append(chunk)
        if not message.get("more_body"):
            return b"".join(parts) if len(parts) != 1 else parts[0]


# After a body goes over the limit, up to this much more of it is read and dropped
# so that the client, still sending, gets its 413 rather than a broken pipe.
DISCARD_BYTES = 1024 * 1024


async def _discard_body(receive, message, timeout_seconds: float, loop: asyncio.AbstractEventLoop) -> None:
    discarded = 0
    while message.get("more_body") and discarded < DISCARD_BYTES:
        try:
            message = await _receive_within(receive, timeout_seconds, loop)
        except TimeoutError:
            return
        if message["type"] == "http.disconnect":
            raise ClientLeft
        discarded += len(message.get("body", b""))


async def _error(send, status: int, message: str, type_: str, code: str | None = None) -> int:
    await send({"type": "http.response.start", "status": status, "headers": JSON_HEADERS})
    await send({"type": "http.response.body", "body": error_body(message, type_, code)})
    return status


# ---- pages ----------------------------------------------------------------------------


async def _send_json(send, value, status: int = 200) -> None:
    await send({"type": "http.response.start", "status": status, "headers": JSON_HEADERS})
    await send({"type": "http.response.body", "body": _encode.encode(value)})


async def _healthz(gateway: Gateway, scope, send) -> None:
    await _send_json(send, {"status": "ok"})


def _model_entries(gateway: Gateway) -> list[dict]:
    """SPEC section 6: every model alias, then `provider/upstream_model` for each model
    of each provider whose last listing succeeded, each with its `availability`: true
    if any of its targets' circuits admits an attempt now, else `retry_after`, whole
    seconds until the soonest probe."""
    # Circuits are looked up, not made: a circuit that no attempt has made yet is closed,
    # and reading this page must not add circuits (and metric series) for every listed model.
    circuits = {(c.provider, c.provider_model): c for c in gateway.breakers.all()}
    models = gateway.settings.models
    entries = [(name, "tinygw", [(t.provider, t.upstream_model) for t in models[name].targets])
               for name in sorted(models)]
    for provider in sorted(gateway.listings):
        for upstream_model in gateway.listings[provider]:
            if f"{provider}/{upstream_model}" not in models:  # else the alias is what a request gets
                entries.append((f"{provider}/{upstream_model}", provider, [(provider, upstream_model)]))
    data = []
    for model_id, owner, targets in entries:
        known = [circuits[t] for t in targets if t in circuits]
        available = len(known) < len(targets) or any(c.available() for c in known)
        retry_after = None if available else min(c.retry_after_header() for c in known)
        data.append(
            {
                "id": model_id,
                "object": "model",
                "created": 0,
                "owned_by": owner,
                "availability": {"available": available, "retry_after": retry_after},
            }
        )
    return data


# The models' creation time is not known to the gateway: 0 in OpenAI's shape, the
# same instant in Anthropic's.
_EPOCH = "1970-01-01T00:00:00Z"
# Anthropic's page size: 20 unless the request's `limit` (1 to 1000) says otherwise.
ANTHROPIC_PAGE = 20
ANTHROPIC_MAX_PAGE = 1000


def _anthropic_entry(entry: dict) -> dict:
    """A model in the shape of Anthropic's Models API, with tinygw's `availability`."""
    return {"type": "model", "id": entry["id"], "display_name": entry["id"], "created_at": _EPOCH,
            "availability": entry["availability"]}


def _anthropic_page(data: list[dict], query: bytes) -> dict | str:
    """One page of the list as Anthropic's API pages it (`limit`, `after_id`,
    `before_id`), or the reason the query is refused. An id not in the list gives an
    empty page."""
    params = {k: v[-1] for k, v in parse_qs(query.decode("latin-1")).items()}
    limit = params.get("limit", str(ANTHROPIC_PAGE))
    if not limit.isdigit() or not 1 <= int(limit) <= ANTHROPIC_MAX_PAGE:
        return f"limit must be an integer from 1 to {ANTHROPIC_MAX_PAGE}"
    limit = int(limit)
    ids = [e["id"] for e in data]
    if "before_id" in params:
        end = ids.index(params["before_id"]) if params["before_id"] in ids else 0
        page, has_more = data[max(0, end - limit) : end], end - limit > 0
    else:
        after = params.get("after_id")
        start = 0 if after is None else ids.index(after) + 1 if after in ids else len(ids)
        page, has_more = data[start : start + limit], start + limit < len(ids)
    return {"data": page, "has_more": has_more, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None}


async def _models(gateway: Gateway, scope, send) -> None:
    """GET /v1/models: OpenAI's list, or Anthropic's pages when the request carries
    `anthropic-version` (as Anthropic's SDKs send it)."""
    if not gateway.auth.allows(scope["headers"]):
        await _error(send, 401, "missing or wrong gateway key", "authentication_error", "invalid_api_key")
        return
    data = _model_entries(gateway)
    if header(scope["headers"], b"anthropic-version") is None:
        await _send_json(send, {"object": "list", "data": data})
        return
    page = _anthropic_page([_anthropic_entry(e) for e in data], scope.get("query_string", b""))
    if isinstance(page, str):
        await _error(send, 400, page, "invalid_request_error", "invalid_query")
        return
    await _send_json(send, page)


async def _model(gateway: Gateway, scope, send, model_id: str) -> None:
    """GET /v1/models/{id}: one entry of the list (the id may hold '/'), or 404."""
    if not gateway.auth.allows(scope["headers"]):
        await _error(send, 401, "missing or wrong gateway key", "authentication_error", "invalid_api_key")
        return
    for entry in _model_entries(gateway):
        if entry["id"] == model_id:
            anthropic = header(scope["headers"], b"anthropic-version") is not None
            await _send_json(send, _anthropic_entry(entry) if anthropic else entry)
            return
    await _error(send, 404, f"the model {model_id!r} does not exist", "invalid_request_error", "model_not_found")


async def _metrics(gateway: Gateway, scope, send) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")],
        }
    )
    await send({"type": "http.response.body", "body": gateway.metrics.render()})


_PAGES = {"/healthz": _healthz, "/v1/models": _models, "/metrics": _metrics, "/status": status_page, "/status.json": status_json,
          "/attestation": attestation_page}
MODEL_PREFIX = "/v1/models/"
# Named in the 404 for an unknown path, so that a client learns what there is.
ROUTE_LIST = ", ".join([*(f"POST {p}" for p in ROUTES), "GET /v1/models", f"GET {MODEL_PREFIX}{{id}}",
                        *(f"GET {p}" for p in _PAGES if p != "/v1/models")])
