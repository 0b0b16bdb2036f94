"""The benchmarks' report helpers beyond lib.py's: percentiles, the cells of a table, goal lines, what a
target's log said, a sum from /metrics, and the run's own command line.

Imported by bench/streams.py, stream_runs.py, neighbours.py, run.py and soak.py; imports no script.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


# ---- numbers ------------------------------------------------------------------------------


def percentile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    return sorted_values[min(len(sorted_values) - 1, max(0, math.ceil(q / 100 * len(sorted_values)) - 1))]


def hist_percentile(hist: dict[int, int], q: float, never: int = 0) -> float | None:
    """The q-th percentile of the histogram's values and `never` more, infinitely large ones."""
    total = sum(hist.values()) + never
    if not total:
        return None
    rank, seen = math.ceil(q / 100 * total), 0
    for k in sorted(hist):
        seen += hist[k]
        if seen >= rank:
            return float(k)
    return math.inf


def added(a: float | None, b: float | None) -> float | None:
    if a is None or b is None:
        return None
    if math.isinf(a):
        return math.inf
    return a - b


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of `name` whose labels include `labels` (Prometheus text)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


# ---- cells and lines ----------------------------------------------------------------------


def ms(value: float | None, spec: str = ",.1f", plus: bool = False) -> str:
    if value is None:
        return "-"
    if math.isinf(value):
        return "cut"
    return ("+" if plus and value >= 0 else "") + format(value, spec)


def kib(n: float | None) -> str:
    if n is None:
        return "-"
    return f"{n / 2**20:,.1f} MiB" if abs(n) >= 2**20 else f"{n / 1024:,.1f} KiB"


def goal(text: str, value: str | None, met: bool) -> None:
    print(
        f"goal: {text}: {value if value is not None else 'not measured in this run'} -> {'MET' if met else 'NOT MET'}"
    )


def stderr_notes(name: str, text: str) -> list[str]:
    """A target's log beside its access lines and its info lines: each distinct message once, with its count."""
    counts: dict[str, int] = {}
    for line in text.splitlines():
        if '"msg":"request"' in line or "connection_drop_guard" in line or not line.strip():
            continue
        try:
            doc = json.loads(line)
            if str(doc.get("level", "")).lower() in ("info", "debug"):
                continue
            key = f"{doc.get('level', '')} {doc.get('msg', line)}".strip()
        except (ValueError, AttributeError):
            key = line[:200]
        counts[key] = counts.get(key, 0) + 1
    return [f"{name}: {n}x {k}" for k, n in list(counts.items())[:12]]


# ---- the run ------------------------------------------------------------------------------


def command_line(script: str) -> str:
    """The command that started this run, as it would be typed at the repository's root."""
    return shlex.join(
        [
            os.path.relpath(sys.executable, ROOT) if sys.executable.startswith(str(ROOT)) else sys.executable,
            os.path.relpath(script, ROOT),
            *sys.argv[1:],
        ]
    )


def on_sigterm(signum, frame):
    """A signal handler: SIGTERM unwinds the run as Ctrl-C does, so that every process it started is stopped."""
    raise KeyboardInterrupt(f"signal {signum}")
