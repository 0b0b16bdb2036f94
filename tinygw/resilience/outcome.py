"""What an attempt's ending means: docs/design.md section 4's failure table, in one place.

Each ending of an attempt maps to a `Verdict`: whether it counts for the breaker
(failure, success, or no verdict), whether the request may go on to another target,
and whether it is a quick failure that the one quick retry may repeat. An answer is
judged whole here (`of_answer`): its status, and for a 200 held whole its body.
Nothing else in the gateway decides what an ending means.
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
FAILURE = Verdict(Outcome.FAILURE, may_fall_back=True)  # not quick: a timeout, a 401/403, a bad answer
ERROR_EVENT = FAILURE  # a stream's error event, or its end without output, before output
CUT = Verdict(Outcome.FAILURE, may_fall_back=False)  # a failure after the client had part of the answer
NO_VERDICT = Verdict(Outcome.NEUTRAL, may_fall_back=False)  # the client's own doing: returned to it
# No verdict on the provider's health, and another target may serve: a 429, or every
# connection to the target busy for pool_timeout_s.
RATE_LIMITED = Verdict(Outcome.NEUTRAL, may_fall_back=True)


class Judgement(Struct, frozen=True):
    """An answer, judged. `status` is what the client gets with the provider's body
    should this attempt be the last (502 for a 200 carrying an error); `error`, when
    set, replaces the answer: the client then gets the gateway's own 502 saying it."""

    verdict: Verdict
    label: str  # for x-tinygw-attempts, the access log and the attempts metric
    status: int
    usage: Usage | None = None
    error: errors.UpstreamError | None = None


def of_error(e: errors.UpstreamError) -> Verdict:
    """Refused, reset, DNS, TLS, protocol errors, every timeout, and a cloud provider's
    token that cannot be had (ProviderCredentials): failures. Only
    connection errors (not timeouts) are quick. The gateway's own limits are no
    verdict on the provider: all its connections busy (another target may serve), or
    an answer over the size the gateway reads whole (no other would do better)."""
    if isinstance(e, errors.PoolTimeout):
        return RATE_LIMITED
    if isinstance(e, errors.ResponseTooLarge):
        return NO_VERDICT
    return Verdict(Outcome.FAILURE, may_fall_back=True, quick=e.cause == "connect_error")


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
    if 300 <= status < 400:
        redirect = errors.UnusableAnswer(f"its answer was a redirect ({status}); check its base_url")
        return Judgement(verdict, str(status), 502, error=redirect)
    return Judgement(verdict, str(status), status)


# Claude on the clouds (docs/design.md section 18): what Bedrock and Vertex call their
# errors (tinygw.protocol.clouds.error_name), before their status is read.
_CLOUD_ERRORS = {
    "ThrottlingException": "rate_limited",  # Bedrock, 429
    "ModelNotReadyException": "rate_limited",  # Bedrock, 429: the model is being loaded
    "RESOURCE_EXHAUSTED": "rate_limited",  # Vertex, 429: a quota
    "ServiceUnavailableException": "failure",  # Bedrock, 503
    "AccessDeniedException": "credentials",  # Bedrock, 403: the credentials' rights
    "UnrecognizedClientException": "credentials",  # Bedrock, 403: the key or the signature
    "ValidationException": "client",  # Bedrock, 400: the request's own
}


def of_cloud_answer(status: int, elapsed_seconds: float, body: bytes | None, error_name: str | None) -> Judgement:
    """A bedrock or vertex provider's answer: its error's name first (`error_name`), then
    as any other answer (`of_answer`). A rate limit is a 429 (another target may serve,
    no verdict); a refusal of the credentials (the named ones, or a 401/403) is a provider
    configuration error, a failure whose client gets the gateway's own 502; a
    ValidationException is the client's 400."""
    kind = _CLOUD_ERRORS.get(error_name or "")
    label = f"{status}+{error_name}" if kind else str(status)
    if kind == "rate_limited":
        return Judgement(RATE_LIMITED, label, 429)
    if kind == "failure":
        return Judgement(of_status(max(status, 500), elapsed_seconds), label, status)
    if kind == "credentials" or (kind is None and status in (401, 403)):
        refused = errors.ProviderCredentials(f"it refused the gateway's credentials ({error_name or status})")
        return Judgement(FAILURE, label, 502, error=refused)
    if kind == "client":
        return Judgement(NO_VERDICT, label, 400)
    return of_answer(status, elapsed_seconds, body)


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
