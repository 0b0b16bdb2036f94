"""A request's conversation key: what keeps an agent's turns on one target and one key,
where the provider's prompt cache is (docs/configuration.md, conversation affinity).

It is, in order: the body's `prompt_cache_key` (OpenAI; Codex sends one), the body's
`metadata.user_id` (Anthropic; Claude Code puts its session there), the client's
`x-tinygw-conversation` header, else the SHA-256 of the conversation's opening, which
stays the same at every turn from the first: the system prompt (Anthropic's `system`,
OpenAI's leading `system`/`developer` messages, Responses' `instructions`) and the first
user message. It is always combined with the client's name, so that two clients never
share one, and it never leaves the gateway (the header is not forwarded: tinygw.headers).

The fields are the spans that tinygw.protocol.request.read_head found in the body's one
parse; only the messages up to the first user message are looked into (their role and
content). A content block is taken without its `cache_control`, which an agent moves
from turn to turn.
"""

from __future__ import annotations

import hashlib

import msgspec
from msgspec import Raw, Struct

from tinygw.headers import CONVERSATION
from tinygw.protocol.request import RequestHead

_ABSENT = Raw()  # a field the JSON does not have


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


_decode_metadata = msgspec.json.Decoder(_Metadata)
_decode_message = msgspec.json.Decoder(_Message)
_decode_blocks = msgspec.json.Decoder(list[_Block])
_decode_items = msgspec.json.Decoder(list[Raw])
_decode_str = msgspec.json.Decoder(str | None).decode

_HEADER = CONVERSATION.encode()
_SYSTEM_ROLES = ("system", "developer")


def conversation_key(head: RequestHead, headers: list[tuple[bytes, bytes]], client: str) -> bytes:
    """The 32-byte key of the conversation that the request (its body's `head`, its
    `headers`) of `client` belongs to. What is not of the expected type counts as absent
    (the provider will refuse such a body anyway)."""
    name = _named(head) or next((v for k, v in headers if k == _HEADER), None) or _opening(head)
    return hashlib.sha256(b"%s\0%s" % (client.encode(), name)).digest()


def _named(fields: RequestHead) -> bytes | None:
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


def _opening(fields: RequestHead) -> bytes:
    """The SHA-256 of the system prompt and the first user message, as `o` + hex digest."""
    opening = hashlib.sha256()
    try:
        for part in _opening_parts(fields):
            opening.update(b"%d:" % len(part))
            opening.update(part)
    except (msgspec.MsgspecError, RecursionError):
        pass
    return b"o" + opening.hexdigest().encode()


def _opening_parts(fields: RequestHead):
    """The spans of the opening, each as the hash takes it (_content)."""
    for system in (fields.system, fields.instructions):
        if system:
            yield _content(system)
    items = fields.messages or fields.input
    if not items:
        return
    if _first_byte(items) == b'"':  # the Responses API's input as one user message
        yield _content(items)
        return
    for item in _decode_items.decode(items):
        message = _decode_message.decode(item)
        if message.role in _SYSTEM_ROLES:
            yield _content(message.content)
        elif message.role == "user":
            yield _content(message.content)
            return


def _content(content: Raw) -> bytes:
    """A message's content (or a system prompt): a string as it is written, a list of
    blocks by their parts that are content (not `cache_control`), each length-prefixed."""
    if _first_byte(content) != b"[":
        return bytes(content)
    return b"".join(b"%d:%s" % (len(span), span) for block in _decode_blocks.decode(content) for span in block.spans())


def _first_byte(value: Raw) -> bytes:
    """A value's first byte, which says its JSON type (msgspec's spans start at the value), without copying it."""
    return bytes(memoryview(value)[:1])
