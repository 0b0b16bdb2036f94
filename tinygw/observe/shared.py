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

import zlib
from collections.abc import Mapping

from tinygw.observe.mapped import Mapped
from tinygw.resilience.rows import Floats

_HEADER_FLOATS = 2  # tinygw.observe.mapped's
_FILE, _LOCK = "shared.db", "shared.lock"


class SharedRuns:
    def __init__(self, runs: Mapping[str, int], directory: str | None = None) -> None:
        """`runs`: each run's name and its number of floats."""
        self._starts: dict[str, tuple[int, int]] = {}
        at = _HEADER_FLOATS
        for name in sorted(runs):
            self._starts[name] = (at, runs[name])
            at += runs[name]
        layout = float(zlib.crc32("\n".join(f"{n}={c}" for n, c in sorted(runs.items())).encode()))
        self._file = Mapped(directory, (_FILE, _LOCK), 8 * at, layout)
        self.values = self._file.values
        self.lock, self.unlock = self._file.lock, self._file.unlock
        self._views: dict[str, Floats] = {}

    def run(self, name: str) -> Floats:
        """The floats of run `name`, indexed from 0 (one view per run, made at its first use)."""
        view = self._views.get(name)
        if view is None:
            start, count = self._starts[name]
            view = self._views[name] = self.values[start : start + count]
        return view

    def close(self) -> None:
        for view in self._views.values():
            view.release()
        self._file.close()
