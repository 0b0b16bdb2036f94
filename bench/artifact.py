"""The frozen executable's size and cold start: the last goal lines of `make bench`.

Cold start: from the exec of `build/dist/tinygw serve` (a fresh process, one worker) to
its first 200 on GET /healthz, polled every 5 ms; the median of --starts starts. Run
after `make build` (or `make test-frozen`); without an executable it says so and exits 0.
Loopback only. Usage: `.venv/bin/python bench/artifact.py [--binary PATH] [--starts N]`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lib import ROOT, free_port  # noqa: E402 - bench/lib.py's, as the other bench tools

ARTIFACT_MB_GOAL = 20
COLD_START_GOAL_S = 0.4


def healthz(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            return s.recv(64).startswith(b"HTTP/1.1 200")
    except OSError:
        return False


def cold_start(binary: Path, timeout: float = 10.0) -> float:
    port = free_port()
    config = {
        "providers": {"up": {"base_url": "http://127.0.0.1:9/v1", "api": "openai"}},
        "models": {"m": {"targets": ["up:m"]}},
    }
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "TINYGW_HOST": "127.0.0.1",
        "TINYGW_PORT": str(port),
        "TINYGW_CONFIG": json.dumps(config),
        "TINYGW_DRAIN_SECONDS": "0",
        "PROVIDER_LISTING_SECONDS": "0",
    }
    started = time.monotonic()
    proc = subprocess.Popen(
        [str(binary), "serve"],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        while not healthz(port):
            if proc.poll() is not None or time.monotonic() - started > timeout:
                raise RuntimeError(f"{binary} did not answer /healthz within {timeout:g} s (exit {proc.poll()})")
            time.sleep(0.005)
        return time.monotonic() - started
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--binary", type=Path, default=ROOT / "build" / "dist" / "tinygw")
    ap.add_argument("--starts", type=int, default=5, help="cold starts measured; the median is reported (5)")
    args = ap.parse_args(argv)
    if not args.binary.is_file():
        print(f"artifact: {args.binary} is not built (make build): size and cold start not measured")
        return 0
    size_mb = args.binary.stat().st_size / 1e6
    times = [cold_start(args.binary) for _ in range(args.starts)]
    median = statistics.median(times)
    print(
        f"artifact: {args.binary.relative_to(ROOT) if args.binary.is_relative_to(ROOT) else args.binary}, "
        f"{size_mb:.1f} MB; cold start to the first /healthz: median {median:.3f} s of {args.starts} "
        f"({', '.join(f'{t:.3f}' for t in times)})"
    )
    for goal, value, limit, unit in (
        ("artifact size", size_mb, ARTIFACT_MB_GOAL, " MB"),
        ("frozen cold start to the first /healthz", median, COLD_START_GOAL_S, " s"),
    ):
        print(f"goal: {goal} <= {limit:g}{unit}: {value:.3g} -> {'MET' if value <= limit else 'NOT MET'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
