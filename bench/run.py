"""tinygw benchmark: an instant upstream, hit directly and through tinygw, with wrk.

Run from the repository root: `.venv/bin/python bench/run.py [--seconds N] [--repeats N]
[--peers litellm,portkey,tensorzero | --no-peer] [--stream] [--json PATH]` (what `make bench` does).
See bench/README.md for how to read the table. The peers are LiteLLM's proxy, Portkey's gateway
and TensorZero's gateway (bench/peers.py installs and starts them).

Everything listens on 127.0.0.1 only. Every process this script starts runs in a
process group of its own and is killed on the way out, whatever happened; every wait
has a deadline. It is a benchmark, not a test: it reports numbers and judges none.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: its library, however run.py is started
from lib import (  # noqa: E402
    BODY,
    HOST,
    PATH,
    STREAM_BODY,
    WRK_LUA,
    Proc,
    check_once,
    ensure_nginx,
    ensure_wrk,
    fmt,
    log,
    machine,
    measured_run,
    median,
    print_rows,
    start_gateway,
    start_nginx,
    start_upstream,
    tinygw_version,
    tree_usage,
)
from peers import DEFAULT_PEERS, PEERS  # noqa: E402
from report import command_line, on_sigterm  # noqa: E402

PEER_NAMES = tuple(PEERS)  # --peers: the other gateways, beside tinygw and nginx
GATEWAYS = ("tinygw", "tinygw-tls", *PEER_NAMES, "nginx")
STREAM_EVENTS = 22  # events in a streamed answer: role, the words (--stream-words, 20), finish ([DONE] aside)


def ratio(a, b) -> str:
    return "-" if a is None or b is None or b <= 0 or a < 0 else f"{a / b:.3g}x"


def print_goals(summary: list[dict], stream: bool) -> None:
    """Issues 11's and 22's goals, each from this run, marked met or not."""
    by_level = {s["concurrency"]: s for s in summary}

    def line(goal: str, value, limit, fmt_: str, higher_is_better: bool = False) -> None:
        if value is None:
            print(f"goal: {goal}: not measured in this run")
            return
        met = value >= limit if higher_is_better else value <= limit
        print(f"goal: {goal}: {format(value, fmt_)} -> {'MET' if met else 'NOT MET'}")

    top = by_level.get(32)
    if top and not stream:
        g, n = top["targets"].get("tinygw"), top["targets"].get("nginx")
        line("c=32 tinygw req/s >= 25% of nginx's", g["rps"] / n["rps"] * 100 if g and n else None, 25, ".1f", True)
        line("c=32 tinygw CPU per request <= 100 µs", g["cpu_us_per_request"] if g else None, 100, ".0f")
    one = by_level.get(1)
    if one and not stream:
        line("c=1 tinygw added p50 <= 0.25 ms", one["added_p50_ms"].get("tinygw"), 0.25, ".3f")
    if stream:
        for s in summary:
            g = s["targets"].get("tinygw")
            cpu = g["cpu_us_per_request"] / STREAM_EVENTS if g and g["cpu_us_per_request"] is not None else None
            line(f"c={s['concurrency']} tinygw CPU per relayed event <= 5 µs", cpu, 5, ".1f")
    for peer in PEER_NAMES:  # ahead of every peer at c=32 (ratios: tinygw's / the peer's)
        g, p = (top or {}).get("targets", {}).get("tinygw"), (top or {}).get("targets", {}).get(peer)
        if g and p:
            line(f"c=32 tinygw req/s / {peer}'s >= 1", g["rps"] / p["rps"] if p["rps"] else None, 1, ".2f", True)
            cpu = (
                g["cpu_us_per_request"] / p["cpu_us_per_request"]
                if g["cpu_us_per_request"] is not None and p["cpu_us_per_request"]
                else None
            )
            line(f"c=32 tinygw CPU per request / {peer}'s <= 1", cpu, 1, ".2f")
    if one and "tensorzero" in one["added_p50_ms"] and one["added_p50_ms"]["tensorzero"] > 0:
        line(
            "c=1 tinygw added p50 / tensorzero's <= 1",
            one["added_p50_ms"]["tinygw"] / one["added_p50_ms"]["tensorzero"],
            1,
            ".2f",
        )


def print_table(summary: list[dict], names: list[str], stream: bool = False) -> None:
    head = [
        "conc",
        "target",
        "req/s",
        "p50 (ms)",
        "p99 (ms)",
        "+p50 (ms)",
        "CPU/req (µs)",
        "peak RSS (MiB)",
        "wrk errors",
    ] + (["CPU/event (µs)"] if stream else [])
    rows = []
    for s in summary:
        for t in names:
            m = s["targets"].get(t)
            if m is None:
                continue
            gw = t in GATEWAYS
            rss = s["peak_rss_bytes"].get(t)
            rows.append(
                [
                    str(s["concurrency"]),
                    t,
                    fmt(m["rps"], ",.0f"),
                    fmt(m["p50_us"] / 1000, ".3f"),
                    fmt(m["p99_us"] / 1000, ".3f"),
                    fmt(s["added_p50_ms"].get(t), "+.3f") if gw else "-",
                    fmt(m["cpu_us_per_request"], ",.0f") if gw else "-",
                    fmt(rss / 2**20 if rss is not None else None, ".1f") if gw else "-",
                    str(m["errors"]),
                ]
                + (
                    [fmt(m["cpu_us_per_request"] / STREAM_EVENTS, ".1f") if gw and m["cpu_us_per_request"] else "-"]
                    if stream
                    else []
                )
            )
    print_rows(head, rows)
    pairs = [(s, peer) for s in summary for peer in PEER_NAMES if peer in s["targets"] and "tinygw" in s["targets"]]
    if pairs:
        print()
        head = ["conc", "tinygw / peer", "req/s", "+p50", "CPU/req", "peak RSS"]
        rows = []
        for s, peer in pairs:
            g, p = s["targets"]["tinygw"], s["targets"][peer]
            rows.append(
                [
                    str(s["concurrency"]),
                    f"tinygw / {peer}",
                    ratio(g["rps"], p["rps"]),
                    ratio(s["added_p50_ms"]["tinygw"], s["added_p50_ms"][peer]),
                    ratio(g["cpu_us_per_request"], p["cpu_us_per_request"]),
                    ratio(s["peak_rss_bytes"]["tinygw"], s["peak_rss_bytes"][peer]),
                ]
            )
        print_rows(head, rows)


# ---- main ---------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=5.0, help="length of each measured run (default 5)")
    ap.add_argument("--warmup", type=float, default=1.0, help="warm-up before each measured run (default 1)")
    ap.add_argument("--repeats", type=int, default=3, help="measured runs per configuration; median reported (3)")
    ap.add_argument(
        "--concurrency",
        default="1,32",
        help="comma-separated connection counts (default 1,32); wrk threads = min(2, c)",
    )
    ap.add_argument(
        "--peers",
        default=",".join(DEFAULT_PEERS),
        help="comma-separated peers measured beside tinygw and nginx (default litellm,portkey,tensorzero): "
        "LiteLLM's proxy (pip, into bench/.venv-litellm), Portkey's gateway (npm, into "
        "bench/.node-portkey) and TensorZero's gateway (pip, into bench/.venv-tensorzero), each "
        "installed on first use; also tensorzero-nodelay (TensorZero with TCP_NODELAY forced on "
        "its accepted sockets); '' for none",
    )
    ap.add_argument("--no-peer", action="store_true", help="no peers at all (the same as --peers '')")
    ap.add_argument("--json", metavar="PATH", help="also write the raw numbers as JSON to PATH")
    ap.add_argument(
        "--stream",
        action="store_true",
        help="streamed answers (stream: true; 22 events, chunked) instead of plain ones; adds CPU/event",
    )
    ap.add_argument(
        "--stream-words",
        type=int,
        default=20,
        metavar="N",
        help="words in a streamed answer (default 20: 22 events); a run with more shows what one more "
        "event costs, without the request's own cost",
    )
    ap.add_argument("--no-nginx", action="store_true", help="skip the nginx peer (Debian's nginx, proxy_pass)")
    ap.add_argument(
        "--tls",
        action="store_true",
        help="also measure tinygw with attested TLS (TINYGW_TLS=attested; wrk over https, keep-alive)",
    )
    args = ap.parse_args(argv)
    if args.stream_words < 1:
        ap.error("--stream-words must be at least 1")
    if args.seconds <= 0 or args.repeats < 1 or args.warmup < 0:
        ap.error("--seconds must be > 0, --repeats >= 1, --warmup >= 0")
    args.levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if not args.levels or min(args.levels) < 1:
        ap.error("--concurrency needs positive integers")
    args.wanted = [] if args.no_peer else [p.strip() for p in args.peers.split(",") if p.strip()]
    if set(args.wanted) - set(PEERS):
        ap.error(
            f"--peers: unknown {', '.join(sorted(set(args.wanted) - set(PEERS)))} (known: {', '.join(PEER_NAMES)})"
        )
    return args


def install_peers(args) -> dict[str, dict]:
    """What each peer is (raw["peers"]): only those that could be had are enabled."""
    peers: dict[str, dict] = {name: {"enabled": False, "chosen": name in args.wanted} for name in PEERS}
    if not args.wanted:
        print(f"peer:    none ({'--no-peer' if args.no_peer else '--peers'})")
    for name, peer in PEERS.items():
        if name not in args.wanted:
            continue
        info = peer.ensure()
        if info is not None:
            peers[name].update(enabled=True, start_s={}, **{k: v for k, v in info.items() if k != "python"})
            peers[name]["_info"] = info
            print(f"peer:    {info['describe']}")
    for name in DEFAULT_PEERS:
        if args.wanted and name not in args.wanted:
            print(f"peer:    {name} not chosen (--peers {','.join(args.wanted)})")
    sys.stdout.flush()
    return peers


class Target:
    """One thing wrk measures: its port, process (None for direct), extra headers, path and Lua script."""

    def __init__(
        self, name: str, port: int, proc: Proc | None, lua: str, headers: dict | None = None, path: str = PATH
    ) -> None:
        self.name, self.port, self.proc, self.lua, self.headers, self.path = name, port, proc, lua, headers, path


def lua_for(body: str, files: dict[str, str]) -> str:
    """A wrk script sending `body` (one temp file per body, removed at the end)."""
    if body not in files:
        f = tempfile.NamedTemporaryFile("w", prefix="bench-wrk-", suffix=".lua", delete=False)  # noqa: SIM115
        f.write(WRK_LUA.replace(BODY, body))
        f.close()
        files[body] = f.name
    return files[body]


def start_targets(
    args,
    conns: int,
    up_port: int,
    nginx: str | None,
    peers: dict,
    procs: list[Proc],
    stderr_of: dict[str, str],
    luas: dict[str, str],
) -> tuple[list[Target], dict]:
    """A fresh gateway (and nginx, and peers) for one concurrency level, so its peak RSS belongs to that level.
    Returns the targets and the chunk events each streamed in its check (or None for plain)."""
    body = STREAM_BODY if args.stream else BODY  # model "bench", as tinygw and nginx take it
    words = args.stream_words
    gateway, gw_port = start_gateway(up_port)
    procs.append(gateway)
    events = {"tinygw": check_once(gw_port, "tinygw", gateway, body, words=words)}
    targets = [
        Target("direct", up_port, None, lua_for(body, luas)),
        Target("tinygw", gw_port, gateway, lua_for(body, luas)),
    ]
    if nginx is not None:
        nginx_proc, nginx_port = start_nginx(nginx, up_port)
        procs.append(nginx_proc)
        events["nginx"] = check_once(nginx_port, "nginx", nginx_proc, body, words=words)
        targets.append(Target("nginx", nginx_port, nginx_proc, lua_for(body, luas)))
    if args.tls:
        tls_gateway, tls_port = start_gateway(up_port, tls=True)
        procs.append(tls_gateway)
        events["tinygw-tls"] = check_once(tls_port, "tinygw with TLS", tls_gateway, body, words=words)
        targets.append(Target("tinygw-tls", tls_port, tls_gateway, lua_for(body, luas)))
    for name, peer in PEERS.items():
        if not peers[name]["enabled"]:
            continue
        log(f"bench: c={conns}: starting {name}" + (" (may take tens of seconds)" if name == "litellm" else ""))
        headers, peer_body = peer.headers(up_port), peer.body(args.stream)
        try:
            peer_proc, peer_port, start_s = peer.start(peers[name]["_info"], up_port)
        except RuntimeError as e:
            print(
                f"WARNING: {name} did not start or answer for c={conns}; this level runs without it: {str(e)[-3000:]}"
            )
            continue
        procs.append(peer_proc)
        try:
            events[name] = check_once(peer_port, name, peer_proc, peer_body, headers, words, peer.path)
        except RuntimeError as e:
            print(f"WARNING: {name} did not answer for c={conns}; this level runs without it: {str(e)[-3000:]}")
            stderr_of[name] += peer_proc.stderr_text()
            peer_proc.stop()
            continue
        peers[name]["start_s"][str(conns)] = start_s
        targets.append(Target(name, peer_port, peer_proc, lua_for(peer_body, luas), headers, peer.path))
        log(f"bench: c={conns}: {name} ready in {start_s:.1f} s")
    return targets, events


def run_level(args, wrk: str, conns: int, targets: list[Target], upstream: Proc, events: dict) -> dict:
    """Every target, args.repeats times in turn; the medians and the per-process accounting."""
    watch = {"upstream": upstream.pid, **{t.name: t.proc.pid for t in targets if t.proc is not None}}
    idle = {t.name: tree_usage(t.proc.pid) for t in targets if t.proc is not None}
    for name, u in idle.items():
        log(f"bench: c={conns}: {name} pids {u['pids']} (RSS {u['rss_bytes'] / 2**20:.1f} MiB idle)")
    if args.stream:
        log(
            f"bench: c={conns}: chunk events in one streamed answer: "
            + ", ".join(f"{t} {n}" for t, n in events.items())
        )
    runs: dict[str, list[dict]] = {t.name: [] for t in targets}
    for rep in range(args.repeats):
        for t in targets:
            r = measured_run(wrk, t.lua, t.port, conns, args.seconds, args.warmup, watch, t.headers, t.path)
            runs[t.name].append(r)
            log(
                f"bench: c={conns} rep {rep + 1}/{args.repeats} {t.name}: {r['rps']:,.0f} req/s, "
                f"p50 {r['p50_us']} µs, p99 {r['p99_us']} µs, errors {r['error_count']}"
            )
            for other in targets:
                if other.proc is not None and other.proc.popen.poll() is not None:
                    raise RuntimeError(
                        f"{other.proc.name} exited with {other.proc.popen.returncode} during the "
                        f"c={conns} runs:\n{other.proc.stderr_text()}"
                    )
    end = {name: tree_usage(pid) for name, pid in watch.items() if name in GATEWAYS}
    med: dict[str, dict] = {}
    for t, rs in runs.items():
        own = "upstream" if t == "direct" else t
        med[t] = {k: median([r[k] for r in rs]) for k in ("rps", "p50_us", "p99_us", "upstream_cpu_us_per_request")}
        med[t]["cpu_us_per_request"] = median([r[f"{own}_cpu_us_per_request"] for r in rs])
        med[t]["errors"] = sum(r["error_count"] for r in rs)
    # CPU a gateway burnt while the *other* targets were measured (its own timers, idle work):
    # it competes with them for the machine's CPUs, so it is recorded.
    background = {
        g: median(
            [r[f"{g}_cpu_s"] / r["duration_s"] * 100 for t, rs in runs.items() if t != g for r in rs if r["duration_s"]]
        )
        for g in end
    }
    return {
        "concurrency": conns,
        "wrk_threads": min(2, conns),
        "targets": med,
        "added_p50_ms": {g: (med[g]["p50_us"] - med["direct"]["p50_us"]) / 1000 for g in end},
        "peak_rss_bytes": {g: end[g]["hwm_bytes"] for g in end},
        "idle_rss_bytes": {g: idle[g]["rss_bytes"] for g in end},
        "pids": {g: end[g]["pids"] for g in end},
        "background_cpu_percent_of_a_core": background,
        "stream_events": events if args.stream else None,
        "runs": runs,
    }


def print_report(args, raw: dict, summary: list[dict], peers: dict, stderr_of: dict[str, str]) -> None:
    names = ["direct", "nginx", "tinygw", "tinygw-tls", *PEER_NAMES]
    described = {
        "litellm": "peer, 1 uvicorn worker",
        "portkey": "peer, Portkey's gateway, 1 node process",
        "tensorzero": "peer, TensorZero's Rust gateway from its wheel",
        "tensorzero-nodelay": "the same with TCP_NODELAY forced on its accepted sockets",
    }
    print()
    print(
        f"direct = the instant upstream; tinygw {raw['tinygw_version']} (this tree, 1 Granian worker)"
        + "".join(
            f"; {name} {peers[name]['version']} ({described[name]})" for name in PEER_NAMES if peers[name]["enabled"]
        )
    )
    print(
        f"answers: {'streamed, ' + str(STREAM_EVENTS) + ' events each (chunked)' if args.stream else 'plain'}; "
        f"gateways at the product's defaults (log level info, access log on); nginx with its access log on"
    )
    print_table(summary, names, args.stream)
    print()
    print_goals(summary, args.stream)
    print()
    print(
        "p50/p99: wrk latency percentiles. +p50: the gateway's p50 - direct p50. CPU/req: utime+stime of the "
        "gateway's process tree during its measured run / requests completed. peak RSS: VmHWM summed over "
        "that tree, at the end of the level's runs."
        + (
            " Ratios: tinygw's median / the peer's median (below 1 means tinygw's is lower: better for "
            "+p50, CPU/req and RSS, worse for req/s)."
            if any(p in s["targets"] for s in summary for p in PEERS)
            else ""
        )
    )
    for name in PEER_NAMES:
        if peers[name]["enabled"] and peers[name]["start_s"]:
            print(
                f"{name} start-up (spawn to first answered chat): "
                + ", ".join(f"c={c}: {t:.1f} s" for c, t in peers[name]["start_s"].items())
            )
    if args.stream and any("portkey" in s["targets"] for s in summary):
        print(
            "portkey: its stream reader waits 25 ms before it relays the first event of every streamed answer "
            "(readStream in its src/handlers/streamHandler.ts): most of its +p50 at c=1"
        )
    if args.stream and any(t.startswith("tensorzero") for s in summary for t in s["targets"]):
        print(
            "tensorzero: its server leaves Nagle's algorithm on for the sockets it accepts, so a stream's last "
            "small writes wait for the client's delayed ACK (~40 ms): most of its +p50 (see bench/README.md); "
            "it also merges the role event into the first word's, one event fewer"
        )
    for s in summary:
        odd = {t: n for t, n in (s["stream_events"] or {}).items() if n != STREAM_EVENTS}
        if odd:
            print(
                f"c={s['concurrency']}: chunk events in one streamed answer other than the upstream's "
                f"{STREAM_EVENTS}: "
                + ", ".join(f"{t} {n}" for t, n in odd.items())
                + f" (CPU/event divides by {STREAM_EVENTS} for every target)"
            )
    for s in summary:
        bg = {g: v for g, v in s["background_cpu_percent_of_a_core"].items() if v is not None}
        if bg and len(s["targets"]) > 2:
            print(
                f"c={s['concurrency']}: CPU used in the background while the other targets were measured: "
                + ", ".join(f"{g} {v:.1f}% of a core" for g, v in bg.items())
            )
    for s in summary:
        for t, m in s["targets"].items():
            if m["errors"]:
                print(
                    f"WARNING: c={s['concurrency']} {t}: wrk counted {m['errors']} errors "
                    "(connect/read/write/non-2xx/timeout); see --json for details"
                )
    for name, text in stderr_of.items():
        # the access log (one line a request, the product's default) is counted, not shown
        # (and the JSON fragments where a tail's limit cut a line)
        # (and TensorZero's warning for each request wrk leaves unanswered when its run ends)
        other = [
            ln
            for ln in text.splitlines()
            if '"msg":"request"' not in ln
            and "connection_drop_guard" not in ln
            and not (ln.endswith("}") and not ln.startswith("{"))
        ]
        if "\n".join(other).strip():
            print(f"--- {name} stderr (access log left out) ---\n" + "\n".join(other)[-8000:])


def main(argv: list[str] | None = None) -> int:
    global STREAM_EVENTS
    args = parse_args(argv)
    STREAM_EVENTS = args.stream_words + 2
    signal.signal(signal.SIGTERM, on_sigterm)
    command = command_line(__file__)
    print(f"command: {command}")
    print(f"machine: {machine()}")
    print(
        f"runs:    {args.warmup:g} s warm-up + {args.seconds:g} s measured, {args.repeats} repeat(s) per "
        f"configuration, median shown; POST {PATH} ({'streamed' if args.stream else 'non-streaming'}) on {HOST}"
    )
    sys.stdout.flush()
    wrk = ensure_wrk()
    wrk_version = subprocess.run([wrk, "-v"], capture_output=True, text=True, timeout=10).stdout.splitlines()
    peers = install_peers(args)
    procs: list[Proc] = []
    luas: dict[str, str] = {}
    raw: dict = {
        "command": command,
        "machine": machine(),
        "nproc": os.cpu_count(),
        "wrk": wrk_version[0] if wrk_version else "",
        "seconds": args.seconds,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "tinygw_version": tinygw_version(),
        "peers": peers,
        "levels": [],
    }
    failed = False
    stderr_of: dict[str, str] = {"tinygw": "", "tinygw-tls": "", "nginx": "", **{name: "" for name in PEERS}}
    nginx = None if args.no_nginx else ensure_nginx()
    try:
        upstream, up_port = start_upstream(args.stream_words)
        procs.append(upstream)
        check_once(up_port, "the instant upstream", None, STREAM_BODY if args.stream else BODY, words=args.stream_words)
        for conns in args.levels:
            targets, events = start_targets(args, conns, up_port, nginx, peers, procs, stderr_of, luas)
            raw["levels"].append(run_level(args, wrk, conns, targets, upstream, events))
            for t in reversed(targets):
                if t.proc is not None:
                    stderr_of[t.proc.name] += t.proc.stderr_text()
                    t.proc.stop()
        print_report(args, raw, raw["levels"], peers, stderr_of)
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
        for name in luas.values():
            os.unlink(name)
    if args.json:
        raw["failed"] = failed
        for info in peers.values():
            info.pop("_info", None)
        Path(args.json).write_text(json.dumps(raw, indent=2, default=str) + "\n")
        print(f"raw numbers: {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
