"""A fake provider that speaks just enough OpenAI and Anthropic, and misbehaves on cue.

Used by `tinygw demo`, the tests and the benchmark. It answers in one write when it
can (a plain `http.server` adds tens of milliseconds), keeps connections alive, and
records every request it got. What it answers is decided per request by a `script`:
a function from the request to a `Reply`, so a test can refuse, hang, answer 502 fast,
cut a stream or answer 429 with Retry-After exactly when it wants.
"""

from __future__ import annotations

import asyncio
import base64
import json
import struct
import threading
from collections.abc import Callable

from msgspec import Struct, field


class FakeRequest(Struct):
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    connection: int = 0  # which connection it came on: the fake's count of accepted ones

    def json(self):
        return json.loads(self.body) if self.body else None


class Reply(Struct):
    """What to answer. `action`: answer | hang (never answer) | close (no answer) |
    cut (send the head and `chunks`, then close without ending the body) |
    answer_close (answer in full, keep-alive, then close the idle connection) |
    raw (write `body` as the whole response, in one write, and keep the connection:
    for answers that break HTTP on purpose, such as bytes past their content-length)."""

    status: int = 200
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""
    # A chunked body: (wait, data) pairs, where wait is seconds to sleep or a
    # threading.Event to wait for (a test's gate) before sending data.
    chunks: list[tuple[object, bytes]] | None = None
    action: str = "answer"


_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 429: "Too Many Requests",
            500: "Internal Server Error", 502: "Bad Gateway", 503: "Service Unavailable", 504: "Gateway Timeout",
            529: "Overloaded"}


def json_reply(status: int, value, headers: list[tuple[str, str]] | None = None) -> Reply:
    return Reply(status=status, headers=[("content-type", "application/json"), *(headers or [])],
                 body=json.dumps(value).encode())


def sse_reply(events: list[bytes], delay_seconds: float = 0.0, cut: bool = False) -> Reply:
    return Reply(headers=[("content-type", "text/event-stream")],
                 chunks=[(delay_seconds, e) for e in events], action="cut" if cut else "answer")


def _openai_chunk(model: str, content: str | None, finish: str | None = None, role: bool = False,
                  with_usage: bool = False) -> bytes:
    delta = {"role": "assistant"} if role else ({"content": content} if content is not None else {})
    chunk = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 0, "model": model,
             "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    if with_usage:
        chunk["usage"] = None  # as OpenAI sends it on every chunk but the last
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def openai_stream_events(model: str, words: list[str], include_usage: bool = False) -> list[bytes]:
    """Chat chunks of `words`; with `include_usage` (the request's
    `stream_options.include_usage`), a last chunk with no choices and the usage."""
    events = [_openai_chunk(model, None, role=True, with_usage=include_usage)]
    events += [_openai_chunk(model, w, with_usage=include_usage) for w in words]
    events += [_openai_chunk(model, None, finish="stop", with_usage=include_usage)]
    if include_usage:
        usage = {"prompt_tokens": 3, "completion_tokens": len(words), "total_tokens": 3 + len(words)}
        chunk = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 0, "model": model,
                 "choices": [], "usage": usage}
        events.append(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    return [*events, b"data: [DONE]\n\n"]


def anthropic_stream_events(model: str, words: list[str]) -> list[bytes]:
    def event(kind: str, data: dict) -> bytes:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode()

    usage = {"input_tokens": 3, "output_tokens": len(words)}
    message = {"id": "msg_fake", "type": "message", "role": "assistant", "model": model, "content": [],
               "stop_reason": None, "stop_sequence": None, "usage": usage}
    events = [event("message_start", {"message": message}),
              event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
              event("ping", {})]
    events += [event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": w}}) for w in words]
    events += [event("content_block_stop", {"index": 0}),
               event("message_delta", {"delta": {"stop_reason": "end_turn", "stop_sequence": None},
                                       "usage": {"output_tokens": len(words)}}),
               event("message_stop", {})]
    return events


def _responses_object(model: str, words: list[str], status: str = "completed") -> dict:
    """A Responses API `response` object: finished with `words` as its text, or empty."""
    done = status == "completed"
    message = {"type": "message", "id": "msg_fake", "status": "completed", "role": "assistant",
               "content": [{"type": "output_text", "text": "".join(words), "annotations": []}]}
    usage = {"input_tokens": 3, "output_tokens": len(words), "total_tokens": 3 + len(words),
             "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}
    return {"id": "resp_fake", "object": "response", "created_at": 0, "status": status, "model": model,
            "output": [message] if done else [], "usage": usage if done else None,
            "error": None, "incomplete_details": None, "instructions": None, "metadata": {},
            "parallel_tool_calls": True, "temperature": 1.0, "tool_choice": "auto", "tools": [], "top_p": 1.0}


def responses_stream_events(model: str, words: list[str]) -> list[bytes]:
    """The OpenAI Responses API's events for a text answer of `words`."""
    events = []

    def event(kind: str, data: dict) -> None:
        value = {"type": kind, "sequence_number": len(events), **data}
        events.append(f"event: {kind}\ndata: {json.dumps(value)}\n\n".encode())

    part = {"item_id": "msg_fake", "output_index": 0, "content_index": 0}
    text = "".join(words)
    message = {"type": "message", "id": "msg_fake", "status": "in_progress", "role": "assistant", "content": []}
    event("response.created", {"response": _responses_object(model, words, "in_progress")})
    event("response.in_progress", {"response": _responses_object(model, words, "in_progress")})
    event("response.output_item.added", {"output_index": 0, "item": message})
    event("response.content_part.added", {**part, "part": {"type": "output_text", "text": "", "annotations": []}})
    for w in words:
        event("response.output_text.delta", {**part, "delta": w, "logprobs": []})
    event("response.output_text.done", {**part, "text": text, "logprobs": []})
    event("response.content_part.done", {**part, "part": {"type": "output_text", "text": text, "annotations": []}})
    done = _responses_object(model, words)
    event("response.output_item.done", {"output_index": 0, "item": done["output"][0]})
    event("response.completed", {"response": done})
    return events


# Exactly representable in float32, so that a vector sent as base64 decodes to these.
EMBEDDING = [0.5, 0.25, -0.125]


def _embedding(encoding_format: object) -> list[float] | str:
    if encoding_format == "base64":  # little-endian float32, as OpenAI sends it
        return base64.b64encode(struct.pack(f"<{len(EMBEDDING)}f", *EMBEDDING)).decode()
    return EMBEDDING


def _placeholder(schema: object) -> object:
    """A value that fits a JSON schema's type: the fake's tool-call arguments."""
    if not isinstance(schema, dict):
        return "fake"
    kind = schema.get("type")
    if "enum" in schema and schema["enum"]:
        return schema["enum"][0]
    if kind == "object" or "properties" in schema:
        properties = schema.get("properties") or {}
        return {name: _placeholder(properties[name]) for name in schema.get("required") or properties}
    return {"integer": 1, "number": 1, "boolean": True, "array": [], "null": None}.get(kind, "fake")


def _tool_call(body: dict) -> tuple[str, str] | None:
    """(name, JSON arguments) of a call to the request's first tool, or None when the
    request has no tools or says `tool_choice: "none"`. OpenAI chat nests a tool under
    `function`; the Responses API and Anthropic do not (Anthropic's schema is `input_schema`)."""
    tools = body.get("tools")
    if not tools or not isinstance(tools, list) or body.get("tool_choice") in ("none", {"type": "none"}):
        return None
    tool = tools[0] if isinstance(tools[0], dict) else {}
    function = tool.get("function") if isinstance(tool.get("function"), dict) else tool
    schema = function.get("parameters", function.get("input_schema", {}))
    return str(function.get("name", "tool")), json.dumps(_placeholder(schema))


def _openai_tool_chunks(model: str, name: str, arguments: str) -> list[bytes]:
    def chunk(delta: dict, finish: str | None = None) -> bytes:
        value = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 0, "model": model,
                 "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        return b"data: " + json.dumps(value).encode() + b"\n\n"

    call = {"index": 0, "id": "call_fake", "type": "function", "function": {"name": name, "arguments": ""}}
    return [chunk({"role": "assistant", "content": None, "tool_calls": [call]}),
            chunk({"tool_calls": [{"index": 0, "function": {"arguments": arguments}}]}),
            chunk({}, "tool_calls"), b"data: [DONE]\n\n"]


def _anthropic_tool_events(model: str, name: str, arguments: str) -> list[bytes]:
    def event(kind: str, data: dict) -> bytes:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode()

    message = {"id": "msg_fake", "type": "message", "role": "assistant", "model": model, "content": [],
               "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 3, "output_tokens": 1}}
    block = {"type": "tool_use", "id": "toolu_fake", "name": name, "input": {}}
    return [event("message_start", {"message": message}),
            event("content_block_start", {"index": 0, "content_block": block}),
            event("content_block_delta", {"index": 0, "delta": {"type": "input_json_delta",
                                                                "partial_json": arguments}}),
            event("content_block_stop", {"index": 0}),
            event("message_delta", {"delta": {"stop_reason": "tool_use", "stop_sequence": None},
                                    "usage": {"output_tokens": 1}}),
            event("message_stop", {})]


def well_behaved(name: str = "fake", words: list[str] | None = None, delay_seconds: float = 0.0) -> Callable:
    """A script that answers like a healthy provider: chat, completions, embeddings,
    responses, messages, count_tokens and model listings; streams when asked,
    `delay_seconds` between events; calls the first tool when the request has `tools`
    (chat, messages, responses); embeddings as base64 when `encoding_format` says so."""
    words = words or ["Hello", " from", f" {name}", "."]

    def script(request: FakeRequest) -> Reply:
        if request.method == "GET" and request.path.endswith("/models"):
            return json_reply(200, {"object": "list", "data": [{"id": f"{name}-model", "object": "model"}]})
        body = request.json() or {}
        model = body.get("model", "unknown")
        path = request.path.partition("?")[0]
        if path.endswith("/messages/count_tokens"):
            return json_reply(200, {"input_tokens": len(json.dumps(body.get("messages", [])).split())})
        tool = _tool_call(body)
        if path.endswith("/responses"):
            if tool is not None:
                answer = _responses_object(model, words)
                answer["output"] = [{"type": "function_call", "id": "fc_fake", "call_id": "call_fake",
                                     "name": tool[0], "arguments": tool[1], "status": "completed"}]
                return json_reply(200, answer)
            if body.get("stream"):
                return sse_reply(responses_stream_events(model, words), delay_seconds)
            return json_reply(200, _responses_object(model, words))
        if request.path.endswith("/messages"):
            if tool is not None:
                if body.get("stream"):
                    return sse_reply(_anthropic_tool_events(model, *tool), delay_seconds)
                return json_reply(200, {"id": "msg_fake", "type": "message", "role": "assistant", "model": model,
                                        "content": [{"type": "tool_use", "id": "toolu_fake", "name": tool[0],
                                                     "input": json.loads(tool[1])}],
                                        "stop_reason": "tool_use", "stop_sequence": None,
                                        "usage": {"input_tokens": 3, "output_tokens": 1}})
            if body.get("stream"):
                return sse_reply(anthropic_stream_events(model, words), delay_seconds)
            return json_reply(200, {"id": "msg_fake", "type": "message", "role": "assistant", "model": model,
                                    "content": [{"type": "text", "text": "".join(words)}],
                                    "stop_reason": "end_turn", "stop_sequence": None,
                                    "usage": {"input_tokens": 3, "output_tokens": len(words)}})
        if request.path.endswith("/embeddings"):
            return json_reply(200, {"object": "list", "model": model, "usage": {"prompt_tokens": 1, "total_tokens": 1},
                                    "data": [{"object": "embedding", "index": 0,
                                              "embedding": _embedding(body.get("encoding_format"))}]})
        if tool is not None and path.endswith("/chat/completions"):
            if body.get("stream"):
                return sse_reply(_openai_tool_chunks(model, *tool), delay_seconds)
            call = {"id": "call_fake", "type": "function", "function": {"name": tool[0], "arguments": tool[1]}}
            return json_reply(200, {"id": "chatcmpl-fake", "object": "chat.completion", "created": 0, "model": model,
                                    "choices": [{"index": 0, "finish_reason": "tool_calls",
                                                 "message": {"role": "assistant", "content": None,
                                                             "tool_calls": [call]}}],
                                    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}})
        if body.get("stream"):
            options = body.get("stream_options")
            include_usage = isinstance(options, dict) and options.get("include_usage") is True
            return sse_reply(openai_stream_events(model, words, include_usage), delay_seconds)
        if request.path.endswith("/completions") and not request.path.endswith("/chat/completions"):
            return json_reply(200, {"id": "cmpl-fake", "object": "text_completion", "created": 0, "model": model,
                                    "choices": [{"index": 0, "text": "".join(words), "finish_reason": "stop",
                                                 "logprobs": None}]})
        return json_reply(200, {"id": "chatcmpl-fake", "object": "chat.completion", "created": 0, "model": model,
                                "choices": [{"index": 0, "finish_reason": "stop",
                                             "message": {"role": "assistant", "content": "".join(words)}}],
                                "usage": {"prompt_tokens": 3, "completion_tokens": len(words), "total_tokens": 7}})

    return script


class FakeUpstream:
    """An HTTP/1.1 server on 127.0.0.1. `script` may be replaced at any time."""

    def __init__(self, script: Callable[[FakeRequest], Reply] | None = None, port: int = 0,
                 record: bool = True) -> None:
        self.script = script or well_behaved()
        self.requests: list[FakeRequest] = []
        self.record = record
        self.port = port
        self.open_connections = 0
        self.accepted = 0  # connections accepted, ever
        self.peer_closed = 0  # streams the peer closed while this fake was still sending
        self._server: asyncio.AbstractServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port, backlog=1024)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()

    def start_in_thread(self) -> FakeUpstream:
        """Serve on an event loop of its own, in a daemon thread; returns self."""
        ready = threading.Event()

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            self._loop.run_until_complete(self.start())
            ready.set()
            self._loop.run_forever()

        threading.Thread(target=run, daemon=True, name=f"fake-upstream-{id(self)}").start()
        if not ready.wait(10):
            raise RuntimeError("the fake upstream did not start")
        return self

    def stop_thread(self) -> None:
        """Close the server and every connection, then stop the thread's loop."""
        if self._loop is None:
            return

        async def shutdown() -> None:
            await self.stop()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(5)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.open_connections += 1
        self.accepted += 1
        connection = self.accepted
        try:
            while True:
                request = await _read_request(reader)
                if request is None:
                    return
                request.connection = connection
                if self.record:
                    self.requests.append(request)
                reply = self.script(request)
                if not await _write_reply(reader, writer, reply, self) or reply.action == "answer_close":
                    return
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            return
        finally:
            writer.close()
            try:
                await writer.wait_closed()  # the FIN is out before the count drops
            except (ConnectionError, OSError):
                pass
            self.open_connections -= 1


async def _read_request(reader: asyncio.StreamReader) -> FakeRequest | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    body = await reader.readexactly(length) if length else b""
    return FakeRequest(method, path, headers, body)


async def _wait(reader: asyncio.StreamReader, wait) -> bool:
    """Sleep or wait for a gate, watching the connection; False if the peer closed it."""
    if isinstance(wait, threading.Event):
        waiting = asyncio.ensure_future(asyncio.get_running_loop().run_in_executor(None, wait.wait, 60))
    else:
        waiting = asyncio.ensure_future(asyncio.sleep(wait))
    eof = asyncio.ensure_future(reader.read(1))
    done, _ = await asyncio.wait([waiting, eof], return_when=asyncio.FIRST_COMPLETED)
    if eof in done:
        waiting.cancel()
        return False
    eof.cancel()
    await asyncio.gather(eof, return_exceptions=True)  # the reader takes no second waiter
    return True


async def _write_reply(reader, writer: asyncio.StreamWriter, reply: Reply, upstream: FakeUpstream) -> bool:
    """Write `reply`; False when the connection must end after it."""
    try:
        return await _write(reader, writer, reply, upstream)
    except ConnectionError:
        upstream.peer_closed += 1
        return False


async def _write(reader, writer: asyncio.StreamWriter, reply: Reply, upstream: FakeUpstream) -> bool:
    if reply.action == "hang":
        if not await _wait(reader, 3600):
            upstream.peer_closed += 1
        return False
    if reply.action == "close":
        return False
    if reply.action == "raw":
        writer.write(reply.body)
        await writer.drain()
        return True
    head = [f"HTTP/1.1 {reply.status} {_REASONS.get(reply.status, 'Status')}"]
    head += [f"{k}: {v}" for k, v in reply.headers]
    if reply.chunks is None:
        head.append(f"content-length: {len(reply.body)}")
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + reply.body)
        await writer.drain()
        return True
    head.append("transfer-encoding: chunked")
    writer.write(("\r\n".join(head) + "\r\n\r\n").encode())
    for wait, data in reply.chunks:
        if wait:
            await writer.drain()
            if not await _wait(reader, wait):
                upstream.peer_closed += 1
                return False
        writer.write(b"%x\r\n%s\r\n" % (len(data), data))
    await writer.drain()
    if reply.action == "cut":
        return False
    writer.write(b"0\r\n\r\n")
    await writer.drain()
    return True


def main(argv: list[str] | None = None) -> None:
    """`tinygw fake [PORT]` (or `python -m tinygw.fake.upstream [PORT]`): a well-behaved
    fake provider on 127.0.0.1, both APIs at once, until interrupted. Prints its port
    (a free one without PORT) on the first line of stdout."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    upstream = FakeUpstream(port=int(args[0]) if args else 0, record=False)

    async def run() -> None:
        await upstream.start()
        print(upstream.port, flush=True)
        await asyncio.Event().wait()

    try:
        asyncio.run(run())
    except KeyboardInterrupt:  # Ctrl-C is how it is meant to stop
        pass


if __name__ == "__main__":
    main()
