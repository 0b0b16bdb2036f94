"""Circuit breakers: unit tests of the pure state machine on a fake clock (docs/design.md section 4)."""

from __future__ import annotations

import pytest

from tinygw.config.settings import Breaker, Target
from tinygw.resilience.breaker import (
    MAX_CIRCUITS_PER_PROVIDER,
    MAX_LABELS_PER_PROVIDER,
    OTHER,
    TRANSITIONS,
    Circuit,
    Event,
    IllegalTransition,
    Outcome,
    State,
)
from tinygw.resilience.breakers import Breakers

S, F, N = Outcome.SUCCESS, Outcome.FAILURE, Outcome.NEUTRAL


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make(failures=3, open_seconds=30.0, max_open_seconds=100.0, probes=1, on_transition=None):
    clock = FakeClock()
    settings = Breaker(
        failures=failures, open_seconds=open_seconds, max_open_seconds=max_open_seconds, half_open_probes=probes
    )
    return Circuit("p", "m", settings, clock, on_transition), clock


def report(circuit: Circuit, *outcomes: Outcome) -> None:
    """One attempt per outcome, each admitted and finished in turn."""
    for outcome in outcomes:
        ticket = circuit.allow()
        assert ticket is not None, f"not admitted in state {circuit.state()}"
        ticket.done(outcome)


def trip(circuit: Circuit) -> None:
    report(circuit, *[F] * circuit.settings.failures)
    assert circuit.state() is State.OPEN


def half_open(circuit: Circuit, clock: FakeClock) -> None:
    trip(circuit)
    clock.now += circuit.pause_seconds
    assert circuit.state() is State.HALF_OPEN


# ---- CLOSED: counting failures -------------------------------------------------------


def test_opens_after_exactly_n_consecutive_failures():
    circuit, _ = make(failures=3)
    report(circuit, F, F)
    assert circuit.state() is State.CLOSED
    report(circuit, F)
    assert circuit.state() is State.OPEN


def test_a_success_between_failures_resets_the_count():
    circuit, _ = make(failures=3)
    report(circuit, F, F, S, F, F)
    assert circuit.state() is State.CLOSED
    report(circuit, F)
    assert circuit.state() is State.OPEN


def test_a_neutral_outcome_leaves_the_count_as_it_was():
    circuit, _ = make(failures=3)
    report(circuit, F, F, N)
    assert (circuit.state(), circuit.failures) == (State.CLOSED, 2)
    report(circuit, F)  # the third failure in a row: the neutral one neither reset nor counted
    assert circuit.state() is State.OPEN


# ---- OPEN: skipping, Retry-After -------------------------------------------------------


def test_open_refuses_and_says_when_the_probe_is_due():
    circuit, clock = make(open_seconds=30.0)
    trip(circuit)
    assert circuit.allow() is None
    assert circuit.retry_after() == pytest.approx(30.0)
    assert circuit.retry_after_header() == 30
    clock.now += 10.75
    assert circuit.allow() is None
    assert circuit.retry_after() == pytest.approx(19.25)
    assert circuit.retry_after_header() == 20  # whole seconds, rounded up
    clock.now += 19.15
    assert circuit.allow() is None
    assert circuit.retry_after_header() == 1  # 0.1 s left: at least 1
    clock.now += 0.1
    assert circuit.retry_after() is None  # the pause is over: a probe may go
    assert circuit.allow() is not None


# ---- HALF_OPEN: probes -----------------------------------------------------------------


def test_one_probe_at_a_time_however_often_allow_is_called():
    circuit, clock = make(probes=1)
    half_open(circuit, clock)
    tickets = [circuit.allow() for _ in range(10)]
    assert sum(t is not None for t in tickets) == 1
    assert tickets[0] is not None and tickets[0].probe
    assert circuit.retry_after() == 0.0 and circuit.retry_after_header() == 1


def test_n_probes_at_once_and_n_successes_close_it():
    circuit, clock = make(probes=3)
    half_open(circuit, clock)
    tickets = [circuit.allow() for _ in range(10)]
    probes = [t for t in tickets if t is not None]
    assert len(probes) == 3
    probes[0].done(S)
    probes[1].done(S)
    assert circuit.state() is State.HALF_OPEN
    assert circuit.allow() is None  # two passed, one in flight: no slot is free
    probes[2].done(S)
    assert circuit.state() is State.CLOSED


def test_probe_failure_reopens_with_the_pause_doubled_up_to_the_cap():
    circuit, clock = make(open_seconds=30.0, max_open_seconds=100.0)
    half_open(circuit, clock)
    pauses = []
    for _ in range(4):
        circuit.allow().done(F)
        assert circuit.state() is State.OPEN
        pauses.append(circuit.retry_after())
        clock.now += pauses[-1] - 1
        assert circuit.state() is State.OPEN  # not early
        clock.now += 1
        assert circuit.state() is State.HALF_OPEN
    assert pauses == pytest.approx([60.0, 100.0, 100.0, 100.0])


def test_closing_resets_the_pause_for_the_next_opening():
    circuit, clock = make(open_seconds=30.0, max_open_seconds=100.0)
    half_open(circuit, clock)
    circuit.allow().done(F)  # reopened for 60 s
    clock.now += 60.0
    circuit.allow().done(S)
    assert circuit.state() is State.CLOSED
    trip(circuit)
    assert circuit.retry_after() == pytest.approx(30.0)


def test_a_neutral_probe_gives_its_slot_back():
    circuit, clock = make(probes=1)
    half_open(circuit, clock)
    probe = circuit.allow()
    assert circuit.allow() is None
    probe.done(N)
    assert circuit.state() is State.HALF_OPEN
    second = circuit.allow()
    assert second is not None and second.probe
    second.done(S)
    assert circuit.state() is State.CLOSED


# ---- generations and tickets -----------------------------------------------------------


def close_again(circuit: Circuit, clock: FakeClock) -> None:
    """Open the circuit, let the pause end and a probe pass: CLOSED, in a new generation."""
    half_open(circuit, clock)
    report(circuit, *[S] * circuit.settings.half_open_probes)
    assert circuit.state() is State.CLOSED


def test_a_stale_closed_failure_does_not_count_in_the_next_closed_period():
    circuit, clock = make(failures=2)
    stale = circuit.allow()  # taken while CLOSED, before the opening
    close_again(circuit, clock)
    report(circuit, F)  # one failure of two in the new CLOSED period
    stale.done(F)  # counted, it would be the second in a row and open the circuit
    assert (circuit.state(), circuit.failures) == (State.CLOSED, 1)
    report(circuit, F)
    assert circuit.state() is State.OPEN


def test_a_stale_closed_success_does_not_reset_the_next_closed_period():
    circuit, clock = make(failures=2)
    stale = circuit.allow()  # taken while CLOSED, before the opening
    close_again(circuit, clock)
    report(circuit, F)
    stale.done(S)  # counted, it would reset the count to 0
    assert (circuit.state(), circuit.failures) == (State.CLOSED, 1)
    report(circuit, F)
    assert circuit.state() is State.OPEN


def test_a_stale_probe_success_cannot_help_close_the_next_half_open():
    circuit, clock = make(probes=2)
    half_open(circuit, clock)
    first, stale = circuit.allow(), circuit.allow()
    first.done(F)  # reopened: `stale` is a probe of the last HALF_OPEN period
    clock.now += circuit.pause_seconds
    assert circuit.state() is State.HALF_OPEN
    stale.done(S)  # counted, it would be one of the two successes that close it
    assert (circuit.state(), circuit.probes_in_flight, circuit.probe_successes) == (State.HALF_OPEN, 0, 0)
    probes = [circuit.allow(), circuit.allow()]
    assert all(p is not None and p.probe for p in probes) and circuit.allow() is None
    probes[0].done(S)
    assert circuit.state() is State.HALF_OPEN  # one fresh success of two
    probes[1].done(S)
    assert circuit.state() is State.CLOSED


def test_a_stale_probe_failure_cannot_reopen_the_next_half_open():
    circuit, clock = make(probes=2)
    half_open(circuit, clock)
    first, stale = circuit.allow(), circuit.allow()
    first.done(F)  # reopened: `stale` is a probe of the last HALF_OPEN period
    clock.now += circuit.pause_seconds
    assert circuit.state() is State.HALF_OPEN
    stale.done(F)
    assert circuit.state() is State.HALF_OPEN


def test_a_stale_neutral_probe_frees_no_slot_in_the_next_half_open():
    circuit, clock = make(probes=2)
    half_open(circuit, clock)
    first, stale = circuit.allow(), circuit.allow()
    first.done(F)  # reopened: `stale` is a probe of the last HALF_OPEN period
    clock.now += circuit.pause_seconds
    probes = [circuit.allow(), circuit.allow()]
    assert all(p is not None for p in probes) and circuit.allow() is None
    stale.done(N)  # its slot went with its period: nothing to give back
    assert circuit.probes_in_flight == 2
    assert circuit.allow() is None  # still no more than two probes at once


# docs/design.md section 7's status page shows a circuit's last error: a ticket admitted before
# the last transition must not overwrite it (its verdict no longer belongs to this state).
def test_a_stale_failure_does_not_overwrite_the_last_error():
    circuit, clock = make(failures=2)
    stale = circuit.allow()  # taken while CLOSED, before the opening
    half_open(circuit, clock)
    circuit.allow().done(F, "probe: 502")  # current: reopens and is the last error
    assert (circuit.state(), circuit.last_error) == (State.OPEN, "probe: 502")
    stale.done(F, "stale: connect_error")
    assert circuit.last_error == "probe: 502"


def test_done_twice_counts_once():
    circuit, _ = make(failures=2)
    ticket = circuit.allow()
    ticket.done(F)
    ticket.done(F)
    assert (circuit.state(), circuit.failures) == (State.CLOSED, 1)


# ---- breaker off, health checks, callbacks, the table -----------------------------------


def test_breaker_off_never_opens_and_always_allows():
    circuit, _ = make(failures=0)
    for _ in range(100):
        ticket = circuit.allow()
        assert ticket is not None
        ticket.done(F)
    assert circuit.state() is State.CLOSED
    assert circuit.retry_after() is None


def test_health_ok_half_opens_an_open_circuit_before_the_pause_ends():
    circuit, clock = make(open_seconds=30.0)
    trip(circuit)
    clock.now += 1.0
    circuit.health_ok()
    assert circuit.state() is State.HALF_OPEN
    assert circuit.allow() is not None


def test_health_ok_does_nothing_when_closed():
    changes = []
    circuit, _ = make(on_transition=lambda c, old, new: changes.append(new))
    generation = circuit.generation
    circuit.health_ok()
    assert (circuit.state(), circuit.generation, changes) == (State.CLOSED, generation, [])


def test_on_transition_reports_each_move_in_order():
    changes = []
    circuit, clock = make(failures=1, on_transition=lambda c, old, new: changes.append((c, old, new)))
    half_open(circuit, clock)
    circuit.allow().done(S)
    assert changes == [
        (circuit, State.CLOSED, State.OPEN),
        (circuit, State.OPEN, State.HALF_OPEN),
        (circuit, State.HALF_OPEN, State.CLOSED),
    ]


def test_a_move_with_no_row_raises():
    circuit, _ = make()
    assert (State.CLOSED, Event.PROBES_PASSED) not in TRANSITIONS
    with pytest.raises(IllegalTransition):
        circuit._move(Event.PROBES_PASSED)
    assert circuit.state() is State.CLOSED


def test_breakers_make_one_circuit_per_provider_and_model():
    breakers = Breakers(Breaker(), FakeClock())
    one = breakers.circuit("a", "m1")
    assert breakers.circuit("a", "m1") is one
    others = [breakers.circuit("a", "m2"), breakers.circuit("b", "m1"), breakers.circuit("a", "")]
    assert len({id(c) for c in [one, *others]}) == 4
    own = breakers.circuit("a")
    assert own is others[2] and (own.provider, own.provider_model) == ("a", "")


def test_a_targets_circuit_is_its_provider_and_models_and_only_configured_ones_are_kept_by_target():
    breakers = Breakers(Breaker(), FakeClock(), configured=[("a", "m1")])
    configured = breakers.by_target[Target("a", "m1")]
    assert configured is breakers.circuit("a", "m1")
    as_sent = breakers.by_target[Target("a", "free-form")]  # made on demand, by circuit()
    assert as_sent is breakers.circuit("a", "free-form") and breakers.by_target[Target("a", "free-form")] is as_sent
    assert list(breakers.by_target) == [Target("a", "m1")]  # a client's names do not grow it


def fail_until_open(circuit: Circuit, failures: int = 3) -> None:
    report(circuit, *[F] * failures)
    assert circuit.state() is State.OPEN


def test_circuits_are_never_shared_and_the_bound_forgets_idle_ones_least_recently_used_first():
    clock = FakeClock()
    breakers = Breakers(Breaker(failures=3), clock, configured=[("b", "configured")])
    names = [breakers.circuit("b", f"m{n}") for n in range(MAX_CIRCUITS_PER_PROVIDER)]
    breakers.circuit("b", "m0")  # used again: now the most recently used
    newcomer = breakers.circuit("b", "one-more")
    assert newcomer not in names and newcomer.provider_model == "one-more"  # its own, never another's
    assert names[1].forgotten and not names[0].forgotten  # the least recently used idle one made room
    assert breakers.circuit("b", "m1") is not names[1]  # a forgotten name starts afresh
    assert not breakers.circuit("b", "configured").forgotten  # a configured target's is kept for good


def test_names_counting_failures_are_forgotten_only_when_they_never_had_a_success_lately():
    clock = FakeClock()
    breakers = Breakers(Breaker(failures=3, max_open_seconds=300), clock)
    good = breakers.circuit("b", "good")
    report(good, S)  # a name that served a client
    fail_until_open(good)
    junk = [breakers.circuit("b", f"junk-{n}") for n in range(MAX_CIRCUITS_PER_PROVIDER - 1)]
    for circuit in junk:  # every other kept name failing: none is idle
        fail_until_open(circuit)
    clock.now += 10
    breakers.circuit("b", "junk-new")
    assert junk[0].forgotten and not good.forgotten  # a name that never had a success goes first
    for n in range(MAX_CIRCUITS_PER_PROVIDER):  # the table filled with failing junk again and again
        fail_until_open(breakers.circuit("b", f"more-junk-{n}"))
    assert not good.forgotten and breakers.circuit("b", "good") is good  # never forgotten for junk
    assert len(breakers.of_provider("b")) == MAX_CIRCUITS_PER_PROVIDER


def test_when_every_kept_name_had_a_success_lately_a_new_name_is_served_by_a_circuit_not_kept():
    clock = FakeClock()
    breakers = Breakers(Breaker(failures=3), clock)
    kept = [breakers.circuit("b", f"m{n}") for n in range(MAX_CIRCUITS_PER_PROVIDER)]
    for circuit in kept:
        report(circuit, S)
        fail_until_open(circuit)
    newcomer = breakers.circuit("b", "new")
    assert not any(c.forgotten for c in kept) and newcomer not in kept
    assert newcomer.label == OTHER and breakers.circuit("b", "new") is not newcomer  # not kept, not labelled
    clock.now += 301  # past PROVIDER_BREAKER_MAX_OPEN_SECONDS: their successes are old, one may make room
    assert breakers.circuit("b", "newer") is breakers.circuit("b", "newer") and kept[0].forgotten


def test_past_the_label_bound_names_are_counted_under_other():
    breakers = Breakers(Breaker(), FakeClock())
    for n in range(MAX_LABELS_PER_PROVIDER):
        assert breakers.circuit("b", f"m{n}").label == f"m{n}"
    assert breakers.circuit("b", "m-late").label == OTHER
    assert breakers.circuit("c", "m0").label == "m0"  # per provider
