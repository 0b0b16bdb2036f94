"""What each worker publishes of its circuits and listings, for the status page.

Circuits are per worker (docs/design.md section 4), but the status page shows every live
worker's in one view (docs/design.md section 7), whichever worker a reload reaches. So each
worker writes its circuits' state into its own file of the shared metric store
(tinygw.observe.metricstore), under names that /metrics does not export, and the page reads
every live worker's. A circuit tells the board when it changed (the breakers'
`on_change`), and a value is written only when it differs from the one published.

Entries (family, labels, part):
- ("status_worker", (), "started_at"): the worker's start, wall-clock seconds
- ("status_circuit", (provider, provider_model), "state" | "failures" | "pause" | "opened_at")
  (provider_model as the circuit shows it: `*#h` for a name a sealed body carried,
  docs/confidential.md)
  (state 0 closed, 1 open, 2 half-open; opened_at on the machine's monotonic clock,
  which every process shares)
- ("status_error", (provider, provider_model, label), ""): when `label` became the
  circuit's last error (a sequence number: the largest is the last)
- ("status_listing", (provider,), "models"): models of the last successful listing, or -1
- ("status_key", (provider, index), "rest_until"): until when a key of the provider's pool
  rests after a 429 (monotonic; `index` its place in the pool, never the key)
"""

from __future__ import annotations

from msgspec import Struct

from tinygw.resilience.breaker import OTHER, Circuit, State, pause_left, pause_over

_STATE_CODE = {State.CLOSED: 0.0, State.OPEN: 1.0, State.HALF_OPEN: 2.0}
_FORGOTTEN = -1.0  # a circuit its worker no longer keeps: not shown
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
    circuits: list[CircuitView]
    listings: dict[str, int | None]  # provider -> models listed, None while not up
    # (provider, index of the key in its pool) -> until when it rests (monotonic); past values too
    key_rests: dict[tuple[str, int], float] = {}


class Board:
    def __init__(self, store, started_at: float) -> None:
        self.store = store
        self._published: dict[tuple[str, str], tuple] = {}
        self._errors = 0
        store.set(("status_worker", (), "started_at"), started_at)

    def publish_circuit(self, circuit: Circuit) -> None:
        """Publish what `circuit.snapshot()` says, if it changed; a circuit without a label of
        its own (breaker.OTHER) is not shown, and a forgotten one is taken off the page."""
        if circuit.label == OTHER:
            return
        key = (circuit.provider, circuit.shown)  # its name as shown: `*#h` for one a sealed body named
        if circuit.forgotten:
            self._published.pop(key, None)
            self.store.set(("status_circuit", key, "state"), _FORGOTTEN)
            return
        now = circuit.snapshot()
        before = self._published.get(key)
        if now == before:
            return
        self._published[key] = now
        state, failures, pause, opened_at, last_error = now
        set_ = self.store.set
        set_(("status_circuit", key, "state"), _STATE_CODE[state])
        set_(("status_circuit", key, "failures"), float(failures))
        set_(("status_circuit", key, "pause"), pause)
        set_(("status_circuit", key, "opened_at"), opened_at or 0.0)
        if last_error is not None and (before is None or before[4] != last_error):
            self._errors += 1
            set_(("status_error", (*key, last_error), ""), float(self._errors))

    def publish_key_rest(self, provider: str, index: int, until: float) -> None:
        self.store.set(("status_key", (provider, str(index)), "rest_until"), until)

    def publish_listing(self, provider: str, models: int | None) -> None:
        self.store.set(("status_listing", (provider,), "models"), -1.0 if models is None else float(models))


def read(store) -> list[WorkerView]:
    """Every live worker's view, by slot."""
    views = []
    for pid, slot, alive, values in store.snapshot():
        if not alive:
            continue
        fields: dict[tuple[str, str], dict[str, float]] = {}
        errors: dict[tuple[str, str], tuple[float, str]] = {}
        listings: dict[str, int | None] = {}
        key_rests: dict[tuple[str, int], float] = {}
        started_at = None
        for (name, labels, part), value in values.items():
            if name == "status_circuit" and len(labels) == 2:
                fields.setdefault(tuple(labels), {})[part] = value
            elif name == "status_error" and len(labels) == 3:
                key = (labels[0], labels[1])
                if key not in errors or errors[key][0] < value:
                    errors[key] = (value, labels[2])
            elif name == "status_listing" and len(labels) == 1:
                listings[labels[0]] = None if value < 0 else int(value)
            elif name == "status_key" and len(labels) == 2 and labels[1].isdigit():
                key_rests[(labels[0], int(labels[1]))] = value
            elif name == "status_worker" and part == "started_at":
                started_at = value
        circuits = [
            CircuitView(
                provider=p,
                provider_model=m,
                state=STATES.get(int(f.get("state", 0)), State.CLOSED),
                failures=int(f.get("failures", 0)),
                pause_seconds=f.get("pause", 0.0),
                opened_at=f.get("opened_at") or None,
                last_error=errors.get((p, m), (0, None))[1],
            )
            for (p, m), f in sorted(fields.items())
            if f.get("state", 0) != _FORGOTTEN
        ]
        views.append(
            WorkerView(
                pid=pid, slot=slot, started_at=started_at, circuits=circuits, listings=listings, key_rests=key_rests
            )
        )
    return sorted(views, key=lambda v: v.slot)
