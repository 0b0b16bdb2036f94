"""The fake provider's well-behaved script: answers as the real APIs give them.

Every route streams when asked. A request with tools gets one call of its first
function tool; a request that carries a tool's result (an OpenAI `tool` message, a
Responses `*_output` item, an Anthropic `tool_result` block) gets a text answer, so
that an agent's loop ends after one tool call, as it does with a real model. Paths
are matched without their query string (`/v1/messages?beta=true`).

Given a prompt cache (tinygw.fake.cache), the script counts a request's prompt tokens
and reports what it read from the cache of its key and model, as the APIs do:
`usage.cache_read_input_tokens` (Anthropic, beside the `input_tokens` not read from it)
and `usage.prompt_tokens_details.cached_tokens` (OpenAI chat). Without one, every
prompt is 3 tokens.
"""

from __future__ import annotations

import base64
import json
import struct
import urllib.parse
from collections.abc import Callable

from msgspec import Struct

from tinygw.fake import events
from tinygw.fake.cache import PromptCache, prompt_blocks
from tinygw.fake.replies import FakeRequest, Reply, json_reply, sse_reply

# Exactly representable in float32, so that a vector sent as base64 decodes to these.
EMBEDDING = [0.5, 0.25, -0.125]


class Ask(Struct, frozen=True):
    """One request, as the answers need it."""

    model: str
    body: dict
    words: list[str]
    delay_seconds: float
    tool: tuple[str, str] | None  # (name, JSON arguments) of the tool to call, if one is to be called
    prompt: tuple[int, int] = (3, 0)  # the prompt's tokens, and how many were read from the cache

    def anthropic_usage(self, output_tokens: int) -> dict:
        total, cached = self.prompt
        usage = {"input_tokens": total - cached, "output_tokens": output_tokens}
        return {**usage, "cache_read_input_tokens": cached} if cached else usage

    def openai_usage(self, completion_tokens: int) -> dict:
        total, cached = self.prompt
        usage = {
            "prompt_tokens": total,
            "completion_tokens": completion_tokens,
            "total_tokens": total + completion_tokens,
        }
        return {**usage, "prompt_tokens_details": {"cached_tokens": cached}} if cached else usage

    @property
    def stream(self) -> bool:
        return self.body.get("stream") is True

    def sse(self, sequence: list[bytes]) -> Reply:
        return sse_reply(sequence, self.delay_seconds)


def _embedding(encoding_format: object) -> list[float] | str:
    if encoding_format == "base64":  # little-endian float32, as OpenAI sends it
        return base64.b64encode(struct.pack(f"<{len(EMBEDDING)}f", *EMBEDDING)).decode()
    return EMBEDDING


def _placeholder(schema: object) -> object:
    """A value that fits a JSON schema's type: the fake's tool-call arguments."""
    if not isinstance(schema, dict):
        return "fake"
    kind = schema.get("type")
    if schema.get("enum"):
        return schema["enum"][0]
    if kind == "object" or "properties" in schema:
        properties = schema.get("properties") or {}
        return {name: _placeholder(properties.get(name)) for name in schema.get("required") or properties}
    return {"integer": 1, "number": 1, "boolean": True, "array": [], "null": None}.get(str(kind), "fake")


def _has_tool_result(body: dict) -> bool:
    """Whether the conversation already carries a tool's result: then it is time for text."""
    for entry in [*_list(body.get("messages")), *_list(body.get("input"))]:
        if not isinstance(entry, dict):
            continue
        if entry.get("role") == "tool" or str(entry.get("type", "")).endswith("_output"):
            return True
        if any(isinstance(b, dict) and b.get("type") == "tool_result" for b in _list(entry.get("content"))):
            return True
    return False


def _list(value: object) -> list:
    return value if isinstance(value, list) else []


def _tool_call(body: dict) -> tuple[str, str] | None:
    """(name, JSON arguments) of a call to the request's first function tool, or None
    when it has none, says `tool_choice: "none"`, or already carries a tool's result.
    OpenAI chat nests a tool under `function`; the Responses API has `type: "function"`
    at the top; Anthropic's have an `input_schema`. Other tools (a provider's own,
    Responses' free-form `custom`) are never called."""
    if body.get("tool_choice") in ("none", {"type": "none"}) or _has_tool_result(body):
        return None
    for tool in _list(body.get("tools")):
        if not isinstance(tool, dict):
            continue
        function: dict = tool["function"] if isinstance(tool.get("function"), dict) else tool
        if function is tool and tool.get("type") != "function" and "input_schema" not in tool:
            continue
        schema = function.get("parameters", function.get("input_schema", {}))
        return str(function.get("name", "tool")), json.dumps(_placeholder(schema))
    return None


def _include_usage(body: dict) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


def _messages(ask: Ask) -> Reply:
    if ask.tool is not None:
        if ask.stream:
            return ask.sse(events.anthropic_tool_events(ask.model, *ask.tool, usage=ask.anthropic_usage(1)))
        content = [{"type": "tool_use", "id": "toolu_fake", "name": ask.tool[0], "input": json.loads(ask.tool[1])}]
        stop, output_tokens = "tool_use", 1
    else:
        if ask.stream:
            return ask.sse(events.anthropic_stream_events(ask.model, ask.words, ask.anthropic_usage(1)))
        content, stop, output_tokens = [{"type": "text", "text": "".join(ask.words)}], "end_turn", len(ask.words)
    return json_reply(
        200,
        {
            "id": "msg_fake",
            "type": "message",
            "role": "assistant",
            "model": ask.model,
            "content": content,
            "stop_reason": stop,
            "stop_sequence": None,
            "usage": ask.anthropic_usage(output_tokens),
        },
    )


def _bedrock(ask: Ask) -> Reply:
    """Claude on Bedrock: `/model/{model}/invoke` as `/v1/messages`, and
    `invoke-with-response-stream` as its events in event-stream frames."""
    if not ask.stream:
        return _messages(ask)
    if ask.tool is not None:
        sequence = events.anthropic_tool_events(ask.model, *ask.tool)
    else:
        sequence = events.anthropic_stream_events(ask.model, ask.words)
    frames: list[tuple[object, bytes]] = [(ask.delay_seconds, f) for f in events.bedrock_frames(sequence)]
    return Reply(headers=[("content-type", events.EVENTSTREAM)], chunks=frames)


def _token(ask: Ask) -> Reply:
    """A Google token endpoint's answer to a JWT bearer grant."""
    return json_reply(200, {"access_token": "fake-access-token", "expires_in": 3599, "token_type": "Bearer"})


def _count_tokens(ask: Ask) -> Reply:
    return json_reply(200, {"input_tokens": len(json.dumps(ask.body.get("messages", [])).split())})


def _responses(ask: Ask) -> Reply:
    if ask.tool is not None:
        if ask.stream:
            return ask.sse(events.responses_tool_events(ask.model, *ask.tool))
        return json_reply(200, events.responses_object(ask.model, [events.function_call_item(*ask.tool)]))
    if ask.stream:
        return ask.sse(events.responses_stream_events(ask.model, ask.words))
    return json_reply(200, events.responses_object(ask.model, [events.text_item(ask.words)]))


def _embeddings(ask: Ask) -> Reply:
    return json_reply(
        200,
        {
            "object": "list",
            "model": ask.model,
            "usage": {"prompt_tokens": 1, "total_tokens": 1},
            "data": [{"object": "embedding", "index": 0, "embedding": _embedding(ask.body.get("encoding_format"))}],
        },
    )


def _chat(ask: Ask) -> Reply:
    if ask.tool is not None:
        if ask.stream:
            return ask.sse(events.openai_tool_chunks(ask.model, *ask.tool))
        call = {"id": "call_fake", "type": "function", "function": {"name": ask.tool[0], "arguments": ask.tool[1]}}
        message, finish, completion = {"role": "assistant", "content": None, "tool_calls": [call]}, "tool_calls", 1
    else:
        if ask.stream:
            usage = ask.openai_usage(len(ask.words)) if _include_usage(ask.body) else None
            return ask.sse(events.openai_stream_events(ask.model, ask.words, usage))
        message, finish = {"role": "assistant", "content": "".join(ask.words)}, "stop"
        completion = len(ask.words)
    return json_reply(
        200,
        {
            "id": "chatcmpl-fake",
            "object": "chat.completion",
            "created": 0,
            "model": ask.model,
            "choices": [{"index": 0, "finish_reason": finish, "message": message}],
            "usage": ask.openai_usage(completion),
        },
    )


def _completions(ask: Ask) -> Reply:
    if ask.stream:
        return ask.sse(events.completions_stream_events(ask.model, ask.words, _include_usage(ask.body)))
    return json_reply(
        200,
        {
            "id": "cmpl-fake",
            "object": "text_completion",
            "created": 0,
            "model": ask.model,
            "choices": [{"index": 0, "text": "".join(ask.words), "finish_reason": "stop", "logprobs": None}],
            "usage": {"prompt_tokens": 3, "completion_tokens": len(ask.words), "total_tokens": 3 + len(ask.words)},
        },
    )


def cloud_model(path: str) -> tuple[str, bool] | None:
    """The model and whether a stream is asked for, of a Bedrock or Vertex path; None for another path."""
    for action, stream in (
        ("/invoke-with-response-stream", True),
        ("/invoke", False),
        (":streamRawPredict", True),
        (":rawPredict", False),
    ):
        if path.endswith(action):
            model = path[: -len(action)].rpartition("/model/" if action.startswith("/") else "/models/")[2]
            return urllib.parse.unquote(model), stream
    return None


# By the end of the path (its query string left off), the longest first.
_ANSWERS: tuple[tuple[str, Callable[[Ask], Reply]], ...] = (
    ("/invoke-with-response-stream", _bedrock),
    ("/invoke", _bedrock),
    (":streamRawPredict", _messages),
    (":rawPredict", _messages),
    ("/token", _token),
    ("/messages/count_tokens", _count_tokens),
    ("/messages", _messages),
    ("/responses", _responses),
    ("/embeddings", _embeddings),
    ("/chat/completions", _chat),
    ("/completions", _completions),
)


def _key_of(request: FakeRequest) -> str:
    """The API key a request carries (the account its prompt cache is kept for)."""
    headers = request.headers
    return headers.get("x-api-key") or headers.get("api-key") or headers.get("authorization", "")


def well_behaved(
    name: str = "fake", words: list[str] | None = None, delay_seconds: float = 0.0, cache: PromptCache | None = None
) -> Callable:
    """A script that answers like a healthy provider: chat, completions, embeddings,
    responses, messages, count_tokens and model listings, Claude on Bedrock and Vertex
    (and a Google token endpoint at `/token`); streams when asked,
    `delay_seconds` between events; calls the first function tool once when the request
    has `tools`; embeddings as base64 when `encoding_format` says so; with `cache`, reads
    and keeps the prompts of chat and messages in it."""
    words = words or ["Hello", " from", f" {name}", "."]

    def script(request: FakeRequest) -> Reply:
        path = request.path.partition("?")[0]
        if request.method == "GET" and path.endswith("/models"):
            return json_reply(200, {"object": "list", "data": [{"id": f"{name}-model", "object": "model"}]})
        body = request.json() or {} if "x-www-form-urlencoded" not in request.headers.get("content-type", "") else {}
        body = body if isinstance(body, dict) else {}
        model = str(body.get("model", "unknown"))
        cloud = cloud_model(path)
        if cloud is not None:  # the model is in the path; Bedrock's path says whether it streams
            model, stream = cloud
            body = {**body, "stream": stream}
        ask = Ask(model, body, words, delay_seconds, None)
        answer = next((a for end, a in _ANSWERS if path.endswith(end)), _chat)
        if answer not in (_count_tokens, _embeddings, _token):
            prompt = (3, 0)
            if cache is not None and answer in (_messages, _bedrock, _chat):
                prompt = cache.read(_key_of(request), model, prompt_blocks(body))
            ask = Ask(ask.model, body, words, delay_seconds, _tool_call(body), prompt)
        return answer(ask)

    return script
