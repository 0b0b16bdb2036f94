"""Small shared numbers of the gateway, one for all its workers (docs/design.md section 4,
"One circuit for the gateway"): the rests of a provider's keys, the counters of the
spreading strategies, whose turn it is to run a health check or a listing, and what the
last listing found.

Every worker maps one file of the run's directory, `shared.db`: named runs of floats
(tinygw.resilience.rows.Runs), laid out in the order of their names after a header of
two floats (a layout number, a marker written last when the file is ready). The runs
are fixed by the configuration, which every worker of a run shares, so every worker
computes the same layout; the first to start makes the file under an exclusive flock
of `shared.lock`, and the others (and a worker started again after a crash) map it as
it is. A single float is written without the lock (a key's rest: the later write wins,
and either is a rest); a read-modify-write (a counter) takes the lock. Without a run
directory (a Gateway built in a test) the runs live in this process alone.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import zlib
from collections.abc import Mapping

from tinygw.resilience.rows import Floats

_HEADER_FLOATS = 2
_LAYOUT, _READY = 0, 1
_READY_MARK = 7.0e15 + 3.0  # a marker no zeroed or half-written file holds
_FILE, _LOCK = "shared.db", "shared.lock"


class SharedRuns:
    def __init__(self, runs: Mapping[str, int], directory: str | None = None) -> None:
        """`runs`: each run's name and its number of floats."""
        self._starts: dict[str, tuple[int, int]] = {}
        at = _HEADER_FLOATS
        for name in sorted(runs):
            self._starts[name] = (at, runs[name])
            at += runs[name]
        self._lock_fd = self._fd = -1
        layout = float(zlib.crc32("\n".join(f"{n}={c}" for n, c in sorted(runs.items())).encode()))
        size = 8 * at
        if directory:
            self._lock_fd = os.open(os.path.join(directory, _LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            self._fd = os.open(os.path.join(directory, _FILE), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            self.lock()
            try:
                if os.fstat(self._fd).st_size != size:
                    os.ftruncate(self._fd, 0)
                    os.ftruncate(self._fd, size)
                self._map = mmap.mmap(self._fd, size)
                self._ready(layout)
            finally:
                self.unlock()
        else:
            self._map = mmap.mmap(-1, size)
            self._ready(layout)
        self._views: dict[str, Floats] = {}

    def _ready(self, layout: float) -> None:
        self.values = memoryview(self._map).cast("d")
        v = self.values
        if v[_LAYOUT] == layout and v[_READY] == _READY_MARK:
            return
        v[_READY] = 0.0
        self._map[:] = bytes(len(self._map))
        v[_LAYOUT] = layout
        v[_READY] = _READY_MARK

    def run(self, name: str) -> Floats:
        """The floats of run `name`, indexed from 0 (one view per run, made at its first use)."""
        view = self._views.get(name)
        if view is None:
            start, count = self._starts[name]
            view = self._views[name] = self.values[start : start + count]
        return view

    def lock(self) -> None:
        if self._lock_fd >= 0:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)

    def unlock(self) -> None:
        if self._lock_fd >= 0:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def close(self) -> None:
        for view in self._views.values():
            view.release()
        self.values.release()
        self._map.close()
        for fd in (self._fd, self._lock_fd):
            if fd >= 0:
                os.close(fd)
        self._fd = self._lock_fd = -1
