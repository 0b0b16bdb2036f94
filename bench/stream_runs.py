"""The runs of `make bench-streams` (bench/streams.py) and `make bench-interfaces` (bench/interfaces.py): the
paced upstream, a target, the load generator (bench/stream_clients.py) started over C streams and its results
merged, one measured run with the target's CPU and memory, the check before it, and a run's summary.

Imported by bench/streams.py (which re-exports what bench/interfaces.py takes from it); imports no script.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: its library, however this is imported
from lib import HERE, HOST, PATH, STREAM_BODY, Proc, tree_usage  # noqa: E402
from report import hist_percentile, percentile  # noqa: E402

GENERATOR = HERE / "stream_clients.py"
QUICK_EVENTS = 3  # the check before measuring: a stream of this many events (max_tokens)


def start_paced_upstream(args, fast: bool = False) -> tuple[Proc, int]:
    argv = [sys.executable, str(HERE / "paced_upstream.py"), "--events", str(args.events)]
    argv += ["--interval-ms", f"{args.interval_ms:g}"] + (["--fast"] if fast else [])
    proc = Proc("fast-upstream" if fast else "paced-upstream", argv, stdout=subprocess.PIPE)
    with proc.stopped_on_error():
        return proc, int(proc.read_stdout_line("", 15))


class Target:
    """One thing the generator streams from: its port, process (None: the upstream itself), path, body, headers."""

    def __init__(
        self, name: str, port: int, proc: Proc | None, path: str = PATH, body: str = STREAM_BODY, headers=None
    ):
        self.name, self.port, self.proc, self.path, self.body, self.headers = name, port, proc, path, body, headers


def generate(
    args,
    t: Target,
    streams: int,
    *,
    events: int,
    ramp: float,
    seconds: float,
    deadline: float,
    slow: bool = False,
    generators: int = 1,
) -> dict:
    """Start the load generator (`generators` processes sharing the streams), each bounded by the deadline."""
    t_start = time.monotonic() + 1.0  # the processes' start-up first
    base = {
        "host": HOST,
        "port": t.port,
        "path": t.path,
        "body": t.body,
        "headers": t.headers or {},
        "ramp_s": ramp,
        "seconds": seconds,
        "stream_s": events * args.interval_ms / 1000,
        "events": events,
        "deadline_s": deadline,
        "slow": slow,
        "slow_bytes": args.slow_bytes,
        "t_start": t_start,
    }
    n = max(1, min(generators, streams))
    children = []
    for j in range(n):
        out = tempfile.NamedTemporaryFile(prefix="bench-streams-", suffix=".json", delete=False)  # noqa: SIM115
        err = tempfile.TemporaryFile(prefix="bench-streams-")  # noqa: SIM115
        p = {**base, "streams": streams // n + (1 if j < streams % n else 0), "phase_s": ramp * j / streams}
        p["out"] = out.name
        out.close()
        child = subprocess.Popen(
            [sys.executable, str(GENERATOR), json.dumps(p)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,
        )
        children.append((child, p["out"], err))
    return {"children": children, "t_start": t_start, "deadline": deadline}


def collect(job: dict) -> dict:
    merged = {
        "streams": 0,
        "intact": 0,
        "events": 0,
        "failures": {},
        "examples": [],
        "first_us": [],
        "delay_hist": {},
        "slow_read": [],
        "cpu_s": 0.0,
        "elapsed_s": 0.0,
        "nofile": None,
    }
    for child, out, err in job["children"]:
        try:
            child.wait(timeout=max(1.0, job["t_start"] + job["deadline"] + 30 - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait(timeout=5)
        try:
            r = json.loads(Path(out).read_text())
        except (OSError, ValueError):
            err.seek(0)
            raise RuntimeError(
                f"the load generator failed (exit {child.returncode}): {err.read().decode('utf-8', 'replace')[-3000:]}"
            ) from None
        finally:
            err.close()
            with contextlib.suppress(OSError):
                os.unlink(out)
        for k in ("streams", "intact", "events", "cpu_s"):
            merged[k] += r[k]
        for k, v in r["failures"].items():
            merged["failures"][k] = merged["failures"].get(k, 0) + v
        for k, v in r["delay_hist"].items():
            merged["delay_hist"][int(k)] = merged["delay_hist"].get(int(k), 0) + v
        merged["examples"] += r["examples"]
        merged["first_us"] += r["first_us"]
        merged["slow_read"] += r["slow_read"]
        merged["elapsed_s"] = max(merged["elapsed_s"], r["elapsed_s"])
        merged["nofile"] = r["nofile"]
    merged["generators"] = len(job["children"])
    return merged


def measure(args, t: Target, streams: int, upstream: Proc, slow: bool = False) -> dict:
    """One run against t: the generator's results, t's tree CPU delta and RSS (sampled every 0.25 s) beside idle."""
    stream_s = args.events * args.interval_ms / 1000
    if slow:
        kw = {"events": 0, "ramp": 0.0, "seconds": args.slow_seconds, "deadline": args.slow_seconds, "slow": True}
    else:
        kw = {
            "events": args.events,
            "ramp": args.ramp,
            "seconds": args.seconds,
            "deadline": args.ramp + max(args.seconds, stream_s) + args.grace,
            "generators": args.generators,
        }
    watch = t.proc.pid if t.proc is not None else upstream.pid
    idle = tree_usage(watch)
    up0 = tree_usage(upstream.pid)
    job = generate(args, t, streams, **kw)
    peak = idle["rss_bytes"]
    samples = []
    while any(c.poll() is None for c, _, _ in job["children"]):
        u = tree_usage(watch)
        peak = max(peak, u["rss_bytes"])
        samples.append((time.monotonic() - job["t_start"], u["rss_bytes"]))
        time.sleep(0.25)
    end = tree_usage(watch)
    up1 = tree_usage(upstream.pid)
    r = collect(job)
    r.update(
        target=t.name,
        expected_events=kw["events"],
        concurrency=streams,
        idle_rss_bytes=idle["rss_bytes"],
        peak_rss_bytes=peak,
        rss_samples=samples,
        cpu_s=end["cpu_s"] - idle["cpu_s"],
        generator_cpu_s=r["cpu_s"],
        upstream_cpu_s=up1["cpu_s"] - up0["cpu_s"],
        pids=end["pids"],
    )
    if t.proc is not None and t.proc.popen.poll() is not None:
        raise RuntimeError(f"{t.name} exited with {t.proc.popen.returncode} during its run:\n{t.proc.stderr_text()}")
    return r


def check(args, t: Target) -> str | None:
    """A stream of QUICK_EVENTS events through t before measuring: None, or what went wrong."""
    quick = Target(
        t.name,
        t.port,
        t.proc,
        t.path,
        t.body.replace('"stream":true', f'"stream":true,"max_tokens":{QUICK_EVENTS}'),
        t.headers,
    )
    job = generate(args, quick, 1, events=QUICK_EVENTS, ramp=0.0, seconds=0.0, deadline=15.0)
    r = collect(job)
    if r["intact"] == 1:
        return None
    return f"{r['failures']} {r['examples']}"


def summarize(r: dict) -> dict:
    """Per run: first event p50/p99 (ms; a stream that had none counts as infinitely late), delivery p99 (ms; an
    event that never came, of a stream cut or broken, counts as infinitely late too), RSS per stream (bytes),
    CPU ms per 1,000 relayed events."""
    firsts = sorted(r["first_us"]) + [math.inf] * (r["streams"] - len(r["first_us"]))
    ms = [v / 1000 for v in firsts]
    missing = max(0, r["streams"] * r["expected_events"] - r["events"])
    delivery = hist_percentile(r["delay_hist"], 99, missing)
    return {
        "intact": r["intact"],
        "streams": r["streams"],
        "first_p50_ms": percentile(ms, 50),
        "first_p99_ms": percentile(ms, 99),
        "missing_events": missing,
        "delivery_p99_ms": delivery / 1000 if delivery is not None else None,
        "rss_per_stream_bytes": (r["peak_rss_bytes"] - r["idle_rss_bytes"]) / r["concurrency"],
        "cpu_ms_per_1k_events": r["cpu_s"] * 1e6 / r["events"] if r["events"] else None,
        "events": r["events"],
        "generator_core": r["generator_cpu_s"] / r["elapsed_s"] if r["elapsed_s"] else None,
        "upstream_core": r["upstream_cpu_s"] / r["elapsed_s"] if r["elapsed_s"] else None,
        "target_core": r["cpu_s"] / r["elapsed_s"] if r["elapsed_s"] else None,
    }
