"""`make bench-neighbours`: no client can hurt another (docs/design.md section 16), measured.

16 well-behaved clients send ordinary chat requests (one in four streamed) to the alias `bench`
of a `tinygw serve` at its defaults, each at most `--rate` requests a second on a keep-alive
connection of its own; one hostile client beside them tries each attack in turn, one phase each,
a fresh gateway for each phase:

- `query`: `POST /v1/chat/completions?a=é`, the é as raw UTF-8 bytes (a raw socket: http.client
  refuses raw bytes);
- `account`: its own `OpenAI-Organization` and `OpenAI-Project`, which the provider answers with
  401 `mismatched_organization` if they ever reach it (as OpenAI does);
- `junk`: 300 junk model names, `up/junk-1` ... `up/junk-300` (provider-qualified, the provider the
  well-behaved use), which the provider answers with 404 `model_not_found`;
- `streams`: 64 streamed requests for a long answer that it never reads (SO_RCVBUF 4096, never a
  recv), against a provider that streams up to 64 MiB as fast as it is read; the gateway cuts each
  after TINYGW_CLIENT_TIMEOUT_SECONDS (shown beside `burst`, not in the goals: what such streams
  cost is the ~0.3 MiB of each that the kernel's and Granian's buffers take before the relay
  blocks, and a named client's `max_concurrent` bounds how many one client holds);
- `burst`: 64 streamed requests at once on new connections, as `streams` sends them, for the
  ordinary short answer, read to its end: what the arrival of `streams`' 64 requests alone costs
  the others, without the long answers (shown, not in the goals);
- `limits`: the hostile client is a named client (`clients.hostile`: max_concurrent 4,
  requests_per_minute 120) and floods: it must get 429s. A gateway without named clients refuses
  the `clients` field at start (exit 2); the phase is then skipped, saying so;
- and first `control`, no attack: plain chat requests at the hostile client's rate, what its load
  alone costs the others (shown, not in the goals).

The hostile client sends at `--hostile-rate` requests a second (4 connections; 8 for `limits`).
It attacks and rests in turn, in slices of 1 s (`streams`: 64 held for the client timeout + 1.5 s,
then closed, then as long a rest; `burst` as long), about `--seconds` of each, so that whatever else the machine
does falls on both alike; the well-behaved clients run throughout (after a 1 s warm-up). "with":
the well-behaved requests that started during its slices; "without": those that started during
its rests (from 0.25 s after a slice's last answer). Per phase: their success (a 200 with the
whole answer) and p99 latency (from the send to the answer's last byte) without and with it,
the ratio of the two p99s (what the hostile client adds, as a factor: with / without), and the
circuits opened from its start to 1 s after its end (`tinygw_circuit_transitions_total{state="open"}`
from /metrics). `--rounds` rounds; the table shows the median of the ratios, and the goal lines
judge it. The gateway runs at the product's defaults (log level info, access log on) except
TINYGW_CLIENT_TIMEOUT_SECONDS=2 (default 30), so that the `streams` phase is short. The clients
and the provider (bench/neighbour_upstream.py) are processes of their own. Loopback only; bounded
in time (about 5 minutes with the defaults).

    .venv/bin/python bench/neighbours.py [--seconds 5] [--rounds 3] [--rate 20] [--hostile-rate 200]
        [--attacks control,query,account,junk,streams,burst,limits] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: its library, however neighbours.py is started
from lib import (  # noqa: E402
    HERE,
    HOST,
    PATH,
    Proc,
    bench_config,
    check_once,
    fmt,
    log,
    machine,
    median,
    start_gateway,
    tinygw_version,
    tree_usage,
    url,
)
from neighbour_clients import (  # noqa: E402
    EXCHANGE_ERRORS,
    REQUEST_TIMEOUT_SECONDS,
    Client,
    exchange,
    paced,
    request_bytes,
    run_loop,
)
from report import metric_sum  # noqa: E402

CLIENTS = 16
STREAM_EVERY = 4  # one well-behaved request in four is streamed
CLIENT_TIMEOUT_SECONDS = 2  # TINYGW_CLIENT_TIMEOUT_SECONDS here (the default is 30): the `streams` phase's cut
WARMUP_SECONDS = 1.0
SLICE_SECONDS = 1.0  # the hostile client attacks for a slice, then rests for one, in turn
GUARD_SECONDS = 0.25  # after an attack's slice, before its rest counts as "without"
SETTLE_SECONDS = 1.0  # after the hostile client stops, before the circuits are read
NEIGHBOUR_KEY = "neighbour-key"  # the well-behaved clients': TINYGW_API_KEYS, the client `default`
HOSTILE_KEY = "hostile-key"  # the hostile client's: a `default` key, or HOSTILE_KEYS in the `limits` phase
HOSTILE_CLIENT = {"keys_env": "HOSTILE_KEYS", "max_concurrent": 4, "requests_per_minute": 120}
JUNK_NAMES = 300
UNREAD_STREAMS = 64
UNREAD_RCVBUF = 4096
LONG_ASK = "tell me everything"  # bench/neighbour_upstream.py answers it with a long stream

ATTACKS = {
    "control": "none: plain chat requests at its rate (what its load alone costs; no goal)",
    "query": "unencodable query (`?a=é`, raw UTF-8)",
    "account": "account headers (`OpenAI-Organization`, `OpenAI-Project`)",
    "junk": f"{JUNK_NAMES} junk model names (`up/junk-N`, 404)",
    "streams": f"{UNREAD_STREAMS} streams it never reads (beside burst; no goal)",
    "burst": f"{UNREAD_STREAMS} short streams at once (what their arrival alone costs; no goal)",
    "limits": "going over its limits (4 at once, 120/min)",
}
SHOWN_ONLY = {"control", "streams", "burst"}  # phases in the table, not in the goals
SKIPPED_LIMITS = "limits phase skipped: this gateway has no named clients"


def body(model: str = "bench", stream: bool = False, content: str = "hi") -> bytes:
    fields = {
        "model": model,
        **({"stream": True} if stream else {}),
        "messages": [{"role": "user", "content": content}],
    }
    return json.dumps(fields, separators=(",", ":")).encode()


def whole(streamed: bool, answer: bytes) -> bool:
    """A well-behaved answer as the upstream sent it: its chat.completion, or its 20 words and [DONE]."""
    if streamed:
        return answer.endswith(b"data: [DONE]\n\n") and b'"content":" word19"' in answer
    return b'"object":"chat.completion"' in answer and b"Hello from bench." in answer


async def well_behaved(port: int, rate: float, out: str) -> None:
    """CLIENTS clients until SIGTERM; then every finished request, (start, seconds, status, streamed, ok),
    goes to `out` as JSON."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    samples: list[tuple[float, float, int, bool, bool]] = []
    plain, streamed = request_bytes(body(), NEIGHBOUR_KEY), request_bytes(body(stream=True), NEIGHBOUR_KEY)

    async def one(i: int) -> None:
        client = Client(port)

        async def step(n: int) -> None:
            stream = (n + i) % STREAM_EVERY == 0
            started = time.monotonic()
            status, answer = await client.send(streamed if stream else plain)
            samples.append(
                (started, time.monotonic() - started, status, stream, status == 200 and whole(stream, answer))
            )

        try:
            await paced(1 / rate, i / rate / CLIENTS, stop, step)
        finally:
            client.close()

    tasks = [asyncio.create_task(one(i)) for i in range(CLIENTS)]
    gc.disable()  # a run of seconds: no collector's pause of this process counts as the gateway's latency
    print("ready", flush=True)
    await stop.wait()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    Path(out).write_text(json.dumps(samples))


# ---- the hostile client ----------------------------------------------------------------------


def attack_requests(attack: str) -> tuple[int, object]:
    """(connections, n -> request bytes) of a paced attack."""
    plain = request_bytes(body(), HOSTILE_KEY)
    if attack == "control":
        return 4, lambda n: plain
    if attack == "query":
        raw = request_bytes(body(), HOSTILE_KEY, target=PATH.encode() + "?a=é".encode())
        return 4, lambda n: raw
    if attack == "account":
        extra = b"OpenAI-Organization: org-hostile\r\nOpenAI-Project: proj_hostile\r\n"
        chosen = request_bytes(body(), HOSTILE_KEY, extra=extra)
        return 4, lambda n: chosen
    if attack == "junk":
        names = [request_bytes(body(f"up/junk-{k}"), HOSTILE_KEY) for k in range(1, JUNK_NAMES + 1)]
        return 4, lambda n: names[n % JUNK_NAMES]
    if attack == "limits":
        return 8, lambda n: plain
    raise ValueError(attack)


async def paced_slice(clients: list[Client], make, rate: float, seconds: float, statuses: dict[str, int]) -> None:
    """One slice of a paced attack: `rate` requests a second over `clients` for `seconds`, then
    until the last one is answered."""
    counter = iter(range(1 << 62))
    stop = asyncio.Event()

    async def one(i: int, client: Client) -> None:
        async def step(_: int) -> None:
            status, _answer = await client.send(make(next(counter)))
            statuses[str(status)] = statuses.get(str(status), 0) + 1

        await paced(len(clients) / rate, i / rate, stop, step)

    tasks = [asyncio.create_task(one(i, client)) for i, client in enumerate(clients)]
    await asyncio.sleep(seconds)
    stop.set()
    await asyncio.gather(*tasks)


async def streams_slice(port: int, seconds: float, statuses: dict[str, int]) -> None:
    """One slice of the `streams` attack: UNREAD_STREAMS streamed requests for a long answer that it
    never reads, held `seconds`, then closed (unread: a reset)."""
    request = request_bytes(body(stream=True, content=LONG_ASK), HOSTILE_KEY)
    held = []
    for _ in range(UNREAD_STREAMS):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, UNREAD_RCVBUF)  # before connect: the window it offers
        try:
            s.settimeout(REQUEST_TIMEOUT_SECONDS)
            s.connect((HOST, port))
            s.sendall(request)
            held.append(s)
        except OSError:
            s.close()
            statuses["0"] = statuses.get("0", 0) + 1
    statuses["never read"] = statuses.get("never read", 0) + len(held)
    await asyncio.sleep(seconds)
    for s in held:
        s.close()


async def burst_slice(port: int, seconds: float, statuses: dict[str, int]) -> None:
    """One slice of the `burst` phase: UNREAD_STREAMS streamed requests for the short answer, sent at
    once on new connections and read to their ends; then the rest of `seconds`, as `streams` holds."""
    started = time.monotonic()
    request = request_bytes(body(stream=True), HOSTILE_KEY)

    async def one() -> None:
        try:
            reader, writer = await asyncio.open_connection(HOST, port)
        except OSError:
            statuses["0"] = statuses.get("0", 0) + 1
            return
        try:
            status, _answer, _ = await asyncio.wait_for(exchange(reader, writer, request), REQUEST_TIMEOUT_SECONDS)
        except EXCHANGE_ERRORS:
            status = 0
        finally:
            writer.close()
        statuses[str(status)] = statuses.get(str(status), 0) + 1

    await asyncio.gather(*(one() for _ in range(UNREAD_STREAMS)))
    await asyncio.sleep(max(0.0, seconds - (time.monotonic() - started)))


def slice_seconds(attack: str) -> float:
    """How long the hostile client attacks, then rests, in turn: the `streams` phase's slice holds
    its streams past the gateway's cut (the client timeout); `burst`'s is as long, to compare."""
    return CLIENT_TIMEOUT_SECONDS + 1.5 if attack in ("streams", "burst") else SLICE_SECONDS


async def hostile(attack: str, port: int, seconds: float, rate: float) -> dict:
    """Attack and rest in turn, slices of `slice_seconds(attack)`, about `seconds` of each: the
    intervals of each ("on": from the slice's start until its last request ended; "off": from
    GUARD_SECONDS after that for a slice) and what the gateway answered it."""
    length = slice_seconds(attack)
    statuses: dict[str, int] = {}
    on, off = [], []
    clients: list[Client] = []
    make = None
    if attack not in ("streams", "burst"):
        connections, make = attack_requests(attack)
        clients = [Client(port) for _ in range(connections)]
    try:
        for _ in range(max(1, round(seconds / length))):
            started = time.monotonic()
            if attack == "streams":
                await streams_slice(port, length, statuses)
            elif attack == "burst":
                await burst_slice(port, length, statuses)
            else:
                await paced_slice(clients, make, rate, length, statuses)
            on.append((started, time.monotonic()))
            await asyncio.sleep(GUARD_SECONDS)
            rest = time.monotonic()
            await asyncio.sleep(length)
            off.append((rest, time.monotonic()))
    finally:
        for client in clients:
            client.close()
    return {"on": on, "off": off, "statuses": statuses}


# ---- the run ---------------------------------------------------------------------------------


def get_json(port: int, path: str) -> dict:
    with urllib.request.urlopen(url(port, path), timeout=10) as r:
        return json.loads(r.read())


def gateway_counts(port: int) -> dict[str, float]:
    """From /metrics, summed over workers: circuits opened ever, open now, and requests answered 499."""
    with urllib.request.urlopen(url(port, "/metrics"), timeout=10) as r:
        text = r.read().decode()
    return {
        "opened": metric_sum(text, "tinygw_circuit_transitions_total", state="open"),
        "open": metric_sum(text, "tinygw_circuit_open"),
        "cut": metric_sum(text, "tinygw_requests_total", status="499"),
    }


def self_argv(*args: str) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), *args]


class NoNamedClients(Exception):
    """The gateway refused the `clients` field at start (exit 2): it has no named clients."""


def start_phase_gateway(up_port: int, attack: str) -> tuple[Proc, int]:
    config = bench_config(up_port)
    env = {"TINYGW_CLIENT_TIMEOUT_SECONDS": str(CLIENT_TIMEOUT_SECONDS)}
    if attack == "limits":
        config["clients"] = {"hostile": HOSTILE_CLIENT}
        env.update(TINYGW_API_KEYS=NEIGHBOUR_KEY, HOSTILE_KEYS=HOSTILE_KEY)
    else:
        env.update(TINYGW_API_KEYS=f"{NEIGHBOUR_KEY},{HOSTILE_KEY}")
    try:
        return start_gateway(up_port, config=config, extra_env=env)
    except RuntimeError as e:
        said = str(e)
        if attack == "limits" and "exited with 2" in said and ("$.clients" in said or "field `clients`" in said):
            raise NoNamedClients from None
        raise


def window(samples: list, intervals: list[list[float]]) -> dict:
    """The well-behaved requests that started within `intervals`: how many, the share that succeeded,
    p50 and p99 (ms), and the statuses of those that failed."""
    inside = [s for s in samples if any(start <= s[0] < end for start, end in intervals)]
    latencies = sorted(s[1] for s in inside)
    failed = [s for s in inside if not s[4]]
    return {
        "requests": len(inside),
        "success_pct": 100.0 * (len(inside) - len(failed)) / len(inside) if inside else 0.0,
        "p50_ms": statistics.median(latencies) * 1000 if latencies else None,
        "p99_ms": latencies[max(0, int(len(latencies) * 0.99) - 1)] * 1000 if latencies else None,
        "failed_statuses": sorted({s[2] for s in failed}),
    }


def run_phase(up_port: int, attack: str, args: argparse.Namespace, tmp: str) -> dict:
    gateway, port = start_phase_gateway(up_port, attack)
    procs = [gateway]
    try:
        auth = {"Authorization": f"Bearer {NEIGHBOUR_KEY}"}
        check_once(port, "tinygw", gateway, body=body().decode(), headers=auth)
        check_once(port, "tinygw", gateway, body=body(stream=True).decode(), headers=auth)
        samples_file, hostile_file = f"{tmp}/{attack}-samples.json", f"{tmp}/{attack}-hostile.json"
        load = Proc(
            "well-behaved",
            self_argv("--role", "well-behaved", "--port", str(port), "--rate", str(args.rate), "--out", samples_file),
            stdout=subprocess.PIPE,
        )
        procs.append(load)
        load.read_stdout_line("ready", 15)
        time.sleep(WARMUP_SECONDS)
        before, provider_before = gateway_counts(port), get_json(up_port, "/stats")
        attacker = Proc(
            "hostile",
            self_argv(
                "--role", "hostile", "--attack", attack, "--port", str(port), "--seconds", str(args.seconds),
                "--hostile-rate", str(args.hostile_rate), "--out", hostile_file,
            ),
        )  # fmt: skip
        procs.append(attacker)
        try:
            code = attacker.popen.wait(3 * args.seconds + 60)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"the hostile client did not end within {3 * args.seconds + 60:g} s") from None
        if code != 0:
            raise RuntimeError(f"the hostile client exited with {code}:\n{attacker.stderr_text()}")
        hostile_result = json.loads(Path(hostile_file).read_text())
        time.sleep(SETTLE_SECONDS)
        after, provider_after = gateway_counts(port), get_json(up_port, "/stats")
        load.popen.send_signal(signal.SIGTERM)
        try:
            load.popen.wait(REQUEST_TIMEOUT_SECONDS + 5)
        except subprocess.TimeoutExpired:
            raise RuntimeError("the well-behaved clients did not stop") from None
        if load.popen.returncode != 0:
            raise RuntimeError(f"the well-behaved clients exited with {load.popen.returncode}:\n{load.stderr_text()}")
        samples = json.loads(Path(samples_file).read_text())
        if gateway.popen.poll() is not None:
            raise RuntimeError(f"the gateway exited with {gateway.popen.returncode}:\n{gateway.stderr_text()}")
        peak_rss = tree_usage(gateway.pid)["hwm_bytes"]
    finally:
        for proc in reversed(procs):
            proc.stop()
            proc.cleanup_files()
    provider = {k: provider_after[k] - provider_before[k] for k in provider_after if isinstance(provider_after[k], int)}
    provider["long_bytes"] = provider_after["long_bytes"][len(provider_before["long_bytes"]) :]
    return {
        "attack": attack,
        "without": window(samples, hostile_result["off"]),
        "with": window(samples, hostile_result["on"]),
        "hostile": hostile_result["statuses"],
        "circuits_opened": after["opened"] - before["opened"],
        "circuits_opened_before": before["opened"],
        "circuits_open_after": after["open"],
        "cut_499": after["cut"] - before["cut"],
        "gateway_peak_rss_mib": peak_rss / 2**20,
        "provider": provider,
    }


def ratio(phase: dict) -> float | None:
    before, after = phase["without"]["p99_ms"], phase["with"]["p99_ms"]
    return after / before if before and after is not None else None


def hostile_got(phases: list[dict]) -> str:
    totals: dict[str, int] = {}
    for phase in phases:
        for status, n in phase["hostile"].items():
            totals[status] = totals.get(status, 0) + n
    parts = [f"{'no answer' if s == '0' else s} ×{n:,}" for s, n in sorted(totals.items()) if n]
    if phases[0]["attack"] == "streams":
        parts.append(f"cut (499) ×{sum(p['cut_499'] for p in phases):,.0f}")
        held = [b for p in phases for b in p["provider"]["long_bytes"]]
        if held:
            parts.append(
                f"the provider wrote {statistics.median(held) / 2**20:.1f} MiB of each before it was cut (median)"
            )
    return ", ".join(parts)


def streams_beside_burst(streams: list[dict], burst: list[dict]) -> str:
    """The streams phase beside the burst phase, whose 64 requests arrive as its do: shown, not judged."""
    s, b = (median([p["with"]["p99_ms"] for p in ps]) for ps in (streams, burst))
    return (
        f"streams beside burst (shown, no goal): p99 with {fmt(s, '.1f')} ms against {fmt(b, '.1f')} ms, ratio "
        f"{fmt(median([ratio(p) for p in streams]), '.2f')}x against {fmt(median([ratio(p) for p in burst]), '.2f')}x. "
        "What never-read streams cost is the ~0.3 MiB of each that the kernel's and Granian's buffers take before "
        "the relay blocks; a named client's max_concurrent bounds how many one client holds"
    )


def report(results: dict[str, list[dict]], rounds: int, skipped: bool) -> list[str]:
    """The table and the goal lines; returns the goal lines."""
    print(
        "| attack | well-behaved success without / with | p99 without / with (ms) | ratio (median; rounds) "
        "| circuits opened | the hostile client got |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    judged: dict[str, tuple[float, float | None, float]] = {}  # attack: (lowest success, median ratio, circuits)
    for attack, phases in results.items():
        ratios = [ratio(p) for p in phases]
        mid = median(ratios)
        low_without = min(p["without"]["success_pct"] for p in phases)
        low_with = min(p["with"]["success_pct"] for p in phases)
        circuits = sum(p["circuits_opened"] for p in phases)
        p99_without = median([p["without"]["p99_ms"] for p in phases])
        p99_with = median([p["with"]["p99_ms"] for p in phases])
        print(
            f"| {ATTACKS[attack]} | {low_without:.2f}% / {low_with:.2f}% | {p99_without:.1f} / {p99_with:.1f} "
            f"| {fmt(mid, '.2f')}x; {', '.join(f'{r:.2f}' for r in ratios if r is not None)} | {circuits:.0f} "
            f"| {hostile_got(phases)} |"
        )
        if attack not in SHOWN_ONLY:
            judged[attack] = (min(low_without, low_with), mid, circuits)
    print()
    if skipped:
        print(SKIPPED_LIMITS)
    if "streams" in results and "burst" in results:
        print(streams_beside_burst(results["streams"], results["burst"]))
    if not judged:  # control, streams and burst are shown only
        return []
    lowest = min(v[0] for v in judged.values())
    below = [f"{a} {v[0]:.2f}%" for a, v in judged.items() if v[0] < 100.0]
    over = [a for a, v in judged.items() if v[1] is None or v[1] > 1.5]
    opened = sum(v[2] for v in judged.values())
    goals = [
        f"goal: well-behaved success 100%: lowest {lowest:.2f}%{' (' + ', '.join(below) + ')' if below else ''} -> "
        + ("NOT MET" if below else "MET"),
        f"goal: added p99 within 1.5x of the run without the hostile client (median of {rounds} rounds): "
        + ", ".join(f"{a} {fmt(v[1], '.2f')}x" for a, v in judged.items())
        + (" -> NOT MET" if over else " -> MET"),
        f"goal: no circuit opened by the hostile client: {opened:.0f}"
        + "".join(f" ({a} {v[2]:.0f})" for a, v in judged.items() if v[2])
        + (" -> MET" if opened == 0 else " -> NOT MET"),
    ]
    for line in goals:
        print(line)
    return goals


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=5.0, help="each measured run, without and with (default 5)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of every phase; the ratio's median (default 3)")
    ap.add_argument("--attacks", default=",".join(ATTACKS), help=f"phases, of {', '.join(ATTACKS)}")
    ap.add_argument("--rate", type=float, default=20.0, help="requests a second of each well-behaved client (20)")
    ap.add_argument("--hostile-rate", type=float, default=200.0, help="the hostile client's requests a second (200)")
    ap.add_argument("--json", metavar="PATH", help="also write every phase of every round")
    ap.add_argument("--role", choices=["well-behaved", "hostile"], help=argparse.SUPPRESS)
    ap.add_argument("--attack", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.role == "well-behaved":
        run_loop(well_behaved(args.port, args.rate, args.out))
        return 0
    if args.role == "hostile":
        result = run_loop(hostile(args.attack, args.port, args.seconds, args.hostile_rate))
        Path(args.out).write_text(json.dumps(result))
        return 0
    attacks = [a.strip() for a in args.attacks.split(",") if a.strip()]
    if not attacks or set(attacks) - set(ATTACKS):
        ap.error(f"--attacks: of {', '.join(ATTACKS)}")
    if not (1 <= args.rounds <= 20 and 1 <= args.seconds <= 120 and 0 < args.rate <= 500 and 0 < args.hostile_rate):
        ap.error("need 1 <= --rounds <= 20, 1 <= --seconds <= 120, 0 < --rate <= 500, 0 < --hostile-rate")
    print(f"machine: {machine()}")
    print(f"tinygw:  {tinygw_version()}")
    print(
        f"method:  {CLIENTS} well-behaved clients, each at most {args.rate:g} requests/s on a keep-alive connection "
        f"(1 in {STREAM_EVERY} streamed), to `bench` -> up:bench-model (bench/neighbour_upstream.py); one hostile "
        f"client at {args.hostile_rate:g} requests/s (the streams phase: {UNREAD_STREAMS} held), attacking and "
        f"resting in turn ({SLICE_SECONDS:g} s slices; streams: {slice_seconds('streams'):g} s), about "
        f"{args.seconds:g} s of each; per phase a fresh tinygw at its defaults (log level info, access log on) but "
        f"TINYGW_CLIENT_TIMEOUT_SECONDS={CLIENT_TIMEOUT_SECONDS} (default 30), {WARMUP_SECONDS:g} s warm-up; "
        f"{args.rounds} rounds",
        flush=True,
    )
    upstream = Proc("neighbour-upstream", [sys.executable, str(HERE / "neighbour_upstream.py")], stdout=subprocess.PIPE)
    results: dict[str, list[dict]] = {a: [] for a in attacks}
    skipped = False
    tmp = tempfile.mkdtemp(prefix="bench-neighbours-")
    started = time.monotonic()
    try:
        with upstream.stopped_on_error():
            up_port = int(upstream.read_stdout_line("", 15))
        for r in range(args.rounds):
            for attack in attacks:
                if attack == "limits" and skipped:
                    continue
                try:
                    phase = run_phase(up_port, attack, args, tmp)
                except NoNamedClients:
                    skipped = True
                    log(f"neighbours: {SKIPPED_LIMITS}")
                    continue
                results[attack].append(phase)
                log(
                    f"neighbours: round {r + 1}/{args.rounds} {attack}: success {phase['without']['success_pct']:.2f}%"
                    f" / {phase['with']['success_pct']:.2f}%, p99 {phase['without']['p99_ms']:.1f} / "
                    f"{phase['with']['p99_ms']:.1f} ms ({phase['without']['requests']} / {phase['with']['requests']} "
                    f"requests), circuits opened {phase['circuits_opened']:.0f}, hostile {phase['hostile']}, "
                    f"provider { ({k: v for k, v in phase['provider'].items() if k != 'long_bytes' and v}) }, "
                    f"gateway peak RSS {phase['gateway_peak_rss_mib']:.0f} MiB"
                )
    finally:
        upstream.stop()
        upstream.cleanup_files()
        for name in os.listdir(tmp):
            os.unlink(os.path.join(tmp, name))
        os.rmdir(tmp)
    results = {a: phases for a, phases in results.items() if phases}
    print(f"({time.monotonic() - started:.0f} s)\n")
    goals = report(results, args.rounds, skipped)
    failures = [
        (a, p["with"]["failed_statuses"] + p["without"]["failed_statuses"]) for a, ps in results.items() for p in ps
    ]
    failures = [(a, s) for a, s in failures if s]
    if failures:
        print("well-behaved failures, by phase (0: no answer within 10 s or a broken connection): " + repr(failures))
    print(
        "gateway peak RSS (serve and its worker), median by phase: "
        + ", ".join(f"{a} {median([p['gateway_peak_rss_mib'] for p in ps]):.0f} MiB" for a, ps in results.items())
    )
    if "streams" in results:
        print(
            f"the streams phase ran with TINYGW_CLIENT_TIMEOUT_SECONDS={CLIENT_TIMEOUT_SECONDS}: at the default (30) "
            "the gateway waits up to 30 s for such a client before it cuts it"
        )
    if "limits" in results and not any(p["hostile"].get("429") for p in results["limits"]):
        print("WARNING: the hostile client over its limits got no 429")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"machine": machine(), "args": vars(args), "results": results, "goals": goals})
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
