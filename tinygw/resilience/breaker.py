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
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterable

from msgspec import Struct

from tinygw.config.settings import Breaker as BreakerSettings
from tinygw.config.settings import Target


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


def pause_over(opened_at: float | None, pause_seconds: float, now: float) -> bool:
    """Has an OPEN circuit's pause ended at `now`? The one rule by which OPEN turns
    HALF_OPEN, for the circuit itself and for the readers of its snapshot."""
    return opened_at is not None and now >= opened_at + pause_seconds


def pause_left(opened_at: float | None, pause_seconds: float, now: float) -> float:
    """Seconds until an OPEN circuit's pause ends (0 once it has): for the circuit and
    for the readers of its snapshot, as `pause_over`."""
    return max(0.0, (opened_at or 0.0) + pause_seconds - now)


class IllegalTransition(RuntimeError):
    """A move that TRANSITIONS has no row for: a bug in the caller."""


# Circuits one provider may have beyond its configured targets'. A provider-qualified
# request names its upstream model freely; past this many models, further ones share
# the provider's own circuit, so that clients cannot grow memory (and metric series)
# without bound.
MAX_CIRCUITS_PER_PROVIDER = 256

_SUCCESS, _CLOSED = Outcome.SUCCESS, State.CLOSED  # one global lookup each, for the usual attempt

Clock = Callable[[], float]
OnTransition = Callable[["Circuit", State, State], None]
OnChange = Callable[["Circuit"], None]


class Ticket(Struct, gc=False):
    """Permission for one attempt at `circuit`. `done()` reports its verdict once (with the
    attempt's label, kept as the circuit's last error when it is a failure); later calls
    are ignored. (A Struct: made in C, once per attempt. No cycle: a circuit keeps no ticket.)"""

    circuit: Circuit
    generation: int
    probe: bool = False  # admitted HALF_OPEN: it holds a probe's slot
    spent: bool = False

    def done(self, outcome: Outcome, error: str | None = None) -> None:
        if not self.spent:
            self.spent = True
            self.circuit._done(self, outcome, error)


class Circuit:
    def __init__(
        self,
        provider: str,
        provider_model: str,
        settings: BreakerSettings,
        clock: Clock,
        on_transition: OnTransition | None = None,
        on_change: OnChange | None = None,
    ) -> None:
        self.provider = provider
        self.provider_model = provider_model
        self.settings = settings
        self._clock = clock
        self._on_transition = on_transition
        self._on_change = on_change  # called whenever what `snapshot()` returns may have changed
        self._state = State.CLOSED
        self.generation = 0
        self.failures = 0  # consecutive failures while CLOSED
        self.pause_seconds = settings.open_seconds  # the pause of the current (or next) opening
        self.opened_at: float | None = None
        self.probes_in_flight = 0
        self.probe_successes = 0
        self.last_error: str | None = None
        self.enabled = settings.failures > 0  # 0 failures turns breakers off

    # ---- reading ------------------------------------------------------------------------

    def state(self) -> State:
        """The state now: an OPEN circuit whose pause has ended becomes HALF_OPEN here."""
        if self._state is State.OPEN and pause_over(self.opened_at, self.pause_seconds, self._clock()):
            self._move(Event.PAUSE_OVER)
        return self._state

    def _probe_free(self) -> bool:
        """HALF_OPEN: may one more probe go?"""
        return self.probes_in_flight + self.probe_successes < self.settings.half_open_probes

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
        if self._state is _CLOSED or not self.enabled:  # the usual answer, without the clock
            return Ticket(self, self.generation)
        state = self.state()
        if state is State.CLOSED:
            return Ticket(self, self.generation)
        if state is State.HALF_OPEN and self._probe_free():
            self.probes_in_flight += 1
            return Ticket(self, self.generation, True)
        return None

    def _done(self, ticket: Ticket, outcome: Outcome, error: str | None) -> None:
        """The verdict of an attempt (Ticket.done, once per ticket)."""
        if outcome is _SUCCESS and self._state is _CLOSED and not self.failures:
            return  # the usual verdict: it changes nothing, whatever the generation it was admitted in
        if ticket.generation != self.generation:
            return  # admitted before the last transition: it cannot move the new state
        if outcome is _SUCCESS and self._state is _CLOSED:  # after failures: the count resets, which is news
            self.failures = 0
            self._changed()
            return
        if outcome is Outcome.FAILURE and error:
            self.last_error = error
        failures = self.failures
        if self.enabled:
            self._count(ticket, outcome)
        # A move has told on_change already; else a failure (its count, its error) or a
        # success that reset the count is news, and the common success is not.
        if self.generation == ticket.generation and (outcome is Outcome.FAILURE or self.failures != failures):
            self._changed()

    def _count(self, ticket: Ticket, outcome: Outcome) -> None:
        if self._state is State.CLOSED:  # a success there was told by _done
            if outcome is Outcome.FAILURE:
                self.failures += 1
                if self.failures >= self.settings.failures:
                    self._move(Event.TRIP)
        elif self._state is State.HALF_OPEN and ticket.probe:
            self.probes_in_flight -= 1
            if outcome is Outcome.FAILURE:
                self.pause_seconds = min(self.pause_seconds * 2, self.settings.max_open_seconds)
                self._move(Event.PROBE_FAILED)
            elif outcome is Outcome.SUCCESS:
                self.probe_successes += 1
                if self.probe_successes >= self.settings.half_open_probes:
                    self.pause_seconds = self.settings.open_seconds
                    self._move(Event.PROBES_PASSED)
            # NEUTRAL: the slot is given back, nothing else changes

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(self)

    def health_ok(self) -> None:
        """A health check of the provider succeeded: an OPEN circuit may probe now."""
        if self.state() is State.OPEN:
            self._move(Event.HEALTH_OK)

    def _move(self, event: Event) -> None:
        old = self._state
        new = TRANSITIONS.get((old, event))
        if new is None:
            raise IllegalTransition(f"{event.value} in state {old.value}")
        self._state = new
        self.generation += 1
        self.probes_in_flight = 0
        self.probe_successes = 0
        if new is State.OPEN:
            self.opened_at = self._clock()
        elif new is State.CLOSED:
            self.failures = 0
            self.opened_at = None
        if self._on_transition is not None:
            self._on_transition(self, old, new)
        self._changed()


class ByTarget(dict[Target, Circuit]):
    """The circuit of a target, `by_target[target]`: `circuit(target.provider,
    target.upstream_model)`. A configured target's is an entry, found by the subscript
    alone (no Python call); any other's (a name as sent, or a provider-qualified one) is
    asked of `circuit` each time and not kept here: clients cannot grow this dict. Only
    the subscript asks (`get` and `in` see the configured targets alone)."""

    def __init__(self, circuit: Callable[[str, str], Circuit]) -> None:
        super().__init__()
        self._circuit = circuit

    def __missing__(self, target: Target) -> Circuit:
        return self._circuit(target.provider, target.upstream_model)


class Breakers:
    """Every circuit of one worker process, made on first use."""

    def __init__(
        self,
        settings: BreakerSettings,
        clock: Clock,
        on_transition: OnTransition | None = None,
        configured: Iterable[tuple[str, str]] = (),
        on_change: OnChange | None = None,
    ) -> None:
        """`on_transition` is told of every move, `on_change` of every circuit made and
        of every change to what its `snapshot()` returns."""
        self.settings = settings
        self._clock = clock
        self._on_transition = on_transition
        self._on_change = on_change
        self._circuits: dict[tuple[str, str], Circuit] = {}
        self._per_provider: dict[str, int] = {}  # circuits made on demand, per provider
        # The configured targets' circuits exist from the start and never share one; found
        # by their Target too, in one subscript (`by_target`).
        self.by_target = ByTarget(self.circuit)
        for provider, provider_model in configured:
            circuit = self._circuits[(provider, provider_model)] = self._make(provider, provider_model)
            self.by_target[Target(provider, provider_model)] = circuit

    def _make(self, provider: str, provider_model: str) -> Circuit:
        circuit = Circuit(provider, provider_model, self.settings, self._clock, self._on_transition, self._on_change)
        circuit._changed()
        return circuit

    def circuit(self, provider: str, provider_model: str = "") -> Circuit:
        """The circuit of (provider, upstream model); "" is the provider's own breaker,
        for requests that name no model."""
        key = (provider, provider_model)
        circuit = self._circuits.get(key)
        if circuit is None:
            if provider_model and self._per_provider.get(provider, 0) >= MAX_CIRCUITS_PER_PROVIDER:
                return self.circuit(provider, "")
            circuit = self._make(provider, provider_model)
            self._circuits[key] = circuit
            self._per_provider[provider] = self._per_provider.get(provider, 0) + 1
        return circuit

    def of_provider(self, provider: str) -> list[Circuit]:
        return [c for (p, _), c in self._circuits.items() if p == provider]

    def all(self) -> list[Circuit]:
        return list(self._circuits.values())
