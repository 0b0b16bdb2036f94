"""Tokens an answer reports in its `usage`, for `tinygw_tokens_total` (docs/design.md section 7).

OpenAI reports `usage.prompt_tokens` / `completion_tokens` (chat, completions,
embeddings), Anthropic and the Responses API `input_tokens` / `output_tokens`. Only
the `usage` field is decoded (msgspec skips the rest without building it), and a held
answer is decoded once for both its `error` (tinygw.resilience.outcome) and its `usage`.

Streams report usage in a few events: OpenAI's last chunk (with
`stream_options.include_usage`), Anthropic's `message_start` (`message.usage`) and
`message_delta` (`usage`, the output so far), the Responses API's `response.completed`
(`response.usage`). Every figure is a running total, so a stream's tokens are the
largest of each that its events report. Only events that hold `"usage":{` are decoded.
"""

from __future__ import annotations

import re
from typing import Annotated

import msgspec
from msgspec import Meta, Struct

Count = Annotated[int, Meta(ge=0, le=2**40)]


class Usage(Struct):
    prompt_tokens: Count | None = None
    completion_tokens: Count | None = None
    input_tokens: Count | None = None
    output_tokens: Count | None = None

    def tokens(self) -> Tokens:
        """The prompt and completion tokens reported, in either API's names (0 when absent)."""
        prompt = self.prompt_tokens if self.prompt_tokens is not None else self.input_tokens or 0
        completion = self.completion_tokens if self.completion_tokens is not None else self.output_tokens or 0
        return Tokens(prompt, completion, reported=True)


class _Holder(Struct):
    usage: Usage | None = None


class Body(Struct):
    """What a held answer is judged by: a non-null `error`, and its `usage`."""

    error: object = None
    usage: Usage | None = None


class _Event(Struct):
    usage: Usage | None = None
    message: _Holder | None = None  # Anthropic's message_start
    response: _Holder | None = None  # the Responses API's response.completed


# The `error` and `usage` of a JSON object body; raises msgspec.MsgspecError (or
# RecursionError) when it cannot be read so: the caller then judges `error` alone.
decode_body = msgspec.json.Decoder(Body).decode
_decode_event = msgspec.json.Decoder(_Event)
# A usage reported: not `"usage": null`, as OpenAI's chunks carry (a stream's scan looks
# for it too: tinygw.protocol.sse).
USAGE_OBJECT = re.compile(rb'"usage"\s*:\s*\{')


def of_event(event: bytes) -> Usage | None:
    """The usage an SSE event reports, if any."""
    at = event.find(b'"usage"')
    if at < 0 or event[at + 7 : at + 14].lstrip(b": ").startswith(b"null"):  # OpenAI's chunks: `"usage":null`
        return None
    if USAGE_OBJECT.search(event, at) is None:
        return None
    data = b"\n".join(line[5:] for line in event.splitlines() if line.startswith(b"data:"))
    try:
        value = _decode_event.decode(data)
    except (msgspec.MsgspecError, RecursionError):
        return None
    message, response = value.message, value.response
    for usage in (value.usage, message.usage if message else None, response.usage if response else None):
        if usage is not None:
            return usage
    return None


# An OpenAI stream's last chunk when its usage was asked for: no choices, only the usage.
_NO_CHOICES = re.compile(rb'"choices"\s*:\s*\[\s*\]')


def usage_only(event: bytes) -> bool:
    """Is `event` the chunk that only reports a stream's usage (`stream_options.include_usage`)?"""
    return _NO_CHOICES.search(event) is not None and of_event(event) is not None


class Tokens(Struct):
    """A stream's tokens so far: the largest of each running total seen."""

    prompt: int = 0
    completion: int = 0
    reported: bool = False  # a usage was read

    def add(self, usage: Usage | None) -> None:
        if usage is not None:
            self.reported = True
            reported = usage.tokens()
            self.prompt = max(self.prompt, reported.prompt)
            self.completion = max(self.completion, reported.completion)
