"""The fake provider's answers as the real APIs stream them: the event sequences of
OpenAI chat and completions, the Responses API and Anthropic messages, for a text
answer or for a call of one tool. Each sequence is one that the official SDKs' stream
parsers, Claude Code and the Codex CLI accept (tests/test_fake.py reads them so)."""

from __future__ import annotations

import base64
import json
import struct
import zlib


def _data(value: dict) -> bytes:
    return b"data: " + json.dumps(value).encode() + b"\n\n"


def _named(kind: str, value: dict) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(value)}\n\n".encode()


# ---- OpenAI chat and completions ------------------------------------------------------------


def _openai_chunk(
    model: str, content: str | None, finish: str | None = None, role: bool = False, with_usage: bool = False
) -> bytes:
    delta = {"role": "assistant"} if role else ({"content": content} if content is not None else {})
    chunk = {
        "id": "chatcmpl-fake",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    if with_usage:
        chunk["usage"] = None  # as OpenAI sends it on every chunk but the last
    return _data(chunk)


def _usage_chunk(model: str, kind: str, words: list[str], usage: dict | None = None) -> bytes:
    usage = usage or {"prompt_tokens": 3, "completion_tokens": len(words), "total_tokens": 3 + len(words)}
    return _data({"id": "chatcmpl-fake", "object": kind, "created": 0, "model": model, "choices": [], "usage": usage})


def openai_stream_events(model: str, words: list[str], include_usage: bool | dict | None = False) -> list[bytes]:
    """Chat chunks of `words`; with `include_usage` (the request's
    `stream_options.include_usage`), a last chunk with no choices and the usage (this
    usage, when it is one)."""
    with_usage = bool(include_usage)
    events = [_openai_chunk(model, None, role=True, with_usage=with_usage)]
    events += [_openai_chunk(model, w, with_usage=with_usage) for w in words]
    events += [_openai_chunk(model, None, finish="stop", with_usage=with_usage)]
    if include_usage:
        usage = include_usage if isinstance(include_usage, dict) else None
        events.append(_usage_chunk(model, "chat.completion.chunk", words, usage))
    return [*events, b"data: [DONE]\n\n"]


def completions_stream_events(model: str, words: list[str], include_usage: bool = False) -> list[bytes]:
    """Legacy completions chunks (`object: text_completion`, `choices[].text`)."""

    def chunk(text: str, finish: str | None = None) -> bytes:
        return _data(
            {
                "id": "cmpl-fake",
                "object": "text_completion",
                "created": 0,
                "model": model,
                "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}],
            }
        )

    events = [*(chunk(w) for w in words), chunk("", "stop")]
    if include_usage:
        events.append(_usage_chunk(model, "text_completion", words))
    return [*events, b"data: [DONE]\n\n"]


def openai_tool_chunks(model: str, name: str, arguments: str) -> list[bytes]:
    def chunk(delta: dict, finish: str | None = None) -> bytes:
        return _data(
            {
                "id": "chatcmpl-fake",
                "object": "chat.completion.chunk",
                "created": 0,
                "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            }
        )

    call = {"index": 0, "id": "call_fake", "type": "function", "function": {"name": name, "arguments": ""}}
    return [
        chunk({"role": "assistant", "content": None, "tool_calls": [call]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": arguments}}]}),
        chunk({}, "tool_calls"),
        b"data: [DONE]\n\n",
    ]


# ---- Anthropic messages -----------------------------------------------------------------------


def _anthropic_events(
    model: str, block: dict, deltas: list[dict], stop_reason: str, output_tokens: int, usage: dict | None = None
) -> list[bytes]:
    def event(kind: str, data: dict) -> bytes:
        return _named(kind, {"type": kind, **data})

    message: dict = {
        "id": "msg_fake",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": usage or {"input_tokens": 3, "output_tokens": 1},
    }
    return [
        event("message_start", {"message": message}),
        event("content_block_start", {"index": 0, "content_block": block}),
        event("ping", {}),
        *(event("content_block_delta", {"index": 0, "delta": d}) for d in deltas),
        event("content_block_stop", {"index": 0}),
        event(
            "message_delta",
            {"delta": {"stop_reason": stop_reason, "stop_sequence": None}, "usage": {"output_tokens": output_tokens}},
        ),
        event("message_stop", {}),
    ]


def anthropic_stream_events(model: str, words: list[str], usage: dict | None = None) -> list[bytes]:
    """A text answer's events; `usage`: message_start's (else 3 tokens in, 1 out)."""
    deltas = [{"type": "text_delta", "text": w} for w in words]
    return _anthropic_events(model, {"type": "text", "text": ""}, deltas, "end_turn", len(words), usage)


def anthropic_tool_events(model: str, name: str, arguments: str, usage: dict | None = None) -> list[bytes]:
    """A `tool_use` block whose input comes as `input_json_delta` pieces."""
    block = {"type": "tool_use", "id": "toolu_fake", "name": name, "input": {}}
    half = len(arguments) // 2
    deltas = [{"type": "input_json_delta", "partial_json": piece} for piece in (arguments[:half], arguments[half:])]
    return _anthropic_events(model, block, deltas, "tool_use", 1, usage)


# ---- the Responses API --------------------------------------------------------------------------


def text_item(words: list[str], status: str = "completed") -> dict:
    text = "".join(words)
    return {
        "type": "message",
        "id": "msg_fake",
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else [],
    }


def function_call_item(name: str, arguments: str, status: str = "completed") -> dict:
    return {
        "type": "function_call",
        "id": "fc_fake",
        "call_id": "call_fake",
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def responses_object(model: str, output: list[dict], status: str = "completed") -> dict:
    """A Responses API `response` object: finished with `output`, or in progress, empty."""
    done = status == "completed"
    usage = {
        "input_tokens": 3,
        "output_tokens": 4,
        "total_tokens": 7,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens_details": {"reasoning_tokens": 0},
    }
    return {
        "id": "resp_fake",
        "object": "response",
        "created_at": 0,
        "status": status,
        "model": model,
        "output": output if done else [],
        "usage": usage if done else None,
        "error": None,
        "incomplete_details": None,
        "instructions": None,
        "metadata": {},
        "parallel_tool_calls": True,
        "temperature": 1.0,
        "tool_choice": "auto",
        "tools": [],
        "top_p": 1.0,
    }


class _Sequence:
    """Responses API events, numbered as the API numbers them."""

    def __init__(self) -> None:
        self.events: list[bytes] = []

    def __call__(self, kind: str, data: dict) -> None:
        self.events.append(_named(kind, {"type": kind, "sequence_number": len(self.events), **data}))

    def around(self, model: str, item: dict) -> None:
        """The events before an item's own (created, in_progress, output_item.added)."""
        self("response.created", {"response": responses_object(model, [], "in_progress")})
        self("response.in_progress", {"response": responses_object(model, [], "in_progress")})
        self("response.output_item.added", {"output_index": 0, "item": item})

    def end(self, model: str, done: dict) -> list[bytes]:
        self("response.output_item.done", {"output_index": 0, "item": done})
        self("response.completed", {"response": responses_object(model, [done])})
        return self.events


def responses_stream_events(model: str, words: list[str]) -> list[bytes]:
    """The Responses API's events for a text answer of `words`."""
    event = _Sequence()
    part = {"item_id": "msg_fake", "output_index": 0, "content_index": 0}
    text = "".join(words)
    done = text_item(words)
    event.around(model, text_item(words, "in_progress"))
    event("response.content_part.added", {**part, "part": {"type": "output_text", "text": "", "annotations": []}})
    for w in words:
        event("response.output_text.delta", {**part, "delta": w, "logprobs": []})
    event("response.output_text.done", {**part, "text": text, "logprobs": []})
    event("response.content_part.done", {**part, "part": {"type": "output_text", "text": text, "annotations": []}})
    return event.end(model, done)


def responses_tool_events(model: str, name: str, arguments: str) -> list[bytes]:
    """The Responses API's events for a call of the tool `name`."""
    event = _Sequence()
    done = function_call_item(name, arguments)
    event.around(model, function_call_item(name, "", "in_progress"))
    call = {"item_id": "fc_fake", "output_index": 0}
    event("response.function_call_arguments.delta", {**call, "delta": arguments})
    event("response.function_call_arguments.done", {**call, "name": name, "arguments": arguments})
    return event.end(model, done)


# ---- Bedrock's event stream (application/vnd.amazon.eventstream) ---------------------------

EVENTSTREAM = "application/vnd.amazon.eventstream"


def frame(headers: dict[str, str], payload: bytes) -> bytes:
    """One event-stream frame: prelude, its CRC32, string headers, payload, message CRC32.
    (The fake's own encoder, apart from the gateway's: each checks the other.)"""
    encoded = b"".join(
        bytes([len(k)]) + k.encode() + b"\x07" + struct.pack(">H", len(v.encode())) + v.encode()
        for k, v in headers.items()
    )
    prelude = struct.pack(">II", 16 + len(encoded) + len(payload), len(encoded))
    message = prelude + struct.pack(">I", zlib.crc32(prelude)) + encoded + payload
    return message + struct.pack(">I", zlib.crc32(message))


def bedrock_frames(events: list[bytes]) -> list[bytes]:
    """Anthropic's server-sent events as Bedrock streams them: each event's JSON as base64
    `bytes` in a chunk frame."""
    frames = []
    for event in events:
        data = next(line[6:] for line in event.split(b"\n") if line.startswith(b"data: "))
        payload = json.dumps({"bytes": base64.b64encode(data).decode(), "p": "abcdefghij"}).encode()
        frames.append(
            frame({":event-type": "chunk", ":content-type": "application/json", ":message-type": "event"}, payload)
        )
    return frames


def bedrock_exception(exception_type: str, message: str) -> bytes:
    """A Bedrock exception frame, as a stream that fails on the way ends."""
    headers = {":exception-type": exception_type, ":content-type": "application/json", ":message-type": "exception"}
    return frame(headers, json.dumps({"message": message}).encode())
