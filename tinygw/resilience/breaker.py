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

Metrics, logs and the status page show a circuit by its `shown` name: its upstream model,
or `*#h` once a sealed request named it (docs/confidential.md).
"""

from __future__ import annotations

import enum
import math
from collections import OrderedDict
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
        shown: str = "",
    ) -> None:
        self.provider = provider
        self.provider_model = provider_model
        self.shown = shown or provider_model  # or `*#h` once a sealed request named it (Breakers.circuit)
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
        self.label = self.shown  # its name in metrics and on the status page: `shown`, or OTHER (Breakers)
        self.forgotten = False  # no longer kept by its Breakers (it may still finish an attempt)

    # ---- reading ------------------------------------------------------------------------

    def target(self) -> Target:
        """Its target, as a request that reached it would name it: concealed when it is shown so."""
        concealed = self.shown if self.shown != self.provider_model else ""
        return Target(self.provider, self.provider_model, concealed=concealed)

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


class NamedCircuit(Circuit):
    """A circuit made for a name a client sent (a provider-qualified model, or a target of
    `*`): it may be forgotten (Breakers), so it knows when it last had a success."""

    succeeded_at: float | None = None  # the clock's time of its last success, None before one

    def _done(self, ticket: Ticket, outcome: Outcome, error: str | None) -> None:
        if outcome is _SUCCESS:
            self.succeeded_at = self._clock()
        super()._done(ticket, outcome, error)


def _show_as(circuit: NamedCircuit, concealed: str) -> None:
    """A sealed request named a circuit shown by its name (a plain request's first): it is shown as
    `concealed` from now on, its old name taken off as a forgotten circuit's is; its state is kept."""
    circuit.forgotten = True
    circuit._changed()
    circuit.forgotten = False
    circuit.shown = concealed
    if circuit.label != OTHER:
        circuit.label = concealed
    circuit._changed()


def forgettable(named: Iterable[NamedCircuit], now: float, recent_seconds: float) -> NamedCircuit | None:
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


class ByTarget(dict[Target, Circuit]):
    """The circuit of a target, `by_target[target]`: `circuit(target.provider,
    target.upstream_model, target.concealed)`. A configured target's is an entry, found by
    the subscript alone (no Python call); any other's (a name as sent, or a
    provider-qualified one) is asked of `circuit` each time and not kept here: clients
    cannot grow this dict. Only the subscript asks (`get` and `in` see the configured
    targets alone)."""

    def __init__(self, circuit: Callable[[str, str, str], Circuit]) -> None:
        super().__init__()
        self._circuit = circuit

    def __missing__(self, target: Target) -> Circuit:
        return self._circuit(target.provider, target.upstream_model, target.concealed)


class Breakers:
    """Every circuit of one worker process: the configured targets', made at the start and
    kept for good, and the named ones, made on first use and kept up to
    MAX_CIRCUITS_PER_PROVIDER per provider."""

    def __init__(
        self,
        settings: BreakerSettings,
        clock: Clock,
        on_transition: OnTransition | None = None,
        configured: Iterable[tuple[str, str]] = (),
        on_change: OnChange | None = None,
    ) -> None:
        """`on_transition` is told of every move, `on_change` of every circuit made and
        forgotten, and of every change to what its `snapshot()` returns."""
        self.settings = settings
        self._clock = clock
        self._on_transition = on_transition
        self._on_change = on_change
        self._circuits: dict[tuple[str, str], Circuit] = {}  # the configured targets'
        # Per provider, by name, least recently used first.
        self._named: dict[str, OrderedDict[str, NamedCircuit]] = {}
        self._labelled: dict[str, set[str]] = {}  # per provider: the names that have a label of their own
        # The configured targets' circuits exist from the start and are never forgotten;
        # found by their Target too, in one subscript (`by_target`).
        self.by_target = ByTarget(self.circuit)
        for provider, provider_model in configured:
            circuit = Circuit(provider, provider_model, settings, clock, on_transition, on_change)
            self._circuits[(provider, provider_model)] = self.by_target[Target(provider, provider_model)] = circuit
            circuit._changed()

    def circuit(self, provider: str, provider_model: str = "", concealed: str = "") -> Circuit:
        """The circuit of (provider, upstream model); "" is the provider's own breaker,
        for requests that name no model. `concealed`: the upstream model is a name a sealed
        body carried, to be shown so (docs/confidential.md); a configured target's name is
        the operator's, shown as it is."""
        circuit = self._circuits.get((provider, provider_model))
        if circuit is not None:
            return circuit
        named = self._named.setdefault(provider, OrderedDict())
        kept = named.get(provider_model)
        if kept is not None:
            named.move_to_end(provider_model)
            if concealed and kept.shown != concealed:
                _show_as(kept, concealed)
            return kept
        return self._make_named(provider, provider_model, named, concealed)

    def _make_named(
        self, provider: str, provider_model: str, named: OrderedDict[str, NamedCircuit], concealed: str
    ) -> Circuit:
        kept = True
        if len(named) >= MAX_CIRCUITS_PER_PROVIDER:
            old = forgettable(named.values(), self._clock(), self.settings.max_open_seconds)
            if old is None:  # every kept name is one that had a success lately: this one is not kept
                kept = False
            else:
                del named[old.provider_model]
                old.forgotten = True
                old._changed()
        settings, clock = self.settings, self._clock
        circuit = NamedCircuit(
            provider, provider_model, settings, clock, self._on_transition, self._on_change, concealed
        )
        labelled = self._labelled.setdefault(provider, set())
        if kept and provider_model not in labelled and len(labelled) < MAX_LABELS_PER_PROVIDER:
            labelled.add(provider_model)
        elif not kept or provider_model not in labelled:
            circuit.label = OTHER
        if kept:
            named[provider_model] = circuit
        circuit._changed()
        return circuit

    def of_provider(self, provider: str) -> list[Circuit]:
        configured = [c for (p, _), c in self._circuits.items() if p == provider]
        return configured + list(self._named.get(provider, {}).values())

    def all(self) -> list[Circuit]:
        return list(self._circuits.values()) + [c for named in self._named.values() for c in named.values()]
