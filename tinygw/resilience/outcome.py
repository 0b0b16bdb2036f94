"""What an attempt's ending means: docs/design.md section 4's failure table, in one place.

Each ending of an attempt is judged here, and nowhere else: an answer held whole by its
status and body (`of_answer`; a cloud's by its error's name first, `of_cloud_answer`),
an attempt without an answer by its error (`of_error`), an answer relayed as it came by
how the relay saw it end (`of_stream`, an `Ending`), and the client leaving
(`CLIENT_LEFT`). A `Judgement` says whether the ending counts for the breaker (failure,
success, or no verdict), whether the request may go on to another target, whether the
one quick retry may repeat it, its label, and the status the client gets should it be
the last attempt.
"""

from __future__ import annotations

import enum
import re

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
    # The prompt is too long for the target's context: the request may go on to the
    # model's context_fallback (no verdict on the provider), else the client gets the answer.
    too_long: bool = False


SUCCESS = Verdict(Outcome.SUCCESS, may_fall_back=False)
FAILURE = Verdict(Outcome.FAILURE, may_fall_back=True)  # not quick: a timeout, a 401/403, a bad answer
QUICK_FAILURE = Verdict(Outcome.FAILURE, may_fall_back=True, quick=True)  # the one quick retry may repeat it
CUT = Verdict(Outcome.FAILURE, may_fall_back=False)  # a failure after the client had part of the answer
NO_VERDICT = Verdict(Outcome.NEUTRAL, may_fall_back=False)  # the client's own doing: returned to it
# No verdict on the provider's health, and another target may serve: a 429, or every
# connection to the target busy for pool_timeout_s.
RATE_LIMITED = Verdict(Outcome.NEUTRAL, may_fall_back=True)
TOO_LONG = Verdict(Outcome.NEUTRAL, may_fall_back=False, too_long=True)

# How providers say that a prompt is longer than the model's context (OpenAI's code
# `context_length_exceeded`, Anthropic's "prompt is too long", Bedrock's "Input is too
# long"), looked for in a 400's body.
_TOO_LONG = re.compile(rb"context_length_exceeded|prompt is too long|input is too long", re.IGNORECASE)


class Judgement(Struct, frozen=True):
    """An attempt's ending, judged. `label` names it in x-tinygw-attempts, the access log
    and the attempts metric (`tinygw_upstream_attempts_total`'s `outcome`). `status` is
    what the client gets should this attempt be the last: the provider's answer's (502
    for a 200 carrying an error), or that of the gateway's own answer when there is none.
    `error`, when set, replaces the answer: the client then gets the gateway's own error
    saying it, with `retry_after_seconds` when it is told when to come back."""

    verdict: Verdict
    label: str
    status: int
    usage: Usage | None = None
    error: errors.UpstreamError | None = None
    retry_after_seconds: int | None = None


# The client went away (or did not take a send in time) while an attempt was under way:
# no verdict, and the count is left as it was. Never sent: logged as nginx's 499.
CLIENT_LEFT = Judgement(NO_VERDICT, "client_closed", 499)


class Ending(enum.Enum):
    """How an answer relayed as it came (a stream, or an answer too large to hold) ended,
    as the relay saw it: the relay reports it, `of_stream` decides what it means."""

    FINISHED = "finished"  # the provider closed it after an event that marks the answer's end
    UNFINISHED = "cut"  # the provider closed it without one
    ERROR_EVENT = "error_event"  # an error event came
    BROKEN = "broken"  # the connection failed or timed out (its error says how)


def of_stream(
    ending: Ending,
    output: bool,
    error: errors.UpstreamError | None = None,
    status: int = 200,
    cloud_error: tuple[str, float, bytes] | None = None,
) -> Judgement:
    """A relayed answer of `status` that ended as `ending`, after output reached the
    client (`output`: nothing is switched, any ending but a finish is a cut, and the
    client's stream ends with an error event) or before (an ending without output may
    fall back, and the held events are the client's 502 should it be the last).
    `cloud_error`: a cloud's leading exception, its name, when it came and its event,
    judged as the HTTP error of that name would be (`of_cloud_error`)."""
    if not output:
        if ending is Ending.BROKEN and error is not None:
            return of_error(error)
        if ending is Ending.ERROR_EVENT:
            return of_cloud_error(*cloud_error) if cloud_error else _ERROR_EVENT
        return NO_OUTPUT
    if ending is Ending.FINISHED:
        return Judgement(SUCCESS, str(status), status)
    return Judgement(CUT, f"{status}+{cause_of(ending, error)}", status)


def cause_of(ending: Ending, error: errors.UpstreamError | None) -> str:
    """The cause a relayed answer's cut is named by: its error's, else its ending's."""
    return error.cause if ending is Ending.BROKEN and error is not None else ending.value


NO_OUTPUT = Judgement(FAILURE, "200+no_output", 502)
_ERROR_EVENT = Judgement(FAILURE, "200+error_event", 502)


# The errors of an attempt that ended without an answer, most specific first: the verdict,
# and the status of the gateway's own answer should the attempt be the last (docs/design.md
# section 3: 502 unless named). Only connection errors (not timeouts, not a protocol error)
# are quick. The gateway's own limits are no verdict on the provider: all its connections
# busy (another target may serve; the client is told to retry in a second), or an answer
# over the size the gateway reads whole (no other target would do better).
_ERRORS: tuple[tuple[type[errors.UpstreamError], Verdict, int], ...] = (
    (errors.PoolTimeout, RATE_LIMITED, 503),
    (errors.ResponseTooLarge, NO_VERDICT, 502),
    (errors.ConnectTimeout, FAILURE, 504),
    (errors.HeadTimeout, FAILURE, 504),
    (errors.FirstByteTimeout, FAILURE, 504),
    (errors.StallTimeout, FAILURE, 504),
    (errors.TotalTimeout, FAILURE, 504),
    (errors.RemoteProtocolError, FAILURE, 502),
    (errors.UnusableAnswer, FAILURE, 502),
    (errors.ProviderCredentials, FAILURE, 502),
    (errors.UpstreamError, QUICK_FAILURE, 502),  # refused, reset, closed early, DNS, TLS
)
# What the client is told to wait before it retries, by the status of the gateway's own
# answer: a busy target frees a connection within a second.
_RETRY_AFTER_SECONDS = {503: 1}


def of_error(e: errors.UpstreamError) -> Judgement:
    """An attempt that ended without an answer, by its error (`_ERRORS`): labelled by
    its cause, and the gateway's own answer (`error`) should it be the last."""
    for kind, verdict, status in _ERRORS:
        if isinstance(e, kind):
            return Judgement(verdict, e.cause, status, error=e, retry_after_seconds=_RETRY_AFTER_SECONDS.get(status))
    raise TypeError(f"no row of the failure table for {type(e).__name__}")  # _ERRORS ends with their base class


def of_status(status: int, elapsed_seconds: float, account_chosen: bool = False) -> Verdict:
    """An answer by its status alone. `account_chosen`: the request carried the client's
    own account headers (the provider lets clients choose them), so a 401/403 is the
    client's."""
    if status < 300:
        return SUCCESS
    if status < 400:  # a redirect: a base_url that is wrong, never the client's to follow
        return FAILURE
    if status == 429:
        return RATE_LIMITED
    if status in (401, 402, 403):  # our key or account: a provider configuration error
        return NO_VERDICT if account_chosen and status != 402 else FAILURE
    if status >= 500:  # 529 (overloaded) included
        quick = status in (502, 503) and elapsed_seconds <= QUICK_SECONDS
        return Verdict(Outcome.FAILURE, may_fall_back=True, quick=quick)
    return NO_VERDICT  # the client's own mistake


def of_answer(status: int, elapsed_seconds: float, body: bytes | None, account_chosen: bool = False) -> Judgement:
    """An answer whose head came after `elapsed_seconds`; `body` is all of it when it
    was held whole, else None (too large to hold: judged by its status)."""
    if status == 200 and body is not None:  # the usual answer: judged by its body too
        try:  # one decode, of `error` and `usage` only (tinygw.protocol.usage.decode_body)
            if b'"usage"' not in body:
                if _decode_error_field.decode(body).error is None:
                    return _SUCCEEDED
            elif (value := decode_body(body)).error is None:
                return Judgement(SUCCESS, "200", 200, value.usage)
        except msgspec.ValidationError:  # JSON, of another shape: the error alone is judged
            if not carries_error(body):
                return _SUCCEEDED
        except msgspec.DecodeError:
            return Judgement(FAILURE, "200+not_json", 502, error=_NOT_JSON)
        except RecursionError:  # JSON nested deeper than can be looked into: passed through as it is
            return _SUCCEEDED
        return _CARRIES_ERROR
    verdict = of_status(status, elapsed_seconds, account_chosen)
    if status == 400 and body and _TOO_LONG.search(body):
        verdict = TOO_LONG
    if 300 <= status < 400:
        redirect = errors.UnusableAnswer(f"its answer was a redirect ({status}); check its base_url")
        return Judgement(verdict, str(status), 502, error=redirect)
    return Judgement(verdict, str(status), status)


# Claude on the clouds (docs/design.md section 18): what Bedrock and Vertex call their
# errors (tinygw.protocol.clouds.error_name), before their status is read: the kind, and
# the status of the HTTP error of that name. Names are matched in lower case: an HTTP
# header says `ThrottlingException` where a stream's exception frame says
# `throttlingException`.
_CLOUD_ERRORS = {
    "throttlingexception": ("rate_limited", 429),  # Bedrock
    "modelnotreadyexception": ("rate_limited", 429),  # Bedrock: the model is being loaded
    "resource_exhausted": ("rate_limited", 429),  # Vertex: a quota
    "serviceunavailableexception": ("failure", 503),  # Bedrock
    "accessdeniedexception": ("credentials", 403),  # Bedrock: the credentials' rights
    "unrecognizedclientexception": ("credentials", 403),  # Bedrock: the key or the signature
    "validationexception": ("client", 400),  # Bedrock: the request's own
}


def of_cloud_answer(status: int, elapsed_seconds: float, body: bytes | None, error_name: str | None) -> Judgement:
    """A bedrock or vertex provider's answer: its error's name first (`error_name`), then
    as any other answer (`of_answer`). A rate limit is a 429 (another target may serve,
    no verdict); a refusal of the credentials (the named ones, or a 401/403) is a provider
    configuration error, a failure whose client gets the gateway's own 502; a
    ValidationException is the client's 400."""
    kind, _ = _CLOUD_ERRORS.get((error_name or "").lower(), (None, status))
    label = f"{status}+{error_name}" if kind else str(status)
    if kind == "rate_limited":
        return Judgement(RATE_LIMITED, label, 429)
    if kind == "failure":
        return Judgement(of_status(max(status, 500), elapsed_seconds), label, status)
    if kind == "credentials" or (kind is None and status in (401, 403)):
        refused = errors.ProviderCredentials(f"it refused the gateway's credentials ({error_name or status})")
        return Judgement(FAILURE, label, 502, error=refused)
    if kind == "client":
        return Judgement(TOO_LONG if body and _TOO_LONG.search(body) else NO_VERDICT, label, 400)
    return of_answer(status, elapsed_seconds, body)


def of_cloud_error(error_name: str, elapsed_seconds: float, event: bytes = b"") -> Judgement:
    """A cloud stream's leading exception (Bedrock's exception frame, read as `event`),
    `elapsed_seconds` into the attempt: judged as the HTTP error of its name would be,
    and any name that is not one of those as a stream's error event."""
    _, status = _CLOUD_ERRORS.get(error_name.lower(), (None, 0))
    if not status:
        return _ERROR_EVENT
    judged = of_cloud_answer(status, elapsed_seconds, event, error_name)
    # No Retry-After came with it: the client is told to come back in a second.
    return msgspec.structs.replace(judged, retry_after_seconds=1) if judged.status == 429 else judged


_NOT_JSON = errors.UnusableAnswer("its answer was a 200 whose body is not JSON")
_SUCCEEDED = Judgement(SUCCESS, "200", 200)
_CARRIES_ERROR = Judgement(FAILURE, "200+error", 502)  # a failure; the client gets 502 if it is the last


class _ErrorField(Struct):
    error: object = None


_decode_error_field = msgspec.json.Decoder(_ErrorField)


def carries_error(body: bytes) -> bool:
    """Does a JSON object body carry a non-null top-level `error`?"""
    if b'"error"' not in body:
        return False
    try:
        return _decode_error_field.decode(body).error is not None
    except (msgspec.MsgspecError, RecursionError):  # not judged: passed through as it is
        return False
