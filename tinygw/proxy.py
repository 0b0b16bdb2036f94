"""Forwarding one client request to a provider and relaying the answer.

A non-streamed answer is read whole (it is small, and reading it before the client
sees anything is what lets a failed attempt be replaced); a streamed one (`stream:
true` answered with `text/event-stream`) is relayed chunk by chunk as it arrives.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from msgspec import Struct

from tinygw import errors
from tinygw.config import Target
from tinygw.gateway import Gateway, Upstream
from tinygw.routing import Resolution, Route
from tinygw.wire import (
    JSON_HEADERS,
    error_body,
    forward_headers,
    header,
    relay_headers,
    rewrite_model,
    sse_error_event,
)

Send = Callable[[dict], Awaitable[None]]


class Inbound(Struct, frozen=True):
    """What the gateway took from the client's request."""

    route: Route
    model: str
    stream: bool
    body: bytes
    headers: list[tuple[bytes, bytes]]
    query: bytes


class Result(Struct):
    """How a forwarded request ended, for the access log and metrics."""

    status: int
    target: Target | None = None
    attempts: list[str] = []
    cut: bool = False  # a stream that ended without a clean end


def _upstream_request(upstream: Upstream, inbound: Inbound, target: Target, key_index: int):
    origin = upstream.provider.origin
    path = (origin.path + inbound.route.upstream_path).encode()
    if inbound.query:
        path += b"?" + inbound.query
    headers = (
        forward_headers(inbound.headers) + upstream.static_headers + upstream.auth_headers[key_index]
    )
    body = rewrite_model(inbound.body, inbound.model, target.upstream_model)
    return path, headers, body


async def forward(gateway: Gateway, inbound: Inbound, resolution: Resolution, send: Send, result: Result) -> Result:
    """Forward `inbound` and answer the client; `result` is filled in as it goes, so
    that it tells what happened even when the client leaves halfway."""
    target = resolution.targets[0]
    upstream = gateway.upstreams[target.provider]
    path, headers, body = _upstream_request(upstream, inbound, target, 0)
    result.target = target
    try:
        response = await upstream.pool.request(b"POST", path, headers, body)
    except errors.UpstreamError as e:
        result.attempts.append(f"{target.provider}:{e.cause}")
        return await _send_upstream_error(send, result, target, e)
    result.attempts.append(f"{target.provider}:{response.status}")
    result.status = response.status
    try:
        content_type = header(response.headers, b"content-type") or b""
        if inbound.stream and response.status == 200 and content_type.startswith(b"text/event-stream"):
            await _relay_stream(send, response, result)
            return result
        data = await response.read()
    except errors.UpstreamError as e:
        return await _send_upstream_error(send, result, target, e)
    finally:
        await response.aclose()
    response_headers = relay_headers(response.headers)
    response_headers.append((b"content-length", b"%d" % len(data)))
    await send({"type": "http.response.start", "status": response.status, "headers": response_headers})
    await send({"type": "http.response.body", "body": data})
    return result


async def _relay_stream(send: Send, response, result: Result) -> None:
    await send({"type": "http.response.start", "status": response.status, "headers": relay_headers(response.headers)})
    try:
        while (chunk := await response.next_chunk()) is not None:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
    except errors.UpstreamError as e:
        result.cut = True
        event = sse_error_event(f"the provider failed mid-stream: {e}", "provider_unavailable", cause=e.cause)
        await send({"type": "http.response.body", "body": event})
        return
    await send({"type": "http.response.body", "body": b""})


async def _send_upstream_error(send: Send, result: Result, target: Target, e: errors.UpstreamError) -> Result:
    result.status = 504 if e.cause == "timeout" else 502
    body = error_body(
        f"provider {target.provider} failed: {e}",
        "provider_unavailable",
        e.cause,
        cause=e.cause,
        provider=target.provider,
        provider_model=target.upstream_model,
    )
    await send({"type": "http.response.start", "status": result.status, "headers": JSON_HEADERS})
    await send({"type": "http.response.body", "body": body})
    return result
