"""The provider of `make bench-neighbours` (bench/neighbours.py): an OpenAI-like fake in its own
process that answers the well-behaved clients as bench/instant_upstream.py does (the same
chat.completion, the same 22-event stream, one `transport.write` each) and each attack as a real
provider would:

- a request carrying `OpenAI-Organization` or `OpenAI-Project`: 401 `mismatched_organization`,
  as OpenAI answers a key that is not of the organization or project asked for (the gateway
  drops a client's own: it should never come, and would count as a failure if it did);
- a model other than `bench-model` (`up/junk-17`): 404 `model_not_found`, as OpenAI answers;
- a streamed request whose message says `tell me everything`: a long answer (16 KiB events, up
  to 64 MiB), written only as fast as the gateway takes it (asyncio's write flow control), so
  that a client that never reads holds it for as long as the gateway lets it (a few events a
  turn of the loop, from a send buffer of 256 KiB: see PUMP_TURN_EVENTS, SEND_BUFFER_BYTES);
- GET .../models: the listing (discovery and health checks); GET /stats: its counters as JSON.

Run as `python bench/neighbour_upstream.py`: it prints its port (one line, flushed), then serves
on 127.0.0.1 until SIGTERM/SIGINT.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket

MODEL = "bench-model"
LONG_MARK = b"tell me everything"
LONG_EVENT_BYTES = 16384
LONG_EVENTS = 4096  # 64 MiB at most a long answer: far more than the sockets and the gateway buffer
# A long answer is written 4 events (64 KiB) a turn of the loop, so that the other
# connections are served between turns: written in one go, 64 long answers held this
# provider's loop for ~0.45 s, and the direct requests beside them waited as long.
PUMP_TURN_EVENTS = 4
# The kernel's send buffer of each connection (set, it is not autotuned). What a provider
# holds unsent is its own memory, on a machine of its own; on these 2 shared cores the
# 4 MiB the kernel would let it grow to were ~250 MiB of copies for 64 long answers, the
# provider's CPU, not the gateway's, which the well-behaved clients would pay for.
SEND_BUFFER_BYTES = 256 * 1024


def _response(status: bytes, body: bytes, ctype: bytes = b"application/json") -> bytes:
    return b"HTTP/1.1 %s\r\ncontent-type: %s\r\ncontent-length: %d\r\nconnection: keep-alive\r\n\r\n%s" % (
        status,
        ctype,
        len(body),
        body,
    )


def _json(value: dict) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


CHAT = _response(
    b"200 OK",
    _json(
        {
            "id": "chatcmpl-bench",
            "object": "chat.completion",
            "created": 0,
            "model": MODEL,
            "choices": [
                {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "Hello from bench."}}
            ],
            "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
        }
    ),
)
MODELS = _response(
    b"200 OK", _json({"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0, "owned_by": "bench"}]})
)
MISMATCHED = _response(
    b"401 Unauthorized",
    _json(
        {
            "error": {
                "message": "OpenAI-Organization header should match organization for API key",
                "type": "invalid_request_error",
                "param": None,
                "code": "mismatched_organization",
            }
        }
    ),
)


def _not_found(model: str) -> bytes:
    message = f"The model `{model}` does not exist or you do not have access to it."
    return _response(
        b"404 Not Found",
        _json(
            {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": "model_not_found"}}
        ),
    )


def _event(delta: dict, finish: str | None = None) -> bytes:
    data = _json(
        {
            "id": "chatcmpl-bench",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": MODEL,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }
    )
    event = b"data: " + data + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(event), event)


STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
    b"connection: keep-alive\r\n\r\n"
)
STREAM_END = _event({}, "stop") + b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"
STREAM = (
    STREAM_HEAD
    + _event({"role": "assistant"})
    + b"".join(_event({"content": f" word{i}"}) for i in range(20))
    + STREAM_END
)
LONG_EVENT = _event({"content": "x" * LONG_EVENT_BYTES})


class Stats:
    """What reached the provider, for the report (GET /stats)."""

    def __init__(self) -> None:
        self.counts = {
            "chat": 0,  # well-behaved answers (plain and streamed)
            "account_headers": 0,  # requests that carried OpenAI-Organization/-Project (answered 401)
            "raw_bytes_in_target": 0,  # request targets with a byte outside visible ASCII
            "unknown_model": 0,  # answered 404
            "long_started": 0,
            "long_cut": 0,  # long answers whose connection the gateway closed before their end
        }
        self.long_bytes: list[int] = []  # bytes written of each long answer that ended

    def as_json(self) -> bytes:
        return _json({**self.counts, "long_bytes": self.long_bytes})


class NeighbourProtocol(asyncio.Protocol):
    def __init__(self, stats: Stats) -> None:
        self.stats = stats
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.paused = False
        self.long_left = 0  # events of a long answer still to write: no other request is read meanwhile
        self.long_written = 0
        self.scheduled = False  # a turn of _pump is due

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport = transport

    def connection_lost(self, exc) -> None:
        if self.long_left:
            self.stats.counts["long_cut"] += 1
            self.stats.long_bytes.append(self.long_written)
            self.long_left = 0

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        if self.long_left and not self.scheduled:
            self._pump()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if not self.long_left:
            self._serve()

    def _serve(self) -> None:
        buf, out = self.buf, []
        while not self.long_left:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > 65536:
                    self.transport.close()
                break
            head = bytes(buf[:end])
            lower = head.lower()
            length = 0
            i = lower.find(b"\r\ncontent-length:")
            if i >= 0:
                j = lower.find(b"\r\n", i + 2)
                length = int(lower[i + 17 : j if j >= 0 else len(lower)].strip())
            elif b"\r\ntransfer-encoding:" in lower:
                self.transport.close()
                return
            if len(buf) < end + 4 + length:
                break
            body = bytes(buf[end + 4 : end + 4 + length])
            del buf[: end + 4 + length]
            out.append(self._answer(head, lower, body))
        if out:
            self.transport.write(b"".join(out))
        if self.long_left and not self.scheduled:
            self._pump()

    def _answer(self, head: bytes, lower: bytes, body: bytes) -> bytes:
        counts = self.stats.counts
        target = head.split(b" ", 2)[1]
        if any(b < 0x21 or b > 0x7E for b in target):
            counts["raw_bytes_in_target"] += 1
        if lower.startswith(b"get "):
            return self.stats_answer() if target == b"/stats" else MODELS
        if b"\r\nopenai-organization:" in lower or b"\r\nopenai-project:" in lower:
            counts["account_headers"] += 1
            return MISMATCHED
        try:
            request = json.loads(body)
            model, stream = request.get("model"), request.get("stream") is True
        except (ValueError, AttributeError):
            model, stream = None, False
        if model != MODEL:
            counts["unknown_model"] += 1
            return _not_found(str(model))
        if stream and LONG_MARK in body:
            counts["long_started"] += 1
            self.long_left, self.long_written = LONG_EVENTS, len(STREAM_HEAD)
            return STREAM_HEAD
        counts["chat"] += 1
        return STREAM if stream else CHAT

    def stats_answer(self) -> bytes:
        return _response(b"200 OK", self.stats.as_json())

    def _pump(self) -> None:
        """Write the long answer's events until the transport's buffer is full (pause_writing),
        then again when it has room (resume_writing), PUMP_TURN_EVENTS a turn; its end once
        all are written."""
        transport = self.transport
        self.scheduled = False
        turn = PUMP_TURN_EVENTS
        while self.long_left and not self.paused and not transport.is_closing():
            if not turn:
                self.scheduled = True
                asyncio.get_running_loop().call_soon(self._pump)
                return
            turn -= 1
            transport.write(LONG_EVENT)
            self.long_left -= 1
            self.long_written += len(LONG_EVENT)
            if not self.long_left:
                transport.write(STREAM_END)
                self.stats.long_bytes.append(self.long_written + len(STREAM_END))
                self._serve()


async def main() -> None:
    loop = asyncio.get_running_loop()
    stats = Stats()
    server = await loop.create_server(lambda: NeighbourProtocol(stats), "127.0.0.1", 0, backlog=4096)
    server.sockets[0].setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)  # its connections inherit it
    print(server.sockets[0].getsockname()[1], flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    server.close()


if __name__ == "__main__":
    asyncio.run(main())
