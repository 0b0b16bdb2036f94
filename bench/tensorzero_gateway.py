"""TensorZero's Rust gateway, as its PyPI wheel ships it, on a free loopback port: the peer bench/peers.py starts.

Run with bench/.venv-tensorzero's Python: `python bench/tensorzero_gateway.py CONFIG.toml`. It starts the
gateway through the package's `_start_http_gateway` (the embedded HTTP gateway behind `patch_openai_client`),
prints `tensorzero-port=N` (flushed; the gateway's own log goes to stderr), and serves until SIGTERM/SIGINT.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from urllib.parse import urlsplit

from tensorzero import _start_http_gateway


def main(config_file: str) -> None:
    port_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # the gateway's log lines go to stderr: stdout is a pipe that nobody reads after the port
    gateway = _start_http_gateway(
        config_file=config_file, clickhouse_url=None, postgres_url=None, valkey_url=None, async_setup=False
    )
    address = urlsplit(gateway.base_url)
    if address.hostname not in ("127.0.0.1", "localhost"):
        gateway.close()
        raise SystemExit(f"tensorzero_gateway: the gateway listens on {address.hostname}, not on loopback")
    print(f"tensorzero-port={address.port}", file=port_out, flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(3600):
        pass
    gateway.close()


if __name__ == "__main__":
    main(sys.argv[1])
