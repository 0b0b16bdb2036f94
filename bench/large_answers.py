"""Worker memory under large non-streamed answers (docs/design.md section 10).

Starts a provider on loopback that answers every request with SIZE_MiB of JSON
(content-length framing, written in 1 MiB pieces), a real `tinygw serve` in front
of it, and sends CONCURRENCY requests at once whose answers the clients read and
drop. Prints the worker's resident memory before, at its peak (VmHWM) and after.

    .venv/bin/python bench/large_answers.py [--size-mib 256] [--concurrency 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lib import ROOT, free_port  # noqa: E402 - bench/lib.py's, as the other bench tools

PIECE = b"x" * (1024 * 1024)


async def provider(port: int, size_mib: int, ready: threading.Event) -> None:
    body_bytes = size_mib * len(PIECE) + 2 + len(b'{"data":""}') - 2

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(
                    next(
                        (
                            line.split(b":")[1]
                            for line in head.split(b"\r\n")
                            if line.lower().startswith(b"content-length")
                        ),
                        b"0",
                    )
                )
                await reader.readexactly(length)
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % body_bytes
                    + b'{"data":"'
                )
                for _ in range(size_mib):
                    writer.write(PIECE)
                    await writer.drain()
                writer.write(b'"}')
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", port)
    ready.set()
    async with server:
        await server.serve_forever()


def rss_kib(pid: int, field: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def worker_of(pid: int) -> int:
    for _ in range(100):
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        if children:
            return int(children[0])
        time.sleep(0.05)
    raise RuntimeError("no worker")


def fetch(url: str) -> int:
    request = urllib.request.Request(
        url, data=json.dumps({"model": "m", "messages": []}).encode(), headers={"content-type": "application/json"}
    )
    total = 0
    with urllib.request.urlopen(request, timeout=300) as response:
        while chunk := response.read(1 << 20):
            total += len(chunk)
    return total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=4)
    args = parser.parse_args()

    upstream_port, port = free_port(), free_port()
    ready = threading.Event()
    threading.Thread(target=lambda: asyncio.run(provider(upstream_port, args.size_mib, ready)), daemon=True).start()
    ready.wait(10)
    config = {
        "providers": {"p": {"base_url": f"http://127.0.0.1:{upstream_port}/v1", "api": "openai", "listing": False}},
        "models": {"m": {"targets": ["p:x"]}},
    }
    env = {
        "PATH": os.environ["PATH"],
        "PYTHONPATH": str(ROOT),
        "TINYGW_CONFIG": json.dumps(config),
        "TINYGW_PORT": str(port),
    }
    command = [os.environ["TINYGW_BINARY"]] if os.environ.get("TINYGW_BINARY") else [sys.executable, "-m", "tinygw"]
    gateway = subprocess.Popen([*command, "serve"], env=env, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(200):
            try:
                urllib.request.urlopen(f"{url}/healthz", timeout=1)
                break
            except OSError:
                time.sleep(0.05)
        worker = worker_of(gateway.pid)
        before = rss_kib(worker)
        threads = [
            threading.Thread(target=fetch, args=(f"{url}/v1/chat/completions",)) for _ in range(args.concurrency)
        ]
        started = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds = time.monotonic() - started
        time.sleep(1)
        peak, after = rss_kib(worker, "VmHWM"), rss_kib(worker)
        print(
            f"| answers | worker RSS before | peak (VmHWM) | after | time |\n| --- | --- | --- | --- | --- |\n"
            f"| {args.concurrency} × {args.size_mib} MiB | {before / 1024:.0f} MiB | {peak / 1024:.0f} MiB "
            f"| {after / 1024:.0f} MiB | {seconds:.1f} s |"
        )
    finally:
        gateway.terminate()
        gateway.wait(30)


if __name__ == "__main__":
    main()
