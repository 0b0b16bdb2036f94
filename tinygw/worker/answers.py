"""Sending a request's answer: an attempt's that is final (held whole, or its beginning
held and its rest relayed as it comes), or the gateway's own when the last attempt had
none (its error's status, tinygw.resilience.outcome) or every circuit refused (503 with
the wait until the next probe). The answer's head is the record's (tinygw.worker.record)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from msgspec.structs import replace

from tinygw import errors
from tinygw.config.settings import Target
from tinygw.protocol.routing import Resolution
from tinygw.protocol.wire import JSON_HEADERS, error_body
from tinygw.resilience import outcome
from tinygw.resilience.breaker import Circuit
from tinygw.worker.record import Attempt, HeldAnswer, Record

Send = Callable[[dict], Awaitable[None]]


async def commit(send: Send, record: Record, attempt: Attempt) -> Attempt:
    """Send a successful attempt's answer: it is final. An answer too large to hold is
    sent as it is read; cut short, it is a failure."""
    answer: HeldAnswer = attempt.answer  # type: ignore[assignment]  # a success has one
    if answer.rest is None:  # the usual answer: held whole
        await send_held(send, record, answer, attempt.judged.label)
        return replace(attempt, committed=True)
    try:
        sent = await send_answer(send, record, answer, attempt.judged.label)
    except BaseException:  # the client left (or send failed) while a large answer was relayed
        await answer.discard()
        raise
    if sent:
        return replace(attempt, committed=True)
    record.was_cut()
    cut = outcome.of_stream(outcome.Ending.UNFINISHED, output=True, status=answer.status)
    return replace(attempt, judged=cut, committed=True)


async def send_held(send: Send, record: Record, answer: HeldAnswer, current: str | None) -> None:
    """Send an answer that was held whole."""
    await send(record.head(answer.status, [*answer.headers, (b"content-length", b"%d" % len(answer.body))], current))
    await send({"type": "http.response.body", "body": answer.body})


async def send_answer(send: Send, record: Record, answer: HeldAnswer, current: str | None = None) -> bool:
    """Send `answer`: whole when it was held whole, else its beginning and then the
    rest as it arrives. False when the provider failed partway: the client's answer
    then ends without its last chunk, which HTTP clients report as an incomplete body."""
    if answer.rest is None:
        await send_held(send, record, answer, current)
        return True
    send = record.timed(send, asyncio.get_running_loop())  # its sends may wait on the client
    await send(record.head(answer.status, answer.headers, current))
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


async def send_final(send: Send, record: Record, last: Attempt, target: Target) -> None:
    """The last attempt failed: pass its answer through, or say why there is none."""
    if last.answer is not None:
        if not await send_answer(send, record, last.answer):
            record.was_cut()
        return
    judged = last.judged
    e, retry_after = judged.error, judged.retry_after_seconds
    if e is None:  # an attempt ends with an answer or an error
        raise RuntimeError("an attempt ended with neither an answer nor an error")
    body = error_body(
        f"provider {target.provider} is busy: {e}; retry after {retry_after} s"
        if retry_after
        else f"provider {target.provider} failed: {e}",
        "provider_unavailable",
        e.cause,
        cause=e.cause,
        provider=target.provider,
        provider_model=target.upstream_model,
    )
    headers = [*JSON_HEADERS, (b"retry-after", b"%d" % retry_after)] if retry_after else JSON_HEADERS
    await send(record.head(judged.status, headers))
    await send({"type": "http.response.body", "body": body})


async def send_circuit_open(send: Send, record: Record, skipped: list[Circuit], resolution: Resolution) -> None:
    """Every usable target's circuit is open: 503 with the wait until the next probe."""
    circuit = min(skipped, key=lambda c: c.retry_after() or 0.0)
    record.refused_at(circuit.target())
    retry_after = circuit.retry_after_header()
    body = error_body(
        f"every target of {resolution.model!r} is unavailable (circuit open); retry after {retry_after} s",
        "provider_unavailable",
        "circuit_open",
        cause="circuit_open",
        provider=circuit.provider,
        provider_model=circuit.provider_model,
    )
    await send(record.head(503, [*JSON_HEADERS, (b"retry-after", b"%d" % retry_after)]))
    await send({"type": "http.response.body", "body": body})
