"""Claude on Bedrock and Vertex (docs/design.md section 18): where a request goes on
each cloud, how an Anthropic Messages body becomes the cloud's, and how the clouds name
their errors.

The gateway writes the whole path: `/model/{model}/invoke` (or
`invoke-with-response-stream`) on Bedrock, `/v1/projects/{project}/locations/{region}/
publishers/anthropic/models/{model}:rawPredict` (or `:streamRawPredict`) on Vertex. A
`/v1/messages` body loses its `model` (it is in the path), for Bedrock its `stream` too
(the path says it), and gains the cloud's `anthropic_version`; the rest of it is left
byte for byte as it came: the prompt is never decoded, unless the edit would be
ambiguous (then the document is re-encoded with the same meaning, as request.rewrite_model
does).
"""

from __future__ import annotations

import re
from urllib.parse import quote

import msgspec
from msgspec import UNSET, Struct, UnsetType

from tinygw.config.documents import ProviderDoc
from tinygw.config.settings import CLOUDS, default_base_url  # noqa: F401 -- passed on
from tinygw.protocol.request import document_of, encode_document

BEDROCK = "bedrock"
VERTEX = "vertex"
ANTHROPIC_VERSION = {BEDROCK: "bedrock-2023-05-31", VERTEX: "vertex-2023-10-16"}


def bedrock_target(model: str, stream: bool) -> bytes:
    """The request target of a Bedrock model (its id, or an inference profile's ARN,
    percent-encoded as one path segment, as the AWS SDKs send it)."""
    action = "invoke-with-response-stream" if stream else "invoke"
    return f"/model/{quote(model, safe='')}/{action}".encode()


def vertex_target(project: str, region: str, model: str, stream: bool) -> bytes:
    """The request target of a Claude model on Vertex, in the provider's project and region."""
    action = "streamRawPredict" if stream else "rawPredict"
    return (
        f"/v1/projects/{quote(project, safe='')}/locations/{quote(region, safe='')}"
        f"/publishers/anthropic/models/{quote(model, safe='@')}:{action}"
    ).encode()


def cloud_request(doc: ProviderDoc, route_api: str, body: bytes, stream: bool, model: str) -> tuple[bytes, bytes]:
    """(request target, body) of a request to a bedrock or vertex provider: a cloud
    shape's body as it came, a `/v1/messages` body as the cloud takes it."""
    if doc.api == BEDROCK:
        target = bedrock_target(model, stream)
    else:
        target = vertex_target(doc.project or "", doc.region or "", model, stream)
    return target, body if route_api == doc.api else messages_body(body, doc.api)


# ---- a Messages body for a cloud --------------------------------------------------------


class _Keys(Struct):
    """The top-level keys a cloud's body is edited in (every other one is skipped by the decoder)."""

    model: object | UnsetType = UNSET
    stream: object | UnsetType = UNSET
    anthropic_version: object | UnsetType = UNSET


_decode_keys = msgspec.json.Decoder(_Keys)
_encode = msgspec.json.Encoder()
# An escaped ASCII letter or `_` (`"mod\u0065l"`): a key no byte search sees.
_LETTER_ESCAPE = re.compile(rb"\\u00[4-7][0-9a-fA-F]")
_VALUE = rb'(?:"(?:[^"\\]|\\.)*"|true|false|null|-?[0-9][0-9.eE+-]*)'
_PAIRS = {
    key: re.compile(rb'(?<!\\)"' + key.encode() + rb'"\s*:\s*' + _VALUE)
    for key in ("model", "stream", "anthropic_version")
}
_SPACE = b" \t\r\n"


def messages_body(body: bytes, api: str) -> bytes:
    """A `/v1/messages` body as `api` (bedrock | vertex) takes it: without `model` (and,
    for Bedrock, `stream`), with the cloud's `anthropic_version` first."""
    drop = ("model", "stream", "anthropic_version") if api == BEDROCK else ("model", "anthropic_version")
    version = ANTHROPIC_VERSION[api]
    try:
        edited = _spliced(body, drop, version)
        if edited is not None:
            return edited
    except (msgspec.MsgspecError, RecursionError):  # read by the standard library's parser instead
        pass
    document = document_of(body)
    return encode_document({"anthropic_version": version, **{k: v for k, v in document.items() if k not in drop}})


def _spliced(body: bytes, drop: tuple[str, ...], version: str) -> bytes | None:
    """`body` edited in place, or None when the edit would be ambiguous (a key written
    twice, or with escapes)."""
    if _LETTER_ESCAPE.search(body) is not None:
        return None
    before = _decode_keys.decode(body)
    for key in drop:
        if getattr(before, key) is UNSET:
            continue
        if body.count(b'"' + key.encode() + b'"') != 1:
            return None
        match = _PAIRS[key].search(body)
        if match is None:
            return None
        start, end = match.span()
        after = len(body) - len(body[end:].lstrip(_SPACE))
        if body[after : after + 1] == b",":  # a member followed by others: its comma (and the space after) goes
            end = len(body) - len(body[after + 1 :].lstrip(_SPACE))
        else:  # the last member: the comma before it goes
            comma = len(body[:start].rstrip(_SPACE))
            if body[comma - 1 : comma] == b",":
                start = comma - 1
        body = body[:start] + body[end:]
    opening = len(body) - len(body.lstrip(_SPACE))
    if body[opening : opening + 1] != b"{":
        return None
    rest = body[opening + 1 :]
    separator = b"" if rest.lstrip(_SPACE).startswith(b"}") else b","
    edited = b'{"anthropic_version":' + _encode.encode(version) + separator + rest
    keys = _decode_keys.decode(edited)
    if keys.anthropic_version != version or any(
        getattr(keys, key) is not UNSET for key in drop if key != "anthropic_version"
    ):
        return None
    return edited


# ---- how the clouds name their errors ---------------------------------------------------

# Bedrock names an error in a header, `ThrottlingException:http://internal.amazon.com/...`
# (or in the body's `__type`); Vertex in the body's `error.status` (Google's canonical codes).
AWS_ERROR_TYPE = b"x-amzn-errortype"


class _ErrorBody(Struct):
    error: object = None
    aws_type: str | None = msgspec.field(default=None, name="__type")


_decode_error = msgspec.json.Decoder(_ErrorBody)


def error_name(headers: list[tuple[bytes, bytes]], body: bytes | None) -> str | None:
    """The name a cloud gives the error of an answer (`ThrottlingException`,
    `RESOURCE_EXHAUSTED`), or None."""
    for name, value in headers:
        if name == AWS_ERROR_TYPE:
            return value.decode("latin-1").partition(":")[0].strip() or None
    if not body:
        return None
    try:
        answer = _decode_error.decode(body)
    except (msgspec.MsgspecError, RecursionError):
        return None
    if isinstance(answer.error, dict) and isinstance(status := answer.error.get("status"), str):
        return status
    return answer.aws_type.rpartition("#")[2] if answer.aws_type else None
