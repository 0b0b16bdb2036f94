"""What the gateway reads and rewrites of a client's request body.

A request body is decoded only for the two fields the gateway needs (`model`,
`stream`), and the spans of those that may name or open its conversation, read only
when its conversation chooses its target (tinygw.protocol.conversation); the prompt is
never decoded into Python objects. The model is rewritten by
replacing its bytes in place when that is unambiguous, and by re-encoding otherwise.
"""

from __future__ import annotations

import json
import re
from typing import TypeVar

import msgspec

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


class _Model(msgspec.Struct):
    """A body's `model` alone: what a rewritten body is checked by."""

    model: str | None = None


_decode_head = msgspec.json.Decoder(RequestHead)
_decode_model = msgspec.json.Decoder(_Model)
_Head = TypeVar("_Head", RequestHead, _Model)
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


def _head_of(body: bytes, decoder: msgspec.json.Decoder[_Head]) -> _Head:
    """The fields of `body` that `decoder` reads (a RequestHead's, or a _Model's), by msgspec
    (its errors raised as they are), or by the standard library when msgspec refused a
    surrogate escape (BadBody then)."""
    try:
        return decoder.decode(body)
    except msgspec.ValidationError:
        raise
    except msgspec.DecodeError:
        if _SURROGATE_ESCAPE.search(body) is None:
            raise
    document = _loads(body)
    if not isinstance(document, dict):
        raise BadBody("invalid request body: Expected `object`")
    try:
        head: _Head = msgspec.convert({k: document[k] for k in ("model", "stream") if k in document}, decoder.type)
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
        head = _head_of(body, _decode_head)
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
            if _head_of(spliced, _decode_model).model == upstream:
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
