"""What goes over the wire: request-body fields, the model rewrite, headers, errors.

A request body is decoded only for the two fields the gateway needs (`model`,
`stream`), and the spans of those that may name or open its conversation, read only
when its conversation chooses its target (tinygw.protocol.conversation); the prompt is
never decoded into Python objects. The model is rewritten by
replacing its bytes in place when that is unambiguous, and by re-encoding otherwise.
"""

from __future__ import annotations

import json
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

# A field's JSON as the body writes it; empty when the body has none.
_ABSENT = msgspec.Raw()


class RequestHead(msgspec.Struct):
    """The only fields of a client's request body that the gateway reads."""

    model: str | None = None
    stream: bool | None = None
    # What may name or open the request's conversation (tinygw.protocol.conversation), as
    # spans of the body, found by the same parse and looked into only when needed.
    prompt_cache_key: msgspec.Raw = _ABSENT
    metadata: msgspec.Raw = _ABSENT
    system: msgspec.Raw = _ABSENT  # Anthropic's
    instructions: msgspec.Raw = _ABSENT  # the Responses API's
    messages: msgspec.Raw = _ABSENT  # chat completions' and Anthropic's
    input: msgspec.Raw = _ABSENT  # the Responses API's: a string, or its items


_decode_head = msgspec.json.Decoder(RequestHead)
_decode_any = msgspec.json.Decoder()
_encode = msgspec.json.Encoder()


# A model name is a label in logs, metrics and circuits: longer ones are refused (docs/design.md
# section 10), so that a client cannot pin memory or grow pages with its model names.
MAX_MODEL_BYTES = 256
# UTF-8 spends at most 4 bytes on a character: a name of at most this many is within the bound unencoded.
_SURELY_SHORT_ENOUGH = MAX_MODEL_BYTES // 4

TOO_DEEP = "the request body's JSON is nested too deeply"


class BadBody(ValueError):
    """The client's body is not a JSON object with a string `model`."""


# A lone surrogate escape (`"\ud83d"`: JavaScript's JSON.stringify writes one for an emoji
# cut in half) is JSON by RFC 8259's grammar, but msgspec refuses to decode it into a str,
# even in a field it skips. A body that msgspec refuses and that holds one is read by the
# standard library's parser instead (_loads): the body is still forwarded as it came.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _head_of(body: bytes) -> RequestHead:
    """The fields the gateway reads, by msgspec (its errors raised as they are), or by
    the standard library when msgspec refused a surrogate escape (BadBody then)."""
    try:
        return _decode_head.decode(body)
    except msgspec.ValidationError:
        raise
    except msgspec.DecodeError:
        if _SURROGATE_ESCAPE.search(body) is None:
            raise
    document = _loads(body)
    if not isinstance(document, dict):
        raise BadBody("invalid request body: Expected `object`")
    try:
        head = msgspec.convert({k: document[k] for k in ("model", "stream") if k in document}, RequestHead)
    except msgspec.ValidationError as e:
        raise BadBody(f"invalid request body: {e}") from None
    except UnicodeError:  # a lone surrogate where a boolean belongs: msgspec cannot encode it to say so
        raise BadBody("invalid request body: 'model' must be a string and 'stream' a boolean") from None
    if head.model and _SURROGATE.search(head.model):
        raise BadBody("the request's 'model' holds a lone surrogate: a name must be Unicode text")
    return head


_SURROGATE = re.compile("[\ud800-\udfff]")


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _loads(body: bytes) -> object:
    """`body` by the standard library's parser, held to RFC 8259 as msgspec holds it
    (UTF-8, no NaN or Infinity; it takes lone surrogates, which is why it is asked)."""
    try:
        return json.loads(body.decode("utf-8"), parse_constant=_refuse_constant)
    except RecursionError:
        raise BadBody(TOO_DEEP) from None
    except ValueError:  # UnicodeDecodeError and JSONDecodeError among them
        raise BadBody("the request body is not valid JSON") from None


def read_head(body: bytes, path_model: str | None = None) -> RequestHead:
    """The fields the gateway reads of a body that is a JSON object: its `model` (or
    `path_model`, a cloud shape's model, named by its path) and `stream`."""
    try:
        head = _head_of(body)
    except msgspec.ValidationError as e:
        raise BadBody(f"invalid request body: {e}") from None
    except msgspec.DecodeError:
        raise BadBody("the request body is not valid JSON") from None
    except RecursionError:  # msgspec's depth bound is the interpreter's recursion limit
        raise BadBody(TOO_DEEP) from None
    if path_model is not None:
        head.model = path_model
    if not head.model:
        raise BadBody("the request body has no 'model'")
    if len(head.model) > _SURELY_SHORT_ENOUGH and len(head.model.encode()) > MAX_MODEL_BYTES:
        raise BadBody(f"the request's 'model' is over {MAX_MODEL_BYTES} bytes")
    return head


# `"model"` as a key, at any depth, followed by its string value (the group, quotes and
# all). Inside a JSON string every quote is escaped, so an unescaped match is always
# real JSON structure.
_MODEL_PAIR = re.compile(rb'"model"\s*:\s*("(?:[^"\\]|\\.)*")')
# A letter of `model` written as an escape (`"mod\u0065l"` is the key `model` too): a body
# with one may hold a second `model` key that no byte search sees, which a provider's
# parser might take instead of the rewritten one. Such a body is re-encoded (one key).
_MODEL_LETTER_ESCAPE = re.compile(rb"\\u006[45cdfCDF]")  # d e l m o


def rewrite_model(body: bytes, requested: str, upstream: str) -> bytes:
    """`body` with its top-level model set to `upstream`, the rest left as it was."""
    if requested == upstream:
        return body
    # The depth msgspec accepts is the interpreter's recursion limit less the stack in
    # use: a body read fine by read_head may be too deep here, a few frames further down.
    try:
        if (
            body.count(b'"model"') == 1
            and (match := _MODEL_PAIR.search(body)) is not None
            and _MODEL_LETTER_ESCAPE.search(body) is None
        ):
            spliced = body[: match.start(1)] + _encode.encode(upstream) + body[match.end(1) :]
            if _head_of(spliced).model == upstream:
                return spliced
        # Ambiguous (a nested "model" key, escapes): re-encode the whole document.
        document = _decode_any.decode(body)
    except msgspec.ValidationError as e:
        raise BadBody(f"invalid request body: {e}") from None
    except msgspec.DecodeError as e:  # valid JSON that Python cannot hold (1e400), or a lone surrogate
        if _SURROGATE_ESCAPE.search(body) is None:
            raise BadBody(f"invalid request body: {e}") from None
        return _reencoded(body, upstream)
    except RecursionError:
        raise BadBody(TOO_DEEP) from None
    document["model"] = upstream
    return _encode.encode(document)


def document_of(body: bytes) -> dict:
    """The whole of a body that is a JSON object (for an edit that cannot be made in
    place; a lone surrogate escape read by the standard library); BadBody otherwise."""
    try:
        document = _decode_any.decode(body)
    except msgspec.DecodeError:
        if _SURROGATE_ESCAPE.search(body) is None:
            raise BadBody("the request body is not valid JSON") from None
        document = _loads(body)
    except RecursionError:
        raise BadBody(TOO_DEEP) from None
    if not isinstance(document, dict):
        raise BadBody("invalid request body: Expected `object`")
    return document


class _StreamOptions(msgspec.Struct):
    stream_options: object = None


_decode_stream_options = msgspec.json.Decoder(_StreamOptions)


def with_usage_asked(body: bytes) -> bytes | None:
    """An OpenAI stream's `body` asking for its usage (`stream_options.include_usage`,
    without which a chat or completions stream reports none), or None when it asks
    already."""
    try:
        options = _decode_stream_options.decode(body).stream_options
    except (msgspec.MsgspecError, RecursionError):  # read_head took it: the whole document says why
        options = None
    if isinstance(options, dict) and options.get("include_usage") is True:
        return None
    document = document_of(body)
    document["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
    return encode_document(document)


def encode_document(document: dict) -> bytes:
    """A document of document_of's, encoded (the standard library's way when it holds a
    lone surrogate, which has no UTF-8)."""
    try:
        return _encode.encode(document)
    except (UnicodeEncodeError, msgspec.EncodeError):
        try:
            return json.dumps(document, separators=(",", ":"), allow_nan=False).encode()
        except ValueError as e:
            raise BadBody(f"invalid request body: {e}") from None


def _reencoded(body: bytes, upstream: str) -> bytes:
    """An ambiguous body with a lone surrogate, re-encoded with `upstream` as its model by
    the standard library (non-ASCII text as escapes: a lone surrogate has no UTF-8)."""
    document = _loads(body)
    if not isinstance(document, dict):
        raise BadBody("invalid request body: Expected `object`")
    document["model"] = upstream
    try:
        return json.dumps(document, separators=(",", ":"), allow_nan=False).encode()
    except ValueError as e:  # a number Python cannot hold as JSON (1e400 read as inf)
        raise BadBody(f"invalid request body: {e}") from None


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
