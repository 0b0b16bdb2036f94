"""An "instant" OpenAI-like upstream for the benchmark.

Run as `python bench/instant_upstream.py [PORT [WORDS]]` (0 or nothing: any free port;
WORDS in a streamed answer, 20 by default). It
prints the port it listens on (one line, flushed), then serves until SIGTERM/SIGINT.

It does as little as possible per request, so that what the benchmark measures is the
gateway and not this server: a raw asyncio Protocol that parses just enough HTTP/1.1
keep-alive to find where each request ends (head up to CRLFCRLF, then a Content-Length
body) and answers every request with one precomputed response in a single
transport.write. GET .../models gets a fixed model listing (the gateway's discovery
and health checks call it); everything else gets a fixed chat.completion. Requests
with a chunked body are not supported: the connection is closed. A request whose body
says `"stream": true` gets a streamed answer: 20 words (or WORDS) as 22 events, chunked.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys

_CHAT = json.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 0,
        "model": "bench-model",
        "choices": [
            {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "Hello from bench."}}
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
    },
    separators=(",", ":"),
).encode()

_MODELS = json.dumps(
    {"object": "list", "data": [{"id": "bench-model", "object": "model", "created": 0, "owned_by": "bench"}]},
    separators=(",", ":"),
).encode()


def _response(body: bytes) -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\n"
        b"content-type: application/json\r\n"
        b"content-length: %d\r\n"
        b"connection: keep-alive\r\n"
        b"\r\n" % len(body)
    ) + body


CHAT_RESPONSE = _response(_CHAT)
MODELS_RESPONSE = _response(_MODELS)


def _stream_response(events: int = 20) -> bytes:
    """A streamed chat answer as providers send it: chunked, one event a chunk: a
    role-only chunk, `events` content chunks, a finish chunk and `[DONE]`."""

    def chunk(delta: dict, finish: str | None = None) -> bytes:
        data = json.dumps(
            {
                "id": "chatcmpl-bench",
                "object": "chat.completion.chunk",
                "created": 0,
                "model": "bench-model",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            },
            separators=(",", ":"),
        ).encode()
        return b"data: " + data + b"\n\n"

    sse = [chunk({"role": "assistant"})] + [chunk({"content": f" word{i}"}) for i in range(events)]
    sse += [chunk({}, "stop"), b"data: [DONE]\n\n"]
    body = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in sse) + b"0\r\n\r\n"
    return (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
        b"connection: keep-alive\r\n\r\n"
    ) + body


STREAM_EVENTS = 22  # relayed events per streamed answer: role, 20 words, finish ([DONE] aside)
STREAM_RESPONSE = _stream_response()


class InstantProtocol(asyncio.Protocol):
    __slots__ = ("transport", "buf")

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        out = []
        while True:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > 65536:  # no end of head in 64 KiB: not a client we serve
                    self.transport.close()
                break
            head = bytes(buf[:end]).lower()
            length = 0
            i = head.find(b"\r\ncontent-length:")
            if i >= 0:
                j = head.find(b"\r\n", i + 2)
                length = int(head[i + 17 : j if j >= 0 else len(head)].strip())
            elif b"\r\ntransfer-encoding:" in head:
                self.transport.close()
                return
            if len(buf) < end + 4 + length:
                break  # the body is still coming
            body = bytes(buf[end + 4 : end + 4 + length])
            del buf[: end + 4 + length]
            if head.startswith(b"get ") and head.split(b" ", 2)[1].endswith(b"/models"):
                out.append(MODELS_RESPONSE)
            elif b'"stream":true' in body.replace(b" ", b""):
                out.append(STREAM_RESPONSE)
            else:
                out.append(CHAT_RESPONSE)
        if out:
            self.transport.write(out[0] if len(out) == 1 else b"".join(out))


async def main(port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(InstantProtocol, "127.0.0.1", port, backlog=4096)
    print(server.sockets[0].getsockname()[1], flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    server.close()


if __name__ == "__main__":
    if len(sys.argv) > 2:
        STREAM_RESPONSE = _stream_response(int(sys.argv[2]))
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 0))
