"""The load generator of `make bench-streams`: C streams from one asyncio process, every event checked.

Run by bench/streams.py as `python bench/stream_clients.py JSON` (JSON: the run's parameters, below);
writes its results as JSON to the file the parameter `out` names. Raw sockets (asyncio Protocols on
uvloop when installed), no HTTP library: the request is one precomputed write, the answer's head, its
chunked framing and its server-sent events are parsed here, as little as needed to check them.

Parameters: host, port, path, body, headers ({name: value}), streams (C), ramp_s (the C streams start
evenly spread over it), seconds (the run's length: a client opens its next stream when one ends, if the
next would end within it), stream_s (a stream's length), events (what an intact stream carries),
deadline_s (from the start: every stream still open then is closed and counted as not intact), t_start
(the run's start, `time.monotonic()`: the same clock in every process; now if absent), phase_s (this
process's stream k starts at t_start + phase_s + ramp_s * k / its streams: several processes interleave
their starts), slow (the slow-reader lane: each client reads slow_bytes a second instead, nothing is
checked but the status line).

A stream is intact when its answer is 200, its events carry the indexes 0..events-1 in order, once
each, and `data: [DONE]` comes before the answer's end. Per event, the delivery delay: receive time
(one `time.monotonic_ns()` per read) minus the send time the upstream wrote into the event
(bench/paced_upstream.py). Per stream, the time to its first event from just before its connect.
Delays go into a histogram (10 µs buckets below 100 ms, 1 ms above) so that the results stay small.
"""

from __future__ import annotations

import asyncio
import json
import re
import resource
import socket
import sys
import time

TOKEN = re.compile(rb'"content"\s*:\s*"(\d+)@(\d+) ')
DONE = b"data: [DONE]"
CUT = "still open at the deadline"


def bucket(us: int) -> int:
    return us // 10 * 10 if us < 100_000 else us // 1000 * 1000


class Run:
    """What every stream of the run adds to."""

    def __init__(self, p: dict) -> None:
        self.p = p
        self.request = self.make_request(p)
        self.hist: dict[int, int] = {}
        self.first_us: list[int] = []  # time to first event, per stream that had one
        self.streams = self.intact = self.events = 0
        self.failures: dict[str, int] = {}
        self.open: set[asyncio.Transport] = set()
        self.examples: list[str] = []
        self.slow_read: list[int] = []
        self.cutting = False  # the deadline passed: what is still open is being closed

    @staticmethod
    def make_request(p: dict) -> bytes:
        body = p["body"].encode()
        head = [
            f"POST {p['path']} HTTP/1.1",
            f"host: {p['host']}:{p['port']}",
            "content-type: application/json",
            "accept: text/event-stream",
            f"content-length: {len(body)}",
            *(f"{k}: {v}" for k, v in (p.get("headers") or {}).items()),
        ]
        return ("\r\n".join(head) + "\r\n\r\n").encode() + body

    def fail(self, why: str, detail: str = "") -> None:
        self.failures[why] = self.failures.get(why, 0) + 1
        if detail and len(self.examples) < 5:
            self.examples.append(f"{why}: {detail[:300]}")


class Stream(asyncio.Protocol):
    """One streamed answer: head, then chunked (or content-length, or until close) body, then events."""

    def __init__(self, run: Run, done: asyncio.Future, t0: int) -> None:
        self.run, self.done, self.t0 = run, done, t0
        self.transport: asyncio.Transport | None = None
        self.head = bytearray()
        self.in_body = False
        self.chunked = False
        self.length: int | None = None  # content-length framing: bytes left
        self.raw = bytearray()  # chunked framing not yet decoded
        self.chunk_left = 0  # bytes left of the current chunk (+2 for its CRLF once known)
        self.sse = bytearray()  # decoded body not yet ending in a newline
        self.next = 0
        self.saw_done = False
        self.ended = False
        self.bad: str | None = None
        self.detail = ""

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport = transport
        self.run.open.add(transport)
        transport.write(self.run.request)

    def data_received(self, data: bytes) -> None:
        now = time.monotonic_ns() // 1000
        if not self.in_body:
            self.head += data
            end = self.head.find(b"\r\n\r\n")
            if end < 0:
                if len(self.head) > 65536:
                    self.finish("head too long")
                return
            head = bytes(self.head[:end]).lower()
            data = bytes(self.head[end + 4 :])
            self.head = bytearray()
            self.in_body = True
            if not head.startswith((b"http/1.1 200", b"http/1.0 200")):
                self.detail = (head[:200] + b" | " + data[:300]).decode("utf-8", "replace")
                self.finish("status " + head[9:12].decode("ascii", "replace"))
                return
            self.chunked = b"\r\ntransfer-encoding: chunked" in head
            i = head.find(b"\r\ncontent-length:")
            if not self.chunked and i >= 0:
                j = head.find(b"\r\n", i + 2)
                self.length = int(head[i + 17 : j if j >= 0 else len(head)].strip())
        if self.chunked:
            if not self.raw and not self.chunk_left:  # the usual read: whole chunks, most often one
                line_end = data.find(b"\r\n")
                if line_end > 0:
                    start = line_end + 2
                    end = start + int(data[:line_end], 16)
                    if end + 2 == len(data) and end > start:
                        self.body(data[start:end], now)
                        return
            self.dechunk(data, now)
        else:
            if self.length is not None:
                self.length -= len(data)
            self.body(data, now)
            if self.length is not None and self.length <= 0:
                self.finish()

    def dechunk(self, data: bytes, now: int) -> None:
        raw = self.raw
        raw += data
        pos, out = 0, []
        while True:
            if self.chunk_left > 0:  # inside a chunk's data
                take = min(self.chunk_left, len(raw) - pos)
                out.append(raw[pos : pos + take])
                pos += take
                self.chunk_left -= take
                if self.chunk_left:
                    break
                self.chunk_left = -1  # its CRLF is next
            if self.chunk_left < 0:
                if len(raw) - pos < 2:
                    break
                pos += 2
                self.chunk_left = 0
            line_end = raw.find(b"\r\n", pos)
            if line_end < 0:
                break
            size = int(raw[pos:line_end].split(b";", 1)[0], 16)
            pos = line_end + 2
            if size == 0:
                del raw[:pos]
                self.body(b"".join(out), now)
                self.finish()
                return
            self.chunk_left = size
        del raw[:pos]
        if out:
            self.body(b"".join(out), now)

    def body(self, data: bytes, now: int) -> None:
        if self.ended:
            return
        if self.run.p["slow"]:
            return
        sse = self.sse
        if not sse and data.endswith(b"\n"):
            whole = data
        else:
            sse += data
            cut = sse.rfind(b"\n")
            if cut < 0:
                return
            whole = bytes(sse[: cut + 1])
            del sse[: cut + 1]
        run, hist = self.run, self.run.hist
        for m in TOKEN.finditer(whole):
            i = int(m.group(1))
            if i != self.next:
                if self.bad is None:
                    self.bad, self.detail = "events out of order", f"event {i} after {self.next - 1}"
                self.next = max(self.next, i + 1)
                continue
            if i == 0:
                run.first_us.append(now - self.t0)
            self.next += 1
            run.events += 1
            d = bucket(max(0, now - int(m.group(2))))
            hist[d] = hist.get(d, 0) + 1
        if DONE in whole:
            self.saw_done = True

    def finish(self, why: str | None = None) -> None:
        if self.ended:
            return
        self.ended = True
        run = self.run
        run.streams += 1
        why = why or self.bad
        if why is None and self.next != run.p["events"]:
            why, self.detail = "events missing", f"{self.next} of {run.p['events']}"
        if why is None and not self.saw_done:
            why = "no [DONE]"
        if why is None:
            run.intact += 1
        else:
            run.fail(why, self.detail)
        if self.transport is not None:
            run.open.discard(self.transport)
            self.transport.close()
        if not self.done.done():
            self.done.set_result(None)

    def connection_lost(self, exc) -> None:
        if not self.ended:
            if self.run.cutting:
                self.finish(CUT)
            elif self.in_body and not self.chunked and self.length is None:
                self.finish()  # close-delimited: the end
            else:
                self.finish("connection closed early" if exc is None else f"connection lost ({type(exc).__name__})")


async def one_stream(run: Run, loop: asyncio.AbstractEventLoop) -> None:
    p = run.p
    t0 = time.monotonic_ns() // 1000
    done = loop.create_future()
    protocol = Stream(run, done, t0)
    try:
        await loop.create_connection(lambda: protocol, p["host"], p["port"])
    except asyncio.CancelledError:
        if not protocol.ended and protocol.transport is None:
            protocol.ended = True
            run.streams += 1
            run.fail(CUT)
        raise
    except OSError as e:
        protocol.ended = True
        run.streams += 1
        run.fail(f"connect failed ({type(e).__name__})", str(e))
        return
    await done


async def slow_stream(run: Run, loop: asyncio.AbstractEventLoop) -> None:
    """Read slow_bytes a second until the deadline; the bytes read are recorded."""
    p = run.p
    sock = socket.socket()
    sock.setblocking(False)
    got = 0
    try:
        await loop.sock_connect(sock, (p["host"], p["port"]))
        await loop.sock_sendall(sock, run.request)
        head = b""
        end = run.t_start + p["deadline_s"]
        while time.monotonic() < end:
            data = await asyncio.wait_for(loop.sock_recv(sock, p["slow_bytes"]), max(0.01, end - time.monotonic()))
            if not data:
                run.fail("connection closed early")
                break
            if not head:
                head = data
                if not data.startswith((b"HTTP/1.1 200", b"HTTP/1.0 200")):
                    run.fail("status " + data[9:12].decode("ascii", "replace"), data[:300].decode("utf-8", "replace"))
                    break
            got += len(data)
            await asyncio.sleep(1.0)
    except TimeoutError:
        pass
    except OSError as e:
        run.fail(f"connection failed ({type(e).__name__})", str(e))
    finally:
        sock.close()
        run.slow_read.append(got)
        run.streams += 1


async def client(run: Run, loop: asyncio.AbstractEventLoop, start_at: float) -> None:
    await asyncio.sleep(max(0.0, start_at - time.monotonic()))
    p = run.p
    if p["slow"]:
        await slow_stream(run, loop)
        return
    while True:
        await one_stream(run, loop)
        if time.monotonic() + p["stream_s"] > run.t_start + p["seconds"]:
            return  # the next stream would not end within the run


async def main(p: dict) -> dict:
    loop = asyncio.get_running_loop()
    run = Run(p)
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    run.t_start = p.get("t_start") or time.monotonic()
    n = p["streams"]
    tasks = [
        asyncio.ensure_future(client(run, loop, run.t_start + p.get("phase_s", 0.0) + p["ramp_s"] * k / n))
        for k in range(n)
    ]
    left = run.t_start + p["deadline_s"] + (5 if p["slow"] else 0) - time.monotonic()
    _, pending = await asyncio.wait(tasks, timeout=max(0.0, left))
    timed_out = len(pending)
    if pending:
        run.cutting = True
        for transport in list(run.open):
            transport.abort()
        for t in pending:
            t.cancel()
        await asyncio.wait(pending, timeout=5)
        await asyncio.sleep(0.1)  # the aborted transports' connection_lost
    elapsed = time.monotonic() - run.t_start
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "streams": run.streams,
        "intact": run.intact,
        "events": run.events,
        "failures": run.failures,
        "examples": run.examples,
        "first_us": run.first_us,
        "delay_hist": run.hist,
        "slow_read": run.slow_read,
        "elapsed_s": elapsed,
        "cpu_s": (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime),
        "user_s": cpu1.ru_utime - cpu0.ru_utime,
        "timed_out_clients": timed_out,
    }


if __name__ == "__main__":
    params = json.loads(sys.argv[1])
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    try:
        import uvloop

        result = uvloop.run(main(params))
    except ImportError:
        result = asyncio.run(main(params))
    result["nofile"] = hard
    with open(params["out"], "w") as f:  # a file, not stdout: a pipe nobody reads until the end would fill
        json.dump(result, f)
