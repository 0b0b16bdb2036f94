"""How many workers `TINYGW_WORKERS=auto` means (docs/configuration.md): the CPUs this
process may run on.

Two things bound them. The affinity mask (`taskset`, a cpuset: `os.sched_getaffinity`)
says which CPUs the kernel will schedule it on; under cgroup v2, the quota of its cgroup
(`cpu.max`: `QUOTA PERIOD`, or `max` for none) says how much CPU time it gets per period,
which is what a container's `limits.cpu` becomes: 1.5 CPUs is 2 workers (rounded up, so
that a fractional quota is used whole). A quota set on a cgroup above ours bounds us too,
so the smallest on the way up to the mount's root is taken. The count is the smaller of
the two, at least 1, at most MAX_WORKERS.

The cgroup file system's root and the process's cgroup file are arguments, so that tests
give their own.
"""

from __future__ import annotations

import math
import os

from msgspec import Struct

MAX_WORKERS = 256  # Granian's bound, and the slots a run's directory has (tinygw.observe.metricstore)
CGROUP_ROOT = "/sys/fs/cgroup"
SELF_CGROUP = "/proc/self/cgroup"

# Where a count came from, as the start log line and `tinygw check` name it.
FROM_AFFINITY, FROM_CGROUP, FROM_VARIABLE = "affinity", "cgroup", "TINYGW_WORKERS"


class Workers(Struct, frozen=True):
    count: int
    source: str  # FROM_AFFINITY | FROM_CGROUP | FROM_VARIABLE


def usable(affinity: int | None = None, cgroup_root: str = CGROUP_ROOT, self_cgroup: str = SELF_CGROUP) -> Workers:
    """The workers `auto` gives: the CPUs of the affinity mask (this process's, unless given),
    bounded by the cgroup's quota when it is smaller."""
    cpus = len(os.sched_getaffinity(0)) if affinity is None else affinity
    quota = cgroup_quota(cgroup_root, self_cgroup)
    if quota is not None and quota < cpus:
        return Workers(_bounded(quota), FROM_CGROUP)
    return Workers(_bounded(cpus), FROM_AFFINITY)


def _bounded(count: int) -> int:
    return max(1, min(MAX_WORKERS, count))


def cgroup_quota(cgroup_root: str, self_cgroup: str) -> int | None:
    """The CPUs that the smallest `cpu.max` quota from this process's cgroup v2 up to the
    root allows, rounded up; None without cgroup v2 or without a quota."""
    path = _own_cgroup(self_cgroup)
    if path is None:
        return None
    parts = [p for p in path.split("/") if p and p not in (".", "..")]
    quotas = []
    for depth in range(len(parts), -1, -1):
        cpus = _quota_in(os.path.join(cgroup_root, *parts[:depth], "cpu.max"))
        if cpus is not None:
            quotas.append(cpus)
    return min(quotas) if quotas else None


def _own_cgroup(self_cgroup: str) -> str | None:
    """The cgroup v2 path of this process (the `0::PATH` line), or None."""
    try:
        with open(self_cgroup, encoding="utf-8", errors="replace") as f:
            lines = f.read(64 * 1024).splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("0::"):
            return line[3:].strip() or "/"
    return None


def _quota_in(path: str) -> int | None:
    """The CPUs one `cpu.max` file allows (`QUOTA PERIOD`, quota over period rounded up), or
    None when it is absent, unreadable, `max` or not understood."""
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            fields = f.read(256).split()
    except OSError:
        return None
    if len(fields) != 2 or not (fields[0].isdigit() and fields[1].isdigit()):
        return None  # "max 100000": no quota
    quota, period = int(fields[0]), int(fields[1])
    if quota <= 0 or period <= 0:
        return None
    return math.ceil(quota / period)
