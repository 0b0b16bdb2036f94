"""What the stack costs before tinygw's own logic: the floor under `make bench`'s numbers.

Side by side in one run, each one process on loopback, the same wrk as bench/lib.py
(plain chat against bench/instant_upstream.py, c=1 and c=32, medians):

  direct        the instant upstream itself
  granian-hello Granian (ASGI, uvloop, as tinygw sets it) answering a fixed body
  granian-pool  Granian + tinygw's upstream pool forwarding each request, nothing else
  uvloop-pool   the same forwarding on one thread, a uvloop server without Granian
  tinygw        the gateway at its defaults

granian-pool is the floor of tinygw's own design: what is left of a request's CPU and
latency once routing, breakers, metrics and the log are taken away; uvloop-pool tells
what Granian's threads cost in it. Usage: `make bench-floor`, or
`.venv/bin/python bench/floor.py [--seconds S] [--repeats N]`.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lib  # noqa: E402 - bench/lib.py: its processes, wrk and accounting

TARGETS = ("direct", "granian-hello", "granian-pool", "uvloop-pool", "tinygw")


def start_granian(app: str, upstream_port: int) -> tuple[lib.Proc, int]:
    port = lib.free_port()
    env = dict(os.environ, FLOOR_UPSTREAM_PORT=str(upstream_port), PYTHONPATH=str(lib.ROOT))
    argv = [
        lib.gateway_python(),
        "-m",
        "granian",
        "--interface",
        "asgi",
        "--loop",
        "uvloop",
        "--http",
        "1",
        "--no-ws",
        "--workers",
        "1",
        "--host",
        lib.HOST,
        "--port",
        str(port),
        "--log-level",
        "warning",
        f"floor_apps:{app}",
    ]
    proc = lib.Proc(f"granian-{app}", argv, env=env, cwd=lib.HERE)
    return proc, port


def start_uvloop_pool(upstream_port: int) -> tuple[lib.Proc, int]:
    port = lib.free_port()
    proc = lib.Proc(
        "uvloop-pool", [lib.gateway_python(), str(lib.HERE / "floor_apps.py"), str(port), str(upstream_port)]
    )
    return proc, port


def print_goals(medians: dict[tuple[int, str], tuple[float, float | None]], paired: list[float]) -> None:
    """Issue 22's goals against the floor: tinygw's CPU per request at c=32 within 1.5x granian-pool's, and its
    added p50 at c=1 within granian-pool's + 0.08 ms. `paired`: the c=32 ratio of each round, the two measured
    one after the other (their spread is this machine's noise, shown beside the goal)."""
    (_, cpu), (_, floor_cpu) = medians[32, "tinygw"], medians[32, "granian-pool"]
    if cpu is not None and floor_cpu:
        ratio = cpu / floor_cpu
        rounds = ", ".join(f"{r:.2f}" for r in paired)
        print(
            f"goal: c=32 tinygw CPU per request <= 1.5x granian-pool's: {ratio:.2f}x (round by round: {rounds}) -> "
            f"{'MET' if ratio <= 1.5 else 'NOT MET'}"
        )
    added = (medians[1, "tinygw"][0] - medians[1, "granian-pool"][0]) / 1000
    print(
        f"goal: c=1 tinygw added p50 <= granian-pool's + 0.08 ms: +{added:.3f} ms over it -> "
        f"{'MET' if added <= 0.08 else 'NOT MET'}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=5.0, help="length of each measured run (default 5)")
    ap.add_argument("--repeats", type=int, default=3, help="measured runs per target; median reported (3)")
    args = ap.parse_args(argv)
    wrk = lib.ensure_wrk()
    lua = tempfile.NamedTemporaryFile("w", prefix="bench-wrk-", suffix=".lua", delete=False)  # noqa: SIM115
    lua.write(lib.WRK_LUA)
    lua.close()
    procs: list[lib.Proc] = []
    try:
        upstream, upstream_port = lib.start_upstream()
        procs.append(upstream)
        started = {"direct": (upstream, upstream_port)}
        for app in ("hello", "pool_app"):
            started["granian-" + ("hello" if app == "hello" else "pool")] = start_granian(app, upstream_port)
        started["uvloop-pool"] = start_uvloop_pool(upstream_port)
        started["tinygw"] = lib.start_gateway(upstream_port)
        procs += [p for name, (p, _) in started.items() if name != "direct"]
        for name, (proc, port) in started.items():
            if name not in ("direct", "tinygw"):  # those were waited for as they started
                lib.wait_ready(proc, port, lib.PATH, 30)
            lib.check_once(port, name, proc)
        print(f"machine: {lib.machine()}")
        print(
            f"runs:    1 s warm-up + {args.seconds:g} s, {args.repeats} per target, median; {lib.PATH} on "
            f"{lib.HOST}; tinygw at its defaults (log level info, access log on)"
        )
        rows, medians = [], {}
        paired: list[float] = []  # c=32: tinygw's CPU per request over granian-pool's, round by round
        for conns in (1, 32):
            results: dict[str, list[dict]] = {name: [] for name in TARGETS}
            for _ in range(args.repeats):
                for name in TARGETS:
                    proc, port = started[name]
                    results[name].append(
                        lib.measured_run(wrk, lua.name, port, conns, args.seconds, 1.0, {"t": proc.pid})
                    )
            direct_p50 = lib.median([r["p50_us"] for r in results["direct"]])
            if conns == 32:
                paired = [
                    t["t_cpu_us_per_request"] / f["t_cpu_us_per_request"]
                    for t, f in zip(results["tinygw"], results["granian-pool"], strict=True)
                    if f["t_cpu_us_per_request"]
                ]
            for name in TARGETS:
                rs = results[name]
                errors = sum(r["error_count"] for r in rs)
                p50 = lib.median([r["p50_us"] for r in rs])
                cpu = lib.median([r["t_cpu_us_per_request"] for r in rs]) if name != "direct" else None
                medians[conns, name] = (p50 - direct_p50, cpu)
                rows.append(
                    [
                        str(conns),
                        name,
                        f"{lib.median([r['rps'] for r in rs]):,.0f}",
                        f"{p50 / 1000:.3f}",
                        "-" if name == "direct" else f"+{(p50 - direct_p50) / 1000:.3f}",
                        "-" if cpu is None else f"{cpu:.0f}",
                        str(errors),
                    ]
                )
        print()
        lib.print_rows(["conc", "target", "req/s", "p50 (ms)", "+p50 (ms)", "CPU/req (µs)", "wrk errors"], rows)
        print(
            "\nCPU/req: utime+stime of the target's process tree during its run / requests. granian-pool is "
            "tinygw's floor on Granian; granian-pool - uvloop-pool is what Granian's threads cost a request."
        )
        print()
        print_goals(medians, paired)
    finally:
        for proc in procs:
            proc.stop()
            proc.cleanup_files()
        os.unlink(lua.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
