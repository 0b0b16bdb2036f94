"""A request to a proxied API route, in three steps, whatever ends it: admitted (its
client's limits, when clients are configured; its body read within its bounds and opened
when it is sealed; its model known on the route), forwarded (tinygw.worker.proxy), and
accounted (its metrics and access-log line, from its record).

A request is cancelled when its client leaves (`ClientWatch`): its attempt's upstream
connection is then closed at once, and it is counted as 499.
"""

from __future__ import annotations

import asyncio
import logging

from msgspec import UNSET, UnsetType
from msgspec.structs import replace

from tinygw import logs
from tinygw.api.body import ClientLeft, ClientWatch, Refused, read_body
from tinygw.config.settings import DEFAULT_CLIENT
from tinygw.errors import SealedBodyRefused, UnsendableRequest
from tinygw.protocol.conversation import conversation_key
from tinygw.protocol.request import BadBody, read_head, with_usage_asked
from tinygw.protocol.routing import Resolution, Route
from tinygw.protocol.wire import send_error
from tinygw.resilience.limits import OverLimit
from tinygw.worker import proxy
from tinygw.worker.gateway import Gateway
from tinygw.worker.record import Record

# A proxied request starts watching for its client leaving this long after it came, or
# after its body was read when that took longer (a task waiting in receive() costs about
# a tenth of a quick request's CPU); until then its ClientWatch looks this often.
WATCH_AFTER_SECONDS = 0.05

# The routes whose streams report their usage only when the body asks for it
# (`stream_options.include_usage`): the gateway asks, for a client charged by its tokens.
USAGE_ASKED_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions"})


async def handle(
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
    """A request to `route` (its gateway key checked at dispatch: that of `client`):
    admitted, forwarded, accounted. `first` is its headers by name (each one's first
    value); `exchange` its EHBP and receipts (tinygw.api.sealed), when they are on."""
    loop = gateway.loop or asyncio.get_running_loop()
    record = Record(request_id, loop.time(), client)
    gateway.metrics.add_in_flight(1)
    task = asyncio.current_task(loop)  # the request's, which the watch cancels when its client leaves
    watch = ClientWatch(receive, task, loop, record, gateway.settings.client_timeout_seconds, WATCH_AFTER_SECONDS)  # type: ignore[arg-type]
    try:
        try:
            if gateway.clients is None or await _within_limits(gateway, send, record):
                body = await read_body(receive, first.get(b"content-length"), gateway.settings.max_body_bytes, watch)
                if exchange is not None:  # opened (or refused) before anything reads it
                    body = await exchange.open(body, record)
                inbound, resolution, send = _inbound(gateway, route, scope, send, body, record, exchange)
                await proxy.forward(gateway, inbound, resolution, send, record)
        finally:
            watch.stop()  # before any error answer
    except BaseException as e:
        await _ended_by(e, gateway, route, send, record, watch, exchange)
    finally:
        if exchange is not None:
            exchange.close()
        _account(gateway, route, scope, first, record, loop)


async def _within_limits(gateway: Gateway, send, record: Record) -> bool:
    """Whether the client's limits admit the request (counted in, then); else it is
    answered 429 at once: no attempt, no circuit moved (docs/design.md section 16)."""
    clients = gateway.clients
    refusal = clients.admit(record.client, gateway.clock())  # type: ignore[union-attr]  # configured
    if refusal is None:
        record.admitted_in()
        return True
    record.limited_by(refusal.limit)
    await _answer_limited(gateway, send, record, refusal)
    return False


def _inbound(
    gateway: Gateway, route: Route, scope, send, body: bytes, record: Record, exchange
) -> tuple[proxy.Inbound, Resolution, object]:
    """What the gateway takes from the request's `body` (read, and opened when sealed):
    its model resolved on `route`, and the `send` its answer goes through (counted, for a
    client charged by its tokens). Refused (404) or BadBody when it cannot be."""
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
    client = record.client
    inbound = proxy.Inbound(
        route=route,
        model=model,
        stream=head.stream is True if route.stream is None else route.stream,  # None: no `stream`
        body=body,
        headers=scope["headers"],
        query=scope["query_string"],
        request_id=record.request_id,
        # its target and key, when its conversation chooses them (decided per name, not per request)
        conversation=conversation_key(head, scope["headers"], client) if resolution.affinity else None,
    )
    if gateway.clients is not None and client in gateway.clients.charged:  # by its tokens: every answer is charged
        send = record.charging(send, body)
        inbound = _usage_asked(inbound)
    if gateway.settings.routing.debug:
        record.forwarding(gateway.breakers)
    return inbound, resolution, send


def _usage_asked(inbound: proxy.Inbound) -> proxy.Inbound:
    """`inbound`, for a client charged by its tokens: a stream of USAGE_ASKED_ROUTES asks
    for its usage if the client did not."""
    if inbound.stream and inbound.route.path in USAGE_ASKED_ROUTES and (body := with_usage_asked(inbound.body)):
        return replace(inbound, body=body, usage_asked=True)
    return inbound


async def _ended_by(
    e: BaseException, gateway: Gateway, route: Route, send, record: Record, watch: ClientWatch, exchange
) -> None:
    """What an exception that ended the request means for its client: the gateway's error
    answer for the client's mistakes and its own failures, nothing for a client that
    left; a cancellation that is not the client's (the server stops) goes on."""
    if isinstance(e, Refused):  # read_body's, or an unknown model
        await _answer_error(send, record, e.status, str(e), "invalid_request_error", e.code)
        if isinstance(e, ClientLeft):
            record.client_left()
    elif isinstance(e, BadBody):  # read_head, or request.rewrite_model for an attempt
        await _answer_error(send, record, 400, str(e), "invalid_request_error", "invalid_body")
    elif isinstance(e, UnsendableRequest):  # the client's head cannot be forwarded: found before any byte went out
        await _answer_error(send, record, 400, str(e), "invalid_request_error", "invalid_request")
    elif isinstance(e, SealedBodyRefused):  # an EHBP body that does not open: the protocol's error, in the clear
        await exchange.refuse(e, record)
    elif isinstance(e, Exception):  # an OSError too: Granian's send never raises one, so it is the gateway's own
        logs.log_exception("request failed inside the gateway", route=route.path)
        if not record.status:  # else the client sees its response end early
            await _answer_error(send, record, 500, "internal gateway error", "internal_error", "internal_error")
        record.failed()
    elif isinstance(e, asyncio.CancelledError) and watch.took_back():  # the client left
        record.client_left()
        if watch.stalled:  # it did not take its answer: cut, its upstream connection closed with the attempt
            logs.log(
                logging.WARNING,
                "client stalled",
                route=route.path,
                model=record.model,
                request_id=record.request_id.decode(),
                timeout_seconds=gateway.settings.client_timeout_seconds,
            )
    else:  # the server is stopping (or the gateway failed it otherwise)
        record.failed()
        raise e


async def _answer_limited(gateway: Gateway, send, record: Record, refusal: OverLimit) -> None:
    """429 for a request over its client's limit (docs/design.md section 16), saying which
    (`x-tinygw-limit`) and when a request would pass it (`Retry-After`)."""
    value = gateway.clients.clients[record.client].limits()[refusal.limit]  # type: ignore[union-attr]
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
    `handle`."""

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


def _account(
    gateway: Gateway, route: Route, scope, first: dict, record: Record, loop: asyncio.AbstractEventLoop
) -> None:
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
    tokens_estimated: bool | UnsetType = UNSET
    if gateway.clients is not None:
        tokens_estimated = _count_client(gateway, record, prompt, completion)
    if record.first_output_at is not None:
        gateway.metrics.observe_first_token(record.model, record.first_output_at - record.started_at)
    logs.access(
        loop,
        scope["path"],
        scope["query_string"],
        first.get(b"user-agent"),
        logs.RequestLine(
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
            tokens_estimated=tokens_estimated,
        ),
    )


def _count_client(gateway: Gateway, record: Record, prompt: int, completion: int) -> bool | UnsetType:
    """The request, counted for its named client: out of flight, its tokens charged to
    its minute (an estimate for an answer that reported none, when the client is charged
    by its tokens), its metrics. For the access line, whether its tokens were estimated
    (UNSET: the client is not charged by its tokens)."""
    estimated = record.estimate()
    if record.limited is not None:
        gateway.metrics.count_limited(record.client, record.limited)
    else:
        if record.admitted:
            charged = prompt + completion if estimated is None else estimated
            gateway.clients.finish(record.client, charged, gateway.clock())  # type: ignore[union-attr]
        gateway.metrics.count_client(record.client, record.status, prompt, completion)
    return UNSET if record.charged_bytes is None else estimated is not None
