"""`process_*` metrics of each live worker, read from /proc at the scrape (docs/design.md section 7).

The names are Prometheus' standard process metrics (as its clients export them), with
a `worker` label: the worker's slot. The worker that answers a scrape reads every
live worker's /proc/PID files, so the workers spend nothing on them between scrapes.
A file that cannot be read (not Linux, a worker that just ended) leaves its series
out; it never fails the scrape.
"""

from __future__ import annotations

import os

FAMILIES = (
    ("process_resident_memory_bytes", "Resident memory size in bytes."),
    ("process_cpu_seconds_total", "Total user and system CPU time spent in seconds."),
    ("process_open_fds", "Number of open file descriptors."),
    ("process_start_time_seconds", "Start time of the process since unix epoch in seconds."),
)
_TYPES = {"process_cpu_seconds_total": "counter"}

try:
    _TICKS = os.sysconf("SC_CLK_TCK")
    _PAGE = os.sysconf("SC_PAGE_SIZE")
except (ValueError, OSError, AttributeError):
    _TICKS = _PAGE = 0


def _boot_time() -> float | None:
    try:
        with open("/proc/stat", "rb") as f:
            for line in f:
                if line.startswith(b"btime "):
                    return float(line.split()[1])
    except OSError:
        pass
    return None


def read(pid: int, boot_time: float | None) -> dict[str, float]:
    """The process metrics of `pid` that can be read now."""
    values: dict[str, float] = {}
    if not _TICKS:
        return values
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()  # after the command name, which may hold spaces
        # fields[0] is the state (stat's 3rd field): utime is the 14th, so fields[11]
        values["process_cpu_seconds_total"] = (int(fields[11]) + int(fields[12])) / _TICKS
        values["process_resident_memory_bytes"] = float(int(fields[21]) * _PAGE)
        if boot_time is not None:
            values["process_start_time_seconds"] = int(fields[19]) / _TICKS + boot_time
    except (OSError, ValueError, IndexError):
        return {}
    try:
        values["process_open_fds"] = float(len(os.listdir(f"/proc/{pid}/fd")))
    except OSError:
        pass
    return values


def render(workers: list[tuple[int, int]]) -> list[str]:
    """Exposition lines for the live `(slot, pid)` workers."""
    boot_time = _boot_time()
    read_values = [(slot, read(pid, boot_time)) for slot, pid in workers]
    lines = []
    for name, help_text in FAMILIES:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {_TYPES.get(name, 'gauge')}")
        for slot, values in read_values:
            if name in values:
                lines.append(f'{name}{{worker="{slot}"}} {values[name]!r}')
    return lines
