"""tinygw benchmark: an instant upstream, hit directly and through tinygw, with wrk.

Run from the repository root: `.venv/bin/python bench/run.py [--seconds N] [--repeats N]
[--json PATH]` (what `make bench` does). See bench/README.md for how to read the table.

Everything listens on 127.0.0.1 only. Every process this script starts runs in a
process group of its own and is killed on the way out, whatever happened; every wait
has a deadline. It is a benchmark, not a test: it reports numbers and judges none.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
HOST = "127.0.0.1"
PATH = "/v1/chat/completions"
BODY = '{"model":"bench","messages":[{"role":"user","content":"hi"}]}'
CLK_TCK = os.sysconf("SC_CLK_TCK")

# wrk's Lua script: the request, and a done() that prints one machine-readable line.
WRK_LUA = """
wrk.method = "POST"
wrk.body = '%s'
wrk.headers["Content-Type"] = "application/json"

done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "BENCH requests=%%d duration_us=%%d p50_us=%%d p99_us=%%d mean_us=%%d max_us=%%d"
    .. " connect=%%d read=%%d write=%%d status=%%d timeout=%%d\\n",
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
    latency.mean, latency.max, e.connect, e.read, e.write, e.status, e.timeout))
end
""" % BODY


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- processes ----------------------------------------------------------------------


class Proc:
    """A child in a new session (so its own process group), output to temp files."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str] | None = None, stdout=None) -> None:
        self.name = name
        self.err_file = tempfile.NamedTemporaryFile(prefix=f"bench-{name}-", suffix=".stderr", delete=False)
        self.popen = subprocess.Popen(
            argv,
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=stdout if stdout is not None else subprocess.DEVNULL,
            stderr=self.err_file,
            start_new_session=True,
        )
        self.pid = self.popen.pid

    def stderr_text(self, limit: int = 20000) -> str:
        try:
            data = Path(self.err_file.name).read_bytes()
        except OSError:
            return ""
        return data[-limit:].decode("utf-8", "replace")

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM the process group (and any descendant that left it), then SIGKILL."""
        tree = descendants(self.pid)
        if self.popen.poll() is None or tree:
            _signal_group(self.pid, signal.SIGTERM)
            for pid in tree:
                _signal(pid, signal.SIGTERM)
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline:
                if self.popen.poll() is not None and not any(_alive(p) for p in tree):
                    break
                time.sleep(0.05)
            _signal_group(self.pid, signal.SIGKILL)
            for pid in tree:
                if _alive(pid):
                    _signal(pid, signal.SIGKILL)
        try:
            self.popen.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        self.err_file.close()

    def cleanup_files(self) -> None:
        try:
            os.unlink(self.err_file.name)
        except OSError:
            pass


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _alive(pid: int) -> bool:
    stat = _read_stat(pid)
    return stat is not None and stat[0] != "Z"


# ---- /proc --------------------------------------------------------------------------


def _read_stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the ")" that closes comm: [state, ppid, ...]."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rindex(")") + 2 :].split()


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _read_stat(int(entry))
            if stat is not None:
                children.setdefault(int(stat[1]), []).append(int(entry))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def tree_usage(root: int) -> dict:
    """CPU seconds (utime+stime) and VmHWM/VmRSS (bytes), summed over root and descendants."""
    cpu, hwm, rss, pids = 0.0, 0, 0, []
    for pid in [root, *descendants(root)]:
        stat = _read_stat(pid)
        if stat is None:
            continue
        pids.append(pid)
        # stat fields 14 and 15 (utime, stime) are at 11 and 12 counting from state (field 3).
        cpu += (int(stat[11]) + int(stat[12])) / CLK_TCK
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    hwm += int(line.split()[1]) * 1024
                elif line.startswith("VmRSS:"):
                    rss += int(line.split()[1]) * 1024
        except OSError:
            pass
    return {"cpu_s": cpu, "hwm_bytes": hwm, "rss_bytes": rss, "pids": pids}


# ---- helpers ------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def ensure_wrk() -> str:
    path = shutil.which("wrk")
    if path:
        return path
    log("bench: wrk is not on PATH; installing it with apt-get (Debian package 'wrk')")
    subprocess.run("apt-get update -qq && apt-get install -y -qq wrk", shell=True, check=True, timeout=600,
                   stdout=subprocess.DEVNULL)
    path = shutil.which("wrk")
    if not path:
        raise SystemExit("bench: wrk is still not on PATH after apt-get install")
    return path


def start_upstream() -> tuple[Proc, int]:
    proc = Proc("upstream", [sys.executable, str(HERE / "instant_upstream.py"), "0"], stdout=subprocess.PIPE)
    os.set_blocking(proc.popen.stdout.fileno(), False)
    deadline, data = time.monotonic() + 15, b""
    while b"\n" not in data:
        if time.monotonic() > deadline or proc.popen.poll() is not None:
            raise RuntimeError(f"the instant upstream did not start:\n{proc.stderr_text()}")
        chunk = proc.popen.stdout.read()
        if chunk:
            data += chunk
        else:
            time.sleep(0.02)
    return proc, int(data.split(b"\n", 1)[0])


def gateway_python() -> str:
    venv = ROOT / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def start_gateway(upstream_port: int) -> tuple[Proc, int]:
    port = free_port()
    config = {
        "providers": {"up": {"base_url": f"http://{HOST}:{upstream_port}/v1", "api": "openai"}},
        "models": {"bench": {"targets": ["up:bench-model"]}},
    }
    env = dict(os.environ)
    env.update(
        TINYGW_HOST=HOST,
        TINYGW_PORT=str(port),
        TINYGW_LOG_LEVEL="warning",
        TINYGW_CONFIG=json.dumps(config),
        TINYGW_DRAIN_SECONDS="2",  # bounds the shutdown at the end
    )
    env.pop("TINYGW_CONFIG_FILE", None)
    proc = Proc("gateway", [gateway_python(), "-m", "tinygw", "serve"], env=env)
    deadline = time.monotonic() + 60
    last = ""
    while True:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"tinygw exited with {proc.popen.returncode} before it was healthy:\n"
                               f"{proc.stderr_text()}")
        try:
            with urllib.request.urlopen(f"http://{HOST}:{port}/healthz", timeout=2) as r:
                if r.status == 200:
                    break
                last = f"status {r.status}"
        except (urllib.error.URLError, OSError) as e:
            last = str(e)
        if time.monotonic() > deadline:
            raise RuntimeError(f"tinygw did not answer GET /healthz with 200 within 60 s (last: {last}):\n"
                               f"{proc.stderr_text()}")
        time.sleep(0.1)
    return proc, port


def check_once(port: int, what: str, gateway: Proc | None) -> None:
    """One request before measuring, so a broken setup fails loudly, not as a fast table."""
    req = urllib.request.Request(f"http://{HOST}:{port}{PATH}", data=BODY.encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            status, body = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, body = e.code, e.read()
    if status != 200 or b"chat.completion" not in body:
        extra = f"\n--- tinygw stderr ---\n{gateway.stderr_text()}" if gateway else ""
        raise RuntimeError(f"{what}: POST {PATH} answered {status}: {body[:500]!r}{extra}")


def run_wrk(wrk: str, lua: str, port: int, conns: int, seconds: float) -> dict:
    threads = min(2, conns)
    argv = [wrk, f"-t{threads}", f"-c{conns}", f"-d{seconds:g}s", "--timeout", "10s", "-s", lua,
            f"http://{HOST}:{port}{PATH}"]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=seconds + 30)
    except subprocess.TimeoutExpired:
        _signal_group(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=5)
        raise RuntimeError(f"wrk did not end within {seconds + 30:g} s: {shlex.join(argv)}")
    finally:
        if proc.poll() is None:
            _signal_group(proc.pid, signal.SIGKILL)
    text = out.decode("utf-8", "replace")
    line = next((l for l in text.splitlines() if l.startswith("BENCH ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"wrk failed (exit {proc.returncode}): {shlex.join(argv)}\n{text}\n"
                           f"{err.decode('utf-8', 'replace')}")
    fields = {k: int(v) for k, v in (kv.split("=") for kv in line.split()[1:])}
    duration = fields["duration_us"] / 1e6
    errors = {k: fields[k] for k in ("connect", "read", "write", "status", "timeout")}
    return {
        "requests": fields["requests"],
        "duration_s": duration,
        "rps": fields["requests"] / duration if duration else 0.0,
        "p50_us": fields["p50_us"],
        "p99_us": fields["p99_us"],
        "mean_us": fields["mean_us"],
        "max_us": fields["max_us"],
        "errors": errors,
        "error_count": sum(errors.values()),
        "wrk_argv": argv,
    }


def measured_run(wrk, lua, port, conns, seconds, warmup, watch: dict[str, int]) -> dict:
    """Warm up, then one measured run; CPU deltas of each watched process tree."""
    if warmup > 0:
        run_wrk(wrk, lua, port, conns, warmup)
    before = {name: tree_usage(pid) for name, pid in watch.items()}
    result = run_wrk(wrk, lua, port, conns, seconds)
    after = {name: tree_usage(pid) for name, pid in watch.items()}
    for name in watch:
        cpu = after[name]["cpu_s"] - before[name]["cpu_s"]
        result[f"{name}_cpu_s"] = cpu
        result[f"{name}_cpu_us_per_request"] = cpu * 1e6 / result["requests"] if result["requests"] else None
    return result


# ---- report -------------------------------------------------------------------------


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def machine() -> str:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        kb = int(Path("/proc/meminfo").read_text().split("\n", 1)[0].split()[1])
        mem = f", {kb / 1024 / 1024:.1f} GiB RAM"
    except (OSError, ValueError, IndexError):
        pass
    return (f"nproc={os.cpu_count()} ({len(os.sched_getaffinity(0))} usable), {model or platform.machine()}{mem}, "
            f"Linux {platform.release()}, Python {platform.python_version()}")


def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(summary: list[dict]) -> None:
    head = ["conc", "req/s direct", "req/s tinygw", "p50 direct", "p50 tinygw", "p99 direct", "p99 tinygw",
            "+p50 (ms)", "gw CPU/req (µs)", "gw peak RSS (MiB)"]
    rows = []
    for s in summary:
        d, g = s["direct"], s["tinygw"]
        rows.append([
            str(s["concurrency"]),
            fmt(d["rps"], ",.0f"), fmt(g["rps"], ",.0f"),
            fmt(d["p50_us"] / 1000, ".3f") + " ms", fmt(g["p50_us"] / 1000, ".3f") + " ms",
            fmt(d["p99_us"] / 1000, ".3f") + " ms", fmt(g["p99_us"] / 1000, ".3f") + " ms",
            fmt(s["added_p50_ms"], "+.3f"),
            fmt(g["gateway_cpu_us_per_request"], ",.0f"),
            fmt(s["gateway_peak_rss_bytes"] / 2**20, ".1f"),
        ])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    line = "  ".join(h.rjust(w) for h, w in zip(head, widths))
    print(line)
    print("-" * len(line))
    for r in rows:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))


# ---- main ---------------------------------------------------------------------------


def _on_sigterm(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=5.0, help="length of each measured run (default 5)")
    ap.add_argument("--warmup", type=float, default=1.0, help="warm-up before each measured run (default 1)")
    ap.add_argument("--repeats", type=int, default=3, help="measured runs per configuration; median reported (3)")
    ap.add_argument("--concurrency", default="1,32",
                    help="comma-separated connection counts (default 1,32); wrk threads = min(2, c)")
    ap.add_argument("--json", metavar="PATH", help="also write the raw numbers as JSON to PATH")
    args = ap.parse_args(argv)
    if args.seconds <= 0 or args.repeats < 1 or args.warmup < 0:
        ap.error("--seconds must be > 0, --repeats >= 1, --warmup >= 0")
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if not levels or min(levels) < 1:
        ap.error("--concurrency needs positive integers")

    signal.signal(signal.SIGTERM, _on_sigterm)
    command = shlex.join([os.path.relpath(sys.executable, ROOT) if sys.executable.startswith(str(ROOT))
                          else sys.executable, os.path.relpath(__file__, ROOT), *sys.argv[1:]])
    print(f"command: {command}")
    print(f"machine: {machine()}")
    print(f"runs:    {args.warmup:g} s warm-up + {args.seconds:g} s measured, {args.repeats} repeat(s) per "
          f"configuration, median shown; POST {PATH} (non-streaming) on {HOST}")
    sys.stdout.flush()

    wrk = ensure_wrk()
    wrk_version = subprocess.run([wrk, "-v"], capture_output=True, text=True, timeout=10).stdout.splitlines()
    procs: list[Proc] = []
    lua_file = tempfile.NamedTemporaryFile("w", prefix="bench-wrk-", suffix=".lua", delete=False)
    lua_file.write(WRK_LUA)
    lua_file.close()
    raw: dict = {"command": command, "machine": machine(), "nproc": os.cpu_count(),
                 "wrk": wrk_version[0] if wrk_version else "", "seconds": args.seconds, "warmup": args.warmup,
                 "repeats": args.repeats, "levels": []}
    failed = False
    gateway_stderr = ""
    try:
        upstream, up_port = start_upstream()
        procs.append(upstream)
        check_once(up_port, "the instant upstream", None)
        summary = []
        for conns in levels:
            # A fresh gateway per concurrency level, so its peak RSS belongs to that level.
            gateway, gw_port = start_gateway(up_port)
            procs.append(gateway)
            check_once(gw_port, "tinygw", gateway)
            idle = tree_usage(gateway.pid)
            log(f"bench: c={conns}: tinygw pids {idle['pids']} (RSS {idle['rss_bytes'] / 2**20:.1f} MiB idle)")
            runs: dict[str, list[dict]] = {"direct": [], "tinygw": []}
            watch = {"gateway": gateway.pid, "upstream": upstream.pid}
            for rep in range(args.repeats):
                for target, port in (("direct", up_port), ("tinygw", gw_port)):
                    r = measured_run(wrk, lua_file.name, port, conns, args.seconds, args.warmup, watch)
                    runs[target].append(r)
                    log(f"bench: c={conns} rep {rep + 1}/{args.repeats} {target}: {r['rps']:,.0f} req/s, "
                        f"p50 {r['p50_us']} µs, p99 {r['p99_us']} µs, errors {r['error_count']}")
                    if gateway.popen.poll() is not None:
                        raise RuntimeError(f"tinygw exited with {gateway.popen.returncode} during the c={conns} "
                                           f"runs:\n{gateway.stderr_text()}")
            end = tree_usage(gateway.pid)
            med = {t: {k: median([r[k] for r in rs]) for k in
                       ("rps", "p50_us", "p99_us", "gateway_cpu_us_per_request", "upstream_cpu_us_per_request")}
                   for t, rs in runs.items()}
            for t, rs in runs.items():
                med[t]["errors"] = sum(r["error_count"] for r in rs)
            level = {
                "concurrency": conns,
                "wrk_threads": min(2, conns),
                "direct": med["direct"],
                "tinygw": med["tinygw"],
                "added_p50_ms": (med["tinygw"]["p50_us"] - med["direct"]["p50_us"]) / 1000,
                "gateway_peak_rss_bytes": end["hwm_bytes"],
                "gateway_idle_rss_bytes": idle["rss_bytes"],
                "gateway_pids": end["pids"],
                "runs": runs,
            }
            summary.append(level)
            raw["levels"].append(level)
            gateway_stderr += gateway.stderr_text()
            gateway.stop()
        print()
        print_table(summary)
        print()
        print("p50/p99: wrk latency percentiles. +p50: tinygw p50 - direct p50. gw CPU/req: utime+stime of the "
              "tinygw process tree (server + Granian workers) during the measured run / requests completed. "
              "gw peak RSS: VmHWM summed over that tree, at the end of the level's runs.")
        errors = [(s["concurrency"], t, s[t]["errors"]) for s in summary for t in ("direct", "tinygw")
                  if s[t]["errors"]]
        for conns, target, n in errors:
            print(f"WARNING: c={conns} {target}: wrk counted {n} errors (connect/read/write/non-2xx/timeout); "
                  "see --json for details")
        if gateway_stderr.strip():
            print(f"--- tinygw stderr ---\n{gateway_stderr[-8000:]}")
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
        os.unlink(lua_file.name)
    if args.json:
        raw["failed"] = failed
        Path(args.json).write_text(json.dumps(raw, indent=2) + "\n")
        print(f"raw numbers: {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
