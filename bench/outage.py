"""`make bench-outage`: what a provider outage costs the clients of a gateway.

A primary provider fails in one of three ways, then recovers; a fallback provider is
healthy throughout. For each way a fresh `tinygw serve` (product defaults: breakers at
5 failures / 30 s, health checks every 10 s, log level info) gets c=4 clients for
`--seconds` (60), the primary recovering at `--recover-at` (35 s). Printed per scenario:
the share of answers that succeeded, p50/p99 latency, how many requests reached the
failing primary, and how long after its recovery the first answer came from it again.
With `--workers N`, tinygw runs each scenario a second time with TINYGW_WORKERS=N, and the
table shows the hits on the failing primary of both side by side: its workers share one
circuit per (provider, upstream model), so N workers cost what one does.

The three ways: `reset` (the primary accepts and resets the connection at once: a
connection error it can count, where a refused port could not be counted), `hang`
(it reads the request and never answers; the gateway's first-byte timeout is 5 s)
and `500` (it answers 500 at once). Loopback only; bounded in time.

    .venv/bin/python bench/outage.py [--seconds 60] [--recover-at 35] [--scenarios reset,hang,500] [--workers 4]
"""

from __future__ import annotations

import argparse
import functools
import http.client
import json
import os
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: its library, however outage.py is started
from lib import ROOT, free_port  # noqa: E402
from peers import LITELLM_CLI, ensure_litellm, ensure_portkey, litellm_env, portkey_argv, portkey_env  # noqa: E402

CONCURRENCY = 4


def answer(status: int, text: str) -> bytes:
    body = json.dumps(
        {
            "id": "x",
            "object": "chat.completion",
            "created": 0,
            "model": "m",
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}],
        }
    ).encode()
    if status != 200:
        body = json.dumps({"error": {"message": text, "type": "server_error"}}).encode()
    return b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        status,
        len(body),
        body,
    )


class Provider:
    """A provider on loopback whose behaviour is switched while it runs; it counts
    the requests (or, when resetting, the connections) that reached it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.mode = "ok"  # ok | reset | hang | 500
        self.reached = 0
        self.listener = socket.create_server(("127.0.0.1", 0), backlog=256)
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            if self.mode == "reset":
                self.reached += 1
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                return
            buffer = b""
            while True:
                try:
                    data = conn.recv(65536)
                except OSError:
                    return
                if not data:
                    return
                buffer += data
                while b"\r\n\r\n" in buffer:
                    head, _, rest = buffer.partition(b"\r\n\r\n")
                    length = next(
                        (
                            int(line.split(b":")[1])
                            for line in head.split(b"\r\n")
                            if line.lower().startswith(b"content-length:")
                        ),
                        0,
                    )
                    if len(rest) < length:
                        break
                    buffer = rest[length:]
                    if head.startswith(b"GET"):  # listings and health checks
                        conn.sendall(answer(200 if self.mode == "ok" else 503, "models"))
                        continue
                    mode = self.mode
                    if mode != "ok":
                        self.reached += 1
                    if mode == "hang":
                        time.sleep(3600)
                        return
                    conn.sendall(answer(500, "down") if mode == "500" else answer(200, self.name))


def start_tinygw(primary: Provider, fallback: Provider, port: int, workdir: str, workers: int = 1) -> subprocess.Popen:
    config = {
        "providers": {
            "primary": {
                "base_url": f"http://127.0.0.1:{primary.port}/v1",
                "api": "openai",
                "first_byte_timeout_s": 5,
                "listing": False,
            },
            "fallback": {"base_url": f"http://127.0.0.1:{fallback.port}/v1", "api": "openai", "listing": False},
        },
        "models": {"m": {"targets": ["primary:x", "fallback:y"]}},
    }
    env = {
        "PATH": os.environ["PATH"],
        "PYTHONPATH": str(ROOT),
        "TINYGW_CONFIG": json.dumps(config),
        "TINYGW_PORT": str(port),
        "TINYGW_WORKERS": str(workers),
    }
    command = [os.environ["TINYGW_BINARY"]] if os.environ.get("TINYGW_BINARY") else [sys.executable, "-m", "tinygw"]
    return subprocess.Popen([*command, "serve"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


# LiteLLM's router set to match tinygw: the primary cooled down after 5 failures for 30 s,
# a 5 s timeout, no retries of its own, the fallback model when the primary fails.
LITELLM_CONFIG = """\
model_list:
  - model_name: m
    litellm_params: {{model: openai/x, api_base: "http://127.0.0.1:{primary}/v1", api_key: dummy, timeout: 5}}
  - model_name: m-fallback
    litellm_params: {{model: openai/y, api_base: "http://127.0.0.1:{fallback}/v1", api_key: dummy, timeout: 5}}
router_settings:
  fallbacks: [{{"m": ["m-fallback"]}}]
  allowed_fails: 5
  cooldown_time: 30
  num_retries: 0
litellm_settings:
  num_retries: 0
  request_timeout: 5
general_settings:
  dangerously_permit_weak_or_unset_master_key: true
"""


def start_litellm(primary: Provider, fallback: Provider, port: int, workdir: str) -> subprocess.Popen:
    config = Path(workdir) / "litellm.yaml"
    config.write_text(LITELLM_CONFIG.format(primary=primary.port, fallback=fallback.port))
    return subprocess.Popen(
        [str(LITELLM_CLI), "--config", str(config), "--host", "127.0.0.1", "--port", str(port), "--num_workers", "1"],
        env=litellm_env(),
        cwd=workdir,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def start_portkey(primary: Provider, fallback: Provider, port: int, workdir: str) -> subprocess.Popen:
    return subprocess.Popen(
        portkey_argv(port, workdir),
        env=portkey_env(),
        cwd=workdir,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # on loopback only, as in make bench


def portkey_headers(primary: Provider, fallback: Provider) -> dict[str, str]:
    """Portkey's fallback strategy, per request (its open-source build has no breaker)."""

    def target(p: Provider, model: str) -> dict:
        return {
            "provider": "openai",
            "api_key": "dummy",
            "custom_host": f"http://127.0.0.1:{p.port}/v1",
            "override_params": {"model": model},
        }

    return {
        "x-portkey-config": json.dumps(
            {
                "strategy": {"mode": "fallback"},
                "request_timeout": 5000,
                "targets": [target(primary, "x"), target(fallback, "y")],
            }
        )
    }


GATEWAYS = {
    "tinygw": (start_tinygw, "/healthz"),
    "litellm": (start_litellm, "/health/liveliness"),
    "portkey": (start_portkey, "/"),
}


def run_scenario(gateway_name: str, way: str, seconds: float, recover_at: float, workers: int = 1) -> dict:
    primary, fallback = Provider("primary"), Provider("fallback")
    port = free_port()
    start_gateway, ready_path = GATEWAYS[gateway_name]
    if workers > 1:
        start_gateway = functools.partial(start_tinygw, workers=workers)
    workdir = tempfile.mkdtemp(prefix=f"outage-{gateway_name}-")
    gateway = start_gateway(primary, fallback, port, workdir)
    results: list[tuple[float, float, int, str]] = []  # (start, latency, status, who answered)
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}{ready_path}", timeout=1)
                break
            except urllib.error.HTTPError:
                break  # it answers: ready
            except OSError:
                if time.monotonic() > deadline or gateway.poll() is not None:
                    raise SystemExit(f"{gateway_name} did not start") from None
                time.sleep(0.2)
        primary.mode = way
        start = time.monotonic()
        stop = start + seconds
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        headers = {"content-type": "application/json"}
        if gateway_name == "portkey":
            headers.update(portkey_headers(primary, fallback))

        def client() -> None:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            while (now := time.monotonic()) < stop:
                if primary.mode != "ok" and now - start >= recover_at:
                    primary.mode = "ok"
                try:
                    connection.request("POST", "/v1/chat/completions", body, headers)
                    response = connection.getresponse()
                    text = response.read().decode(errors="replace")
                    status = response.status
                except (OSError, http.client.HTTPException):
                    connection.close()
                    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
                    status, text = 0, ""
                who = "primary" if '"primary"' in text else "fallback" if '"fallback"' in text else ""
                results.append((now - start, time.monotonic() - now, status, who))

        threads = [threading.Thread(target=client) for _ in range(CONCURRENCY)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(seconds + 40)
    finally:
        gateway.terminate()
        try:
            gateway.wait(30)
        except subprocess.TimeoutExpired:
            gateway.kill()
        primary.listener.close()
        fallback.listener.close()
        shutil.rmtree(workdir, ignore_errors=True)
    latencies = sorted(r[1] for r in results)
    back = [r[0] for r in results if r[3] == "primary" and r[0] >= recover_at]
    return {
        "gateway": gateway_name,
        "way": way,
        "requests": len(results),
        "success": sum(1 for r in results if r[2] == 200) / len(results) * 100 if results else 0.0,
        "p50_ms": statistics.median(latencies) * 1000 if latencies else None,
        "p99_ms": latencies[int(len(latencies) * 0.99) - 1] * 1000 if latencies else None,
        "reached": primary.reached,
        "back_s": (min(back) - recover_at) if back else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--recover-at", type=float, default=35.0)
    parser.add_argument("--scenarios", default="reset,hang,500")
    parser.add_argument(
        "--workers", type=int, default=1, help="also run tinygw with this many workers, its hits in a column beside"
    )
    parser.add_argument(
        "--gateways",
        default="tinygw,litellm,portkey",
        help="tinygw; LiteLLM's proxy (installed with pip into bench/.venv-litellm when missing); "
        "Portkey's gateway (installed with npm into bench/.node-portkey when missing)",
    )
    args = parser.parse_args()
    if not 0 < args.recover_at < args.seconds <= 600:
        parser.error("need 0 < --recover-at < --seconds <= 600")
    gateways = [g for g in args.gateways.split(",") if g]
    if "litellm" in gateways and (ensure_litellm() is None or not LITELLM_CLI.exists()):
        print("litellm: pip or the install into bench/.venv-litellm failed; left out")
        gateways.remove("litellm")
    if "portkey" in gateways and ensure_portkey() is None:
        print("portkey: npm/node missing or the install failed; left out")
        gateways.remove("portkey")
    print(
        f"tinygw at product defaults (breaker 5 failures / 30 s, health checks every 10 s); LiteLLM's router "
        f"with allowed_fails 5, cooldown 30 s, timeout 5 s, fallbacks; c={CONCURRENCY}, {args.seconds:g} s a "
        f"scenario, the primary recovering at +{args.recover_at:g} s",
        flush=True,
    )
    if args.workers < 1:
        parser.error("need --workers >= 1")
    rows = []
    for way in args.scenarios.split(","):
        for g in gateways:
            row = run_scenario(g, way, args.seconds, args.recover_at)
            if g == "tinygw" and args.workers > 1:
                row["reached_n"] = run_scenario(g, way, args.seconds, args.recover_at, args.workers)["reached"]
            rows.append(row)
    many = f" | reached it, {args.workers} workers" if args.workers > 1 else ""
    print(
        f"| primary fails by | gateway | requests | success | p50 | p99 | reached the failing primary{many} "
        "| back to the primary after recovery |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |" + (" --- |" if many else ""))
    for r in rows:
        back = f"{r['back_s']:.1f} s" if r["back_s"] is not None else "not within the run"
        reached_n = f" | {r.get('reached_n', '—')}" if many else ""
        print(
            f"| {r['way']} | {r['gateway']} | {r['requests']:,} | {r['success']:.1f}% | {r['p50_ms']:.1f} ms "
            f"| {r['p99_ms']:.1f} ms | {r['reached']}{reached_n} | {back} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
