"""tinygw benchmark: thousands of long streams at once, as LLM traffic is (`make bench-streams`).

Run from the repository root: `.venv/bin/python bench/streams.py [--concurrency 100,1000,2000,3000]
[--peers tensorzero,portkey,litellm | --no-peer] [--seconds N] [--json PATH]`. A paced upstream
(bench/paced_upstream.py: 200 events, one every 50 ms, each carrying its send time), C concurrent
streams from a cheap load generator (bench/stream_clients.py, which checks every event of every stream),
against the upstream directly, tinygw at its defaults, nginx (`proxy_buffering off`) and the peers
(bench/peers.py installs and starts them; Portkey and LiteLLM at C <= 1,000 only), one run per target and
C, all in one run; then the slow-reader lane. See bench/README.md for how to read the table.

Everything listens on 127.0.0.1 only. Every process this script starts runs in a process group of its
own and is killed on the way out; every run has a deadline. It is a benchmark, not a test: it reports
numbers and marks its goals met or not.
"""

from __future__ import annotations

import argparse
import json
import resource
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: its library, however streams.py is started
from lib import (  # noqa: E402
    HOST,
    PATH,
    Proc,
    ensure_nginx,
    fmt,
    log,
    machine,
    print_rows,
    start_gateway,
    start_nginx,
    tinygw_version,
)
from peers import PEERS  # noqa: E402
from report import added, command_line, goal, kib, ms, on_sigterm, stderr_notes  # noqa: E402
from stream_runs import QUICK_EVENTS, Target, check, measure, start_paced_upstream, summarize  # noqa: E402

# bench/interfaces.py takes Target, added, measure, parse_args, start_paced_upstream and summarize from here.
__all__ = ["Target", "added", "measure", "parse_args", "start_paced_upstream", "summarize"]

STREAM_PEERS = ("tensorzero", "portkey", "litellm")
PEER_MAX_LEVEL = {"portkey": 1000, "litellm": 1000}  # the slowest peers: not past C=1,000
NGINX_WORKER_CONNECTIONS = 16384  # a relayed stream takes two; Debian's default (768) would refuse past 384


# ---- the processes -----------------------------------------------------------------------


def start_targets(args, level: int, up_port: int, nginx: str | None, peers: dict, procs: list[Proc]) -> list[Target]:
    """A fresh tinygw, nginx and peers for one level (or the slow lane: level 0), so their memory is that run's."""
    targets = [Target("direct", up_port, None)] if level else []
    gateway, port = start_gateway(up_port)  # at its defaults: one provider, one model, log level info
    procs.append(gateway)
    targets.append(Target("tinygw", port, gateway))
    if nginx is not None:
        proc, port = start_nginx(nginx, up_port, NGINX_WORKER_CONNECTIONS)
        procs.append(proc)
        targets.append(Target("nginx", port, proc))
    for name in STREAM_PEERS:
        if name not in peers or (level and level > PEER_MAX_LEVEL.get(name, level)):
            continue
        peer = PEERS[name]
        log(f"bench: {f'c={level}' if level else 'slow lane'}: starting {name}")
        try:
            proc, port, start_s = peer.start(peers[name], up_port)
        except RuntimeError as e:
            print(
                f"WARNING: {name} did not start or answer; {f'c={level}' if level else 'the slow lane'} "
                f"runs without it: {str(e)[-2000:]}"
            )
            continue
        procs.append(proc)
        log(f"bench: {name} ready in {start_s:.1f} s")
        targets.append(Target(name, port, proc, peer.path, peer.body(True), peer.headers(up_port)))
    return targets


# ---- the report --------------------------------------------------------------------------


def level_rows(levels: list[dict]) -> list[dict]:
    rows = []
    for lv in levels:
        direct = lv["summary"].get("direct")
        for name, s in lv["summary"].items():
            gw = name != "direct"
            rows.append(
                {
                    "c": lv["concurrency"],
                    "target": name,
                    "intact": f"{s['intact']:,}/{s['streams']:,}",
                    "first": f"{ms(s['first_p50_ms'], ',.1f')} / {ms(s['first_p99_ms'], ',.1f')}",
                    "added_first": (
                        f"{ms(added(s['first_p50_ms'], direct and direct['first_p50_ms']), ',.1f', True)} / "
                        f"{ms(added(s['first_p99_ms'], direct and direct['first_p99_ms']), ',.1f', True)}"
                    )
                    if gw and direct
                    else "-",
                    "delivery": ms(s["delivery_p99_ms"], ",.1f"),
                    "added_delivery": ms(
                        added(s["delivery_p99_ms"], direct and direct["delivery_p99_ms"]), ",.1f", True
                    )
                    if gw and direct
                    else "-",
                    "rss": fmt(s["rss_per_stream_bytes"] / 1024, ",.1f") if gw else "-",
                    "cpu": fmt(s["cpu_ms_per_1k_events"], ",.1f"),
                }
            )
    return rows


HEAD = [
    "conc",
    "target",
    "streams intact",
    "first event p50 / p99 (ms)",
    "added p50 / p99 (ms)",
    "delivery p99 (ms)",
    "added delivery p99 (ms)",
    "RSS/stream (KiB)",
    "CPU ms / 1k events",
]
KEYS = ["c", "target", "intact", "first", "added_first", "delivery", "added_delivery", "rss", "cpu"]


def print_table(levels: list[dict]) -> list[dict]:
    rows = level_rows(levels)
    print_rows(HEAD, [[f"{r['c']:,}" if k == "c" else r[k] for k in KEYS] for r in rows])
    return rows


def print_markdown(rows: list[dict], slow: list[dict]) -> None:
    print("| " + " | ".join("C" if h == "conc" else h for h in HEAD) + " |")
    print("|" + " --- |" * len(HEAD))
    for r in rows:
        print("| " + " | ".join(f"{r['c']:,}" if k == "c" else r[k] for k in KEYS) + " |")
    if slow:
        print()
        print("| slow reader (10 clients, 1 KiB/s) | RSS growth per stream | read per client |")
        print("| --- | --- | --- |")
        for s in slow:
            print(f"| {s['target']} | {kib(s['growth_per_stream_bytes'])} | {s['read_kib']:.0f} KiB |")


def print_goals(levels: list[dict], slow: list[dict]) -> None:
    by = {lv["concurrency"]: lv["summary"] for lv in levels}

    def at(c: int, name: str = "tinygw") -> dict | None:
        return (by.get(c) or {}).get(name)

    def intact(c: int) -> None:
        s = at(c)
        value = f"{s['intact']:,}/{s['streams']:,}" if s else None
        goal(f"c={c:,} tinygw: every stream intact", value, bool(s) and s["intact"] == s["streams"] > 0)

    def vs_direct(c: int, key: str) -> float | None:
        s, d = at(c), at(c, "direct")
        return added(s[key], d[key]) if s and d else None

    intact(1000)
    v = vs_direct(1000, "first_p99_ms")
    goal(
        "c=1,000 tinygw: added first-event p99 <= 15 ms",
        None if v is None else f"{ms(v, '.1f', True)} ms",
        v is not None and v <= 15,
    )
    s = at(1000)
    rss = s["rss_per_stream_bytes"] if s else None
    goal(
        "c=1,000 tinygw: RSS per stream <= 32 KiB",
        None if rss is None else f"{rss / 1024:,.1f} KiB",
        rss is not None and rss <= 32 * 1024,
    )
    intact(2000)
    v = vs_direct(2000, "delivery_p99_ms")
    goal(
        "c=2,000 tinygw: added delivery p99 <= 100 ms",
        None if v is None else f"{ms(v, ',.1f', True)} ms",
        v is not None and v <= 100,
    )
    intact(3000)
    mine = vs_direct(3000, "delivery_p99_ms")
    d3 = at(3000, "direct")
    others = {
        n: added(s["delivery_p99_ms"], d3["delivery_p99_ms"]) if d3 else None
        for n, s in (by.get(3000) or {}).items()
        if n in STREAM_PEERS  # the gateways users would pick instead; nginx is the floor, shown beside
    }
    ahead = (
        mine is not None
        and bool(others)
        and all(
            v is None or (at(3000)["intact"] >= at(3000, n)["intact"] and mine < v)  # type: ignore[index]
            for n, v in others.items()
        )
    )
    value = (
        None
        if mine is None or not others
        else (
            f"added delivery p99 {ms(mine, ',.1f', True)} ms, "
            + ", ".join(f"{n} {ms(v, ',.1f', True)} ms ({at(3000, n)['intact']:,} intact)" for n, v in others.items())  # type: ignore[index]
            + (
                f"; nginx {ms(added(n3['delivery_p99_ms'], d3['delivery_p99_ms']), ',.1f', True)} ms"
                if (n3 := at(3000, "nginx")) and d3
                else ""
            )
        )
    )
    goal(
        "c=3,000 tinygw: ahead of every peer in the same run (fewer streams broken, lower added delivery p99)",
        value,
        ahead,
    )
    s = at(1000)
    cpu = s["cpu_ms_per_1k_events"] if s else None
    goal(
        "c=1,000 tinygw: CPU per 1,000 relayed events <= 20 ms",
        None if cpu is None else f"{cpu:,.1f} ms",
        cpu is not None and cpu <= 20,
    )
    g = next((x for x in slow if x["target"] == "tinygw"), None)
    held = g["growth_per_stream_bytes"] if g else None
    goal(
        "slow reader: tinygw holds at most 1 MiB per stream",
        None if held is None else kib(held),
        held is not None and held <= 2**20,
    )


# ---- main --------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", default="100,1000,2000,3000", help="comma-separated stream counts C")
    ap.add_argument(
        "--peers",
        default=",".join(STREAM_PEERS),
        help="comma-separated peers beside tinygw and nginx (default tensorzero,portkey,litellm; "
        "portkey and litellm at C <= 1,000 only); '' for none",
    )
    ap.add_argument("--no-peer", action="store_true", help="no peers at all (the same as --peers '')")
    ap.add_argument("--no-nginx", action="store_true", help="skip nginx")
    ap.add_argument(
        "--seconds",
        type=float,
        default=10.0,
        help="each client opens its next stream while the run lasts this long (default 10: a stream's "
        "length, so one stream a client)",
    )
    ap.add_argument("--ramp", type=float, default=2.0, help="the C streams start evenly spread over this (default 2 s)")
    ap.add_argument(
        "--grace",
        type=float,
        default=20.0,
        help="a run's deadline is ramp + max(seconds, a stream's length) + this (default 20 s); what is "
        "still open then is closed and not intact",
    )
    ap.add_argument("--events", type=int, default=200, help="events a stream (default 200)")
    ap.add_argument("--interval-ms", type=float, default=50.0, help="between two events (default 50)")
    ap.add_argument("--generators", type=int, default=1, help="load generator processes sharing the streams (1)")
    ap.add_argument("--slow-clients", type=int, default=10, help="the slow-reader lane's clients (10; 0 skips it)")
    ap.add_argument("--slow-seconds", type=float, default=15.0, help="the slow-reader lane's length (15 s)")
    ap.add_argument("--slow-bytes", type=int, default=1024, help="what a slow reader reads a second (1024)")
    ap.add_argument("--json", metavar="PATH", help="also write the raw numbers as JSON to PATH")
    args = ap.parse_args(argv)
    args.levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if not args.levels or min(args.levels) < 1 or args.events < 1 or args.generators < 1:
        ap.error("--concurrency needs positive integers; --events and --generators at least 1")
    args.wanted = [] if args.no_peer else [p.strip() for p in args.peers.split(",") if p.strip()]
    if set(args.wanted) - set(STREAM_PEERS):
        ap.error(f"--peers: unknown {', '.join(sorted(set(args.wanted) - set(STREAM_PEERS)))}")
    return args


def install_peers(args) -> dict[str, dict]:
    peers = {}
    if not args.wanted:
        print(f"peer:    none ({'--no-peer' if args.no_peer else '--peers'})")
    for name in STREAM_PEERS:
        if name in args.wanted:
            info = PEERS[name].ensure()
            if info is not None:
                peers[name] = info
                print(f"peer:    {info['describe']}")
    sys.stdout.flush()
    return peers


def open_files_line(levels: list[int]) -> str:
    """This process's soft limit raised to the hard one (the generator does the same), and whether it is enough:
    at the largest C, C client sockets in the generator, 2C in a gateway, C in the upstream."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    c = max(levels)
    need = 2 * c + 256
    verdict = "enough" if hard == resource.RLIM_INFINITY or hard >= need else "NOT ENOUGH: raise `ulimit -Hn`"
    return (
        f"open files: hard limit {hard}; at C={c:,} a gateway needs {2 * c:,} sockets (client and upstream "
        f"sides) + its files, the generator and the upstream {c:,} each: {verdict}"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, on_sigterm)
    command = command_line(__file__)
    t_begin = time.monotonic()
    print(f"command: {command}")
    print(f"machine: {machine()}")
    print(open_files_line(args.levels))
    stream_s = args.events * args.interval_ms / 1000
    print(
        f"streams: {args.events} events, one every {args.interval_ms:g} ms ({stream_s:g} s a stream), C started "
        f"over {args.ramp:g} s, runs of {args.seconds:g} s, deadline ramp + {max(args.seconds, stream_s):g} + "
        f"{args.grace:g} s; POST {PATH} on {HOST}"
    )
    sys.stdout.flush()
    peers = install_peers(args)
    nginx = None if args.no_nginx else ensure_nginx()
    procs: list[Proc] = []
    raw: dict = {
        "command": command,
        "machine": machine(),
        "tinygw_version": tinygw_version(),
        "peers": {k: {kk: vv for kk, vv in v.items() if kk != "python"} for k, v in peers.items()},
        "levels": [],
        "slow": [],
    }
    stderr_of: dict[str, str] = {}
    failed = False
    try:
        upstream, up_port = start_paced_upstream(args)
        procs.append(upstream)
        for level in args.levels:
            targets = start_targets(args, level, up_port, nginx, peers, procs)
            lv = {"concurrency": level, "runs": {}, "summary": {}}
            for t in targets:
                problem = check(args, t)
                if problem is not None:
                    print(
                        f"WARNING: c={level}: {t.name} did not relay a {QUICK_EVENTS}-event stream intact; "
                        f"it is left out of this level: {problem[:1000]}"
                    )
                    continue
                time.sleep(0.5)
                r = measure(args, t, level, upstream)
                s = summarize(r)
                lv["runs"][t.name], lv["summary"][t.name] = r, s
                log(
                    f"bench: c={level} {t.name}: {s['intact']}/{s['streams']} intact, first p99 "
                    f"{ms(s['first_p99_ms'])} (ms), delivery p99 {ms(s['delivery_p99_ms'])} ms, RSS/stream "
                    f"{s['rss_per_stream_bytes'] / 1024:.1f} KiB, CPU/1k events "
                    f"{fmt(s['cpu_ms_per_1k_events'], '.1f')} ms; "
                    f"cores: target {fmt(s['target_core'], '.2f')}, generator {fmt(s['generator_core'], '.2f')}, "
                    f"upstream {fmt(s['upstream_core'], '.2f')}; {r['failures'] or ''}"
                )
            raw["levels"].append(lv)
            for t in reversed(targets):
                if t.proc is not None:
                    stderr_of[t.name] = stderr_of.get(t.name, "") + t.proc.stderr_text(2_000_000)
                    t.proc.stop()
        if args.slow_clients > 0:
            fast, fast_port = start_paced_upstream(args, fast=True)
            procs.append(fast)
            for t in start_targets(args, 0, fast_port, nginx, peers, procs):
                time.sleep(0.5)
                r = measure(args, t, args.slow_clients, fast, slow=True)
                growth = r["peak_rss_bytes"] - r["idle_rss_bytes"]
                entry = {
                    "target": t.name,
                    "growth_per_stream_bytes": growth / args.slow_clients,
                    "read_kib": sum(r["slow_read"]) / max(1, len(r["slow_read"])) / 1024,
                    "run": r,
                }
                raw["slow"].append(entry)
                log(
                    f"bench: slow lane {t.name}: RSS +{kib(growth / args.slow_clients)} a stream, {r['failures'] or ''}"
                )
                if t.proc is not None:
                    stderr_of[t.name + " (slow lane)"] = t.proc.stderr_text(200_000)
                    t.proc.stop()
        print_report(args, raw, peers, stderr_of, time.monotonic() - t_begin)
    except KeyboardInterrupt as e:
        log(f"bench: interrupted ({e}); cleaning up")
        failed = True
    except Exception as e:  # noqa: BLE001 - report and clean up
        log(f"bench: FAILED: {e}")
        failed = True
    finally:
        for proc in reversed(procs):
            proc.stop()
        for proc in procs:
            proc.cleanup_files()
    if args.json:
        raw["failed"] = failed
        Path(args.json).write_text(json.dumps(raw, indent=1, default=str) + "\n")
        print(f"raw numbers: {args.json}")
    return 1 if failed else 0


def print_report(args, raw: dict, peers: dict, stderr_of: dict[str, str], took: float) -> None:
    print()
    print(
        f"direct = the paced upstream; tinygw {raw['tinygw_version']} (this tree, at its defaults: 1 Granian worker, "
        f"log level info, access log on); nginx: proxy_buffering off, 1 worker"
        + "".join(f"; {n} {peers[n]['version']}" for n in STREAM_PEERS if n in peers)
    )
    rows = print_table(raw["levels"])
    if raw["slow"]:
        print()
        print_rows(
            ["slow reader", "RSS growth per stream", "read per client"],
            [[s["target"], kib(s["growth_per_stream_bytes"]), f"{s['read_kib']:.0f} KiB"] for s in raw["slow"]],
        )
    print()
    print_goals(raw["levels"], raw["slow"])
    print()
    print(
        "streams intact: every event, in order, then [DONE]. first event: from the client's connect to the first "
        "event. delivery: an event's receive time - the send time the upstream wrote into it, over every event. "
        "cut: the percentile falls among the streams (first event) or events (delivery) that had not come by the "
        "run's deadline, counted as infinitely late. "
        "added: the target's - direct's, in the same level. RSS/stream: (peak VmRSS of the target's process tree "
        "during its run - idle) / C. CPU ms / 1k events: utime+stime of that tree during its run / events relayed "
        "x 1,000 (direct: the upstream's). One run per row; the machine's CPUs are shared by the generator, the "
        "upstream and the target, so at large C all three compete: CPU per event is the comparable figure."
    )
    for lv in raw["levels"]:
        for name, r in lv["runs"].items():
            s = lv["summary"][name]
            print(
                f"c={lv['concurrency']:,} {name}: cores used, target {fmt(s['target_core'], '.2f')}, generator "
                f"{fmt(s['generator_core'], '.2f')} ({r['generators']} process), upstream "
                f"{fmt(s['upstream_core'], '.2f')}"
                + (f"; not intact: {r['failures']}" if r["failures"] else "")
                + (f"; e.g. {r['examples'][0]}" if r["examples"] else "")
            )
    for name, text in stderr_of.items():
        for line in stderr_notes(name, text):
            print(line)
    print(f"took {took / 60:.1f} min")
    print()
    print("markdown:")
    print_markdown(rows, raw["slow"])


if __name__ == "__main__":
    sys.exit(main())
