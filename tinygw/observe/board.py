"""What each worker publishes of itself and its keys' rests, for the status page; how it shows a circuit.

The status page shows every live worker's in one view (docs/design.md section 7), whichever
worker a reload reaches. So each worker writes into its own file of the shared metric store
(tinygw.observe.metricstore), under names that /metrics does not export, and the page reads
every live worker's. The circuits are the gateway's, one table in shared memory
(tinygw.observe.circuittable), read from there as `CircuitView`s; so is its last
listing of each provider (tinygw.worker.discovery).

Entries (family, labels, part):
- ("status_worker", (), "started_at"): the worker's start, wall-clock seconds
- ("status_key", (provider, index), "rest_until"): until when a key of the provider's pool
  rests after a 429 (monotonic; `index` its place in the pool, never the key)
"""

from __future__ import annotations

from msgspec import Struct

from tinygw.resilience.breaker import State, pause_left, pause_over

STATES = {0: State.CLOSED, 1: State.OPEN, 2: State.HALF_OPEN}


class CircuitView(Struct):
    provider: str
    provider_model: str
    state: State
    failures: int
    pause_seconds: float
    opened_at: float | None  # monotonic
    last_error: str | None

    def state_at(self, now: float) -> State:
        """The state at `now`: an OPEN circuit whose pause is over is HALF_OPEN (its
        worker turns it so when it next looks)."""
        if self.state is State.OPEN and pause_over(self.opened_at, self.pause_seconds, now):
            return State.HALF_OPEN
        return self.state

    def next_probe_seconds(self, now: float) -> float | None:
        """Seconds until an OPEN circuit's pause ends; None when it is not OPEN at `now`."""
        if self.state_at(now) is not State.OPEN or not self.opened_at:
            return None
        return pause_left(self.opened_at, self.pause_seconds, now)


class WorkerView(Struct):
    pid: int
    slot: int
    started_at: float | None  # wall clock
    # (provider, index of the key in its pool) -> until when it rests (monotonic); past values too
    key_rests: dict[tuple[str, int], float] = {}


class Board:
    def __init__(self, store, started_at: float) -> None:
        self.store = store
        store.set(("status_worker", (), "started_at"), started_at)

    def publish_key_rest(self, provider: str, index: int, until: float) -> None:
        self.store.set(("status_key", (provider, str(index)), "rest_until"), until)


def read(store) -> list[WorkerView]:
    """Every live worker's view, by slot."""
    views = []
    for pid, slot, alive, values in store.snapshot():
        if not alive:
            continue
        key_rests: dict[tuple[str, int], float] = {}
        started_at = None
        for (name, labels, part), value in values.items():
            if name == "status_key" and len(labels) == 2 and labels[1].isdigit():
                key_rests[(labels[0], int(labels[1]))] = value
            elif name == "status_worker" and part == "started_at":
                started_at = value
        views.append(WorkerView(pid=pid, slot=slot, started_at=started_at, key_rests=key_rests))
    return sorted(views, key=lambda v: v.slot)
