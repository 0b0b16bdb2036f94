"""tinygw benchmark: an instant upstream, hit directly and through tinygw, with wrk.

Run from the repository root: `.venv/bin/python bench/run.py [--seconds N] [--repeats N]
[--peers litellm,portkey | --no-peer] [--stream] [--json PATH]` (what `make bench` does). See
bench/README.md for how to read the table. The peers are LiteLLM's proxy and Portkey's gateway.

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
import ssl
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: its outage.py, however run.py is started
from outage import PORTKEY, PORTKEY_VERSION  # noqa: E402 - Portkey's gateway: which release, and where

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
HOST = "127.0.0.1"
PATH = "/v1/chat/completions"
BODY = '{"model":"bench","messages":[{"role":"user","content":"hi"}]}'
CLK_TCK = os.sysconf("SC_CLK_TCK")

# wrk's Lua script: the request, and a done() that prints one machine-readable line.
STREAM_BODY = '{"model":"bench","stream":true,"messages":[{"role":"user","content":"hi"}]}'
STREAM_EVENTS = 22  # bench/instant_upstream.py's streamed answer: role, 20 words, finish ([DONE] aside)

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

    def __init__(self, name: str, argv: list[str], env: dict[str, str] | None = None, stdout=None,
                 cwd: Path | str = ROOT, tmpdir: str | None = None) -> None:
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


def ensure_nginx() -> str | None:
    """Debian's nginx, the reference peer (apt-get when missing); None where it cannot be had."""
    path = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
    if path:
        return path
    log("bench: nginx is not installed; installing it with apt-get (Debian package 'nginx')")
    done = subprocess.run("apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx",
                          shell=True, timeout=600, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    if done.returncode != 0:
        print(f"WARNING: nginx could not be installed; no nginx peer: {done.stderr.decode()[-500:]}")
        return None
    return shutil.which("nginx") or "/usr/sbin/nginx"


NGINX_CONF = """daemon off;
worker_processes 1;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{ worker_connections 4096; }}
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


def start_nginx(nginx: str, upstream_port: int) -> tuple[Proc, int]:
    """nginx `proxy_pass` with upstream keep-alive, one worker, access log on (its default)."""
    port = free_port()
    tmp = tempfile.mkdtemp(prefix="bench-nginx-")
    conf = Path(tmp) / "nginx.conf"
    conf.write_text(NGINX_CONF.format(tmp=tmp, host=HOST, up_port=upstream_port, port=port))
    proc = Proc("nginx", [nginx, "-p", tmp, "-c", str(conf), "-e", f"{tmp}/error.log"], tmpdir=tmp)
    try:
        wait_ready(proc, port, "/v1/models", 30)
    except BaseException:
        proc.stop()
        proc.cleanup_files()
        raise
    return proc, port


def start_upstream() -> tuple[Proc, int]:
    proc = Proc("upstream", [sys.executable, str(HERE / "instant_upstream.py"), "0", str(STREAM_EVENTS - 2)],
                stdout=subprocess.PIPE)
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


# Ports served over TLS (a gateway with TINYGW_TLS=attested); wrk and the checks use https there.
HTTPS_PORTS: set[int] = set()
UNVERIFIED_TLS = ssl.create_default_context()
UNVERIFIED_TLS.check_hostname, UNVERIFIED_TLS.verify_mode = False, ssl.CERT_NONE


def url(port: int, path: str) -> str:
    return f"{'https' if port in HTTPS_PORTS else 'http'}://{HOST}:{port}{path}"


def start_gateway(upstream_port: int, tls: bool = False) -> tuple[Proc, int]:
    port = free_port()
    if tls:
        HTTPS_PORTS.add(port)
    config = {
        "providers": {"up": {"base_url": f"http://{HOST}:{upstream_port}/v1", "api": "openai"}},
        "models": {"bench": {"targets": ["up:bench-model"]}},
    }
    env = dict(os.environ)
    env.update(
        TINYGW_HOST=HOST,
        TINYGW_PORT=str(port),
        TINYGW_LOG_LEVEL=os.environ.get("BENCH_LOG_LEVEL", "info"),  # the product's default
        TINYGW_CONFIG=json.dumps(config),
        TINYGW_DRAIN_SECONDS="2",  # bounds the shutdown at the end
        TINYGW_TLS="attested" if tls else "off",
    )
    env.pop("TINYGW_CONFIG_FILE", None)
    proc = Proc("tinygw-tls" if tls else "tinygw", [gateway_python(), "-m", "tinygw", "serve"], env=env)
    try:
        wait_ready(proc, port, "/healthz", 60)
    except BaseException:
        proc.stop()
        proc.cleanup_files()
        raise
    return proc, port


def wait_ready(proc: Proc, port: int, path: str, timeout: float) -> None:
    """Poll GET path until it answers 200, the process exits, or timeout seconds pass."""
    deadline = time.monotonic() + timeout
    last = ""
    while True:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode} before it was ready:\n"
                               f"{proc.stderr_text()}")
        try:
            with urllib.request.urlopen(url(port, path), timeout=2, context=UNVERIFIED_TLS) as r:
                if r.status == 200:
                    return
                last = f"status {r.status}"
        except (urllib.error.URLError, OSError) as e:
            last = str(e)
        if time.monotonic() > deadline:
            raise RuntimeError(f"{proc.name} did not answer GET {path} with 200 within {timeout:g} s "
                               f"(last: {last}):\n{proc.stderr_text()}")
        time.sleep(0.1)


# ---- the peer: LiteLLM's proxy, in a venv of its own ---------------------------------

PEER_VENV = HERE / ".venv-litellm"  # git-ignored; a benchmark-only peer, never in the project's locks
PEER_STAMP = PEER_VENV / ".installed"
PEER_INSTALL_TIMEOUT = 1200
PEER_START_TIMEOUT = 180


def ensure_litellm() -> tuple[Path, str, float | None] | None:
    """bench/.venv-litellm with `litellm[proxy]`: (its litellm CLI, version, install seconds or None if
    it was already there), or None (after printing why) if it cannot be had."""
    bin_dir = PEER_VENV / "bin"
    cli, py = bin_dir / "litellm", bin_dir / "python"
    install_s = None
    if not (PEER_STAMP.exists() and cli.exists() and py.exists()):
        log(f"bench: installing the peer: python3 -m venv {os.path.relpath(PEER_VENV, ROOT)} && "
            "pip install 'litellm[proxy]' (first use only; may take minutes)")
        t0 = time.monotonic()
        python3 = shutil.which("python3") or sys.executable
        try:
            subprocess.run([python3, "-m", "venv", "--clear", str(PEER_VENV)], check=True, timeout=300,
                           stdin=subprocess.DEVNULL, capture_output=True)
            subprocess.run([str(py), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                            "litellm[proxy]"], check=True, timeout=PEER_INSTALL_TIMEOUT,
                           stdin=subprocess.DEVNULL, capture_output=True)
        except subprocess.CalledProcessError as e:
            tail = (e.stderr or b"").decode("utf-8", "replace").strip().splitlines()[-5:]
            print(f"peer:    LiteLLM could not be installed into {os.path.relpath(PEER_VENV, ROOT)} "
                  f"(exit {e.returncode}: {' | '.join(tail) or 'no output'}); running without the peer")
            return None
        except (subprocess.TimeoutExpired, OSError) as e:
            print(f"peer:    LiteLLM could not be installed into {os.path.relpath(PEER_VENV, ROOT)} ({e}); "
                  "running without the peer")
            return None
        install_s = time.monotonic() - t0
        PEER_STAMP.write_text(f"litellm[proxy] installed in {install_s:.0f} s\n")
    try:
        version = subprocess.run([str(py), "-c", "import importlib.metadata as m; print(m.version('litellm'))"],
                                 capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    except (subprocess.SubprocessError, OSError) as e:
        print(f"peer:    the LiteLLM venv {os.path.relpath(PEER_VENV, ROOT)} is broken ({e}); running without "
              f"the peer (delete that folder to reinstall)")
        return None
    return cli, version, install_s


# LiteLLM's proxy config: the same instant upstream, as an OpenAI-compatible model named `bench`. No
# master key, like tinygw here (which needs no inbound key on loopback): LiteLLM refuses to start without
# one unless told that this is deliberate; with one it would also check the key on every request.
LITELLM_CONFIG = """\
model_list:
  - model_name: bench
    litellm_params:
      model: openai/bench-model
      api_base: http://{host}:{upstream_port}/v1
      api_key: dummy
general_settings:
  dangerously_permit_weak_or_unset_master_key: true
"""


def start_litellm(cli: Path, upstream_port: int) -> tuple[Proc, int, float]:
    """`litellm --config FILE --host 127.0.0.1 --port P --num_workers 1` (uvicorn, one process), quiet, no
    database, no telemetry, no fetch of the remote model cost map; ready once /health/liveliness answers
    200 and one chat request succeeds. Returns (process, port, seconds from spawn to ready)."""
    port = free_port()
    tmpdir = tempfile.mkdtemp(prefix="bench-litellm-")  # its cwd too, so it reads no .env of ours
    config = Path(tmpdir) / "config.yaml"
    config.write_text(LITELLM_CONFIG.format(host=HOST, upstream_port=upstream_port))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("LITELLM_", "DATABASE_", "REDIS_", "OPENAI_")) and k not in ("DIRECT_URL",)}
    env.update(
        LITELLM_LOG="ERROR",
        LITELLM_TELEMETRY="False",           # older releases
        LITELLM_TELEMETRY_DISABLED="True",   # current releases' veto (litellm/proxy/telemetry/settings.py)
        LITELLM_LOCAL_MODEL_COST_MAP="True",  # no fetch of the cost map from the internet at start-up
    )
    argv = [str(cli), "--config", str(config), "--host", HOST, "--port", str(port), "--num_workers", "1"]
    t0 = time.monotonic()
    proc = Proc("litellm", argv, env=env, cwd=tmpdir, tmpdir=tmpdir)
    try:
        wait_ready(proc, port, "/health/liveliness", PEER_START_TIMEOUT)
        deadline = time.monotonic() + 30
        while True:  # the first chat request, which also loads the model route
            try:
                check_once(port, "litellm", proc)
                break
            except (RuntimeError, urllib.error.URLError, OSError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
    except BaseException:
        proc.stop()
        proc.cleanup_files()
        raise
    return proc, port, time.monotonic() - t0


# ---- the second peer: Portkey's open-source gateway (npm, run with node) ----------------

# One install for run.py and outage.py: the release outage.py names (PORTKEY_VERSION), where it looks
# for it (PORTKEY, in the git-ignored bench/.node-portkey), made here with the project's npm. The
# release declares "@hono/node-server": "^1.3.3", so npm takes the newest 1.x, whose lightweight
# Response (since 1.14.2, honojs/node-server#242) hands back an upstream fetch answer's immutable
# headers: Portkey's updateHeaders() then throws `TypeError: immutable` on every streamed answer,
# which the client sees as a 500 {"status":"failure","message":"Something went wrong"}
# (Portkey-AI/gateway issues #1389 and #1550). So the install is pinned, with npm overrides, to the
# release before that change, and to the @hono/node-ws whose peer range allows it (the newest wants
# node-server ^1.19.11).
PORTKEY_DIR = PORTKEY.parents[4]  # bench/.node-portkey (…/node_modules/@portkey-ai/gateway/build/start-server.js)
PORTKEY_OVERRIDES = {"@hono/node-server": "1.14.1", "@hono/node-ws": "1.2.0"}
PORTKEY_INSTALL_TIMEOUT = 600

# Portkey's start-server.js has no host option: its server listens on every interface. This
# preload makes a listen() without a host listen on loopback only.
PORTKEY_LOOPBACK_CJS = """\
const net = require("net");
const listen = net.Server.prototype.listen;
net.Server.prototype.listen = function (...args) {
  if (args[0] !== null && typeof args[0] === "object" && args[0].path === undefined && args[0].host == null) {
    args[0] = { ...args[0], host: %s };
  } else if (typeof args[0] === "number" || (typeof args[0] === "string" && /^\\d+$/.test(args[0]))) {
    if (args[1] === undefined || args[1] === null) args[1] = %s;
    else if (typeof args[1] !== "string") args.splice(1, 0, %s);
  }
  return listen.apply(this, args);
};
""" % ((json.dumps(HOST),) * 3)


def _npm_version(package_json: Path) -> str | None:
    try:
        return json.loads(package_json.read_text()).get("version")
    except (OSError, ValueError, AttributeError):
        return None


def _portkey_hono_version() -> str | None:
    """The @hono/node-server that Portkey's build resolves: its own nested copy first, else the hoisted one."""
    for base in (PORTKEY.parents[1] / "node_modules", PORTKEY_DIR / "node_modules"):
        version = _npm_version(base / "@hono" / "node-server" / "package.json")
        if version:
            return version
    return None


def ensure_portkey_peer() -> dict | None:
    """Portkey's gateway PORTKEY_VERSION in bench/.node-portkey, pinned as above (npm install on first
    use, or when the folder holds something else): {version, node, hono, install_s, dir}, or None
    (after printing why: Portkey is then left out) if it cannot be had."""
    rel = os.path.relpath(PORTKEY_DIR, ROOT)
    node, npm = shutil.which("node"), shutil.which("npm")
    if not node or not npm:
        print(f"peer:    Portkey left out: {'node' if not node else 'npm'} is not on PATH")
        return None
    manifest = PORTKEY_DIR / "package.json"
    try:
        data = json.loads(manifest.read_text())
        if not isinstance(data, dict):
            data = {}
    except (OSError, ValueError):
        data = {}
    install_s = None
    if (not PORTKEY.exists() or _npm_version(PORTKEY.parents[1] / "package.json") != PORTKEY_VERSION
            or _portkey_hono_version() != PORTKEY_OVERRIDES["@hono/node-server"]
            or data.get("overrides") != PORTKEY_OVERRIDES
            or (data.get("dependencies") or {}).get("@portkey-ai/gateway") != PORTKEY_VERSION):
        log(f"bench: installing the peer: npm install --prefix {rel} @portkey-ai/gateway@{PORTKEY_VERSION} with "
            f"overrides {json.dumps(PORTKEY_OVERRIDES)} (first use only)")
        t0 = time.monotonic()
        data.setdefault("dependencies", {})["@portkey-ai/gateway"] = PORTKEY_VERSION  # exact, not ^
        data["overrides"] = PORTKEY_OVERRIDES
        try:
            PORTKEY_DIR.mkdir(parents=True, exist_ok=True)
            manifest.write_text(json.dumps(data, indent=2) + "\n")
            done = subprocess.run([npm, "install", "--loglevel=error", "--no-audit", "--no-fund", "--prefix", str(PORTKEY_DIR)],
                                  stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                  timeout=PORTKEY_INSTALL_TIMEOUT)
        except (subprocess.SubprocessError, OSError) as e:
            print(f"peer:    Portkey left out: npm install into {rel} failed ({e})")
            return None
        if done.returncode != 0:
            tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-5:]) or "no output"
            print(f"peer:    Portkey left out: npm install into {rel} failed (exit {done.returncode}: {tail})")
            return None
        install_s = time.monotonic() - t0
    version, hono = _npm_version(PORTKEY.parents[1] / "package.json"), _portkey_hono_version()
    if not PORTKEY.exists() or version != PORTKEY_VERSION or hono != PORTKEY_OVERRIDES["@hono/node-server"]:
        print(f"peer:    Portkey left out: {rel} holds @portkey-ai/gateway {version} with @hono/node-server {hono}, "
              f"not {PORTKEY_VERSION} with {PORTKEY_OVERRIDES['@hono/node-server']} (delete that folder to reinstall)")
        return None
    try:
        node_version = subprocess.run([node, "--version"], capture_output=True, text=True, timeout=30,
                                      check=True).stdout.strip()
    except (subprocess.SubprocessError, OSError) as e:
        print(f"peer:    Portkey left out: `node --version` failed ({e})")
        return None
    return {"version": version, "node": node_version, "hono": hono, "install_s": install_s, "dir": rel}


def portkey_headers(upstream_port: int) -> dict[str, str]:
    """Portkey takes its target per request: one OpenAI-compatible provider at the instant upstream."""
    config = {"provider": "openai", "api_key": "sk-bench", "custom_host": f"http://{HOST}:{upstream_port}/v1"}
    return {"x-portkey-config": json.dumps(config, separators=(",", ":"))}


def start_portkey(upstream_port: int, body: str) -> tuple[Proc, int, float]:
    """`node --require loopback.cjs .../build/start-server.js --port=P --headless` (one node process, its
    defaults otherwise; cwd a temp dir); ready once GET / answers 200 and one chat request (`body`,
    with the x-portkey-config header) succeeds. Returns (process, port, seconds from spawn to ready)."""
    port = free_port()
    tmpdir = tempfile.mkdtemp(prefix="bench-portkey-")
    shim = Path(tmpdir) / "loopback.cjs"
    shim.write_text(PORTKEY_LOOPBACK_CJS)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PORTKEY_", "OPENAI_", "NODE_"))}
    argv = [shutil.which("node") or "node", "--require", str(shim), str(PORTKEY), f"--port={port}", "--headless"]
    t0 = time.monotonic()
    proc = Proc("portkey", argv, env=env, cwd=tmpdir, tmpdir=tmpdir)
    try:
        wait_ready(proc, port, "/", PEER_START_TIMEOUT)
        check_once(port, "portkey", proc, body, portkey_headers(upstream_port))
    except BaseException:
        proc.stop()
        proc.cleanup_files()
        raise
    return proc, port, time.monotonic() - t0


STREAM_TEXT = "".join(f" word{i}" for i in range(STREAM_EVENTS - 2))  # what the instant upstream streams


def check_once(port: int, what: str, proc: Proc | None, body: str = BODY,
               headers: dict[str, str] | None = None) -> int | None:
    """One request before measuring, so a broken setup fails loudly, not as a fast table. A streamed
    answer must be SSE whose chunks carry the upstream's whole text, then `data: [DONE]`; returns how
    many chunk events it had (None for a plain answer)."""
    req = urllib.request.Request(url(port, PATH), data=body.encode(), method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    ctype = ""
    try:
        with urllib.request.urlopen(req, timeout=10, context=UNVERIFIED_TLS) as r:
            status, answer, ctype = r.status, r.read(), r.headers.get("content-type", "")
    except urllib.error.HTTPError as e:
        status, answer = e.code, e.read()
    problem = None
    if status != 200 or b"chat.completion" not in answer:
        problem = f"answered {status}"
    elif body == STREAM_BODY:
        events = [line[5:].strip() for line in answer.decode("utf-8", "replace").splitlines()
                  if line.startswith("data:")]
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
        elif problem is None and text != STREAM_TEXT:
            problem = f"streamed the text {text[:200]!r}, not the upstream's"
        if problem is None:
            return len(events) - 1
    if problem is None:
        return None
    extra = f"\n--- {proc.name} stderr ---\n{proc.stderr_text()}" if proc else ""
    raise RuntimeError(f"{what}: POST {PATH} {problem}: {answer[:500]!r}{extra}")


def run_wrk(wrk: str, lua: str, port: int, conns: int, seconds: float, headers: dict[str, str] | None = None) -> dict:
    threads = min(2, conns)
    extra = [a for k, v in (headers or {}).items() for a in ("-H", f"{k}: {v}")]  # wrk adds them to wrk.headers
    argv = [wrk, f"-t{threads}", f"-c{conns}", f"-d{seconds:g}s", "--timeout", "10s", "-s", lua, *extra,
            url(port, PATH)]
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


def measured_run(wrk, lua, port, conns, seconds, warmup, watch: dict[str, int],
                 headers: dict[str, str] | None = None) -> dict:
    """Warm up, then one measured run; CPU deltas of each watched process tree."""
    if warmup > 0:
        run_wrk(wrk, lua, port, conns, warmup, headers)
    before = {name: tree_usage(pid) for name, pid in watch.items()}
    result = run_wrk(wrk, lua, port, conns, seconds, headers)
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


PEERS = ("litellm", "portkey")  # --peers: the other gateways, beside tinygw and nginx
GATEWAYS = ("tinygw", "tinygw-tls", *PEERS, "nginx")


def ratio(a, b) -> str:
    return "-" if a is None or b is None or b <= 0 or a < 0 else f"{a / b:.3g}x"


def print_goals(summary: list[dict], stream: bool) -> None:
    """Issue 11's goals, each from this run, marked met or not."""
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


def print_table(summary: list[dict], names: list[str], stream: bool = False) -> None:
    head = ["conc", "target", "req/s", "p50 (ms)", "p99 (ms)", "+p50 (ms)", "CPU/req (µs)", "peak RSS (MiB)",
            "wrk errors"] + (["CPU/event (µs)"] if stream else [])
    rows = []
    for s in summary:
        for t in names:
            m = s["targets"].get(t)
            if m is None:
                continue
            gw = t in GATEWAYS
            rss = s["peak_rss_bytes"].get(t)
            rows.append([
                str(s["concurrency"]), t,
                fmt(m["rps"], ",.0f"),
                fmt(m["p50_us"] / 1000, ".3f"), fmt(m["p99_us"] / 1000, ".3f"),
                fmt(s["added_p50_ms"].get(t), "+.3f") if gw else "-",
                fmt(m["cpu_us_per_request"], ",.0f") if gw else "-",
                fmt(rss / 2**20 if rss is not None else None, ".1f") if gw else "-",
                str(m["errors"]),
            ] + ([fmt(m["cpu_us_per_request"] / STREAM_EVENTS, ".1f") if gw and m["cpu_us_per_request"] else "-"]
                 if stream else []))
    _print_rows(head, rows)
    pairs = [(s, peer) for s in summary for peer in PEERS if peer in s["targets"] and "tinygw" in s["targets"]]
    if pairs:
        print()
        head = ["conc", "tinygw / peer", "req/s", "+p50", "CPU/req", "peak RSS"]
        rows = []
        for s, peer in pairs:
            g, l = s["targets"]["tinygw"], s["targets"][peer]
            rows.append([str(s["concurrency"]), f"tinygw / {peer}", ratio(g["rps"], l["rps"]),
                         ratio(s["added_p50_ms"]["tinygw"], s["added_p50_ms"][peer]),
                         ratio(g["cpu_us_per_request"], l["cpu_us_per_request"]),
                         ratio(s["peak_rss_bytes"]["tinygw"], s["peak_rss_bytes"][peer])])
        _print_rows(head, rows)


def _print_rows(head: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    aligns = [str.ljust if h in ("target", "tinygw / peer") else str.rjust for h in head]
    line = "  ".join(al(h, w) for h, w, al in zip(head, widths, aligns))
    print(line)
    print("-" * len(line))
    for r in rows:
        print("  ".join(al(c, w) for c, w, al in zip(r, widths, aligns)))


def tinygw_version() -> str:
    try:
        for line in (ROOT / "tinygw" / "__init__.py").read_text().splitlines():
            if line.startswith("__version__"):
                return line.split("=", 1)[1].strip().strip("\"'")
    except OSError:
        pass
    return "?"


# ---- main ---------------------------------------------------------------------------


def _on_sigterm(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    global STREAM_EVENTS, STREAM_TEXT
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=5.0, help="length of each measured run (default 5)")
    ap.add_argument("--warmup", type=float, default=1.0, help="warm-up before each measured run (default 1)")
    ap.add_argument("--repeats", type=int, default=3, help="measured runs per configuration; median reported (3)")
    ap.add_argument("--concurrency", default="1,32",
                    help="comma-separated connection counts (default 1,32); wrk threads = min(2, c)")
    ap.add_argument("--peers", default=",".join(PEERS),
                    help="comma-separated peers measured beside tinygw and nginx (default litellm,portkey): "
                         "LiteLLM's proxy (pip, into bench/.venv-litellm) and Portkey's gateway (npm, into "
                         "bench/.node-portkey), each installed on first use; '' for none")
    ap.add_argument("--no-peer", action="store_true", help="no peers at all (the same as --peers '')")
    ap.add_argument("--json", metavar="PATH", help="also write the raw numbers as JSON to PATH")
    ap.add_argument("--stream", action="store_true",
                    help="streamed answers (stream: true; 22 events, chunked) instead of plain ones; adds CPU/event")
    ap.add_argument("--stream-words", type=int, default=20, metavar="N",
                    help="words in a streamed answer (default 20: 22 events); a run with more shows what one more "
                         "event costs, without the request's own cost")
    ap.add_argument("--no-nginx", action="store_true", help="skip the nginx peer (Debian's nginx, proxy_pass)")
    ap.add_argument("--tls", action="store_true",
                    help="also measure tinygw with attested TLS (TINYGW_TLS=attested; wrk over https, keep-alive)")
    args = ap.parse_args(argv)
    if args.stream_words < 1:
        ap.error("--stream-words must be at least 1")
    STREAM_EVENTS = args.stream_words + 2
    STREAM_TEXT = "".join(f" word{i}" for i in range(STREAM_EVENTS - 2))
    if args.seconds <= 0 or args.repeats < 1 or args.warmup < 0:
        ap.error("--seconds must be > 0, --repeats >= 1, --warmup >= 0")
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if not levels or min(levels) < 1:
        ap.error("--concurrency needs positive integers")
    wanted = [] if args.no_peer else [p.strip() for p in args.peers.split(",") if p.strip()]
    if set(wanted) - set(PEERS):
        ap.error(f"--peers: unknown {', '.join(sorted(set(wanted) - set(PEERS)))} (known: {', '.join(PEERS)})")

    signal.signal(signal.SIGTERM, _on_sigterm)
    command = shlex.join([os.path.relpath(sys.executable, ROOT) if sys.executable.startswith(str(ROOT))
                          else sys.executable, os.path.relpath(__file__, ROOT), *sys.argv[1:]])
    print(f"command: {command}")
    print(f"machine: {machine()}")
    print(f"runs:    {args.warmup:g} s warm-up + {args.seconds:g} s measured, {args.repeats} repeat(s) per "
          f"configuration, median shown; POST {PATH} ({'streamed' if args.stream else 'non-streaming'}) on {HOST}")
    sys.stdout.flush()

    wrk = ensure_wrk()
    wrk_version = subprocess.run([wrk, "-v"], capture_output=True, text=True, timeout=10).stdout.splitlines()
    # The peers: what each is (raw["peers"]), only those that could be had are enabled.
    peers: dict[str, dict] = {name: {"enabled": False, "chosen": name in wanted} for name in PEERS}
    litellm_cli = None
    if not wanted:
        print(f"peer:    none ({'--no-peer' if args.no_peer else '--peers'})")
    if "litellm" in wanted:
        got = ensure_litellm()
        if got is not None:
            litellm_cli, version, install_s = got
            peers["litellm"].update(enabled=True, version=version, venv=os.path.relpath(PEER_VENV, ROOT),
                                    install_s=install_s, start_s={})
            how = f"installed now in {install_s:.0f} s" if install_s is not None else "already installed"
            print(f"peer:    LiteLLM {version} (litellm[proxy] in {peers['litellm']['venv']}, {how}); "
                  "1 uvicorn worker, no database, no master key")
    if "portkey" in wanted:
        got = ensure_portkey_peer()
        if got is not None:
            peers["portkey"].update(enabled=True, start_s={}, **got)
            how = f"installed now in {got['install_s']:.0f} s" if got["install_s"] is not None else "already installed"
            print(f"peer:    Portkey gateway {got['version']} (npm @portkey-ai/gateway in {got['dir']}, {how}; "
                  f"node {got['node']}, @hono/node-server pinned to {got['hono']}); 1 node process, its target "
                  "per request in an x-portkey-config header")
    for name in PEERS:
        if wanted and name not in wanted:
            print(f"peer:    {name} not chosen (--peers {','.join(wanted)})")
    sys.stdout.flush()
    procs: list[Proc] = []
    lua_file = tempfile.NamedTemporaryFile("w", prefix="bench-wrk-", suffix=".lua", delete=False)
    body = STREAM_BODY if args.stream else BODY
    lua_file.write(WRK_LUA.replace(BODY, body))
    lua_file.close()
    raw: dict = {"command": command, "machine": machine(), "nproc": os.cpu_count(),
                 "wrk": wrk_version[0] if wrk_version else "", "seconds": args.seconds, "warmup": args.warmup,
                 "repeats": args.repeats, "tinygw_version": tinygw_version(), "peers": peers, "levels": []}
    failed = False
    stderr_of: dict[str, str] = {"tinygw": "", "tinygw-tls": "", "nginx": "", **{name: "" for name in PEERS}}
    nginx = None if args.no_nginx else ensure_nginx()
    try:
        upstream, up_port = start_upstream()
        procs.append(upstream)
        check_once(up_port, "the instant upstream", None, body)
        summary = []
        for conns in levels:
            # A fresh gateway (and peer) per concurrency level, so its peak RSS belongs to that level.
            gateway, gw_port = start_gateway(up_port)
            procs.append(gateway)
            events = {"tinygw": check_once(gw_port, "tinygw", gateway, body)}
            # (name, port, process, extra request headers)
            targets: list[tuple[str, int, Proc | None, dict | None]] = [
                ("direct", up_port, None, None), ("tinygw", gw_port, gateway, None)]
            watch = {"upstream": upstream.pid, "tinygw": gateway.pid}
            idle = {"tinygw": tree_usage(gateway.pid)}
            if nginx is not None:
                nginx_proc, nginx_port = start_nginx(nginx, up_port)
                procs.append(nginx_proc)
                events["nginx"] = check_once(nginx_port, "nginx", nginx_proc, body)
                targets.append(("nginx", nginx_port, nginx_proc, None))
                watch["nginx"] = nginx_proc.pid
                idle["nginx"] = tree_usage(nginx_proc.pid)
            if args.tls:
                tls_gateway, tls_port = start_gateway(up_port, tls=True)
                procs.append(tls_gateway)
                events["tinygw-tls"] = check_once(tls_port, "tinygw with TLS", tls_gateway, body)
                targets.append(("tinygw-tls", tls_port, tls_gateway, None))
                watch["tinygw-tls"] = tls_gateway.pid
                idle["tinygw-tls"] = tree_usage(tls_gateway.pid)
            for name in PEERS:
                if not peers[name]["enabled"]:
                    continue
                log(f"bench: c={conns}: starting {name}" + (" (may take tens of seconds)" if name == "litellm" else ""))
                headers = portkey_headers(up_port) if name == "portkey" else None
                peer_proc = None
                try:
                    if name == "litellm":
                        peer_proc, peer_port, start_s = start_litellm(litellm_cli, up_port)
                        procs.append(peer_proc)
                    else:
                        peer_proc, peer_port, start_s = start_portkey(up_port, body)
                        procs.append(peer_proc)
                    events[name] = check_once(peer_port, name, peer_proc, body, headers)  # this run's body
                except RuntimeError as e:
                    print(f"WARNING: {name} did not start or answer for c={conns}; this level runs without it: "
                          f"{str(e)[-3000:]}")
                    if peer_proc is not None:
                        stderr_of[name] += peer_proc.stderr_text()
                        peer_proc.stop()
                    continue
                peers[name]["start_s"][str(conns)] = start_s
                targets.append((name, peer_port, peer_proc, headers))
                watch[name] = peer_proc.pid
                idle[name] = tree_usage(peer_proc.pid)
                log(f"bench: c={conns}: {name} ready in {start_s:.1f} s")
            for name, u in idle.items():
                log(f"bench: c={conns}: {name} pids {u['pids']} (RSS {u['rss_bytes'] / 2**20:.1f} MiB idle)")
            if args.stream:
                log(f"bench: c={conns}: chunk events in one streamed answer: "
                    + ", ".join(f"{t} {n}" for t, n in events.items()))
            runs: dict[str, list[dict]] = {t: [] for t, _, _, _ in targets}
            for rep in range(args.repeats):
                for target, port, proc, headers in targets:
                    r = measured_run(wrk, lua_file.name, port, conns, args.seconds, args.warmup, watch, headers)
                    runs[target].append(r)
                    log(f"bench: c={conns} rep {rep + 1}/{args.repeats} {target}: {r['rps']:,.0f} req/s, "
                        f"p50 {r['p50_us']} µs, p99 {r['p99_us']} µs, errors {r['error_count']}")
                    for _, _, p, _ in targets:
                        if p is not None and p.popen.poll() is not None:
                            raise RuntimeError(f"{p.name} exited with {p.popen.returncode} during the c={conns} "
                                               f"runs:\n{p.stderr_text()}")
            end = {name: tree_usage(pid) for name, pid in watch.items() if name in GATEWAYS}
            med: dict[str, dict] = {}
            for t, rs in runs.items():
                own = "upstream" if t == "direct" else t
                med[t] = {k: median([r[k] for r in rs]) for k in ("rps", "p50_us", "p99_us",
                                                                   "upstream_cpu_us_per_request")}
                med[t]["cpu_us_per_request"] = median([r[f"{own}_cpu_us_per_request"] for r in rs])
                med[t]["errors"] = sum(r["error_count"] for r in rs)
            # CPU a gateway burnt while the *other* targets were measured (its own timers, idle work):
            # it competes with them for the machine's CPUs, so it is recorded.
            background = {}
            for g in end:
                other = [r[f"{g}_cpu_s"] / r["duration_s"] * 100 for t, rs in runs.items() if t != g for r in rs
                         if r["duration_s"]]
                background[g] = median(other)
            level = {
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
            summary.append(level)
            raw["levels"].append(level)
            for _, _, p, _ in reversed(targets):
                if p is not None:
                    stderr_of[p.name] += p.stderr_text()
                    p.stop()
        names = ["direct", "nginx", "tinygw", "tinygw-tls", *PEERS]
        print()
        print(f"direct = the instant upstream; tinygw {raw['tinygw_version']} (this tree, 1 Granian worker)"
              + (f"; litellm {peers['litellm']['version']} (peer, 1 uvicorn worker)" if peers["litellm"]["enabled"]
                 else "")
              + (f"; portkey {peers['portkey']['version']} (peer, Portkey's gateway, 1 node process)"
                 if peers["portkey"]["enabled"] else ""))
        print(f"answers: {'streamed, ' + str(STREAM_EVENTS) + ' events each (chunked)' if args.stream else 'plain'}; "
              f"gateways at the product's defaults (log level info, access log on); nginx with its access log on")
        print_table(summary, names, args.stream)
        print()
        print_goals(summary, args.stream)
        print()
        print("p50/p99: wrk latency percentiles. +p50: the gateway's p50 - direct p50. CPU/req: utime+stime of the "
              "gateway's process tree during its measured run / requests completed. peak RSS: VmHWM summed over "
              "that tree, at the end of the level's runs."
              + (" Ratios: tinygw's median / the peer's median (below 1 means tinygw's is lower: better for "
                 "+p50, CPU/req and RSS, worse for req/s)." if any(p in s["targets"] for s in summary for p in PEERS)
                 else ""))
        for name in PEERS:
            if peers[name]["enabled"] and peers[name]["start_s"]:
                print(f"{name} start-up (spawn to first answered chat): "
                      + ", ".join(f"c={c}: {t:.1f} s" for c, t in peers[name]["start_s"].items()))
        if args.stream and any("portkey" in s["targets"] for s in summary):
            print("portkey: its stream reader waits 25 ms before it relays the first event of every streamed answer "
                  "(readStream in its src/handlers/streamHandler.ts): most of its +p50 at c=1")
        for s in summary:
            odd = {t: n for t, n in (s["stream_events"] or {}).items() if n != STREAM_EVENTS}
            if odd:
                print(f"c={s['concurrency']}: chunk events in one streamed answer other than the upstream's "
                      f"{STREAM_EVENTS}: " + ", ".join(f"{t} {n}" for t, n in odd.items())
                      + f" (CPU/event divides by {STREAM_EVENTS} for every target)")
        for s in summary:
            bg = {g: v for g, v in s["background_cpu_percent_of_a_core"].items() if v is not None}
            if bg and len(s["targets"]) > 2:
                print(f"c={s['concurrency']}: CPU used in the background while the other targets were measured: "
                      + ", ".join(f"{g} {v:.1f}% of a core" for g, v in bg.items()))
        for s in summary:
            for t, m in s["targets"].items():
                if m["errors"]:
                    print(f"WARNING: c={s['concurrency']} {t}: wrk counted {m['errors']} errors "
                          "(connect/read/write/non-2xx/timeout); see --json for details")
        for name, text in stderr_of.items():
            # the access log (one line a request, the product's default) is counted, not shown
            lines = text.splitlines()
            # (and the JSON fragments where a tail's limit cut a line)
            other = [ln for ln in lines if '"msg":"request"' not in ln
                     and not (ln.endswith("}") and not ln.startswith("{"))]
            if "\n".join(other).strip():
                print(f"--- {name} stderr (access log left out) ---\n" + "\n".join(other)[-8000:])
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
