"""What an attempt's ending means: docs/design.md section 4's failure table, in one place.

Each outcome of an attempt maps to a `Verdict`: whether it counts for the breaker
(failure, success, or no verdict), whether the request may go on to another target,
and whether it is a quick failure that the one quick retry may repeat.
"""

from __future__ import annotations

import msgspec
from msgspec import Struct

from tinygw import errors
from tinygw.protocol.usage import Usage, decode_body
from tinygw.resilience.breaker import Outcome

# A 502/503 that came back within this many seconds is a quick failure (docs/design.md section 4).
QUICK_SECONDS = 5.0


class Verdict(Struct, frozen=True):
    outcome: Outcome
    may_fall_back: bool
    quick: bool = False


SUCCESS = Verdict(Outcome.SUCCESS, may_fall_back=False)
ERROR_IN_BODY = Verdict(Outcome.FAILURE, may_fall_back=True)  # a 200 carrying an error
ERROR_EVENT = Verdict(Outcome.FAILURE, may_fall_back=True)  # an error event, or no output, before output


def of_error(e: errors.UpstreamError) -> Verdict:
    """Refused, reset, DNS, TLS, protocol errors and every timeout: failures. Only
    connection errors (not timeouts) are quick. The gateway's own limits are no
    verdict on the provider: all its connections busy (another target may serve), or
    an answer over the size the gateway reads whole (no other would do better)."""
    if isinstance(e, errors.PoolTimeout):
        return Verdict(Outcome.NEUTRAL, may_fall_back=True)
    if isinstance(e, errors.ResponseTooLarge):
        return Verdict(Outcome.NEUTRAL, may_fall_back=False)
    return Verdict(Outcome.FAILURE, may_fall_back=True, quick=e.cause == "connect_error")


def of_status(status: int, elapsed_seconds: float) -> Verdict:
    if status < 400:
        return SUCCESS
    if status == 429:  # rate limited: no verdict on the provider's health
        return Verdict(Outcome.NEUTRAL, may_fall_back=True)
    if status in (401, 402, 403):  # our key or account: a provider configuration error
        return Verdict(Outcome.FAILURE, may_fall_back=True)
    if status >= 500:  # 529 (overloaded) included
        quick = status in (502, 503) and elapsed_seconds <= QUICK_SECONDS
        return Verdict(Outcome.FAILURE, may_fall_back=True, quick=quick)
    return Verdict(Outcome.NEUTRAL, may_fall_back=False)  # the client's own mistake


class _ErrorField(Struct):
    error: object = None


_decode_error_field = msgspec.json.Decoder(_ErrorField)


def judge(body: bytes) -> tuple[bool, Usage | None]:
    """Does a JSON object body carry a non-null top-level `error`, and what `usage`
    does it report? One decode for both, of these two fields only (tinygw.protocol.usage.decode_body)."""
    if b'"usage"' not in body:
        return carries_error(body), None
    try:
        value = decode_body(body)
    except (msgspec.MsgspecError, RecursionError):  # a `usage` of another shape: the error alone is judged
        return carries_error(body), None
    return value.error is not None, value.usage


def carries_error(body: bytes) -> bool:
    """Does a JSON object body carry a non-null top-level `error`?"""
    if b'"error"' not in body:
        return False
    try:
        return _decode_error_field.decode(body).error is not None
    except (msgspec.MsgspecError, RecursionError):  # not judged: passed through as it is
        return False
