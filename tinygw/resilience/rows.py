"""Where a circuit's numbers live: a row of floats, the same for one process and for a gateway.

A circuit (tinygw.resilience.breaker) is a pure state machine over one row; it is handed
the row and never owns the numbers. The row of a circuit built alone (unit tests, a
Gateway without a run directory) is a list in its process (`LocalRows`); the gateway's
rows are in shared memory in the run's directory (tinygw.observe.circuittable), so that
every worker counts into the one circuit (docs/design.md section 4, "One circuit for
the gateway").

Row, by float index (a state is a code: 0 closed, 1 open, 2 half-open; a time is on the
machine's monotonic clock, which every process shares; 0 means none):
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

STATE = 0  # 0 closed, 1 open, 2 half-open
GENERATION = 1  # +1 at every transition (and when a row is given to another name)
FAILURES = 2  # consecutive failures while closed
PAUSE = 3  # the pause of the current (or next) opening, seconds
OPENED_AT = 4  # when it last opened (0: not open)
PROBES = 5  # half-open probes in flight
PASSED = 6  # half-open probes that succeeded, in a row
SUCCEEDED_AT = 7  # the last success (0: none): what may be forgotten first
USED_AT = 8  # the last time a worker looked it up by name: least recently used first
NAME = 9  # the name's hash (a 52-bit integer, exact in a float); 0: a free row
KIND = 10  # 1: a configured target's (never forgotten), 2: a name a request carried
CONCEALED = 11  # 1: shown as `*#h` (a sealed body named it)
ROW_FLOATS = 16  # room for more

CLOSED_CODE, OPEN_CODE, HALF_OPEN_CODE = 0.0, 1.0, 2.0

Floats = Any  # a list of floats, or a memoryview of a map's doubles (tinygw.resilience.limits.Floats)
CONFIGURED, NAMED = 1.0, 2.0


class Rows(Protocol):
    """The store of circuits' rows: their floats, and the lock that transitions take."""

    values: Floats

    def lock(self) -> None: ...

    def unlock(self) -> None: ...

    def hold(self, at: int, generation: float) -> int:
        """Record that this worker holds a probe of the row at `at` (so that it is given
        back if the worker dies); the record's index, or -1 when none is kept."""
        ...

    def release(self, hold: int) -> None:
        """The probe of record `hold` ended (its verdict is being counted)."""
        ...

    def give_back(self, at: int, now: float) -> bool:
        """Give back the probes of the row at `at` held by workers that are dead; whether
        any was. Under the lock."""
        ...

    def set_error(self, at: int, error: str) -> None:
        """The circuit's last error, for the status page."""
        ...


class LocalRows:
    """One row in this process: a circuit built alone (as the unit tests build them)."""

    def __init__(self, open_seconds: float) -> None:
        self.values: Floats = [0.0] * ROW_FLOATS
        self.values[PAUSE] = open_seconds

    def lock(self) -> None:
        pass

    def unlock(self) -> None:
        pass

    def hold(self, at: int, generation: float) -> int:
        return -1

    def release(self, hold: int) -> None:
        pass

    def give_back(self, at: int, now: float) -> bool:
        return False

    def set_error(self, at: int, error: str) -> None:
        pass


class Runs(Protocol):
    """Named runs of floats, shared by the workers of a gateway (tinygw.observe.shared), and
    the lock that a read-modify-write of them takes."""

    def run(self, name: str) -> Floats: ...

    def lock(self) -> None: ...

    def unlock(self) -> None: ...


class LocalRuns:
    """The runs of one process (unit tests, a Strategies built alone)."""

    def __init__(self, runs: Mapping[str, int]) -> None:
        self._runs = {name: [0.0] * count for name, count in runs.items()}

    def run(self, name: str) -> Floats:
        return self._runs[name]

    def lock(self) -> None:
        pass

    def unlock(self) -> None:
        pass
