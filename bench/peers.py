"""The peers that bench/ measures tinygw beside, each installed on first use into a git-ignored folder
under bench/ and started on loopback, with its telemetry off:

- LiteLLM's proxy: `litellm[proxy]` from PyPI in bench/.venv-litellm (1 uvicorn worker, no database).
- Portkey's open-source gateway: npm `@portkey-ai/gateway` (pinned) in bench/.node-portkey, run with node.
- TensorZero's gateway: PyPI `tensorzero` (pinned; its Rust gateway ships inside the wheel) in
  bench/.venv-tensorzero, started by bench/tensorzero_gateway.py with bench/tensorzero.toml.

`PEERS` names them for the scripts: each `Peer` has an installer (`ensure`: a dict describing what is
installed, or None after printing why it cannot be had), a starter (`start`: process, port, seconds to
ready), and the path, model and headers a client uses. Imports bench/lib.py only.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from lib import BODY, HERE, HOST, PATH, ROOT, STREAM_BODY, Proc, check_once, free_port, log, wait_ready

PEER_INSTALL_TIMEOUT = 1200
PEER_START_TIMEOUT = 180


# ---- a Python peer in a venv of its own ------------------------------------------------


def ensure_venv(name: str, venv: Path, requirement: str, dist: str) -> dict | None:
    """`venv` with `requirement` pip-installed (first use only; a stamp file marks a finished install):
    {version, install_s (None if it was there), venv, python}, or None (after printing why)."""
    rel = os.path.relpath(venv, ROOT)
    py, stamp = venv / "bin" / "python", venv / ".installed"
    install_s = None
    if not (stamp.exists() and py.exists() and stamp.read_text().startswith(requirement + " ")):
        log(
            f"bench: installing the peer: python3 -m venv {rel} && pip install '{requirement}' "
            "(first use only; may take minutes)"
        )
        t0 = time.monotonic()
        python3 = shutil.which("python3") or sys.executable
        try:
            subprocess.run(
                [python3, "-m", "venv", "--clear", str(venv)],
                check=True,
                timeout=300,
                stdin=subprocess.DEVNULL,
                capture_output=True,
            )
            subprocess.run(
                [str(py), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", requirement],
                check=True,
                timeout=PEER_INSTALL_TIMEOUT,
                stdin=subprocess.DEVNULL,
                capture_output=True,
            )
        except subprocess.CalledProcessError as e:
            tail = (e.stderr or b"").decode("utf-8", "replace").strip().splitlines()[-5:]
            print(
                f"peer:    {name} could not be installed into {rel} "
                f"(exit {e.returncode}: {' | '.join(tail) or 'no output'}); running without the peer"
            )
            return None
        except (subprocess.TimeoutExpired, OSError) as e:
            print(f"peer:    {name} could not be installed into {rel} ({e}); running without the peer")
            return None
        install_s = time.monotonic() - t0
        stamp.write_text(f"{requirement} installed in {install_s:.0f} s\n")
    try:
        version = subprocess.run(
            [str(py), "-c", f"import importlib.metadata as m; print(m.version({dist!r}))"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout.strip()
    except (subprocess.SubprocessError, OSError) as e:
        print(
            f"peer:    the {name} venv {rel} is broken ({e}); running without the peer (delete that folder to "
            "reinstall)"
        )
        return None
    return {"version": version, "install_s": install_s, "venv": rel, "python": str(py)}


def _installed(info: dict) -> str:
    return f"installed now in {info['install_s']:.0f} s" if info["install_s"] is not None else "already installed"


def _start(
    proc: Proc, port: int, ready_path: str | None, peer: Peer, upstream_port: int, t0: float, retry_seconds: float = 0
) -> tuple[Proc, int, float]:
    """Wait until GET ready_path (if any) answers 200 and one plain chat request succeeds (retried for up to
    retry_seconds); the process is stopped if it does not. Returns (process, port, seconds from spawn)."""
    with proc.stopped_on_error():
        if ready_path is not None:
            wait_ready(proc, port, ready_path, PEER_START_TIMEOUT)
        deadline = time.monotonic() + retry_seconds
        while True:
            try:
                check_once(port, peer.name, proc, peer.body(False), peer.headers(upstream_port), path=peer.path)
                break
            except (RuntimeError, urllib.error.URLError, OSError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
    return proc, port, time.monotonic() - t0


# ---- LiteLLM's proxy ---------------------------------------------------------------------

LITELLM_VENV = HERE / ".venv-litellm"  # git-ignored; a benchmark-only peer, never in the project's locks
LITELLM_CLI = LITELLM_VENV / "bin" / "litellm"


def ensure_litellm() -> dict | None:
    info = ensure_venv("LiteLLM", LITELLM_VENV, "litellm[proxy]", "litellm")
    if info is not None:
        info["describe"] = (
            f"LiteLLM {info['version']} (litellm[proxy] in {info['venv']}, {_installed(info)}); "
            "1 uvicorn worker, no database, no master key"
        )
    return info


def litellm_env() -> dict[str, str]:
    """The environment LiteLLM runs in: none of ours that it reads, quiet, no telemetry, no fetch of the
    remote model cost map at start-up."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("LITELLM_", "DATABASE_", "REDIS_", "OPENAI_")) and k not in ("DIRECT_URL",)
    }
    env.update(
        LITELLM_LOG="ERROR",
        LITELLM_TELEMETRY="False",  # older releases
        LITELLM_TELEMETRY_DISABLED="True",  # current releases' veto (litellm/proxy/telemetry/settings.py)
        LITELLM_LOCAL_MODEL_COST_MAP="True",  # no fetch of the cost map from the internet at start-up
    )
    return env


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


def start_litellm(info: dict, upstream_port: int) -> tuple[Proc, int, float]:
    """`litellm --config FILE --host 127.0.0.1 --port P --num_workers 1` (uvicorn, one process); ready once
    /health/liveliness answers 200 and one chat request succeeds (which also loads the model route)."""
    port = free_port()
    tmpdir = tempfile.mkdtemp(prefix="bench-litellm-")  # its cwd too, so it reads no .env of ours
    config = Path(tmpdir) / "config.yaml"
    config.write_text(LITELLM_CONFIG.format(host=HOST, upstream_port=upstream_port))
    argv = [str(LITELLM_CLI), "--config", str(config), "--host", HOST, "--port", str(port), "--num_workers", "1"]
    t0 = time.monotonic()
    proc = Proc("litellm", argv, env=litellm_env(), cwd=tmpdir, tmpdir=tmpdir)
    return _start(proc, port, "/health/liveliness", PEERS["litellm"], upstream_port, t0, retry_seconds=30)


# ---- Portkey's open-source gateway (npm, run with node) ---------------------------------

PORTKEY = HERE / ".node-portkey" / "node_modules" / "@portkey-ai" / "gateway" / "build" / "start-server.js"
PORTKEY_VERSION = "1.15.2"

# One install for every script: the release PORTKEY_VERSION, in the git-ignored bench/.node-portkey
# (PORTKEY), made with the project's npm. The release declares "@hono/node-server": "^1.3.3", so npm
# takes the newest 1.x, whose lightweight Response (since 1.14.2, honojs/node-server#242) hands back an
# upstream fetch answer's immutable headers: Portkey's updateHeaders() then throws
# `TypeError: immutable` on every streamed answer,
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


def ensure_portkey() -> dict | None:
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
    if (
        not PORTKEY.exists()
        or _npm_version(PORTKEY.parents[1] / "package.json") != PORTKEY_VERSION
        or _portkey_hono_version() != PORTKEY_OVERRIDES["@hono/node-server"]
        or data.get("overrides") != PORTKEY_OVERRIDES
        or (data.get("dependencies") or {}).get("@portkey-ai/gateway") != PORTKEY_VERSION
    ):
        log(
            f"bench: installing the peer: npm install --prefix {rel} @portkey-ai/gateway@{PORTKEY_VERSION} with "
            f"overrides {json.dumps(PORTKEY_OVERRIDES)} (first use only)"
        )
        t0 = time.monotonic()
        data.setdefault("dependencies", {})["@portkey-ai/gateway"] = PORTKEY_VERSION  # exact, not ^
        data["overrides"] = PORTKEY_OVERRIDES
        try:
            PORTKEY_DIR.mkdir(parents=True, exist_ok=True)
            manifest.write_text(json.dumps(data, indent=2) + "\n")
            done = subprocess.run(
                [npm, "install", "--loglevel=error", "--no-audit", "--no-fund", "--prefix", str(PORTKEY_DIR)],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=PORTKEY_INSTALL_TIMEOUT,
            )
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
        print(
            f"peer:    Portkey left out: {rel} holds @portkey-ai/gateway {version} with @hono/node-server {hono}, "
            f"not {PORTKEY_VERSION} with {PORTKEY_OVERRIDES['@hono/node-server']} (delete that folder to reinstall)"
        )
        return None
    try:
        node_version = subprocess.run(
            [node, "--version"], capture_output=True, text=True, timeout=30, check=True
        ).stdout.strip()
    except (subprocess.SubprocessError, OSError) as e:
        print(f"peer:    Portkey left out: `node --version` failed ({e})")
        return None
    info = {"version": version, "node": node_version, "hono": hono, "install_s": install_s, "dir": rel}
    info["describe"] = (
        f"Portkey gateway {version} (npm @portkey-ai/gateway in {rel}, {_installed(info)}; node "
        f"{node_version}, @hono/node-server pinned to {hono}); 1 node process, its target per request "
        "in an x-portkey-config header"
    )
    return info


def portkey_headers(upstream_port: int) -> dict[str, str]:
    """Portkey takes its target per request: one OpenAI-compatible provider at the instant upstream."""
    config = {"provider": "openai", "api_key": "sk-bench", "custom_host": f"http://{HOST}:{upstream_port}/v1"}
    return {"x-portkey-config": json.dumps(config, separators=(",", ":"))}


def portkey_argv(port: int, tmpdir: str) -> list[str]:
    """`node --require loopback.cjs .../build/start-server.js --port=P --headless`, the preload written to tmpdir."""
    shim = Path(tmpdir) / "loopback.cjs"
    shim.write_text(PORTKEY_LOOPBACK_CJS)
    return [shutil.which("node") or "node", "--require", str(shim), str(PORTKEY), f"--port={port}", "--headless"]


def portkey_env() -> dict[str, str]:
    """Ours without what Portkey or node would read. Its open-source build reports no telemetry: it calls
    api.portkey.ai only for guardrails and files, which nothing here configures."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("PORTKEY_", "OPENAI_", "NODE_"))}


def start_portkey(info: dict, upstream_port: int) -> tuple[Proc, int, float]:
    """`node --require loopback.cjs .../build/start-server.js --port=P --headless` (one node process, its
    defaults otherwise; cwd a temp dir); ready once GET / answers 200 and one chat request (with the
    x-portkey-config header) succeeds."""
    port = free_port()
    tmpdir = tempfile.mkdtemp(prefix="bench-portkey-")
    t0 = time.monotonic()
    proc = Proc("portkey", portkey_argv(port, tmpdir), env=portkey_env(), cwd=tmpdir, tmpdir=tmpdir)
    return _start(proc, port, "/", PEERS["portkey"], upstream_port, t0)


# ---- TensorZero's gateway (Rust, inside its PyPI wheel) ----------------------------------

TENSORZERO_VENV = HERE / ".venv-tensorzero"  # git-ignored, like the other peers
TENSORZERO_VERSION = "2026.6.0"
TENSORZERO_CONFIG = HERE / "tensorzero.toml"  # its model's api_base has the upstream's port filled in
TENSORZERO_ENV = {
    "TENSORZERO_DISABLE_PSEUDONYMOUS_USAGE_ANALYTICS": "1",  # its "howdy" usage report, off (the config says so too)
    "TENSORZERO_HOWDY_URL": f"http://{HOST}:9/",  # and, were it ever sent, to a closed port on loopback
    "RUST_LOG": "warn",
}


def ensure_tensorzero() -> dict | None:
    info = ensure_venv("TensorZero", TENSORZERO_VENV, f"tensorzero=={TENSORZERO_VERSION}", "tensorzero")
    if info is not None:
        info["describe"] = (
            f"TensorZero {info['version']} (its Rust gateway, from the tensorzero wheel in "
            f"{info['venv']}, {_installed(info)}); bench/tensorzero.toml, observability off"
        )
    return info


def start_tensorzero(info: dict, upstream_port: int) -> tuple[Proc, int, float]:
    """bench/tensorzero_gateway.py in TensorZero's venv: `_start_http_gateway` with bench/tensorzero.toml (its
    upstream's port filled in); the port it prints once it listens; ready once one chat request succeeds."""
    name = info.get("peer", "tensorzero")
    tmpdir = tempfile.mkdtemp(prefix=f"bench-{name}-")
    config = Path(tmpdir) / "tensorzero.toml"
    config.write_text(TENSORZERO_CONFIG.read_text().replace("{upstream_port}", str(upstream_port)))
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("TENSORZERO_", "OPENAI_", "RUST_")) and k != "LD_PRELOAD"
    }
    env.update(TENSORZERO_ENV)
    if info.get("preload"):
        env["LD_PRELOAD"] = info["preload"]
    t0 = time.monotonic()
    proc = Proc(
        name,
        [info["python"], str(HERE / "tensorzero_gateway.py"), str(config)],
        env=env,
        cwd=tmpdir,
        tmpdir=tmpdir,
        stdout=subprocess.PIPE,
    )
    with proc.stopped_on_error():
        port = int(proc.read_stdout_line("tensorzero-port=", 60))
    return _start(proc, port, None, PEERS[name], upstream_port, t0, retry_seconds=30)  # it listens: up


# TensorZero as shipped leaves Nagle's algorithm on for the sockets it accepts (see bench/README.md). The
# variant `tensorzero-nodelay` (not measured unless named in --peers) runs it with this preload, which sets
# TCP_NODELAY on every socket accept() or accept4() returns: what its streams would cost without that.
NODELAY_C = """\
#define _GNU_SOURCE
#include <dlfcn.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

static int nodelay(int fd) {
    int one = 1;
    if (fd >= 0) setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    return fd;
}

int accept(int fd, struct sockaddr *addr, socklen_t *len) {
    static int (*real)(int, struct sockaddr *, socklen_t *);
    if (!real) real = dlsym(RTLD_NEXT, "accept");
    return nodelay(real(fd, addr, len));
}

int accept4(int fd, struct sockaddr *addr, socklen_t *len, int flags) {
    static int (*real)(int, struct sockaddr *, socklen_t *, int);
    if (!real) real = dlsym(RTLD_NEXT, "accept4");
    return nodelay(real(fd, addr, len, flags));
}
"""


def ensure_tensorzero_nodelay() -> dict | None:
    """TensorZero's install, and the TCP_NODELAY preload built with the system's cc beside it."""
    info = ensure_tensorzero()
    if info is None:
        return None
    source, library = TENSORZERO_VENV / "nodelay.c", TENSORZERO_VENV / "nodelay.so"
    if not library.exists() or not source.exists() or source.read_text() != NODELAY_C:
        cc = shutil.which("cc") or shutil.which("gcc")
        if cc is None:
            print("peer:    tensorzero-nodelay left out: no C compiler (cc) for its TCP_NODELAY preload")
            return None
        source.write_text(NODELAY_C)
        done = subprocess.run(
            [cc, "-shared", "-fPIC", "-O2", "-o", str(library), str(source), "-ldl"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if done.returncode != 0:
            print(f"peer:    tensorzero-nodelay left out: cc failed: {done.stderr.strip()[-500:]}")
            return None
    info.update(peer="tensorzero-nodelay", preload=str(library))
    info["describe"] += "; tensorzero-nodelay: the same, TCP_NODELAY forced on its accepted sockets (LD_PRELOAD)"
    return info


# ---- the table -------------------------------------------------------------------------


@dataclass(frozen=True)
class Peer:
    name: str
    ensure: Callable[[], dict | None]
    start: Callable[[dict, int], tuple[Proc, int, float]]
    path: str = PATH  # where a client sends a chat request
    model: str = "bench"  # the model it names
    config_header: Callable[[int], dict[str, str]] | None = field(default=None)  # per request, from the upstream's port

    def body(self, stream: bool) -> str:
        body = STREAM_BODY if stream else BODY
        return body.replace('"model":"bench"', json.dumps(self.model).join(('"model":', "")))

    def headers(self, upstream_port: int) -> dict[str, str] | None:
        return self.config_header(upstream_port) if self.config_header else None


PEERS = {
    "litellm": Peer("litellm", ensure_litellm, start_litellm),
    "portkey": Peer("portkey", ensure_portkey, start_portkey, config_header=portkey_headers),
    "tensorzero": Peer(
        "tensorzero",
        ensure_tensorzero,
        start_tensorzero,
        path="/openai/v1/chat/completions",
        model="tensorzero::model_name::bench",
    ),
    "tensorzero-nodelay": Peer(
        "tensorzero-nodelay",
        ensure_tensorzero_nodelay,
        start_tensorzero,
        path="/openai/v1/chat/completions",
        model="tensorzero::model_name::bench",
    ),
}
DEFAULT_PEERS = ("litellm", "portkey", "tensorzero")  # tensorzero-nodelay only when asked for
