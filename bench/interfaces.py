"""Granian's RSGI interface against its ASGI interface, and tinygw against both, on the streams
workload (`make bench-interfaces`).

    .venv/bin/python bench/interfaces.py [--concurrency 1000] [--rounds 3] [--seconds 15]
                                         [--targets asgi,rsgi,tinygw]

The paced upstream of `make bench-streams` (200 events, one every 50 ms), C streams from its load
generator, and, each on one Granian worker: two bare relays (bench/interface_apps.py: tinygw's upstream
pool, one server send per upstream read; nothing else of the gateway) and tinygw itself at its defaults
(one worker, log level info, access log on). They run in turn, `--rounds` times, the order turned around
each round. Per run: streams intact, added delivery p99 (beside the upstream directly, measured in the
same round) and the target's CPU per 1,000 relayed events; the table gives each run and the medians.
It decides whether tinygw should move to RSGI (the saving per event is what the interface alone costs or
saves), and what tinygw's own work costs an event above the bare relay on the same stack: the ratio of
their CPU per event, measured in the same round (the machine's speed moves from day to day), with its
goal (rounds where either fell behind the upstream left out). Loopback only; every process is stopped on
the way out. 3 to 5 minutes at the defaults; `--rounds 1 --seconds 5 --targets asgi,tinygw` for a quick
look (about a minute).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: its library, however it is started
from lib import HERE, HOST, ROOT, Proc, free_port, gateway_python, log, start_gateway  # noqa: E402
from streams import Target, added, measure, parse_args, start_paced_upstream, summarize  # noqa: E402

INTERFACES = {"asgi": "asgi_app", "rsgi": "rsgi_app"}
TARGETS = (*INTERFACES, "tinygw")
# tinygw's CPU per relayed event against the bare ASGI relay's, measured in the same round: its own
# work per event (docs/performance.md). The goal, and what counts as done.
GOAL_RATIO, DONE_RATIO = 1.10, 1.20
# A run whose added delivery p99 is above this (five of the upstream's intervals) fell behind: its
# reads brought several events, and its CPU per event is not the comparable figure.
KEPT_UP_MS = 250


def start_relay(interface: str, up_port: int) -> tuple[Proc, int]:
    port = free_port()
    argv = [gateway_python(), "-m", "granian", "--interface", interface, "--loop", "uvloop", "--http", "1"]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--workers", "1", "--no-ws", "--log-level", "warning"]
    argv += [f"interface_apps:{INTERFACES[interface]}"]
    env = {**os.environ, "BENCH_UPSTREAM_PORT": str(up_port), "PYTHONPATH": f"{HERE}:{ROOT}"}
    proc = Proc(f"relay-{interface}", argv, env=env, cwd=str(HERE))
    with proc.stopped_on_error():
        deadline = time.monotonic() + 30
        while True:  # listening (a request would start a stream)
            try:
                socket.create_connection((HOST, port), timeout=1).close()
                break
            except OSError:
                if proc.popen.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{proc.name} did not start:\n{proc.stderr_text()}") from None
                time.sleep(0.1)
    return proc, port


def start_target(name: str, up_port: int) -> tuple[Proc, int]:
    if name == "tinygw":  # at its defaults, as in `make bench-streams`: one worker
        return start_gateway(up_port, extra_env={"TINYGW_WORKERS": "1"})
    return start_relay(name, up_port)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=1000, help="streams at once (1,000)")
    ap.add_argument("--rounds", type=int, default=3, help="each target once a round (3)")
    ap.add_argument(
        "--seconds", type=float, default=15.0, help="each client opens its next stream while a run lasts this (15)"
    )
    ap.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated, of {', '.join(TARGETS)}")
    args = ap.parse_args(argv)
    args.targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    if not args.targets or set(args.targets) - set(TARGETS) or args.rounds < 1 or args.concurrency < 1:
        ap.error(f"--targets: some of {', '.join(TARGETS)}; --rounds and --concurrency at least 1")
    return args


def run_rounds(mine: argparse.Namespace) -> dict[str, list[dict]]:
    """Every target once a round, after the upstream directly: each run's summary, by target."""
    args = parse_args(["--concurrency", str(mine.concurrency), "--seconds", f"{mine.seconds:g}", "--no-peer"])
    upstream, up_port = start_paced_upstream(args)
    rows: dict[str, list[dict]] = {name: [] for name in mine.targets}
    try:
        for round_ in range(mine.rounds):
            order = list(mine.targets) if round_ % 2 == 0 else list(reversed(mine.targets))
            direct = summarize(measure(args, Target("direct", up_port, None), mine.concurrency, upstream))
            for name in order:
                proc, port = start_target(name, up_port)
                try:
                    time.sleep(0.5)
                    s = summarize(measure(args, Target(name, port, proc), mine.concurrency, upstream))
                finally:
                    proc.stop()
                s["added_delivery_p99_ms"] = added(s["delivery_p99_ms"], direct["delivery_p99_ms"])
                rows[name].append(s)
                log(
                    f"bench: round {round_ + 1}/{mine.rounds} {name}: {s['intact']}/{s['streams']} intact, "
                    f"added delivery p99 {s['added_delivery_p99_ms']:+.1f} ms, "
                    f"CPU/1k events {s['cpu_ms_per_1k_events']:.1f} ms"
                )
    finally:
        upstream.stop()
    return rows


def cpu(runs: list[dict]) -> float:
    return statistics.median(r["cpu_ms_per_1k_events"] for r in runs)


def print_table(rows: dict[str, list[dict]], concurrency: int) -> None:
    print(
        f"\n| target (C={concurrency:,}, one worker) | intact (runs) | added delivery p99 (ms) "
        "| CPU per 1,000 events (ms) |"
    )
    print("| --- | --- | --- | --- |")
    for name, runs in rows.items():
        per_run = [r["cpu_ms_per_1k_events"] for r in runs]
        p99 = [r["added_delivery_p99_ms"] for r in runs]
        intact = ", ".join(f"{r['intact']:,}/{r['streams']:,}" for r in runs)
        label = name if name == "tinygw" else f"bare relay, {name}"
        print(
            f"| {label} | {intact} | {statistics.median(p99):+.1f} (runs: {', '.join(f'{v:+.1f}' for v in p99)}) "
            f"| {cpu(runs):.1f} (runs: {', '.join(f'{v:.1f}' for v in per_run)}) |"
        )


def print_comparisons(rows: dict[str, list[dict]]) -> None:
    """RSGI against ASGI; tinygw against the bare ASGI relay, the ratio of each round's pair, and its goal."""
    if "asgi" in rows and "rsgi" in rows:
        a, r = cpu(rows["asgi"]), cpu(rows["rsgi"])
        print(f"\nRSGI / ASGI CPU per event: {r / a:.2f} ({a - r:.1f} µs an event saved)")
    if "asgi" not in rows or "tinygw" not in rows:
        return
    pairs = list(zip(rows["asgi"], rows["tinygw"], strict=True))
    kept = [(b, t) for b, t in pairs if kept_up(b) and kept_up(t)]
    left = len(pairs) - len(kept)
    if not kept:
        print(
            f"\ntinygw against the bare ASGI relay: no round where both kept up (added delivery p99 within "
            f"{KEPT_UP_MS} ms): the machine was too busy for CPU per event to compare; run it again"
        )
        print(f"goal: tinygw's CPU per relayed event within {GOAL_RATIO:.2f}x the bare ASGI relay's: not measured")
        return
    ratios = [t["cpu_ms_per_1k_events"] / b["cpu_ms_per_1k_events"] for b, t in kept]
    ratio = statistics.median(ratios)
    bare, tinygw = cpu([b for b, _ in kept]), cpu([t for _, t in kept])
    print(
        f"\ntinygw: {tinygw:.1f} ms per 1,000 events, the bare ASGI relay {bare:.1f} in the same rounds: "
        f"{ratio:.2f}x (median of the rounds' ratios: {', '.join(f'{v:.2f}' for v in ratios)}; "
        f"{tinygw - bare:.1f} µs an event of tinygw's own)"
        + (f"; {left} round(s) left out, where one fell behind" if left else "")
    )
    verdict = "MET" if ratio <= GOAL_RATIO else f"NOT MET (done: within {DONE_RATIO:.2f}x)"
    if GOAL_RATIO < ratio <= DONE_RATIO:
        verdict = f"NOT MET, done (within {DONE_RATIO:.2f}x)"
    print(
        f"goal: tinygw's CPU per relayed event within {GOAL_RATIO:.2f}x the bare ASGI relay's, the same round: "
        f"{ratio:.2f}x -> {verdict}"
    )


def kept_up(run: dict) -> bool:
    """Whether a run kept up with the upstream: a target that falls behind reads several events at
    once, and its CPU per event drops (a busy machine makes the bare relay look cheaper than it is)."""
    late = run["added_delivery_p99_ms"]
    return run["intact"] == run["streams"] and late is not None and late <= KEPT_UP_MS


def main(argv: list[str] | None = None) -> int:
    mine = parse(argv)
    started = time.monotonic()
    rows = run_rounds(mine)
    print_table(rows, mine.concurrency)
    print_comparisons(rows)
    print(f"\n({mine.rounds} rounds in {(time.monotonic() - started) / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
