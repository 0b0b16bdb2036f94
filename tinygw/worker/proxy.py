"""Forwarding one client request: the attempt loop (its answer is sent by tinygw.worker.answers).

Targets come in the order of the model's strategy; a target whose circuit is open is
skipped (not an attempt). An attempt's ending is judged by `tinygw.resilience.outcome`,
and what follows it is decided once, in `_next_attempt` (docs/design.md section 4):
another key of the provider after a 429, the context fallback after a prompt too long,
the next target after a failure that may fall back, the one quick retry when no target
is left, and at most `routing.max_attempts` attempts. Nothing reaches the client until an attempt is final:
a non-streamed answer is held (up to HOLD_BYTES) until it can be judged, and a stream's
leading events without output are held back until output arrives (tinygw.worker.relay).
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Awaitable, Callable, Sequence

from tinygw import errors, logs
from tinygw.config.settings import Model, Target
from tinygw.protocol import clouds, eventstream, sse
from tinygw.protocol.routing import Resolution
from tinygw.protocol.wire import (
    carries_account_headers,
    header,
    relay_headers,
    retry_after_seconds,
)
from tinygw.resilience import outcome
from tinygw.resilience.breaker import Circuit, Outcome, Ticket
from tinygw.resilience.breakers import Breakers
from tinygw.upstream.pool import Response
from tinygw.worker import answers, frames
from tinygw.worker.gateway import Gateway
from tinygw.worker.record import Attempt, HeldAnswer, Inbound, Record
from tinygw.worker.relay import Events, Relay
from tinygw.worker.upstreams import Upstream

Send = Callable[[dict], Awaitable[None]]

# The pause before the one quick retry (docs/design.md section 4).
QUICK_RETRY_DELAY_SECONDS = 0.25

# A non-streamed answer is held whole, to be judged (a 200 carrying an `error`), only
# up to this size; a larger one is relayed as it arrives (docs/design.md section 10), so
# that a worker's memory does not grow with answer size. A 200 this large is not an
# error object; a larger error answer is passed through (or dropped) as it arrives.
HOLD_BYTES = 1024 * 1024


_SUCCESS = Outcome.SUCCESS  # the usual outcome, as a module name (docs/performance.md)


class Retry(enum.Enum):
    """Why another attempt is made; the value is tinygw_provider_retries_total's `reason`."""

    KEY_ROTATION = "key_rotation"  # the same target with another key, after a 429
    FALLBACK = "fallback"  # a later target whose circuit admits an attempt
    QUICK = "transient_retry"  # the same target once more, after a quick failure


def _ordered_targets(gateway: Gateway, alias: Model, usable: tuple[Target, ...], inbound: Inbound) -> Sequence[Target]:
    """The `usable` targets of `alias` in the order of its strategy, for `inbound` (by its
    conversation, when that chooses)."""
    order = gateway.strategies.order(alias, inbound.conversation)
    if len(usable) == len(alias.targets):  # every target is usable on this route
        return order
    return [t for t in order if t in usable]


def _admit(breakers: Breakers, targets: Sequence[Target], start: int) -> tuple[int, Ticket | None]:
    """The first of `targets[start:]` whose circuit admits an attempt, and its ticket:
    (index, ticket), or (len(targets), None) when none does."""
    for index in range(start, len(targets)):
        ticket = breakers.by_target[targets[index]].allow()
        if ticket is not None:
            return index, ticket
    return len(targets), None


async def forward(gateway: Gateway, inbound: Inbound, resolution: Resolution, send: Send, record: Record) -> None:
    """Forward `inbound` and answer the client: one attempt after another while the last
    is not final, then the last one's answer, or why there is none. `record` is kept up
    to date as it goes, so that it tells what happened even when the client leaves
    halfway. Whatever ends the request, no provider answer is left half-read."""
    alias = resolution.alias  # None: a fixed order, the targets' own
    targets = resolution.targets if alias is None else _ordered_targets(gateway, alias, resolution.targets, inbound)
    index, ticket = _admit(gateway.breakers, targets, 0)
    if ticket is None:  # every circuit refused: each one is named by the 503's wait
        return await answers.send_circuit_open(
            send, record, [gateway.breakers.by_target[t] for t in targets], resolution
        )
    attempt = await _make_attempt(gateway, inbound, resolution, targets[index], ticket, send, record)
    if attempt.committed:  # the usual end: the first attempt's answer was the client's, and was read to its end
        return
    try:
        attempts_left = gateway.settings.routing.max_attempts - 1
        quick = False  # the one quick retry was used
        while not attempt.committed:
            following = (
                await _next_attempt(gateway, resolution, targets, index, ticket.circuit, attempt, quick)
                if attempts_left
                else None
            )
            if following is None:
                return await answers.send_final(send, record, attempt, targets[index])
            retry, targets, index, ticket = following
            attempts_left -= 1
            quick = quick or retry is Retry.QUICK
            await attempt.discard()
            _count_retry(gateway, targets[index], ticket.circuit, retry, attempt.judged.label)
            attempt = await _make_attempt(gateway, inbound, resolution, targets[index], ticket, send, record)
    finally:
        await attempt.discard()  # safe twice, and once the answer was read to its end


async def _next_attempt(
    gateway: Gateway,
    resolution: Resolution,
    targets: Sequence[Target],
    index: int,
    circuit: Circuit,
    last: Attempt,
    quick_retry_used: bool,
) -> tuple[Retry, Sequence[Target], int, Ticket] | None:
    """Whether another attempt follows `last` (made at `targets[index]`, whose circuit
    is `circuit`): why, at which of which targets (the model's, or after a prompt too long
    for a target's context, its `context_fallback`), with its ticket; None when `last` is
    final."""
    longer = resolution.context_fallback
    if last.other_key:
        retry = Retry.KEY_ROTATION
    elif last.judged.verdict.too_long and longer:  # on to a longer context, in order
        later, ticket = _admit(gateway.breakers, longer, index + 1 if targets is longer else 0)
        return (Retry.FALLBACK, longer, later, ticket) if ticket is not None else None
    elif not last.judged.verdict.may_fall_back:
        return None
    else:
        later, ticket = _admit(gateway.breakers, targets, index + 1)
        if ticket is not None:
            return Retry.FALLBACK, targets, later, ticket
        # No target is left: the one quick retry, unless this failure opened the circuit.
        verdict = last.judged.verdict
        if not (
            verdict.quick and gateway.settings.retry_fast_failures and not quick_retry_used and circuit.available()
        ):
            return None
        retry = Retry.QUICK
        await asyncio.sleep(QUICK_RETRY_DELAY_SECONDS)  # before allow(): the circuit may move meanwhile
    index, ticket = _admit(gateway.breakers, targets, index)
    return (retry, targets, index, ticket) if ticket is not None else None


def _count_retry(gateway: Gateway, target: Target, circuit: Circuit, retry: Retry, failure: str) -> None:
    gateway.metrics.count_retry(circuit.provider, circuit.label, retry.value)
    if retry is Retry.QUICK:
        logs.log(
            logging.INFO,
            "retrying provider after a quick failure",
            provider=target.provider,
            provider_model=target.shown_model,
            failure=failure,
            delay_ms=int(QUICK_RETRY_DELAY_SECONDS * 1000),
        )


async def _make_attempt(
    gateway: Gateway,
    inbound: Inbound,
    resolution: Resolution,
    target: Target,
    ticket: Ticket,
    send: Send,
    record: Record,
) -> Attempt:
    """One attempt at `target`, admitted by `ticket`; its verdict goes to the circuit,
    the record and the metrics, once, when it ends, whatever the client does. A success
    is sent here (a stream's, relayed as it came, was sent already): when its client
    leaves as it goes out, the exchange that came is still counted."""
    circuit = ticket.circuit
    record.aimed_at(target)
    attempt = None  # until the provider's answer came
    try:
        attempt = await _attempt(gateway, gateway.upstreams[target.provider], inbound, resolution, target, send, record)
        if not attempt.committed and attempt.judged.verdict.outcome is _SUCCESS:  # final: the client gets it
            attempt = await answers.commit(send, record, attempt)
    except BaseException as e:
        left = outcome.CLIENT_LEFT
        ticket.done(left.verdict.outcome)
        if isinstance(e, asyncio.CancelledError):  # the client left: its request was cancelled
            gateway.metrics.count_attempt(circuit.provider, circuit.label, left.label)
        raise
    label = attempt.judged.label
    try:
        ticket.done(attempt.judged.verdict.outcome, label)  # the circuit keeps a failure's label as its last error
        record.attempt_ended(target, label)
        gateway.metrics.count_attempt(circuit.provider, circuit.label, label)
    except BaseException:  # the answer will not be sent: a rest still being read must not keep its pool slot
        await attempt.discard()
        raise
    return attempt


async def _attempt(
    gateway: Gateway,
    upstream: Upstream,
    inbound: Inbound,
    resolution: Resolution,
    target: Target,
    send: Send,
    record: Record,
) -> Attempt:
    """Send the request (the client's, with the provider's parts: tinygw.worker.upstreams) and take the answer: a
    stream is relayed (tinygw.worker.relay), any other is held and judged (tinygw.resilience.outcome), and sent
    by _make_attempt when it is a success."""
    started = gateway.clock()
    # One key: nothing to pick. A pool's key in turn, or the conversation's (tinygw.resilience.keys).
    key_index = upstream.keys.pick(started, inbound.conversation) if upstream.rotates_keys else 0
    request = upstream.request_for(inbound, target, key_index, gateway.timeouts[(resolution.model, target.provider)])
    try:
        response = await upstream.pool.send(request)
    except errors.UpstreamError as e:
        return Attempt(outcome.of_error(e))
    elapsed = gateway.clock() - started
    gateway.metrics.observe_first_byte(target.provider, elapsed)  # its answer's head came
    if inbound.stream and response.status == 200:
        content_type = header(response.headers, b"content-type") or b""
        shape = sse.shape_of(inbound.route.api, inbound.route.upstream_path)  # its events' API
        if content_type.startswith(b"text/event-stream"):
            return await _relay(gateway, upstream, response, send, record, target, inbound.usage_asked, shape)
        if content_type.startswith(eventstream.CONTENT_TYPE):  # Bedrock's frames, read as events
            events = frames.Unwrapped(response, keep_frames=inbound.route.api == "bedrock")
            return await _relay(gateway, upstream, response, send, record, target, False, shape, events)
    return await _held(gateway, upstream, inbound, target, response, elapsed, key_index, record)


async def _held(
    gateway: Gateway,
    upstream: Upstream,
    inbound: Inbound,
    target: Target,
    response: Response,
    elapsed: float,
    key_index: int,
    record: Record,
) -> Attempt:
    """An answer that is not a stream, whose head came after `elapsed`: held whole (up to
    HOLD_BYTES) and judged (tinygw.resilience.outcome), its beginning held and its rest
    kept open when it is larger."""
    data = response.whole_body(HOLD_BYTES)  # the usual answer: all of it came with its head, taken without a wait
    rest = None  # the answer still to be read, when it is not held whole
    if data is None:  # read as it comes (the attempt may last); one read in part is kept open as the answer's rest
        try:
            data, ended = await response.read_upto(HOLD_BYTES)
        except errors.UpstreamError as e:
            return Attempt(outcome.of_error(e))
        rest = None if ended else response
    held = None if rest else data
    if upstream.cloud:  # Bedrock's and Vertex's errors go by their names first
        error_name = clouds.error_name(response.headers, held) if response.status >= 400 else None
        judged = outcome.of_cloud_answer(response.status, elapsed, held, error_name)
    else:
        # A 401/403 is the client's when it chose the account its provider key acts for (docs/design.md section 16)
        chosen = upstream.lets_clients_choose_account and carries_account_headers(inbound.headers)
        judged = outcome.of_answer(response.status, elapsed, held, chosen)
    if judged.error is not None:  # nothing of it is the client's: the gateway's own 502, should it be the last
        await response.aclose()
        return Attempt(judged)
    if judged.usage is not None:  # a success, which is sent: its tokens count
        record.counted(judged.usage)
    redact = upstream.redactor
    return Attempt(
        judged,
        # a provider's secrets never reach the client (tinygw.trust.redact)
        answer=HeldAnswer(judged.status, redact.headers(relay_headers(response.headers)), redact.body(data), rest),
        other_key=response.status == 429 and _rest_key(gateway, upstream, key_index, response),
    )


async def _relay(
    gateway: Gateway,
    upstream: Upstream,
    response: Response,
    send: Send,
    record: Record,
    target: Target,
    drop_usage: bool,
    shape: sse.Shape,
    unwrapped: frames.Unwrapped | None = None,
) -> Attempt:
    """A stream's attempt: relayed as it comes (tinygw.worker.relay), its events read as
    `shape`'s API writes them. `unwrapped`: Bedrock's frames, read as server-sent events
    (tinygw.worker.frames), and sent on as frames when it keeps them."""
    loop = gateway.loop or asyncio.get_running_loop()
    events: Events = response if unwrapped is None else unwrapped
    if unwrapped is not None and unwrapped.keep_frames:
        send = frames.rewrapped(send, unwrapped)
    try:
        relay = Relay(events, record.timed(send, loop), record, target, loop, upstream.redactor, drop_usage, shape)
        return await relay.run()
    finally:
        await response.aclose()


def _rest_key(gateway: Gateway, upstream: Upstream, key_index: int, response: Response) -> bool:
    """A 429: the key rests (for its Retry-After, if any). Whether another key may be tried."""
    now = gateway.clock()
    seconds = retry_after_seconds(header(response.headers, b"retry-after"), gateway.settings.breaker.max_open_seconds)
    upstream.keys.rest(key_index, now, seconds)
    return upstream.keys.has_other(key_index, now)
