"""A request's conversation key: what keeps an agent's turns on one target and one key,
where the provider's prompt cache is (docs/configuration.md, conversation affinity).

It is, in order: the body's `prompt_cache_key` (OpenAI; Codex sends one), the body's
`metadata.user_id` (Anthropic; Claude Code puts its session there), the client's
`x-tinygw-conversation` header, else the SHA-256 of the conversation's opening, which
stays the same at every turn from the first: the system prompt (Anthropic's `system`,
OpenAI's leading `system`/`developer` messages, Responses' `instructions`) and the first
user message. It is always combined with the client's name, so that two clients never
share one, and it never leaves the gateway (the header is not forwarded: tinygw.headers).

Only these fields are decoded: the messages as raw JSON spans of the body, and only
those up to the first user message are looked into (their role and content). A
content block is taken without its `cache_control`, which an agent moves from turn to
turn.
"""

from __future__ import annotations

import hashlib

import msgspec
from msgspec import Raw, Struct

from tinygw.headers import CONVERSATION

# A field's JSON as it is written in the body; empty when the body has none.
_ABSENT = Raw()


class _Body(Struct):
    """The fields of a request body that may name or open its conversation, undecoded."""

    prompt_cache_key: Raw = _ABSENT
    metadata: Raw = _ABSENT
    system: Raw = _ABSENT  # Anthropic's
    instructions: Raw = _ABSENT  # the Responses API's
    messages: list[Raw] | None = None  # chat completions' and Anthropic's
    input: Raw = _ABSENT  # the Responses API's: a string, or its items


class _Metadata(Struct):
    user_id: str | None = None


class _Message(Struct):
    role: str | None = None
    content: Raw = _ABSENT


class _Block(Struct):
    """A content block as the opening's hash takes it: what it says, not how it is cached."""

    type: str | None = None
    text: Raw = _ABSENT
    source: Raw = _ABSENT  # Anthropic's image or document
    image_url: Raw = _ABSENT  # OpenAI's
    file: Raw = _ABSENT

    def spans(self) -> list[bytes]:
        return [(self.type or "").encode(), *map(bytes, (self.text, self.source, self.image_url, self.file))]


_decode_body = msgspec.json.Decoder(_Body)
_decode_metadata = msgspec.json.Decoder(_Metadata)
_decode_message = msgspec.json.Decoder(_Message)
_decode_blocks = msgspec.json.Decoder(list[_Block])
_decode_items = msgspec.json.Decoder(list[Raw])
_decode_str = msgspec.json.Decoder(str | None).decode

_HEADER = CONVERSATION.encode()
_SYSTEM_ROLES = ("system", "developer")


def conversation_key(body: bytes, headers: list[tuple[bytes, bytes]], client: str) -> bytes:
    """The 32-byte key of the conversation that the request (`body`, its `headers`) of
    `client` belongs to. A body whose fields are not of the expected types has the
    key of an empty opening (its provider will refuse it anyway)."""
    try:
        fields = _decode_body.decode(body)
    except (msgspec.MsgspecError, RecursionError):
        fields = _Body()
    name = _named(fields) or next((v for k, v in headers if k == _HEADER), None) or _opening(fields)
    return hashlib.sha256(b"%s\0%s" % (client.encode(), name)).digest()


def _named(fields: _Body) -> bytes | None:
    """The conversation's name as the body gives it: `prompt_cache_key`, else `metadata.user_id`
    (each when it is a non-empty string)."""
    for raw, decode in ((fields.prompt_cache_key, _decode_str), (fields.metadata, _decode_user)):
        try:
            name = decode(raw) if raw else None
        except (msgspec.MsgspecError, RecursionError):
            continue
        if isinstance(name, str) and name:
            return name.encode("utf-8", "surrogatepass")
    return None


def _decode_user(raw: Raw) -> str | None:
    return _decode_metadata.decode(raw).user_id


def _opening(fields: _Body) -> bytes:
    """The SHA-256 of the system prompt and the first user message, as `o` + hex digest."""
    opening = hashlib.sha256()
    try:
        for part in _opening_parts(fields):
            opening.update(b"%d:" % len(part))
            opening.update(part)
    except (msgspec.MsgspecError, RecursionError):
        pass
    return b"o" + opening.hexdigest().encode()


def _opening_parts(fields: _Body):
    """The spans of the opening, each as the hash takes it (_content)."""
    for system in (fields.system, fields.instructions):
        if system:
            yield _content(system)
    items = fields.messages
    if items is None and fields.input:
        if bytes(fields.input).lstrip().startswith(b'"'):  # the Responses API's input as one user message
            yield _content(fields.input)
            return
        items = _decode_items.decode(fields.input)
    for item in items or ():
        message = _decode_message.decode(item)
        if message.role in _SYSTEM_ROLES:
            yield _content(message.content)
        elif message.role == "user":
            yield _content(message.content)
            return


def _content(content: Raw) -> bytes:
    """A message's content (or a system prompt): a string as it is written, a list of
    blocks by their parts that are content (not `cache_control`), each length-prefixed."""
    raw = bytes(content)
    if not raw.lstrip().startswith(b"["):
        return raw
    return b"".join(b"%d:%s" % (len(span), span) for block in _decode_blocks.decode(raw) for span in block.spans())
