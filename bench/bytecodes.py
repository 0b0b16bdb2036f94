"""The Python bytecodes one gateway process executes per plain request and per relayed event:
a measure of the hot path that no noise can move, so that every change to it can be judged exactly.

tinygw's ASGI app runs in this process, as a Granian worker runs it: log level info, access log on
(its lines written to a temp file, and counted: one per request), the shared metrics directory, the
app's lifespan on a uvloop loop, its upstream pool talking over real loopback sockets to
bench/instant_upstream.py (two of them, in child processes: one streaming 20 words, one 120).
Only the client's side is played here, through the ASGI interface: a request's body handed to
`receive`, the answer taken by `send`, as Granian's Rust side does (its own work is no bytecode).

Counting: `sys.settrace` with `f_trace_opcodes` on this thread (Python 3.11 has no sys.monitoring),
every opcode of every frame except this file's own; per request, from the call of the app to the
end of the next turn of the loop (when the access line is written). After a warm-up, the median
over --requests requests of each kind. Per relayed event: (a 122-event stream - a 22-event stream)
/ 100, so the request's own cost cancels out.

    .venv/bin/python bench/bytecodes.py [--requests 30]

prints exactly `bytecodes per plain request: N` and `bytecodes per relayed event: N` (and the spread,
and a 22-event stream's total, on the lines after). Loopback only; bounded in time.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import re
import shutil
import socket
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: its library
from lib import BODY, HOST, PATH, ROOT, STREAM_BODY, Proc, start_upstream  # noqa: E402

sys.path.insert(0, str(ROOT))  # tinygw, from this tree

SHORT_WORDS, LONG_WORDS = 20, 120
WARMUP = 20  # requests of each kind before counting: pools, caches and lazy imports settle
# Tracing makes a request ~50x slower: long enough for the gateway's watch for a client that leaves (started
# 50 ms into a request, never in a quick one) to start. It is put off for the count; a request that calls
# `receive` a second time anyway is not counted.
WATCH_AFTER_SECONDS = 10.0
# A plain request's goal: at most 5% above the figure recorded for the last release, on its one marked line of
# docs/performance.md (RELEASE_LINE); a relayed event's, a fixed 39 (once 60, then 40).
PERFORMANCE_DOC = ROOT / "docs" / "performance.md"
RELEASE_LINE = re.compile(r"^release figure: bytecodes per plain request ([0-9][0-9,]*)\b", re.MULTILINE)
PLAIN_MARGIN = 1.05
GOAL_EVENT = 39
HERE_FILE = str(Path(__file__).resolve())


class Counter:
    """Opcodes executed on this thread while tracing is on, in frames not of this file; with `by_function`,
    also per function (file:line name)."""

    def __init__(self, by_function: collections.Counter | None = None) -> None:
        self.n = 0
        self.by_function = by_function

    def global_trace(self, frame, event, arg):
        if frame.f_code.co_filename == HERE_FILE:
            return None
        frame.f_trace_lines = False
        frame.f_trace_opcodes = True
        return self.local_trace

    def local_trace(self, frame, event, arg):
        if event == "opcode":
            self.n += 1
            if self.by_function is not None:
                code = frame.f_code
                self.by_function[f"{os.path.relpath(code.co_filename, ROOT)}:{code.co_firstlineno} {code.co_name}"] += 1
        return self.local_trace


class Client:
    """One request through the ASGI interface: its body in one `http.request`; `send` collects the answer.
    A second `receive` (the watch for a client that leaves) waits until the request is over."""

    def __init__(self, body: bytes) -> None:
        self.body, self.received, self.status, self.chunks, self.done = body, 0, 0, 0, False
        self.over = asyncio.get_running_loop().create_future()

    async def receive(self):
        self.received += 1
        if self.received == 1:
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.over
        return {"type": "http.disconnect"}

    async def send(self, message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        elif message["type"] == "http.response.body":
            self.chunks += 1
            self.done = not message.get("more_body", False)


def scope(state: dict, body: bytes) -> dict:
    """What Granian hands the app for wrk's request."""
    headers = [
        (b"host", b"%s:8080" % HOST.encode()),
        (b"content-length", b"%d" % len(body)),
        (b"content-type", b"application/json"),
    ]
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "server": (HOST, 8080),
        "client": (HOST, 50000),
        "scheme": "http",
        "method": "POST",
        "root_path": "",
        "path": PATH,
        "raw_path": PATH.encode(),
        "query_string": b"",
        "headers": headers,
        "state": state.copy(),
    }


async def next_turn() -> None:
    """Let the loop run once around (the access line is written on the turn after the answer)."""
    loop = asyncio.get_running_loop()
    for _ in range(2):
        future = loop.create_future()
        loop.call_soon(future.set_result, None)
        await future


async def one(app, state: dict, body: bytes, counter: Counter | None) -> tuple[int | None, Client]:
    client = Client(body)
    if counter is not None:
        counter.n = 0
        sys.settrace(counter.global_trace)
    try:
        await app(scope(state, body), client.receive, client.send)
        await next_turn()
    finally:
        sys.settrace(None)
    client.over.set_result(None)
    if client.status != 200 or not client.done:
        raise RuntimeError(f"the gateway answered {client.status} (complete: {client.done})")
    return (None if client.received > 1 or counter is None else counter.n), client


async def count(
    app, state: dict, body: bytes, requests: int, by_function: collections.Counter | None = None
) -> list[int]:
    for _ in range(WARMUP):
        await one(app, state, body, None)
    counts: list[int] = []
    for _ in range(requests * 4):  # a request that started the watch is retried, within bounds
        n, _client = await one(app, state, body, Counter(by_function))
        if n is not None:
            counts.append(n)
        if len(counts) == requests:
            return counts
    raise RuntimeError(
        f"only {len(counts)} of {requests} requests ended before the gateway's watch for a client "
        "that leaves started: no count"
    )


async def measure(requests: int, by_function: dict[str, collections.Counter]) -> dict[str, list[int]]:
    from tinygw.api import app as app_module  # after the environment is set: as a Granian worker imports it

    app = app_module.app
    if hasattr(app_module, "WATCH_AFTER_SECONDS"):
        app_module.WATCH_AFTER_SECONDS = WATCH_AFTER_SECONDS

    state: dict = {}
    startup = asyncio.Queue()
    await startup.put({"type": "lifespan.startup"})
    started = asyncio.get_running_loop().create_future()

    async def lifespan_send(message) -> None:
        if not started.done():
            started.set_result(message)

    lifespan = asyncio.ensure_future(app({"type": "lifespan", "state": state}, startup.get, lifespan_send))
    message = await asyncio.wait_for(started, 30)
    if message["type"] != "lifespan.startup.complete":
        raise RuntimeError(f"the gateway did not start: {message}")
    plain = BODY.encode()
    stream = STREAM_BODY.encode()
    try:
        return {
            "plain": await count(app, state, plain, requests, by_function["plain"]),
            "short": await count(app, state, stream, requests, by_function["short"]),
            "long": await count(app, state, stream.replace(b'"bench"', b'"bench-long"'), requests, by_function["long"]),
        }
    finally:
        await startup.put({"type": "lifespan.shutdown"})
        await asyncio.wait_for(lifespan, 30)


def configure(short_port: int, long_port: int, metrics_dir: str, port: int) -> None:
    """The environment `tinygw serve` gives its one worker, with the benchmark's configuration; `port`
    is the worker's listening socket's (opened here, as Granian opens it: the worker's search for it,
    tinygw.worker.listener, ends at once, as in a worker, and runs in no request's count)."""
    config = {
        "providers": {
            "up": {"base_url": f"http://{HOST}:{short_port}/v1", "api": "openai"},
            "up-long": {"base_url": f"http://{HOST}:{long_port}/v1", "api": "openai"},
        },
        "models": {"bench": {"targets": ["up:bench-model"]}, "bench-long": {"targets": ["up-long:bench-model"]}},
    }
    for name in [k for k in os.environ if k.startswith(("TINYGW_", "PROVIDER_"))]:
        del os.environ[name]
    os.environ.update(
        TINYGW_HOST=HOST,
        TINYGW_PORT=str(port),
        TINYGW_LOG_LEVEL="info",
        TINYGW_CONFIG=json.dumps(config),
        TINYGW_METRICS_DIR=metrics_dir,
    )


def print_top(by_function: dict[str, collections.Counter], requests: int, top: int) -> None:
    """The functions that execute the most bytecodes: per plain request, and per relayed event."""
    print(f"per plain request, the top {top} functions (bytecodes, mean of {requests} requests):")
    for name, n in by_function["plain"].most_common(top):
        print(f"  {n / requests:8.1f}  {name}")
    events = collections.Counter(
        {
            k: (by_function["long"][k] - by_function["short"][k]) / requests / (LONG_WORDS - SHORT_WORDS)
            for k in by_function["long"]
        }
    )
    print(f"per relayed event, the top {top} functions:")
    for name, n in events.most_common(top):
        print(f"  {n:8.1f}  {name}")


def release_figure(text: str) -> int:
    """The bytecodes per plain request recorded for the last release: its marked line in docs/performance.md."""
    found = RELEASE_LINE.findall(text)
    if len(found) != 1:
        raise SystemExit(
            f"bytecodes: {os.path.relpath(PERFORMANCE_DOC, ROOT)} needs exactly one line "
            f"'release figure: bytecodes per plain request N' (found {len(found)})"
        )
    return int(found[0].replace(",", ""))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=30, help="counted requests of each kind; median shown (30)")
    ap.add_argument(
        "--top",
        type=int,
        default=0,
        metavar="N",
        help="also list the N functions that execute the most bytecodes per plain request and per event",
    )
    args = ap.parse_args(argv)
    if args.requests < 1:
        ap.error("--requests must be at least 1")
    released = release_figure(PERFORMANCE_DOC.read_text())
    import uvloop

    procs: list[Proc] = []
    metrics_dir = tempfile.mkdtemp(prefix="tinygw-metrics-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    log_file = tempfile.TemporaryFile()
    saved_stderr = os.dup(2)
    try:
        short, short_port = start_upstream(SHORT_WORDS)
        procs.append(short)
        long, long_port = start_upstream(LONG_WORDS)
        procs.append(long)
        listening = socket.create_server((HOST, 0))  # never accepts: no client comes
        configure(short_port, long_port, metrics_dir, listening.getsockname()[1])
        os.dup2(log_file.fileno(), 2)  # the gateway's log lines, as a worker writes them to its stderr
        try:
            by_function = {k: collections.Counter() for k in ("plain", "short", "long")}
            # run_until_complete, not uvloop.run: its wrapper coroutine would sit between the loop and the
            # requests, and execute bytecodes each time one waits, where a Granian worker's task has none.
            loop = uvloop.new_event_loop()
            try:
                counts = loop.run_until_complete(measure(args.requests, by_function))
            finally:
                loop.close()
        finally:
            os.dup2(saved_stderr, 2)
    finally:
        for proc in procs:
            proc.stop()
            proc.cleanup_files()
        shutil.rmtree(metrics_dir, ignore_errors=True)
    log_file.seek(0)
    access_lines = log_file.read().count(b'"msg":"request"')
    expected = 3 * (WARMUP + args.requests)
    if access_lines < expected:
        raise SystemExit(
            f"bytecodes: {access_lines} access lines for at least {expected} requests: the access log "
            "is not on as in the product"
        )
    plain, short_med, long_med = (statistics.median(counts[k]) for k in ("plain", "short", "long"))
    per_event = (long_med - short_med) / (LONG_WORDS - SHORT_WORDS)
    print(f"bytecodes per plain request: {plain:.0f}")
    print(f"bytecodes per relayed event: {per_event:.0f}")
    spread = ", ".join(f"{k} {min(v)}-{max(v)}" for k, v in counts.items())
    if args.top:
        print_top(by_function, args.requests, args.top)
    print(
        f"(medians of {args.requests} requests each, Python {sys.version.split()[0]}; a {SHORT_WORDS + 2}-event "
        f"stream: {short_med:.0f}; a {LONG_WORDS + 2}-event stream: {long_med:.0f}; min-max: {spread})"
    )
    goals = (
        (
            f"plain request <= {released * PLAIN_MARGIN:,.0f} (the last release's {released:,} + 5%)",
            plain,
            released * PLAIN_MARGIN,
        ),
        (f"relayed event <= {GOAL_EVENT}", per_event, GOAL_EVENT),
    )
    for what, value, limit in goals:
        print(f"goal: bytecodes per {what}: {value:,.0f} -> {'MET' if value <= limit else 'NOT MET'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
