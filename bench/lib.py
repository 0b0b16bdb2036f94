"""The benchmarks' library: processes, their CPU and memory, wrk, and the targets they all share.

Imported by bench/run.py, bytecodes.py, floor.py, overhead.py, outage.py, neighbours.py, soak.py,
artifact.py, large_answers.py, sealed_bodies.py, streams.py, stream_runs.py, neighbour_clients.py and
peers.py; imports none of them. What is here:

- `Proc`: a child in a process group of its own, stopped with its whole tree (`stopped_on_error` while
  it gets ready); `wait_ready`.
- `/proc` accounting: `descendants`, `tree_usage` (CPU seconds, VmHWM and VmRSS of a tree).
- `free_port`, `url`, `check_once` (one request before measuring, so a broken setup fails loudly).
- wrk: `ensure_wrk`, `WRK_LUA`, `run_wrk` (one run, parsed), `measured_run` (warm-up, run, CPU deltas).
- the targets: `start_upstream` (bench/instant_upstream.py), `start_gateway` (tinygw at its
  defaults, with `bench_config` or a configuration of the caller's), `ensure_nginx`/`start_nginx`
  (`apt_install`, as for wrk).
- the report: `median`, `machine`, `fmt`, `print_rows`, `tinygw_version`.

Everything listens on 127.0.0.1; every wait has a deadline.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shlex
import shutil
import signal
import socket
import ssl
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
STREAM_BODY = '{"model":"bench","stream":true,"messages":[{"role":"user","content":"hi"}]}'
STREAM_EVENTS = 22  # bench/instant_upstream.py's streamed answer: role, 20 words, finish ([DONE] aside)

# wrk's Lua script: the request, and a done() that prints one machine-readable line.
WRK_LUA = (
    """
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
"""  # noqa: UP031 (a Lua script full of braces: %-formatting leaves them alone)
    % BODY
)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- processes ----------------------------------------------------------------------


class Proc:
    """A child in a new session (so its own process group), output to temp files."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str] | None = None,
        stdout=None,
        cwd: Path | str = ROOT,
        tmpdir: str | None = None,
    ) -> None:
        self.name = name
        self.tmpdir = tmpdir  # removed by cleanup_files()
        self.err_file = tempfile.NamedTemporaryFile(prefix=f"bench-{name}-", suffix=".stderr", delete=False)
        self.popen = subprocess.Popen(
            argv,
            cwd=cwd,
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

    def read_stdout_line(self, prefix: str, timeout: float) -> str:
        """The rest of the first line on its stdout (a pipe) that starts with prefix; RuntimeError if the process
        exits or timeout seconds pass first."""
        os.set_blocking(self.popen.stdout.fileno(), False)
        deadline, data = time.monotonic() + timeout, b""
        while True:
            lines = data.split(b"\n")
            for line in lines[:-1]:
                if line.startswith(prefix.encode()):
                    return line[len(prefix) :].decode().strip()
            if time.monotonic() > deadline or self.popen.poll() is not None:
                raise RuntimeError(
                    f"{self.name} did not print {prefix or 'its port'!r} within {timeout:g} s:\n{self.stderr_text()}"
                )
            chunk = self.popen.stdout.read()
            if chunk:
                data += chunk
            else:
                time.sleep(0.02)

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

    @contextlib.contextmanager
    def stopped_on_error(self):
        """For the block that waits for it to get ready: if that raises (or is interrupted), stop it, remove its
        files and re-raise (the errors of wait_ready and read_stdout_line already carry its stderr)."""
        try:
            yield self
        except BaseException:
            self.stop()
            self.cleanup_files()
            raise

    def cleanup_files(self) -> None:
        try:
            os.unlink(self.err_file.name)
        except OSError:
            pass
        if self.tmpdir:
            shutil.rmtree(self.tmpdir, ignore_errors=True)


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


def apt_install(package: str) -> str | None:
    """`apt-get update`, then `apt-get install PACKAGE` (Debian's): None, or the end of what failed said."""
    log(f"bench: {package} is not installed; installing it with apt-get (Debian package {package!r})")
    environment = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", package]):
        done = subprocess.run(command, env=environment, timeout=600, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        if done.returncode != 0:
            return done.stderr.decode("utf-8", "replace")[-500:]
    return None


def ensure_wrk() -> str:
    path = shutil.which("wrk")
    if path:
        return path
    failed = apt_install("wrk")
    path = shutil.which("wrk")
    if not path:
        raise SystemExit(f"bench: wrk is still not on PATH after apt-get install: {failed or 'no error'}")
    return path


def ensure_nginx() -> str | None:
    """Debian's nginx, the reference peer (apt-get when missing); None where it cannot be had."""
    path = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
    if path:
        return path
    failed = apt_install("nginx")
    if failed is not None:
        print(f"WARNING: nginx could not be installed; no nginx peer: {failed}")
        return None
    return shutil.which("nginx") or "/usr/sbin/nginx"


NGINX_CONF = """daemon off;
worker_processes 1;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{ worker_connections {worker_connections}; }}
http {{
    access_log {tmp}/access.log;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    upstream up {{ server {host}:{up_port}; keepalive 64; }}
    server {{
        listen {host}:{port};
        location / {{
            proxy_pass http://up;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}
}}
"""


def start_nginx(nginx: str, upstream_port: int, worker_connections: int = 4096) -> tuple[Proc, int]:
    """nginx `proxy_pass` with upstream keep-alive, one worker, access log on (its default); a relayed
    stream takes two of its `worker_connections` (the client's and the upstream's)."""
    port = free_port()
    tmp = tempfile.mkdtemp(prefix="bench-nginx-")
    conf = Path(tmp) / "nginx.conf"
    conf.write_text(
        NGINX_CONF.format(tmp=tmp, host=HOST, up_port=upstream_port, port=port, worker_connections=worker_connections)
    )
    proc = Proc("nginx", [nginx, "-p", tmp, "-c", str(conf), "-e", f"{tmp}/error.log"], tmpdir=tmp)
    with proc.stopped_on_error():
        wait_ready(proc, port, "/v1/models", 30)
    return proc, port


def start_upstream(words: int = STREAM_EVENTS - 2) -> tuple[Proc, int]:
    """bench/instant_upstream.py on a free port, `words` words in a streamed answer (`words` + 2 events)."""
    proc = Proc(
        "upstream", [sys.executable, str(HERE / "instant_upstream.py"), "0", str(words)], stdout=subprocess.PIPE
    )
    with proc.stopped_on_error():
        return proc, int(proc.read_stdout_line("", 15))


def gateway_python() -> str:
    venv = ROOT / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


# Ports served over TLS (a gateway with TINYGW_TLS=attested); wrk and the checks use https there.
HTTPS_PORTS: set[int] = set()
UNVERIFIED_TLS = ssl.create_default_context()
UNVERIFIED_TLS.check_hostname, UNVERIFIED_TLS.verify_mode = False, ssl.CERT_NONE


def url(port: int, path: str) -> str:
    return f"{'https' if port in HTTPS_PORTS else 'http'}://{HOST}:{port}{path}"


def bench_config(upstream_port: int) -> dict:
    """The gateway's configuration in every benchmark: one provider `up` at the upstream, one model
    `bench` -> `up:bench-model`."""
    return {
        "providers": {"up": {"base_url": f"http://{HOST}:{upstream_port}/v1", "api": "openai"}},
        "models": {"bench": {"targets": ["up:bench-model"]}},
    }


def start_gateway(
    upstream_port: int, tls: bool = False, config: dict | None = None, extra_env: dict[str, str] | None = None
) -> tuple[Proc, int]:
    """tinygw at its defaults in front of the upstream (`bench_config`, or `config`); `extra_env` is set
    last, over the defaults here."""
    port = free_port()
    if tls:
        HTTPS_PORTS.add(port)
    config = config if config is not None else bench_config(upstream_port)
    env = dict(os.environ)
    env.update(
        TINYGW_HOST=HOST,
        TINYGW_PORT=str(port),
        TINYGW_LOG_LEVEL=os.environ.get("BENCH_LOG_LEVEL", "info"),  # the product's default
        TINYGW_CONFIG=json.dumps(config),
        TINYGW_DRAIN_SECONDS="2",  # bounds the shutdown at the end
        # One, as the peers it is measured beside (the product's default is one per CPU); BENCH_WORKERS
        # to compare builds at another count.
        TINYGW_WORKERS=os.environ.get("BENCH_WORKERS", "1"),
        TINYGW_TLS="attested" if tls else "off",
    )
    env.update(extra_env or {})
    env.pop("TINYGW_CONFIG_FILE", None)
    proc = Proc("tinygw-tls" if tls else "tinygw", [gateway_python(), "-m", "tinygw", "serve"], env=env)
    with proc.stopped_on_error():
        wait_ready(proc, port, "/healthz", 60)
    return proc, port


def wait_ready(proc: Proc, port: int, path: str, timeout: float) -> None:
    """Poll GET path until it answers 200, the process exits, or timeout seconds pass."""
    deadline = time.monotonic() + timeout
    last = ""
    while True:
        if proc.popen.poll() is not None:
            raise RuntimeError(
                f"{proc.name} exited with {proc.popen.returncode} before it was ready:\n{proc.stderr_text()}"
            )
        try:
            with urllib.request.urlopen(url(port, path), timeout=2, context=UNVERIFIED_TLS) as r:
                if r.status == 200:
                    return
                last = f"status {r.status}"
        except (urllib.error.URLError, OSError) as e:
            last = str(e)
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{proc.name} did not answer GET {path} with 200 within {timeout:g} s "
                f"(last: {last}):\n{proc.stderr_text()}"
            )
        time.sleep(0.1)


def stream_text(words: int) -> str:
    """What bench/instant_upstream.py streams with `words` words."""
    return "".join(f" word{i}" for i in range(words))


def check_once(
    port: int,
    what: str,
    proc: Proc | None,
    body: str = BODY,
    headers: dict[str, str] | None = None,
    words: int = STREAM_EVENTS - 2,
    path: str = PATH,
) -> int | None:
    """One request before measuring, so a broken setup fails loudly, not as a fast table. A streamed
    answer must be SSE whose chunks carry the upstream's whole text (`words` words), then `data: [DONE]`;
    returns how many chunk events it had (None for a plain answer)."""
    req = urllib.request.Request(
        url(port, path),
        data=body.encode(),
        method="POST",
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    ctype = ""
    try:
        with urllib.request.urlopen(req, timeout=10, context=UNVERIFIED_TLS) as r:
            status, answer, ctype = r.status, r.read(), r.headers.get("content-type", "")
    except urllib.error.HTTPError as e:
        status, answer = e.code, e.read()
    problem = None
    if status != 200 or b"chat.completion" not in answer:
        problem = f"answered {status}"
    elif '"stream":true' in body:
        events = [
            line[5:].strip() for line in answer.decode("utf-8", "replace").splitlines() if line.startswith("data:")
        ]
        text = ""
        try:
            for data in events[:-1]:
                for choice in json.loads(data).get("choices") or []:
                    text += (choice.get("delta") or {}).get("content") or ""
        except (ValueError, AttributeError) as e:
            problem = f"streamed an event that is not a JSON chunk ({e})"
        if problem is None and not ctype.startswith("text/event-stream"):
            problem = f"streamed with content-type {ctype!r}"
        elif problem is None and (not events or events[-1] != "[DONE]"):
            problem = "streamed no final `data: [DONE]`"
        elif problem is None and text != stream_text(words):
            problem = f"streamed the text {text[:200]!r}, not the upstream's"
        if problem is None:
            return len(events) - 1
    if problem is None:
        return None
    extra = f"\n--- {proc.name} stderr ---\n{proc.stderr_text()}" if proc else ""
    raise RuntimeError(f"{what}: POST {path} {problem}: {answer[:500]!r}{extra}")


def run_wrk(
    wrk: str, lua: str, port: int, conns: int, seconds: float, headers: dict[str, str] | None = None, path: str = PATH
) -> dict:
    threads = min(2, conns)
    extra = [a for k, v in (headers or {}).items() for a in ("-H", f"{k}: {v}")]  # wrk adds them to wrk.headers
    argv = [
        wrk,
        f"-t{threads}",
        f"-c{conns}",
        f"-d{seconds:g}s",
        "--timeout",
        "10s",
        "-s",
        lua,
        *extra,
        url(port, path),
    ]
    proc = subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=seconds + 30)
    except subprocess.TimeoutExpired:
        _signal_group(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=5)
        raise RuntimeError(f"wrk did not end within {seconds + 30:g} s: {shlex.join(argv)}") from None
    finally:
        if proc.poll() is None:
            _signal_group(proc.pid, signal.SIGKILL)
    text = out.decode("utf-8", "replace")
    line = next((ln for ln in text.splitlines() if ln.startswith("BENCH ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(
            f"wrk failed (exit {proc.returncode}): {shlex.join(argv)}\n{text}\n{err.decode('utf-8', 'replace')}"
        )
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


def measured_run(
    wrk,
    lua,
    port,
    conns,
    seconds,
    warmup,
    watch: dict[str, int],
    headers: dict[str, str] | None = None,
    path: str = PATH,
) -> dict:
    """Warm up, then one measured run; CPU deltas of each watched process tree."""
    if warmup > 0:
        run_wrk(wrk, lua, port, conns, warmup, headers, path)
    before = {name: tree_usage(pid) for name, pid in watch.items()}
    result = run_wrk(wrk, lua, port, conns, seconds, headers, path)
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
    return (
        f"nproc={os.cpu_count()} ({len(os.sched_getaffinity(0))} usable), {model or platform.machine()}{mem}, "
        f"Linux {platform.release()}, Python {platform.python_version()}"
    )


def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_rows(head: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    aligns = [str.ljust if h in ("target", "tinygw / peer") else str.rjust for h in head]
    line = "  ".join(al(h, w) for h, w, al in zip(head, widths, aligns, strict=True))
    print(line)
    print("-" * len(line))
    for r in rows:
        print("  ".join(al(c, w) for c, w, al in zip(r, widths, aligns, strict=True)))


def tinygw_version() -> str:
    try:
        for line in (ROOT / "tinygw" / "__init__.py").read_text().splitlines():
            if line.startswith("__version__"):
                return line.split("=", 1)[1].strip().strip("\"'")
    except OSError:
        pass
    return "?"
