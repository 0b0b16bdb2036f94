"""The machine instructions one gateway process executes per plain request: bench/bytecodes.py's
harness (tinygw's ASGI app in this process, as a Granian worker runs it, log level info, access log
on, against bench/instant_upstream.py) run under valgrind's callgrind, which counts the instructions of
the interpreter and of the C extensions (msgspec, uvloop) alike. Bytecodes miss what a call, an
allocation or a keyword argument costs in C; time on a shared machine moves by a tenth from one run to
the next; this count moves by a fraction of a percent, whatever else the machine runs. It is what a
plain request's CPU follows (on 4863d38 and issue 37's main: 1.124x the instructions, 1.13x the CPU
a request in `make bench`).

    .venv/bin/python bench/instructions.py [--requests 500] [--tree DIR] [--stream]

Counting starts after a warm-up (callgrind_control turns the instrumentation on) and stops after
--requests plain requests: the figure is the instructions counted / requests. `--stream` also counts
a relayed event's, as bytecodes.py does: (--requests 122-event streams - as many 22-event ones) / 100.
`--tree DIR` measures another checkout (its tinygw and its bench/bytecodes.py harness, with its own
.venv: `git worktree add --detach DIR REV && make -C DIR all`), for a side-by-side ratio. Needs
valgrind (installed with apt-get when missing, as wrk is). About 10 s a count; loopback only.
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


KINDS = ("plain", "short", "long")  # a plain request; a stream of 22 events; of 122
EVENTS_APART = 100


def inner(tree: Path, requests: int, kind: str) -> None:
    """Under callgrind: the app of `tree` served `requests` requests of `kind`, counted after a warm-up."""
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
        uvloop.new_event_loop().run_until_complete(_serve(harness, requests, kind))
    finally:
        for proc in procs:
            proc.stop()
        shutil.rmtree(metrics_dir, ignore_errors=True)


async def _serve(harness, requests: int, kind: str) -> None:
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
    body = (harness.BODY if kind == "plain" else harness.STREAM_BODY).encode()
    if kind == "long":  # bytecodes.py's long stream: the model of the 122-event upstream
        body = body.replace(b'"bench"', b'"bench-long"')
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


def measure(tree: Path, requests: int, kind: str = "plain") -> float:
    """Instructions per request of `kind` of the app of `tree`."""
    python = tree / ".venv" / "bin" / "python"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        argv = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}"]
        argv += [f"--log-file={tmp}/valgrind.log", str(python), __file__, "--inner", "--tree", str(tree)]
        subprocess.run([*argv, "--requests", str(requests), "--kind", kind], check=True, timeout=600)
        totals = re.search(r"^totals: (\d+)", out.read_text(), re.MULTILINE)  # (its `summary` is 0 then)
    if totals is None:
        raise SystemExit("instructions: callgrind wrote no totals")
    return int(totals.group(1)) / requests


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=500, help="counted plain requests (500)")
    ap.add_argument("--tree", type=Path, help="another checkout to measure beside this one")
    ap.add_argument("--stream", action="store_true", help="also a relayed event's instructions")
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--kind", choices=KINDS, default="plain", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.inner:
        inner(args.tree, args.requests, args.kind)
        return 0
    if shutil.which("valgrind") is None:
        sys.path.insert(0, str(HERE))
        from lib import apt_install

        apt_install("valgrind")
    trees = [("", HERE.parent)] + ([(f" of {args.tree}", args.tree.resolve())] if args.tree is not None else [])
    figures: dict[str, list[float]] = {"plain request": [], "relayed event": []}
    for _, tree in trees:
        figures["plain request"].append(measure(tree, args.requests))
        if args.stream:
            short, long = (measure(tree, args.requests, kind) for kind in ("short", "long"))
            figures["relayed event"].append((long - short) / EVENTS_APART)
    for what, (here, *other) in ((k, v) for k, v in figures.items() if v):
        print(f"instructions per {what}: {here:,.0f}")
        if other:
            print(f"instructions per {what}{trees[1][0]}: {other[0]:,.0f} (this tree: {here / other[0]:.3f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
