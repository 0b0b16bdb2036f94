"""A paced OpenAI-like upstream for `make bench-streams`: streams that trickle, as a provider generates.

Run as `python bench/paced_upstream.py [--events N] [--interval-ms MS] [--fast] [--fast-cap-bytes B]`.
It prints the port it listens on (one line, flushed), then serves on 127.0.0.1 until SIGTERM/SIGINT.

- A request whose body says `"stream": true` gets a chunked `text/event-stream` answer of N
  chat-completion chunks (200 by default), the first at once, then one every MS ms (50), then a
  finish chunk and `data: [DONE]` with the last. Each chunk's content is `"<i>@<t> "`: its index from
  0, and its send time, `time.monotonic_ns() // 1000` read just before the write (CLOCK_MONOTONIC:
  the same clock in every process, so a client subtracts it from its own receive time). A body with
  `"max_tokens": K` (or `max_completion_tokens`, as some gateways rename it) gets K events instead
  (the benchmark's quick check of a target).
- `--fast` (the slow-reader lane): a streamed answer is sent as fast as the connection takes it:
  batches of events written while the transport accepts (asyncio's flow control: paused above its
  high-water mark, resumed below), up to `--fast-cap-bytes` a stream (64 MiB), then the finish
  chunk and `[DONE]`. A gateway that stops reading when its client does keeps this upstream paused; one
  that does not reads the whole cap.
- GET .../models answers a fixed listing (the gateways' discovery), anything else a fixed
  `chat.completion` (the peers' start-up checks).

One process, one event loop (uvloop when installed), no per-event timer: a wheel of ticks (5 ms) of
which each stream is due once every interval; a tick writes the next event of every stream in its slot.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import resource
import signal
import time

TICK_S = 0.005

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
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)


CHAT_RESPONSE, MODELS_RESPONSE = _response(_CHAT), _response(_MODELS)
STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
    b"cache-control: no-cache\r\n\r\n"
)
_PREFIX = b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","created":0,"model":"bench-model",'
FIRST = _PREFIX + b'"choices":[{"index":0,"delta":{"role":"assistant","content":"%d@%d "},"finish_reason":null}]}\n\n'
EVENT = _PREFIX + b'"choices":[{"index":0,"delta":{"content":"%d@%d "},"finish_reason":null}]}\n\n'
_FINISH = _PREFIX + b'"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'
END = b"%x\r\n%s\r\n0\r\n\r\n" % (len(_FINISH), _FINISH)
MAX_TOKENS = re.compile(rb'"max_(?:completion_)?tokens"\s*:\s*(\d+)')


def chunk(sse: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(sse), sse)


def event(i: int) -> bytes:
    return chunk((FIRST if i == 0 else EVENT) % (i, time.monotonic_ns() // 1000))


class Server:
    """The wheel: `slots[k % per]` holds the streams due at tick k (per = ticks an interval)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, events: int, interval_s: float, fast: bool, cap: int) -> None:
        self.loop, self.events, self.fast, self.cap = loop, events, fast, cap
        self.per = max(1, round(interval_s / TICK_S))
        self.slots: list[list[Paced]] = [[] for _ in range(self.per)]
        self.tick, self.t0 = 0, loop.time()
        loop.call_at(self.t0 + TICK_S, self.on_tick)

    def on_tick(self) -> None:
        now = self.loop.time()
        while self.t0 + (self.tick + 1) * TICK_S <= now:  # every tick that is due, late ones included
            self.tick += 1
            slot = self.tick % self.per
            due, self.slots[slot] = self.slots[slot], []
            keep = self.slots[slot]
            for stream in due:
                if stream.send_next():
                    keep.append(stream)
        self.loop.call_at(self.t0 + (self.tick + 1) * TICK_S, self.on_tick)

    def add(self, stream: Paced) -> None:
        self.slots[self.tick % self.per].append(stream)  # due one interval from now


class Paced:
    """One paced stream: event i is sent on its turn of the wheel."""

    __slots__ = ("transport", "left", "i")

    def __init__(self, transport: asyncio.Transport, events: int) -> None:
        self.transport, self.left, self.i = transport, events, 0

    def send_next(self) -> bool:
        """Write the next event (and the end after the last); False when the stream is over."""
        transport = self.transport
        if transport.is_closing():
            return False
        data = event(self.i)
        self.i += 1
        self.left -= 1
        if self.left <= 0:
            transport.write(data + END)
            return False
        transport.write(data)
        return True


class Protocol(asyncio.Protocol):
    server: Server  # set in main()

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.paused = False
        self.pump_left = 0  # --fast: bytes still to send in the current stream
        self.pump_i = 0

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        while True:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > 65536:
                    self.transport.close()
                return
            head = bytes(buf[:end]).lower()
            length = 0
            i = head.find(b"\r\ncontent-length:")
            if i >= 0:
                j = head.find(b"\r\n", i + 2)
                length = int(head[i + 17 : j if j >= 0 else len(head)].strip())
            elif b"\r\ntransfer-encoding:" in head:
                self.transport.close()  # chunked request bodies: no client here sends one
                return
            if len(buf) < end + 4 + length:
                return
            body = bytes(buf[end + 4 : end + 4 + length])
            del buf[: end + 4 + length]
            self.answer(head, body)

    def answer(self, head: bytes, body: bytes) -> None:
        transport = self.transport
        if head.startswith(b"get ") and head.split(b" ", 2)[1].endswith(b"/models"):
            transport.write(MODELS_RESPONSE)
            return
        if b'"stream":true' not in body.replace(b" ", b""):
            transport.write(CHAT_RESPONSE)
            return
        server = self.server
        asked = MAX_TOKENS.search(body)
        events = int(asked.group(1)) if asked else server.events
        transport.write(STREAM_HEAD)
        if server.fast:
            self.pump_left, self.pump_i = server.cap, 0
            self.pump()
            return
        stream = Paced(transport, max(1, events))
        if stream.send_next():
            server.add(stream)

    def pump(self) -> None:
        """--fast: write batches of events while the transport takes them, then the end."""
        transport = self.transport
        while self.pump_left > 0 and not self.paused and not transport.is_closing():
            batch = b"".join(event(self.pump_i + k) for k in range(64))
            self.pump_i += 64
            self.pump_left -= len(batch)
            transport.write(batch)
        if self.pump_left <= 0 and not transport.is_closing():
            self.pump_left = 0
            transport.write(END)

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        if self.pump_left > 0:
            self.pump()


async def main(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    Protocol.server = Server(loop, args.events, args.interval_ms / 1000, args.fast, args.fast_cap_bytes)
    server = await loop.create_server(Protocol, "127.0.0.1", args.port, backlog=8192)
    print(server.sockets[0].getsockname()[1], flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    server.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--events", type=int, default=200)
    ap.add_argument("--interval-ms", type=float, default=50.0)
    ap.add_argument("--fast", action="store_true")
    ap.add_argument("--fast-cap-bytes", type=int, default=64 << 20)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    try:
        import uvloop

        uvloop.run(main(ap.parse_args()))
    except ImportError:
        asyncio.run(main(ap.parse_args()))
