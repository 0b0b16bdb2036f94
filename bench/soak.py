"""tinygw chaos soak: many clients, a real gateway, two upstreams that misbehave and die.

Run from the repository root: `.venv/bin/python bench/soak.py [--seconds 180]
[--concurrency 32] [--max-requests 200000]` (what `make soak` does). See bench/README.md.

Two fake providers (tinygw.fake.upstream, each in a child process of its own) answer
every request by a random script: mostly well, sometimes 500, a closed connection, no
answer at all, a stream or body cut short; each is SIGKILLed every 20-30 s (b's first
kill 10 s later than a's would be) and restarted on the same port after 1.5-3 s. A real
`tinygw serve` (one Granian worker, a model with
both providers as targets, short timeouts and breaker pauses) stands in front of them.
`--concurrency` clients (half of them streaming) send chat requests over keep-alive
HTTP/1.1 connections (h11, framing checked strictly), each with a nonce that the fake
echoes, and classify every answer: its status, whether it is well-formed for its kind
and carries this request's nonce (else "malformed"), or whether the connection broke or
timed out before a complete answer ("client-side reset").

It prints one table, and exits 1 when an answer was malformed, a client saw a reset, the
worker's open fds grew, or the gateway's worker died. Everything listens on 127.0.0.1;
the run is bounded in time (--seconds, plus a hard deadline) and in requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import socket
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path

import h11

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: its library, however soak.py is started
from lib import HOST, PATH, ROOT, Proc, descendants, machine, wait_ready  # noqa: E402 - processes in their own groups
from report import metric_sum  # noqa: E402

NONCE = re.compile(rb"n[0-9a-f]{16}")
WARMUP_SECONDS = 8  # traffic before the "start" measurement (no upstream kills yet)
SETTLE_SECONDS = 3  # quiet before each RSS/fd measurement
CLIENT_TIMEOUT = 30  # per request; longer is a client-side reset
KILL_EVERY = (20.0, 30.0)  # seconds between two SIGKILLs of one upstream
DOWN_FOR = (1.5, 3.0)  # seconds an upstream stays dead
EVENT_DELAY = 0.01  # seconds between a stream's events, so that kills land mid-stream
FD_TOLERANCE = 16  # more worker fds than this after the soak than before it: a leak
# What the fake does to a chat request, with probabilities; the rest is a good answer.
CHAOS = [("500", 0.05), ("close", 0.03), ("hang", 0.02), ("cut", 0.05), ("answer_close", 0.03)]
GATEWAY_ENV = {
    "TINYGW_HOST": HOST,
    "TINYGW_DRAIN_SECONDS": "2",
    "PROVIDER_BREAKER_FAILURES": "5",
    "PROVIDER_BREAKER_OPEN_SECONDS": "2",
    "PROVIDER_BREAKER_MAX_OPEN_SECONDS": "8",
    "PROVIDER_HEALTH_CHECK_SECONDS": "2",
    "PROVIDER_LISTING_SECONDS": "5",
}


# ---- the fake upstream (child process: `soak.py --upstream PORT NAME`) ----------------


def chaos_script(name: str):
    """A FakeUpstream script: per request, a well-behaved answer that echoes the nonce
    (the first message's content) in its text, or one of CHAOS's misbehaviours (listings
    and health checks, GETs, get the 500s, closes and hangs too)."""
    from tinygw.fake.upstream import Reply, json_reply, openai_stream_events, sse_reply, well_behaved

    rng = random.Random()

    def script(request):
        body = request.json() if request.method == "POST" else None
        roll, chaos = rng.random(), None
        for what, p in CHAOS:
            if roll < p:
                chaos = what
                break
            roll -= p
        if chaos == "500":
            return json_reply(500, {"error": {"message": "chaos", "type": "server_error", "code": None}})
        if chaos in ("close", "hang"):
            return Reply(action=chaos)
        if body is None:  # a listing or health check
            return well_behaved(name)(request)
        words = ["echo", " " + body["messages"][0]["content"], "."]
        if chaos == "cut" and body.get("stream"):
            events = openai_stream_events(body["model"], words)
            return sse_reply(events[: rng.randrange(len(events))], EVENT_DELAY, cut=True)
        good = well_behaved(name, words, EVENT_DELAY)(request)
        if chaos == "cut":  # a non-streamed body cut halfway
            return Reply(status=200, headers=good.headers, chunks=[(0, good.body[: len(good.body) // 2])], action="cut")
        if chaos == "answer_close":
            good.action = "answer_close"
        return good

    return script


def upstream_main(port: int, name: str) -> None:
    from tinygw.fake.upstream import FakeUpstream

    upstream = FakeUpstream(chaos_script(name), port=port, record=False)

    async def run() -> None:
        await upstream.start()
        await asyncio.Event().wait()  # until SIGKILL (or SIGTERM at the end)

    asyncio.run(run())


# ---- processes ----------------------------------------------------------------------


def quiet_port() -> int:
    """A free port below the ephemeral range, so that no outgoing connection takes it
    while its upstream is down (it is bound again, on restart)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(100):
        port = random.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind((HOST, port))
                return port
            except OSError:
                continue
    raise RuntimeError("no free port below the ephemeral range")


class Upstream:
    """One chaos upstream in its own process; `kill()` is SIGKILL, `start()` rebinds the port."""

    def __init__(self, name: str) -> None:
        self.name, self.port, self.proc, self.kills = name, quiet_port(), None, 0

    def start(self, timeout: float = 15) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        argv = [sys.executable, str(Path(__file__).resolve()), "--upstream", str(self.port), self.name]
        deadline = time.monotonic() + timeout
        while True:
            self.proc = Proc(f"soak-{self.name}", argv, env=env)
            while time.monotonic() < deadline and self.proc.popen.poll() is None:
                try:
                    socket.create_connection((HOST, self.port), timeout=1).close()
                    return
                except OSError:
                    time.sleep(0.05)
            self.stop()  # it exited (port still taken?): try again until the deadline
            if time.monotonic() > deadline:
                raise RuntimeError(f"upstream {self.name} did not start on port {self.port}")

    def kill(self) -> None:
        self.kills += 1
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.popen.wait(10)
        self.stop()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop(grace=1)
            self.proc.cleanup_files()
            self.proc = None


def start_gateway(upstreams: list[Upstream]) -> tuple[Proc, int]:
    port = quiet_port()
    provider = {"api": "openai", "connect_timeout_s": 1, "first_byte_timeout_s": 1.5, "timeout_s": 20}
    config = {
        "providers": {u.name: {**provider, "base_url": f"http://{HOST}:{u.port}/v1"} for u in upstreams},
        "models": {"soak": {"targets": [f"{u.name}:soak-{u.name}" for u in upstreams], "strategy": "round_robin"}},
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TINYGW_", "PROVIDER_"))}
    env.update(GATEWAY_ENV, TINYGW_PORT=str(port), TINYGW_CONFIG=json.dumps(config), PYTHONPATH=str(ROOT))
    binary = os.environ.get("TINYGW_BINARY")  # a frozen build, as in tests/conftest.py
    proc = Proc("soak-tinygw", [binary, "serve"] if binary else [sys.executable, "-m", "tinygw", "serve"], env=env)
    with proc.stopped_on_error():
        wait_ready(proc, port, "/healthz", 30)
    return proc, port


def get(port: int, path: str) -> bytes:
    with urllib.request.urlopen(f"http://{HOST}:{port}{path}", timeout=5) as r:
        return r.read()


def worker_usage(pid: int) -> dict:
    """VmRSS (MiB) and open fds of one process."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        raise RuntimeError(f"the gateway's worker (pid {pid}) is gone") from None
    rss_kib = int(re.search(r"^VmRSS:\s+(\d+)", status, re.M).group(1))
    return {"rss_mib": rss_kib / 1024, "fds": fds}


# ---- the clients --------------------------------------------------------------------


class Tally:
    def __init__(self) -> None:
        self.status: Counter = Counter()  # "200", "502", ..., "200 + stream error event"
        self.malformed: list[str] = []
        self.resets: list[str] = []
        self.requests = self.streamed = 0


class Malformed(Exception):
    pass


class Client:
    """One keep-alive HTTP/1.1 connection through h11; reconnects after any break."""

    def __init__(self, port: int) -> None:
        self.port, self.conn, self.reader, self.writer = port, None, None, None

    async def request(self, body: bytes) -> tuple[int, dict, bytes]:
        if self.conn is None:
            self.reader, self.writer = await asyncio.open_connection(HOST, self.port)
            self.conn = h11.Connection(h11.CLIENT)
        conn = self.conn
        head = h11.Request(
            method="POST",
            target=PATH,
            headers=[
                ("host", f"{HOST}:{self.port}"),
                ("content-type", "application/json"),
                ("content-length", str(len(body))),
            ],
        )
        self.writer.write(conn.send(head) + conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
        await self.writer.drain()
        response, chunks, eof = None, [], False
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as e:
                if eof:
                    raise ConnectionError(f"EOF before a complete response ({e})") from None
                raise Malformed(f"HTTP framing: {e}") from None
            if event is h11.NEED_DATA:
                data = await self.reader.read(65536)
                eof = not data
                conn.receive_data(data)
            elif isinstance(event, h11.Response):
                response = event
            elif isinstance(event, h11.Data):
                chunks.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                break
            elif isinstance(event, h11.ConnectionClosed):
                raise ConnectionError("closed before a response")
        if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
            conn.start_next_cycle()
        else:  # the server said Connection: close
            self.close()
        headers = {k.decode().lower(): v.decode("latin-1") for k, v in response.headers}
        return response.status_code, headers, b"".join(chunks)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.conn = self.reader = self.writer = None


def classify(status: int, headers: dict, body: bytes, nonce: str, stream: bool) -> str:
    """The answer's row in the table, or raise Malformed saying what is wrong with it."""
    expected = f"echo {nonce}."
    foreign = {m.decode() for m in NONCE.findall(body)} - {nonce}
    if foreign:
        raise Malformed(f"carries another request's nonce {sorted(foreign)[:3]} (ours: {nonce})")
    if status == 200 and stream:
        if not headers.get("content-type", "").startswith("text/event-stream"):
            raise Malformed(f"a streamed 200 with content-type {headers.get('content-type')!r}")
        text, last, error_event = "", None, False
        if not body.endswith(b"\n\n"):
            raise Malformed("the stream does not end at an event boundary")
        for raw in body[:-2].split(b"\n\n"):
            fields = dict(line.split(b": ", 1) for line in raw.split(b"\n"))  # ValueError: malformed
            if set(fields) - {b"event", b"data"} or error_event:
                raise Malformed(f"unexpected event {raw[:120]!r}")
            if fields.get(b"event") == b"error":
                if not isinstance(json.loads(fields[b"data"])["error"]["message"], str):
                    raise Malformed("an error event without a message")
                error_event = True
            elif fields[b"data"] == b"[DONE]":
                last = "[DONE]"
            else:
                choice = json.loads(fields[b"data"])["choices"][0]
                text += choice["delta"].get("content") or ""
                last = "finish" if choice.get("finish_reason") else "chunk"
        if error_event:
            if not expected.startswith(text):
                raise Malformed(f"stream text {text!r} is not a prefix of {expected!r}")
            return "200 + stream error event"
        if last not in ("[DONE]", "finish"):
            raise Malformed("the stream ended without [DONE], a finish or an error event")
        if text != expected:
            raise Malformed(f"stream text {text!r}, expected {expected!r}")
        return "200"
    value = json.loads(body)  # ValueError: malformed
    if status == 200:
        if value["choices"][0]["message"]["content"] != expected:
            raise Malformed(f"content {value['choices'][0]['message']['content']!r}, expected {expected!r}")
    elif not (isinstance(value["error"]["message"], str) and isinstance(value["error"]["type"], str)):
        raise Malformed("an error body that is not OpenAI-shaped")
    return str(status)


async def client_loop(cid: int, port: int, tally: Tally, running: dict, limit: int) -> None:
    """Send requests until running["go"] is false; client ids of one parity stream."""
    stream, client, seq = cid % 2 == 1, Client(port), 0
    while running["go"] and tally.requests < limit:
        seq += 1
        nonce = f"n{random.getrandbits(64):016x}"
        body = json.dumps(
            {"model": "soak", "stream": stream, "max_tokens": 8, "messages": [{"role": "user", "content": nonce}]}
        ).encode()
        tally.requests += 1
        tally.streamed += stream
        try:
            async with asyncio.timeout(CLIENT_TIMEOUT):
                status, headers, answer = await client.request(body)
        except (ConnectionError, OSError, TimeoutError) as e:
            tally.resets.append(f"client {cid} request {seq}: {type(e).__name__}: {e}")
            client.close()
            continue
        except Malformed as e:
            tally.malformed.append(f"client {cid} request {seq}: {e}")
            client.close()
            continue
        try:
            tally.status[classify(status, headers, answer, nonce, stream)] += 1
        except (Malformed, ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
            tally.status[f"{status} (malformed)"] += 1
            tally.malformed.append(
                f"client {cid} request {seq}: {status} {type(e).__name__}: {e}; body {answer[:300]!r}"
            )
    client.close()


async def chaos_monkey(upstream: Upstream, stop: asyncio.Event, offset: float) -> None:
    """SIGKILL `upstream` every KILL_EVERY seconds (the first time `offset` seconds later),
    and restart it DOWN_FOR seconds after each kill."""
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), random.uniform(*KILL_EVERY) + offset)
            return
        except TimeoutError:
            offset = 0.0
        await asyncio.to_thread(upstream.kill)
        await asyncio.sleep(random.uniform(*DOWN_FOR))
        await asyncio.to_thread(upstream.start)


async def traffic(
    gateway: Proc, port: int, concurrency: int, seconds: float, tally: Tally, limit: int, upstreams: list[Upstream] = ()
) -> float:
    """`concurrency` clients for `seconds` (or until `limit` requests); the seconds it took."""
    running, stop, started = {"go": True}, asyncio.Event(), time.monotonic()
    clients = [asyncio.create_task(client_loop(i, port, tally, running, limit)) for i in range(concurrency)]
    # Staggered, so that mostly one provider is down at a time (fallbacks), sometimes both (503s).
    monkeys = [asyncio.create_task(chaos_monkey(u, stop, i * KILL_EVERY[0] / 2)) for i, u in enumerate(upstreams)]
    deadline = started + seconds
    while time.monotonic() < deadline and tally.requests < limit:
        await asyncio.sleep(0.2)
        if gateway.popen.poll() is not None:
            running["go"] = False
            raise RuntimeError(f"the gateway exited with {gateway.popen.returncode} during the soak")
    running["go"] = False
    stop.set()
    done, pending = await asyncio.wait([*clients, *monkeys], timeout=CLIENT_TIMEOUT + 30)
    if pending:
        raise RuntimeError(f"{len(pending)} client or chaos task(s) did not end in time")
    for task in done:
        task.result()  # an exception in a client is a bug of this tool: say so
    return time.monotonic() - started


# ---- main ---------------------------------------------------------------------------


async def soak(args, gateway: Proc, gw_port: int, worker: int, upstreams: list[Upstream], tally: Tally) -> dict:
    """Warm up, measure, soak with upstream kills, measure under load, stop, settle, measure."""
    usage = {}
    warmup = await traffic(gateway, gw_port, args.concurrency, WARMUP_SECONDS, tally, args.max_requests)
    await asyncio.sleep(SETTLE_SECONDS)
    usage["start"] = worker_usage(worker)
    print(f"soak: warm-up done; {args.seconds:g} s of chaos ({tally.requests} requests so far)", file=sys.stderr)
    end_usage = {}

    async def sample_end() -> None:  # the last moment under load
        await asyncio.sleep(max(0.0, args.seconds - 1))
        end_usage.update(worker_usage(worker))

    sampler = asyncio.create_task(sample_end())
    duration = await traffic(gateway, gw_port, args.concurrency, args.seconds, tally, args.max_requests, upstreams)
    sampler.cancel()
    usage["end"] = end_usage or worker_usage(worker)
    await asyncio.sleep(SETTLE_SECONDS)
    usage["settled"] = worker_usage(worker)
    usage["duration"] = warmup + duration
    return usage


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=180, help="length of the chaos phase (default 180)")
    ap.add_argument("--concurrency", type=int, default=32, help="clients, half of them streaming (default 32)")
    ap.add_argument("--max-requests", type=int, default=200_000, help="hard bound on requests (default 200000)")
    ap.add_argument("--upstream", nargs=2, metavar=("PORT", "NAME"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.upstream:
        upstream_main(int(args.upstream[0]), args.upstream[1])
        return 0
    if not (0 < args.seconds <= 3600 and 1 <= args.concurrency <= 1024 and args.max_requests >= 1):
        ap.error("--seconds must be in (0, 3600], --concurrency in [1, 1024], --max-requests >= 1")
    signal.signal(signal.SIGTERM, _interrupt)
    print(f"machine: {machine()}")
    print(
        f"soak:    {WARMUP_SECONDS} s warm-up + {args.seconds:g} s chaos, c={args.concurrency} (half streamed), "
        f"at most {args.max_requests} requests; chaos per request: "
        + ", ".join(f"{w} {p:.0%}" for w, p in CHAOS)
        + f"; each upstream SIGKILLed every {KILL_EVERY[0]:g}-{KILL_EVERY[1]:g} s",
        flush=True,
    )
    upstreams = [Upstream("a"), Upstream("b")]
    gateway, tally, failures = None, Tally(), []
    try:
        for u in upstreams:
            u.start()
        gateway, gw_port = start_gateway(upstreams)
        worker = json.loads(get(gw_port, "/status.json"))["worker"]["pid"]
        if worker not in descendants(gateway.pid):
            raise RuntimeError(f"/status.json names pid {worker}, not a process of the gateway {gateway.pid}")
        signal.signal(signal.SIGALRM, _interrupt)  # the hard deadline
        signal.alarm(int(WARMUP_SECONDS + args.seconds + 2 * SETTLE_SECONDS + CLIENT_TIMEOUT + 120))
        usage = asyncio.run(soak(args, gateway, gw_port, worker, upstreams, tally))
        metrics = get(gw_port, "/metrics").decode()
        worker_now = json.loads(get(gw_port, "/status.json"))["worker"]["pid"]
        signal.alarm(0)
    except RuntimeError as e:
        failures.append(str(e))
    except KeyboardInterrupt as e:  # ^C, SIGTERM, or SIGALRM: the hard deadline
        print(f"soak: stopped early ({e or 'SIGINT'}); gateway log: {gateway and gateway.err_file.name}")
        return 1
    finally:
        for u in upstreams:
            u.stop()
        if gateway is not None:
            gateway.stop()
    log = Path(gateway.err_file.name).read_text(errors="replace").splitlines() if gateway else []
    log_errors = [
        line for line in log if not line.startswith("{") or '"level":"error"' in line or '"level":"critical"' in line
    ]
    if failures:  # the soak could not run to its end
        print("\n".join(line for line in log if '"msg":"request"' not in line)[-4000:])
        print(
            f"FAILED: {failures[0]} (after {tally.requests} requests; gateway log: "
            f"{gateway.err_file.name if gateway else '-'})"
        )
        return 1

    def row(what: str, value) -> None:
        print(f"| {what} | {value} |")

    def use(key: str) -> str:
        return " → ".join(
            f"{usage[k][key]:,.1f}" if key == "rss_mib" else str(usage[k][key]) for k in ("start", "end", "settled")
        )

    print("\n| soak | |\n| --- | --- |")
    row("duration (warm-up + chaos)", f"{usage['duration']:.1f} s")
    capped = " (stopped at --max-requests)" if tally.requests >= args.max_requests else ""
    row("requests (streamed)", f"{tally.requests:,} ({tally.streamed:,}){capped}")
    for status, n in sorted(tally.status.items()):
        row(f"answers {status}", f"{n:,}")
    row("**malformed answers**", len(tally.malformed))
    row("**client-side resets**", len(tally.resets))
    row("upstream kills (a, b)", f"{upstreams[0].kills}, {upstreams[1].kills}")
    row(
        "circuits opened / closed",
        f"{metric_sum(metrics, 'tinygw_circuit_transitions_total', state='open'):.0f} / "
        f"{metric_sum(metrics, 'tinygw_circuit_transitions_total', state='closed'):.0f}",
    )
    row(
        "fallbacks / quick retries",
        f"{metric_sum(metrics, 'tinygw_provider_retries_total', reason='fallback'):.0f} / "
        f"{metric_sum(metrics, 'tinygw_provider_retries_total', reason='transient_retry'):.0f}",
    )
    row("worker RSS MiB (start → end → settled)", use("rss_mib"))
    row("worker open fds (start → end → settled)", use("fds"))
    row("gateway log lines: error or not JSON", len(log_errors))

    if tally.malformed:
        failures.append(f"{len(tally.malformed)} malformed answer(s)")
    if tally.resets:
        failures.append(f"{len(tally.resets)} client-side reset(s)")
    if usage["settled"]["fds"] > usage["start"]["fds"] + FD_TOLERANCE:
        failures.append(f"the worker's open fds grew from {usage['start']['fds']} to {usage['settled']['fds']}")
    if worker_now != worker:
        failures.append(f"the worker changed (pid {worker} -> {worker_now}): it died during the soak")
    for title, examples in (("malformed", tally.malformed), ("resets", tally.resets), ("gateway log", log_errors)):
        for line in examples[:5]:
            print(f"{title}: {line[:600]}")
    if failures:
        print(f"FAILED: {'; '.join(failures)} (gateway log: {gateway.err_file.name})")
        return 1
    gateway.cleanup_files()
    print("OK: no malformed answer, no client-side reset, no fd growth")
    return 0


if __name__ == "__main__":
    sys.exit(main())
