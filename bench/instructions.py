"""The machine instructions one gateway process executes per plain request: bench/bytecodes.py's
harness (tinygw's ASGI app in this process, as a Granian worker runs it, log level info, access log
on, against bench/instant_upstream.py) run under valgrind's callgrind, which counts the instructions of
the interpreter and of the C extensions (msgspec, uvloop) alike. Bytecodes miss what a call, an
allocation or a keyword argument costs in C; time on a shared machine moves by a tenth from one run to
the next; this count moves by a fraction of a percent, whatever else the machine runs. It is what a
plain request's CPU follows (on 4863d38 and issue 37's main: 1.124x the instructions, 1.13x the CPU
a request in `make bench`).

    .venv/bin/python bench/instructions.py [--requests 500] [--tree DIR]

Counting starts after a warm-up (callgrind_control turns the instrumentation on) and stops after
--requests plain requests: the figure is the instructions counted / requests. `--tree DIR` measures
another checkout (its tinygw and its bench/bytecodes.py harness, with its own .venv: `git worktree add
--detach DIR REV && make -C DIR all`), for a side-by-side ratio. Needs valgrind (installed with apt-get
when missing, as wrk is). About 10 s a tree; loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
WARMUP = 200  # requests before counting: pools, caches and lazy imports settle


def inner(tree: Path, requests: int) -> None:
    """Under callgrind: the app of `tree` served `requests` plain requests, counted after a warm-up."""
    sys.path[:0] = [str(tree / "bench"), str(tree)]
    import inspect

    import bytecodes as harness  # the tree's own: its configure() and its Client
    import uvloop
    from lib import HOST, start_upstream

    procs = []
    metrics_dir = tempfile.mkdtemp(prefix="tinygw-metrics-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        (short, short_port), (long, long_port) = start_upstream(20), start_upstream(120)
        procs += [short, long]
        listening = socket.create_server((HOST, 0))  # never accepts: the worker's listener search ends at once
        ports = [short_port, long_port, metrics_dir, listening.getsockname()[1]]
        harness.configure(*ports[: len(inspect.signature(harness.configure).parameters)])
        os.dup2(os.open(os.devnull, os.O_WRONLY), 2)  # the gateway's log lines
        uvloop.new_event_loop().run_until_complete(_serve(harness, requests))
    finally:
        for proc in procs:
            proc.stop()
        shutil.rmtree(metrics_dir, ignore_errors=True)


async def _serve(harness, requests: int) -> None:
    from tinygw.api import app as app_module

    app, state = app_module.app, {}
    startup: asyncio.Queue = asyncio.Queue()
    await startup.put({"type": "lifespan.startup"})
    started = asyncio.get_running_loop().create_future()

    async def lifespan_send(message) -> None:
        if not started.done():
            started.set_result(message)

    lifespan = asyncio.ensure_future(app({"type": "lifespan", "state": state}, startup.get, lifespan_send))
    if (await asyncio.wait_for(started, 60))["type"] != "lifespan.startup.complete":
        raise RuntimeError("the gateway did not start")
    body = harness.BODY.encode()
    for _ in range(WARMUP):
        await harness.one(app, state, body, None)
    _instrument("on")
    for _ in range(requests):
        await harness.one(app, state, body, None)
    _instrument("off")
    await startup.put({"type": "lifespan.shutdown"})
    await asyncio.wait_for(lifespan, 30)


def _instrument(state: str) -> None:
    subprocess.run(["callgrind_control", f"--instr={state}", str(os.getpid())], check=True, capture_output=True)


def measure(tree: Path, requests: int) -> float:
    """Instructions per plain request of the app of `tree`."""
    python = tree / ".venv" / "bin" / "python"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        argv = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}"]
        argv += [f"--log-file={tmp}/valgrind.log", str(python), __file__, "--inner", "--tree", str(tree)]
        subprocess.run([*argv, "--requests", str(requests)], check=True, timeout=600)
        totals = re.search(r"^totals: (\d+)", out.read_text(), re.MULTILINE)  # (its `summary` is 0 then)
    if totals is None:
        raise SystemExit("instructions: callgrind wrote no totals")
    return int(totals.group(1)) / requests


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=500, help="counted plain requests (500)")
    ap.add_argument("--tree", type=Path, help="another checkout to measure beside this one")
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.inner:
        inner(args.tree, args.requests)
        return 0
    if shutil.which("valgrind") is None:
        sys.path.insert(0, str(HERE))
        from lib import apt_install

        apt_install("valgrind")
    here = measure(HERE.parent, args.requests)
    print(f"instructions per plain request: {here:,.0f}")
    if args.tree is not None:
        other = measure(args.tree.resolve(), args.requests)
        print(f"instructions per plain request of {args.tree}: {other:,.0f} (this tree: {here / other:.3f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
