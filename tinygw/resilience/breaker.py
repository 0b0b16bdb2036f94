"""Circuit breakers: one per (provider, upstream model), as a pure state machine.

In gobreaker's shape: no timers; the state advances when it is read, with `now` from an
injected monotonic clock; a generation number changes on every transition, so that an
attempt admitted before a change cannot move the new state; `allow()` hands back a
`Ticket` whose `done(outcome)` reports the attempt's verdict when it ends (a stream's
may end minutes later). Every legal move is a row of `TRANSITIONS`; any other raises.

docs/design.md section 4: CLOSED -> OPEN after `failures` consecutive failures. OPEN skips the
target until the pause ends (or a health check succeeds), then HALF_OPEN admits
`half_open_probes` probes; that many successes in a row close it and reset the pause;
any probe failure reopens it with the pause doubled, capped at `max_open_seconds`. A
probe without a verdict (NEUTRAL: client left, 4xx, 429) gives its slot back.

Where the numbers live is not the breaker's: a circuit is handed a row (tinygw.resilience.rows),
its own alone (the unit tests), in the gateway a row of the table its workers share
(tinygw.observe.circuittable, docs/design.md section 4), changed under the row's lock.
Metrics, logs and the status page show a circuit by its `shown` name: its upstream model,
or `*#h` once a sealed request named it (docs/confidential.md).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterable
from typing import TypeVar

from msgspec import Struct

from tinygw.config.settings import Breaker as BreakerSettings
from tinygw.config.settings import Target
from tinygw.resilience import rows
from tinygw.resilience.rows import LocalRows, Rows


class State(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class Outcome(enum.Enum):
    SUCCESS = "success"
    FAILURE = "failure"
    NEUTRAL = "neutral"  # no verdict: the count is left as it was


class Event(enum.Enum):
    TRIP = "trip"  # the failure threshold was reached
    PAUSE_OVER = "pause_over"
    HEALTH_OK = "health_ok"  # a health check of the provider succeeded
    PROBE_FAILED = "probe_failed"
    PROBES_PASSED = "probes_passed"


TRANSITIONS: dict[tuple[State, Event], State] = {
    (State.CLOSED, Event.TRIP): State.OPEN,
    (State.OPEN, Event.PAUSE_OVER): State.HALF_OPEN,
    (State.OPEN, Event.HEALTH_OK): State.HALF_OPEN,
    (State.HALF_OPEN, Event.PROBE_FAILED): State.OPEN,
    (State.HALF_OPEN, Event.PROBES_PASSED): State.CLOSED,
}


def pause_ends(opened_at: float | None, pause_seconds: float) -> float:
    """When an OPEN circuit's pause ends: the one rule by which OPEN turns HALF_OPEN, for the
    circuit itself and for the readers of its row (the status page, tinygw_circuit_open)."""
    return (opened_at or 0.0) + pause_seconds


def pause_over(opened_at: float | None, pause_seconds: float, now: float) -> bool:
    """Has an OPEN circuit's pause ended at `now`?"""
    return bool(opened_at) and now >= pause_ends(opened_at, pause_seconds)


def pause_left(opened_at: float | None, pause_seconds: float, now: float) -> float:
    """Seconds until an OPEN circuit's pause ends (0 once it has)."""
    return max(0.0, pause_ends(opened_at, pause_seconds) - now)


class IllegalTransition(RuntimeError):
    """A move that TRANSITIONS has no row for: a bug in the caller."""


# Circuits one provider keeps beyond its configured targets': a provider-qualified
# request (or a target of `*`) names its upstream model freely. A circuit is never
# shared with another name; past this many, one is forgotten to make room (`forgettable`),
# so that clients cannot grow memory without bound.
MAX_CIRCUITS_PER_PROVIDER = 256
# Names of one provider that get metric series and status-page entries of their own;
# the circuits of later names are counted under OTHER, so that the series stay bounded
# however many names clients send (their circuits are still their own).
MAX_LABELS_PER_PROVIDER = 4 * MAX_CIRCUITS_PER_PROVIDER
OTHER = "(other)"

_SUCCESS, _NEUTRAL = Outcome.SUCCESS, Outcome.NEUTRAL  # and below, the row's fields the usual attempt reads
_STATE, _GENERATION, _FAILURES, _CLOSED_CODE = rows.STATE, rows.GENERATION, rows.FAILURES, rows.CLOSED_CODE
# A state's code in a row (tinygw.resilience.rows), and back.
_CODES = {State.CLOSED: rows.CLOSED_CODE, State.OPEN: rows.OPEN_CODE, State.HALF_OPEN: rows.HALF_OPEN_CODE}
_STATES = (State.CLOSED, State.OPEN, State.HALF_OPEN)
_T = TypeVar("_T")
_C = TypeVar("_C", bound="Circuit")

Clock = Callable[[], float]
OnTransition = Callable[["Circuit", State, State], None]
OnChange = Callable[["Circuit"], None]


class Ticket(Struct, gc=False):
    """Permission for one attempt at `circuit`. `done()` reports its verdict once (with the
    attempt's label, kept as the circuit's last error when it is a failure); later calls
    are ignored. (A Struct: made in C, once per attempt. No cycle: a circuit keeps no ticket.)"""

    circuit: Circuit
    generation: float
    probe: bool = False  # admitted HALF_OPEN: it holds a probe's slot
    spent: bool = False
    hold: int = -1  # the record of the probe's slot in the rows (Rows.hold), -1: none

    def done(self, outcome: Outcome, error: str | None = None) -> None:
        if not self.spent:
            self.spent = True
            self.circuit._done(self, outcome, error)


class Circuit:
    """One circuit, over the row `at` of `rows` (its own LocalRows when none is given):
    the numbers are the row's, the rules are here. Admitting through a CLOSED circuit
    and the usual success read the row and take no lock; every change takes the rows'
    lock, and reads the row again under it (another worker may have moved it)."""

    def __init__(
        self,
        provider: str,
        provider_model: str,
        settings: BreakerSettings,
        clock: Clock,
        on_transition: OnTransition | None = None,
        on_change: OnChange | None = None,
        shown: str = "",
        rows: Rows | None = None,
        at: int = 0,
    ) -> None:
        self.provider = provider
        self.provider_model = provider_model
        self.shown = shown or provider_model  # or `*#h` once a sealed request named it (Breakers.circuit)
        self.settings = settings
        self._clock = clock
        self._on_transition = on_transition
        self._on_change = on_change  # called whenever what `snapshot()` returns may have changed
        self._rows: Rows = LocalRows(settings.open_seconds) if rows is None else rows
        self._v = self._rows.values
        self._at = at
        self.last_error: str | None = None
        self.enabled = settings.failures > 0  # 0 failures turns breakers off
        self.label = self.shown  # its name in metrics and on the status page: `shown`, or OTHER (Breakers)
        self.forgotten = False  # no longer kept by its Breakers (it may still finish an attempt)
        self.key = 0.0  # its name's hash in a shared table (Breakers), 0 for a row of its own

    # ---- the row ----------------------------------------------------------------------------

    @property
    def _state(self) -> State:
        """The state last moved to, without reading the clock."""
        return _STATES[int(self._v[self._at + rows.STATE])]

    @property
    def generation(self) -> float:
        return float(self._v[self._at + rows.GENERATION])

    @property
    def failures(self) -> int:
        return int(self._v[self._at + rows.FAILURES])

    @property
    def pause_seconds(self) -> float:
        return float(self._v[self._at + rows.PAUSE])

    @property
    def opened_at(self) -> float | None:
        return self._v[self._at + rows.OPENED_AT] or None

    @property
    def probes_in_flight(self) -> int:
        return int(self._v[self._at + rows.PROBES])

    @property
    def probe_successes(self) -> int:
        return int(self._v[self._at + rows.PASSED])

    @property
    def succeeded_at(self) -> float | None:
        """The clock's time of its last success, None before one (what `forgettable` reads)."""
        return self._v[self._at + rows.SUCCEEDED_AT] or None

    # ---- reading ------------------------------------------------------------------------

    def target(self) -> Target:
        """Its target, as a request that reached it would name it: concealed when it is shown so."""
        concealed = self.shown if self.shown != self.provider_model else ""
        return Target(self.provider, self.provider_model, concealed=concealed)

    def _pause_over(self, now: float) -> bool:
        v, at = self._v, self._at
        return v[at + rows.STATE] == rows.OPEN_CODE and pause_over(v[at + rows.OPENED_AT], v[at + rows.PAUSE], now)

    def state(self) -> State:
        """The state now: an OPEN circuit whose pause has ended becomes HALF_OPEN here."""
        if self._pause_over(self._clock()):
            self._locked(self._advance)
        return self._state

    def _advance(self) -> None:
        """Under the lock: OPEN turns HALF_OPEN once its pause is over."""
        if self._pause_over(self._clock()):
            self._move(Event.PAUSE_OVER)

    def _probe_free(self) -> bool:
        """HALF_OPEN: may one more probe go?"""
        v, at = self._v, self._at
        return bool(v[at + rows.PROBES] + v[at + rows.PASSED] < self.settings.half_open_probes)

    def available(self) -> bool:
        """Would `allow()` admit an attempt now? (Takes no slot.)"""
        state = self.state()
        return state is State.CLOSED or (state is State.HALF_OPEN and self._probe_free())

    def retry_after(self) -> float | None:
        """Seconds until the next probe may be let through; None while it is available."""
        if self.available():
            return None
        if self._state is State.OPEN:
            return pause_left(self.opened_at, self.pause_seconds, self._clock())
        return 0.0  # HALF_OPEN with every probe slot taken: a verdict is due any moment

    def open_until(self) -> float:
        """When the pause of an OPEN circuit ends (the gauge tinygw_circuit_open's value), 0
        when it is not OPEN: the one rule its readers apply (pause_over, pause_left)."""
        v, at = self._v, self._at
        return pause_ends(v[at + rows.OPENED_AT], v[at + rows.PAUSE]) if v[at + rows.STATE] == rows.OPEN_CODE else 0.0

    def snapshot(self) -> tuple[State, int, float, float | None, str | None]:
        """(state, failures, pause_seconds, opened_at, last_error), for the status page.
        The state is the one last moved to, without reading the clock: an OPEN circuit
        whose pause is over reads OPEN until `state()` is next called (its reader
        applies `pause_over` with its own clock)."""
        return self._state, self.failures, self.pause_seconds, self.opened_at, self.last_error

    def retry_after_header(self) -> int:
        """The Retry-After of docs/design.md section 3: whole seconds until the next probe, at least 1."""
        return max(1, math.ceil(self.retry_after() or 0.0))

    # ---- attempts -------------------------------------------------------------------------

    def allow(self) -> Ticket | None:
        """A ticket for one attempt, or None: skip this target as if it were open."""
        v, at = self._v, self._at
        if v[at + _STATE] == _CLOSED_CODE or not self.enabled:  # the usual answer: a read of the row, no clock, no lock
            return Ticket(self, v[at + _GENERATION])
        if v[at + _STATE] == rows.OPEN_CODE and not self._pause_over(self._clock()):
            return None
        return self._locked(self._admit)

    def _admit(self) -> Ticket | None:
        """Under the lock: a ticket through a circuit that is not (or was not) CLOSED."""
        self._advance()
        v, at = self._v, self._at
        if v[at + rows.STATE] == _CLOSED_CODE:
            return Ticket(self, v[at + rows.GENERATION])
        if v[at + rows.STATE] != rows.HALF_OPEN_CODE:
            return None
        if not self._probe_free() and not self._rows.give_back(at, self._clock()):
            return None
        v[at + rows.PROBES] += 1
        generation = v[at + rows.GENERATION]
        return Ticket(self, generation, True, hold=self._rows.hold(at, generation))

    def _done(self, ticket: Ticket, outcome: Outcome, error: str | None) -> None:
        """The verdict of an attempt (Ticket.done, once per ticket). The usual one, a success
        through a CLOSED circuit that counts no failure, changes nothing: no lock."""
        v, at = self._v, self._at
        if outcome is _SUCCESS:
            if v[at + _STATE] == _CLOSED_CODE and not v[at + _FAILURES]:
                return
        elif outcome is _NEUTRAL and not ticket.probe:
            return  # no verdict, no slot to give back: nothing changes
        self._locked(self._verdict, ticket, outcome, error)

    def _verdict(self, ticket: Ticket, outcome: Outcome, error: str | None) -> None:
        """Under the lock: count a verdict that may change the row."""
        if ticket.hold >= 0:
            self._rows.release(ticket.hold)
        v, at = self._v, self._at
        if ticket.generation != v[at + rows.GENERATION]:
            return  # admitted before the last transition: it cannot move the new state
        if outcome is Outcome.FAILURE and error:
            self.last_error = error
            self._rows.set_error(at, error)
        failures = v[at + rows.FAILURES]
        if self.enabled:
            self._count(ticket, outcome)
        # A move has told on_change already; else a failure (its count, its error) or a
        # success that reset the count is news.
        if v[at + rows.GENERATION] == ticket.generation and (
            outcome is Outcome.FAILURE or v[at + rows.FAILURES] != failures
        ):
            self._changed()

    def _count(self, ticket: Ticket, outcome: Outcome) -> None:
        v, at = self._v, self._at
        state = v[at + rows.STATE]
        if state == _CLOSED_CODE:
            if outcome is Outcome.FAILURE:
                v[at + rows.FAILURES] += 1
                if v[at + rows.FAILURES] >= self.settings.failures:
                    self._move(Event.TRIP)
            elif outcome is _SUCCESS:  # after failures: the count resets
                v[at + rows.FAILURES] = 0.0
        elif state == rows.HALF_OPEN_CODE and ticket.probe:
            v[at + rows.PROBES] -= 1
            if outcome is Outcome.FAILURE:
                v[at + rows.PAUSE] = min(v[at + rows.PAUSE] * 2, self.settings.max_open_seconds)
                self._move(Event.PROBE_FAILED)
            elif outcome is _SUCCESS:
                v[at + rows.PASSED] += 1
                if v[at + rows.PASSED] >= self.settings.half_open_probes:
                    v[at + rows.PAUSE] = self.settings.open_seconds
                    self._move(Event.PROBES_PASSED)
            # NEUTRAL: the slot is given back, nothing else changes

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(self)

    def health_ok(self, generation: float | None = None) -> None:
        """A health check of the provider succeeded: an OPEN circuit may probe now. With
        `generation` (the circuit's when the check began), only if it has not moved since."""
        self._locked(self._health_ok, generation)

    def _health_ok(self, generation: float | None) -> None:
        self._advance()
        if generation is not None and generation != self.generation:
            return  # it moved during the check: not the check's to move
        if self._state is State.OPEN:
            self._move(Event.HEALTH_OK)

    def _locked(self, work: Callable[..., _T], *args: object) -> _T:
        rows_ = self._rows
        rows_.lock()
        try:
            return work(*args)
        finally:
            rows_.unlock()

    def _move(self, event: Event) -> None:
        """Under the lock: the one way the state changes (TRANSITIONS)."""
        old = self._state
        new = TRANSITIONS.get((old, event))
        if new is None:
            raise IllegalTransition(f"{event.value} in state {old.value}")
        v, at = self._v, self._at
        v[at + rows.GENERATION] += 1  # first: a worker that dies here leaves the old state, moved on
        v[at + rows.STATE] = _CODES[new]
        v[at + rows.PROBES] = v[at + rows.PASSED] = 0.0
        if new is State.OPEN:
            v[at + rows.OPENED_AT] = self._clock()
        elif new is State.CLOSED:
            v[at + rows.FAILURES] = v[at + rows.OPENED_AT] = 0.0
        if self._on_transition is not None:
            self._on_transition(self, old, new)
        self._changed()


class NamedCircuit(Circuit):
    """A circuit made for a name a client sent (a provider-qualified model, or a target of
    `*`): it may be forgotten (Breakers); `succeeded_at` says when it last had a success."""

    def _done(self, ticket: Ticket, outcome: Outcome, error: str | None) -> None:
        if outcome is _SUCCESS:
            self._v[self._at + rows.SUCCEEDED_AT] = self._clock()
        super()._done(ticket, outcome, error)


def forgettable(named: Iterable[_C], now: float, recent_seconds: float) -> _C | None:
    """Which of a provider's named circuits (least recently used first) is forgotten to make
    room for a new name (docs/design.md section 16): the least recently used of those closed
    with no failure counted (nothing is lost), else of those that never had a success, else
    of those whose last success is older than `recent_seconds`. None: every one had a
    success lately and counts failures now; none is forgotten for a name that never had one."""
    circuits = list(named)
    for keep in (
        lambda c: c._state is State.CLOSED and not c.failures,
        lambda c: c.succeeded_at is None,
        lambda c: now - (c.succeeded_at or now) > recent_seconds,
    ):
        for circuit in circuits:
            if keep(circuit):
                return circuit
    return None
