"""Granian's RSGI interface against its ASGI interface on the streams workload (`make bench-interfaces`).

    .venv/bin/python bench/interfaces.py [--concurrency 1000] [--rounds 3] [--seconds 20]

The paced upstream of `make bench-streams` (200 events, one every 50 ms), C streams from its load
generator, and two bare relays on one Granian worker each (bench/interface_apps.py: tinygw's upstream pool,
one server send per upstream read; nothing else of the gateway), run in turn, `--rounds` times,
alternating which goes first. Per run: streams intact, added delivery p99 (beside the upstream
directly, measured in the same round) and the relay's CPU per 1,000 relayed events; the table gives
each run and the medians. It decides whether tinygw should move to RSGI: the saving per event is
what the interface alone costs or saves. Loopback only; every process is stopped on the way out.
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
from lib import HERE, HOST, ROOT, Proc, free_port, gateway_python, log  # noqa: E402
from streams import Target, added, measure, parse_args, start_paced_upstream, summarize  # noqa: E402

INTERFACES = {"asgi": "asgi_app", "rsgi": "rsgi_app"}


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=20.0)
    mine = ap.parse_args(argv)
    args = parse_args(["--concurrency", str(mine.concurrency), "--seconds", f"{mine.seconds:g}", "--no-peer"])
    upstream, up_port = start_paced_upstream(args)
    rows: dict[str, list[dict]] = {name: [] for name in INTERFACES}
    try:
        for round_ in range(mine.rounds):
            order = list(INTERFACES) if round_ % 2 == 0 else list(reversed(INTERFACES))
            direct = summarize(measure(args, Target("direct", up_port, None), mine.concurrency, upstream))
            for name in order:
                proc, port = start_relay(name, up_port)
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
    print(
        f"\n| interface (C={mine.concurrency:,}, one worker) | intact (runs) | added delivery p99 (ms) "
        "| CPU per 1,000 events (ms) |"
    )
    print("| --- | --- | --- | --- |")
    for name, runs in rows.items():
        cpu = [r["cpu_ms_per_1k_events"] for r in runs]
        p99 = [r["added_delivery_p99_ms"] for r in runs]
        intact = ", ".join(f"{r['intact']:,}/{r['streams']:,}" for r in runs)
        print(
            f"| {name} | {intact} | {statistics.median(p99):+.1f} (runs: {', '.join(f'{v:+.1f}' for v in p99)}) "
            f"| {statistics.median(cpu):.1f} (runs: {', '.join(f'{v:.1f}' for v in cpu)}) |"
        )
    a, r = (statistics.median(x["cpu_ms_per_1k_events"] for x in rows[n]) for n in ("asgi", "rsgi"))
    print(f"\nRSGI / ASGI CPU per event: {r / a:.2f} ({a - r:.1f} µs an event saved)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
