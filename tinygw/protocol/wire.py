"""What goes over the wire besides a request's body (tinygw.protocol.request): the
headers forwarded and relayed, request ids, Retry-After, and the gateway's errors in
each API's shape."""

from __future__ import annotations

import math
import re
import time
from binascii import hexlify
from datetime import UTC
from email.utils import parsedate_to_datetime
from itertools import compress
from operator import itemgetter, not_
from os import urandom

import msgspec

from tinygw.headers import ACCOUNT, GATEWAY_HEADERS
from tinygw.headers import HOP_BY_HOP as _HOP_BY_HOP_NAMES

_decode_any = msgspec.json.Decoder()
_encode = msgspec.json.Encoder()

# ---- headers --------------------------------------------------------------------------

# Hop-by-hop headers and the ones the gateway sets itself (tinygw.headers, one policy
# with the configuration's).
HOP_BY_HOP = frozenset(name.encode() for name in _HOP_BY_HOP_NAMES)
NOT_FORWARDED = frozenset(name.encode() for name in GATEWAY_HEADERS)
# A provider's answer reaches the client with these headers only (docs/design.md section 10):
# never its cookies, HSTS, CORS, a redirect's target, or headers that look like the
# gateway's own (x-tinygw-*). Framing headers are the gateway's to set.
_RELAYED = frozenset(
    {b"content-type", b"x-request-id", b"request-id", b"retry-after", b"retry-after-ms", b"x-should-retry"}
)
_RELAYED_PREFIXES = (b"x-ratelimit-", b"ratelimit", b"openai-", b"anthropic-")
# The answer's `x-request-id` is the gateway's; the provider's own goes on under this name.
UPSTREAM_REQUEST_ID = b"x-upstream-request-id"
_RENAMED = {b"x-request-id": UPSTREAM_REQUEST_ID}
# The names above as one pattern, for a C-speed filter: a name in _RELAYED, or one that
# starts with one of _RELAYED_PREFIXES.
_RELAYED_NAME = re.compile(
    b"|".join([*map(re.escape, sorted(_RELAYED)), *(re.escape(prefix) + b".*" for prefix in _RELAYED_PREFIXES)]),
    re.DOTALL,
)


_NAME_OF = itemgetter(0)  # a header's name


def _and_named_by_connection(
    headers: list[tuple[bytes, bytes]], names: list[bytes], drop: frozenset[bytes]
) -> frozenset[bytes]:
    """`drop` and the headers that the `connection` headers name (`names` are the headers'
    names). A client's usual `connection: keep-alive` names one that `drop` holds already:
    `drop` as it is then, without splitting the value."""
    if names.count(b"connection") == 1 and headers[names.index(b"connection")][1] in drop:
        return drop
    values = [v for k, v in headers if k == b"connection"]
    return drop | frozenset(n.strip().lower() for v in values for n in v.split(b","))


def forward_headers(
    client_headers: list[tuple[bytes, bytes]], not_forwarded: frozenset[bytes] = NOT_FORWARDED
) -> list[tuple[bytes, bytes]]:
    """The client's headers that go on to a provider: never its credentials, nor any
    named in `not_forwarded` (NOT_FORWARDED and, for some providers, their key header)."""
    names = list(map(_NAME_OF, client_headers))
    drop = not_forwarded
    if b"connection" in names:  # the headers it names are hop-by-hop too
        drop = _and_named_by_connection(client_headers, names, not_forwarded)
    # Each header kept unless its name is in `drop`.
    return list(compress(client_headers, map(not_, map(drop.__contains__, names))))


_ACCOUNT = frozenset(name.encode() for name in ACCOUNT)


def carries_account_headers(client_headers: list[tuple[bytes, bytes]]) -> bool:
    """Does a client's request choose the account its provider key acts for
    (tinygw.headers.ACCOUNT)?"""
    return not _ACCOUNT.isdisjoint(map(_NAME_OF, client_headers))


def relay_headers(upstream_headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The provider's headers that go back to the client: a fixed set."""
    names = list(map(_NAME_OF, upstream_headers))
    relayed = list(compress(upstream_headers, map(_RELAYED_NAME.fullmatch, names)))
    if b"x-request-id" in names:
        return [(_RENAMED.get(k, k), v) for k, v in relayed]
    return relayed


# A client's own request id is kept when it is a plain token of at most 128 bytes;
# anything else (spaces, quotes, control bytes, a log-injection attempt) is replaced.
_SANE_REQUEST_ID = re.compile(rb"[A-Za-z0-9._:-]{1,128}")


# New ids are drawn from the kernel this many at a time: one getrandom call for them, not
# one per request. Each id is still 8 bytes of its own from the kernel, used once.
IDS_PER_DRAW = 256


class RequestIds:
    """A worker's request ids (its Gateway's: each worker draws its own)."""

    __slots__ = ("_unused",)

    def __init__(self) -> None:
        self._unused: list[bytes] = []

    def of(self, given: bytes | None) -> bytes:
        """The id of a request whose first `x-request-id` is `given` (None without one):
        the client's if it is sane, else a new random one (16 hex digits). It goes back in
        the answer, on the access-log line and upstream."""
        if given is not None and _SANE_REQUEST_ID.fullmatch(given):
            return given
        try:
            return self._unused.pop()
        except IndexError:  # none left (another thread may take the ones drawn now: free-threaded workers)
            self._draw()
            return hexlify(urandom(8))

    def _draw(self) -> None:
        digits = hexlify(urandom(8 * IDS_PER_DRAW))
        self._unused.extend([digits[i : i + 16] for i in range(0, len(digits), 16)])


def header(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    """The value of the first header called `name` (lower case, as ASGI gives names), or None."""
    return dict(reversed(headers)).get(name)  # reversed: the first one wins, as a scan's would


def retry_after_seconds(value: bytes | None, cap_seconds: float) -> float | None:
    """A Retry-After header's seconds, at most `cap_seconds`: a number, or an HTTP-date
    (read against the wall clock, which is what such a date is written in)."""
    if not value:
        return None
    text = value.decode("latin-1").strip()
    try:
        seconds = float(text)
    except ValueError:
        try:
            date = parsedate_to_datetime(text)
        except (TypeError, ValueError, IndexError, OverflowError):
            return None
        if date.tzinfo is None:
            date = date.replace(tzinfo=UTC)  # HTTP-dates are GMT
        seconds = date.timestamp() - time.time()  # wall
    if not math.isfinite(seconds):
        return None
    return min(max(0.0, seconds), cap_seconds)


# ---- errors -----------------------------------------------------------------------------


def error_body(message: str, type_: str, code: str | None = None, **extra: object) -> bytes:
    """An OpenAI-shaped error: {"error": {"message", "type", "code", ...}}."""
    return _encode.encode({"error": {"message": message, "type": type_, "code": code, **extra}})


def sse_error_event(message: str, type_: str, **extra: object) -> bytes:
    """The event that ends a client's stream when the provider failed after output."""
    return b"event: error\ndata: " + error_body(message, type_, None, **extra) + b"\n\n"


JSON_HEADERS = [(b"content-type", b"application/json")]

# Anthropic's error types, by status (an unlisted 4xx is a bad request, an unlisted 5xx
# the API's own error); the gateway's 503 (circuits open) is Anthropic's "overloaded".
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}
_SSE_ERROR = b"event: error\ndata: "


def anthropic_type(status: int) -> str:
    return _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def anthropic_error(body: bytes, status: int) -> bytes | None:
    """An OpenAI-shaped error `body` in Anthropic's shape, `{"type": "error", "error":
    {"type", "message", ...}}`, with the gateway's extra fields (code, cause, provider,
    provider_model) kept; None when `body` is no OpenAI-shaped error (an Anthropic
    provider's own error, passed through as it is)."""
    try:
        document = _decode_any.decode(body)
    except (msgspec.MsgspecError, RecursionError):
        return None
    if not isinstance(document, dict) or "type" in document or not isinstance(document.get("error"), dict):
        return None
    fields = {k: v for k, v in document["error"].items() if k != "type" and v is not None}
    return _encode.encode({"type": "error", "error": {"type": anthropic_type(status), **fields}})


def anthropic_sse_error(chunk: bytes) -> bytes | None:
    """The gateway's `error` event that ends a cut stream, in Anthropic's shape; None for
    any other chunk (the provider's own events are relayed as they are)."""
    if not chunk.startswith(_SSE_ERROR + b'{"error"'):
        return None
    reshaped = anthropic_error(chunk[len(_SSE_ERROR) :].strip(), 500)
    return None if reshaped is None else _SSE_ERROR + reshaped + b"\n\n"


def anthropic_errors(send):
    """`send`, with the gateway's own errors in Anthropic's shape (an Anthropic route's
    clients expect it); the provider's answers, its errors included, pass as they are."""
    error_status = 0

    async def send_anthropic(message) -> None:
        nonlocal error_status
        if message["type"] == "http.response.start":
            error_status = message["status"] if message["status"] >= 400 else 0
        elif message.get("body"):
            body = message["body"]
            if error_status and not message.get("more_body"):
                reshaped = anthropic_error(body, error_status)
            else:
                reshaped = anthropic_sse_error(body) if body[:1] == b"e" else None
            if reshaped is not None:
                message = {**message, "body": reshaped}
        await send(message)

    return send_anthropic


# ---- sending an answer --------------------------------------------------------------


def with_headers(send, headers: list[tuple[bytes, bytes]]):
    """`send`, with `headers` added to the answer's head (a 405's `allow`)."""

    async def send_with_headers(message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message["headers"], *headers]}
        await send(message)

    return send_with_headers


async def send_json(send, value, status: int = 200) -> None:
    """An answer of JSON in two ASGI messages."""
    await send({"type": "http.response.start", "status": status, "headers": JSON_HEADERS})
    await send({"type": "http.response.body", "body": _encode.encode(value)})


async def send_error(send, status: int, message: str, type_: str, code: str | None = None) -> int:
    """An OpenAI-shaped error answer; returns its status, for the access log."""
    await send({"type": "http.response.start", "status": status, "headers": JSON_HEADERS})
    await send({"type": "http.response.body", "body": error_body(message, type_, code)})
    return status
