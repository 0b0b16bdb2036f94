"""Forwarding one client request: the attempt loop, and relaying the answer.

Targets come in the order of the model's strategy; a target whose circuit is open is
skipped (not an attempt). An attempt's ending is judged by `tinygw.resilience.outcome`; what the
loop does next follows SPEC section 4: another key of the provider after a 429, the
next target after a failure that may fall back, the one quick retry when no target is
left, and at most `routing.max_attempts` attempts. Nothing reaches the client until an
attempt is final: a non-streamed answer is held (up to HOLD_BYTES) until it can be
judged, and a stream's leading events without output are held back until output
arrives.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from msgspec import Struct

from tinygw import errors, logs
from tinygw.resilience import outcome
from tinygw.protocol import sse
from tinygw.protocol import usage
from tinygw.resilience.breaker import Outcome
from tinygw.config.settings import Target
from tinygw.worker.gateway import Gateway, Upstream
from tinygw.resilience.outcome import Verdict
from tinygw.upstream.pool import Response
from tinygw.protocol.routing import Resolution, Route
from tinygw.protocol.wire import (
    JSON_HEADERS,
    error_body,
    forward_headers,
    header,
    relay_headers,
    retry_after_seconds,
    rewrite_model,
    sse_error_event,
)

Send = Callable[[dict], Awaitable[None]]

# The pause before the one quick retry (SPEC section 4).
QUICK_RETRY_DELAY_SECONDS = 0.25

# Leading events held back before output are bounded: past this, they are sent on.
MAX_HELD_BYTES = 1024 * 1024

# A non-streamed answer is held whole, to be judged (a 200 carrying an `error`), only
# up to this size; a larger one is relayed as it arrives (SPEC section 10), so that a
# worker's memory does not grow with answer size. A 200 this large is not an error
# object; a larger error answer is passed through (or dropped) as it arrives.
HOLD_BYTES = 1024 * 1024


class Inbound(Struct, frozen=True):
    """What the gateway took from the client's request."""

    route: Route
    model: str
    stream: bool
    body: bytes
    headers: list[tuple[bytes, bytes]]
    query: bytes
    request_id: bytes = b""  # sent upstream as x-request-id


class Result(Struct):
    """How a forwarded request ended, for the access log and metrics."""

    status: int
    target: Target | None = None
    attempts: list[str] = []  # "provider:status or cause", one per attempt that ended
    current: str | None = None  # the attempt whose answer is being sent, before it ends
    cut: bool = False  # a stream that ended without a finish, or with an error after output
    tokens: usage.Tokens | None = None  # what the sent answer's `usage` reported
    first_output_at: float | None = None  # the loop's time when a stream's first output was sent


class Answer(Struct):
    """A provider's answer, not yet sent: it is sent if no later attempt is made.
    `rest` is the provider's response still being read when the answer was too large
    to hold (`body` is then its beginning); it must be relayed or closed."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes
    rest: Response | None = None

    async def discard(self) -> None:
        if self.rest is not None:
            await self.rest.aclose()


class Attempt(Struct):
    """How one attempt ended."""

    verdict: Verdict
    label: str  # for x-tinygw-attempts and the access log: a status or a cause
    committed: bool = False  # the client already has the answer (or its start)
    answer: Answer | None = None
    error: errors.UpstreamError | None = None
    retry_after_seconds: float | None = None  # a 429's Retry-After


def _upstream_request(upstream: Upstream, inbound: Inbound, target: Target, key_index: int):
    origin = upstream.provider.origin
    path = upstream.target((origin.path + inbound.route.upstream_path).encode(), inbound.query)
    client_headers = forward_headers(inbound.headers)
    if upstream.key_header is not None:  # a client's own copy of the provider's key header
        client_headers = [(k, v) for k, v in client_headers if k != upstream.key_header]
    headers = client_headers + upstream.static_headers + upstream.auth_headers[key_index]
    if inbound.request_id:
        headers.append((b"x-request-id", inbound.request_id))
    body = rewrite_model(inbound.body, inbound.model, target.upstream_model)
    return path, headers, body


def _ordered_targets(gateway: Gateway, resolution: Resolution) -> list[Target]:
    if resolution.alias is None:
        return list(resolution.targets)
    usable = set(resolution.targets)
    return [t for t in gateway.strategies.order(resolution.alias) if t in usable]


async def forward(gateway: Gateway, inbound: Inbound, resolution: Resolution, send: Send, result: Result) -> Result:
    """Forward `inbound` and answer the client; `result` is filled in as it goes, so
    that it tells what happened even when the client leaves halfway."""
    settings = gateway.settings
    queue = _ordered_targets(gateway, resolution)
    index = 0
    attempts = 0
    quick_retry_used = False
    reason: str | None = None  # why the next attempt is made
    last: Attempt | None = None
    skipped = []
    try:
        while index < len(queue) and attempts < settings.routing.max_attempts:
            if last is not None and last.answer is not None:
                await last.answer.discard()  # another attempt may follow: this answer is not sent
            target = queue[index]
            circuit = gateway.breakers.circuit(target.provider, target.upstream_model)
            if reason == "transient_retry":
                await asyncio.sleep(QUICK_RETRY_DELAY_SECONDS)  # before allow(): the circuit may move meanwhile
            ticket = circuit.allow()
            if ticket is None:
                skipped.append(circuit)
                index += 1
                continue
            try:
                if reason is not None:
                    gateway.metrics.count_retry(circuit.provider, circuit.provider_model, reason)
                    if reason == "transient_retry":
                        logs.log(
                            logging.INFO,
                            "retrying provider after a quick failure",
                            provider=target.provider,
                            provider_model=target.upstream_model,
                            failure=last.label,
                            delay_ms=int(QUICK_RETRY_DELAY_SECONDS * 1000),
                        )
                upstream = gateway.upstreams[target.provider]
                key_index = upstream.keys.pick(gateway.clock())
                attempts += 1
                result.target = target
                last = await _attempt(gateway, upstream, inbound, target, key_index, send, result)
            except asyncio.CancelledError:  # the client left mid-attempt (the one await above)
                ticket.done(Outcome.NEUTRAL)
                gateway.metrics.count_attempt(circuit.provider, circuit.provider_model, "client_closed")
                raise
            except BaseException:
                ticket.done(Outcome.NEUTRAL)
                raise
            ticket.done(last.verdict.outcome, None if last.verdict.outcome is not Outcome.FAILURE else last.label)
            gateway.board.publish_circuit(circuit)
            result.attempts.append(f"{target.provider}:{last.label}")
            result.current = None
            gateway.metrics.count_attempt(circuit.provider, circuit.provider_model, last.label)
            if last.committed:
                result.status = last.answer.status if last.answer is not None else 200
                return result

            # What next (SPEC section 4).
            now = gateway.clock()
            if last.label == "429":
                upstream.keys.rest(key_index, now, last.retry_after_seconds)
                if upstream.keys.has_other(key_index, now):
                    reason = "key_rotation"
                    continue
            if not last.verdict.may_fall_back:
                break
            if any(gateway.breakers.circuit(t.provider, t.upstream_model).available() for t in queue[index + 1 :]):
                reason = "fallback"
                index += 1
                continue
            if (
                last.verdict.quick
                and settings.retry_fast_failures
                and not quick_retry_used
                and attempts < settings.routing.max_attempts
                and circuit.available()
            ):
                quick_retry_used = True
                reason = "transient_retry"
                continue
            break

        if last is not None:
            return await _send_final(send, result, last, result.target)
        return await _send_circuit_open(send, result, skipped, resolution)
    finally:  # whatever ended the request, no provider answer is left half-read
        if last is not None and last.answer is not None:
            await last.answer.discard()


async def _attempt(
    gateway: Gateway, upstream: Upstream, inbound: Inbound, target: Target, key_index: int, send: Send, result: Result
) -> Attempt:
    path, headers, body = _upstream_request(upstream, inbound, target, key_index)
    started = gateway.clock()
    try:
        response = await upstream.pool.request(b"POST", path, headers, body)
    except errors.UpstreamError as e:
        return Attempt(outcome.of_error(e), e.cause, error=e)
    elapsed = gateway.clock() - started
    gateway.metrics.observe_first_byte(target.provider, elapsed)
    held = False  # the answer keeps the response open: it is relayed or discarded later
    try:
        content_type = header(response.headers, b"content-type") or b""
        if inbound.stream and response.status == 200 and content_type.startswith(b"text/event-stream"):
            return await _relay_stream(response, send, result, gateway.loop or asyncio.get_running_loop())
        data, ended = await response.read_upto(HOLD_BYTES)
        held = not ended
    except errors.UpstreamError as e:
        return Attempt(outcome.of_error(e), e.cause, error=e)
    finally:
        if not held:
            await response.aclose()
    answer = Answer(response.status, relay_headers(response.headers), data, None if ended else response)
    reported = None
    if ended and response.status == 200 and (b"json" in content_type or not content_type):
        failed, reported = outcome.judge(data)
        if failed:
            answer.status = 502  # SPEC: a 200 carrying an error is a failure; the client gets 502
            return Attempt(outcome.ERROR_IN_BODY, "200+error", answer=answer)
    verdict = outcome.of_status(response.status, elapsed)
    attempt = Attempt(verdict, str(response.status), answer=answer)
    if response.status == 429:
        attempt.retry_after_seconds = retry_after_seconds(
            header(response.headers, b"retry-after"), gateway.settings.breaker.max_open_seconds
        )
    if verdict.outcome is Outcome.SUCCESS:
        result.current = f"{target.provider}:{response.status}"
        if reported is not None:
            result.tokens = usage.Tokens()
            result.tokens.add(reported)
        attempt.committed = True
        try:
            sent = await _send_answer(send, answer)
        except BaseException:  # the client left (or send failed) while a large answer was relayed
            await answer.discard()
            raise
        if not sent:
            result.cut = True
            attempt.verdict = Verdict(Outcome.FAILURE, may_fall_back=False)
            attempt.label = f"{response.status}+cut"
    return attempt


async def _relay_stream(response, send: Send, result: Result, loop: asyncio.AbstractEventLoop) -> Attempt:
    """Hold leading events without output; on output, commit and relay as it comes.

    Before output, an error event, a broken connection or an end without output is a
    failure that may still fall back (the held events become a 502 answer, sent only
    if no other attempt is made). After output, nothing is switched: a failure, an
    error event or an end without a finish reason is a failure, and the client's
    stream ends with an SSE error event, never as a clean end.
    """
    start = {"type": "http.response.start", "status": 200, "headers": relay_headers(response.headers)}
    held: list[bytes] = []
    held_bytes = 0
    tokens = usage.Tokens()
    pending = b""  # bytes not yet split into events
    committed = False
    finished = False
    error_after_output = False

    def after_output(event: bytes) -> None:
        """An event once output was sent: only the cheap scan, unless it may end the
        answer or carry an error; its `usage`, if any, counted."""
        nonlocal finished, error_after_output
        if sse.may_end_or_fail(event):
            event_kind, done = sse.kind(event)
            finished |= done
            error_after_output |= event_kind is sse.Kind.ERROR
        if b'"usage"' in event:
            tokens.add(usage.of_event(event))

    def after_output_block(block: bytes, end: int) -> None:
        """The complete events of `block[:end]`, sent after output: one scan of the
        bytes finds the few that need a look (sse.suspects), not a step per event."""
        for event in sse.suspects(block, end):
            after_output(event)

    while True:
        try:
            chunk = await response.next_chunk()
        except errors.UpstreamError as e:
            if not committed:
                return Attempt(outcome.of_error(e), e.cause, error=e)
            return await _end_stream_with_error(send, result, f"the provider failed mid-stream: {e}", e.cause)
        if chunk is None:
            break
        data = pending + chunk if pending else chunk
        if committed:  # all that arrived goes on in one message
            end = sse.last_end(data)
            if end:
                after_output_block(data, end)
            pending = data[end:]
            if len(pending) > MAX_HELD_BYTES:  # no event boundary in sight: stop looking
                after_output(pending)
                pending = b""
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            continue
        events, pending = sse.split(data)
        if len(pending) > MAX_HELD_BYTES:  # no event boundary in sight: stop looking
            events.append(pending)
            pending = b""
        for i, event in enumerate(events):
            event_kind, done = sse.kind(event)
            if event_kind is sse.Kind.ERROR:
                answer = Answer(502, start["headers"], b"".join(held) + event)
                return Attempt(outcome.ERROR_EVENT, "200+error_event", answer=answer)
            held.append(event)
            held_bytes += len(event)
            finished |= done
            if b'"usage"' in event:
                tokens.add(usage.of_event(event))
            if event_kind is sse.Kind.OUTPUT or held_bytes > MAX_HELD_BYTES:
                committed = True
                result.current = f"{result.target.provider}:200"
                later = b"".join(events[i + 1 :])  # in the same read as the first output
                after_output_block(later, len(later))
                await send(start)
                body = b"".join(held) + later + pending
                await send({"type": "http.response.body", "body": body, "more_body": True})
                result.first_output_at = loop.time()
                result.tokens = tokens  # counted from here on: this answer is the client's
                break
    if not committed:
        answer = Answer(502, start["headers"], b"".join(held) + pending)
        return Attempt(outcome.ERROR_EVENT, "200+no_output", answer=answer)
    if error_after_output:
        result.cut = True
        await send({"type": "http.response.body", "body": b""})  # the provider's error event was relayed
        return Attempt(Verdict(Outcome.FAILURE, may_fall_back=False), "200+error_event", committed=True)
    if not finished:
        logs.log(logging.WARNING, "stream cut", provider=result.target.provider,
                 provider_model=result.target.upstream_model)
        return await _end_stream_with_error(send, result, "the provider ended the stream without a finish", "cut")
    await send({"type": "http.response.body", "body": b""})
    return Attempt(outcome.SUCCESS, "200", committed=True)


async def _end_stream_with_error(send: Send, result: Result, message: str, cause: str) -> Attempt:
    result.cut = True
    event = sse_error_event(message, "provider_unavailable", cause=cause)
    await send({"type": "http.response.body", "body": event})
    return Attempt(Verdict(Outcome.FAILURE, may_fall_back=False), f"200+{cause}", committed=True)


async def _send_answer(send: Send, answer: Answer) -> bool:
    """Send `answer`: whole when it was held whole, else its beginning and then the
    rest as it arrives. False when the provider failed partway: the client's answer
    then ends without its last chunk, which HTTP clients report as an incomplete body."""
    if answer.rest is None:
        headers = [*answer.headers, (b"content-length", b"%d" % len(answer.body))]
        await send({"type": "http.response.start", "status": answer.status, "headers": headers})
        await send({"type": "http.response.body", "body": answer.body})
        return True
    await send({"type": "http.response.start", "status": answer.status, "headers": answer.headers})
    await send({"type": "http.response.body", "body": answer.body, "more_body": True})
    while True:
        try:
            chunk = await answer.rest.next_chunk()
        except errors.UpstreamError:
            return False  # nothing more is sent: the client's answer is cut, not ended
        if chunk is None:
            await send({"type": "http.response.body", "body": b""})
            return True
        await send({"type": "http.response.body", "body": chunk, "more_body": True})


async def _send_final(send: Send, result: Result, last: Attempt, target: Target) -> Result:
    """The last attempt failed: pass its answer through, or say why there is none."""
    if last.answer is not None:
        result.status = last.answer.status
        if not await _send_answer(send, last.answer):
            result.cut = True
        return result
    e = last.error
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


async def _send_circuit_open(send: Send, result: Result, skipped, resolution: Resolution) -> Result:
    """Every usable target's circuit is open: 503 with the wait until the next probe."""
    circuit = min(skipped, key=lambda c: c.retry_after() or 0.0)
    result.status = 503
    result.target = Target(circuit.provider, circuit.provider_model)
    retry_after = circuit.retry_after_header()
    body = error_body(
        f"every target of {resolution.model!r} is unavailable (circuit open); retry after {retry_after} s",
        "provider_unavailable",
        "circuit_open",
        cause="circuit_open",
        provider=circuit.provider,
        provider_model=circuit.provider_model,
    )
    headers = [*JSON_HEADERS, (b"retry-after", b"%d" % retry_after)]
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": body})
    return result
