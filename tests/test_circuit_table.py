"""The gateway's circuit table (docs/design.md section 4, "One circuit for the gateway"):
two tables over one directory are two workers of one gateway, on a fake clock."""

from __future__ import annotations

import fcntl
import os

from tinygw.config.settings import Breaker
from tinygw.observe.circuittable import CircuitTable
from tinygw.resilience.breaker import MAX_CIRCUITS_PER_PROVIDER, Outcome, State
from tinygw.resilience.breakers import Breakers

F, S = Outcome.FAILURE, Outcome.SUCCESS


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def alive(tmp_path, slot: int) -> int:
    """A live worker's mark, as the metric store makes it: its slot's lock, held (closed: it died)."""
    fd = os.open(tmp_path / f"slot-{slot}.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def workers(tmp_path, count=2, failures=5, probes=1):
    """`count` live workers' Breakers over one table, and the clock they share."""
    clock = FakeClock()
    for slot in range(1, count + 1):
        if not (tmp_path / f"slot-{slot}.lock").exists():
            alive(tmp_path, slot)  # held for the test's life
    settings = Breaker(failures=failures, open_seconds=30.0, max_open_seconds=300.0, half_open_probes=probes)
    tables = [CircuitTable(settings, {"p": ["m"]}, str(tmp_path), slot) for slot in range(1, count + 1)]
    return [Breakers(settings, clock, configured=[("p", "m")], table=t) for t in tables], clock


def fail(breakers: Breakers, times: int = 1) -> None:
    for _ in range(times):
        ticket = breakers.circuit("p", "m").allow()
        assert ticket is not None
        ticket.done(F, "502")


def test_the_workers_count_failures_into_one_circuit(tmp_path):
    (one, two), _ = workers(tmp_path)
    fail(one, 3)
    fail(two, 1)
    assert two.circuit("p", "m").state() is State.CLOSED
    fail(one, 1)
    assert [b.circuit("p", "m").state() for b in (one, two)] == [State.OPEN, State.OPEN]
    assert two.circuit("p", "m").allow() is None


def test_a_pause_admits_one_probe_for_the_gateway_and_its_failure_doubles_the_pause(tmp_path):
    (one, two), clock = workers(tmp_path)
    fail(one, 5)
    clock.now += 30
    probe = one.circuit("p", "m").allow()
    assert probe is not None and probe.probe
    assert two.circuit("p", "m").allow() is None  # the gateway's one probe is taken
    probe.done(F, "502")
    assert (two.circuit("p", "m").state(), two.circuit("p", "m").pause_seconds) == (State.OPEN, 60.0)


def test_a_success_in_one_worker_resets_the_count_of_the_other(tmp_path):
    (one, two), _ = workers(tmp_path)
    fail(one, 4)
    ticket = two.circuit("p", "m").allow()
    assert ticket is not None
    ticket.done(S)
    fail(one, 4)
    assert one.circuit("p", "m").state() is State.CLOSED


def test_a_dead_workers_probe_is_given_back_and_a_live_ones_is_not(tmp_path):
    (one, two), clock = workers(tmp_path)
    fail(one, 5)
    clock.now += 30
    assert one.circuit("p", "m").allow() is not None  # worker 1 holds the probe
    assert two.circuit("p", "m").allow() is None
    clock.now += 1
    assert two.circuit("p", "m").allow() is None  # worker 1 is alive: its probe is its own
    os.remove(tmp_path / "slot-1.lock")  # worker 1 dies: its slot's lock is free (no file: none held)
    clock.now += 1  # a full half-open circuit looks for dead workers' probes at most once a second
    ticket = two.circuit("p", "m").allow()
    assert ticket is not None and ticket.probe


def test_a_worker_started_again_in_its_slot_gives_back_the_probes_of_the_one_before(tmp_path):
    (one, _), clock = workers(tmp_path)
    fail(one, 5)
    clock.now += 30
    assert one.circuit("p", "m").allow() is not None
    assert one.circuit("p", "m").probes_in_flight == 1
    settings = one.settings
    again = Breakers(
        settings, clock, configured=[("p", "m")], table=CircuitTable(settings, {"p": ["m"]}, str(tmp_path), 1)
    )
    assert again.circuit("p", "m").probes_in_flight == 0
    assert again.circuit("p", "m").allow() is not None


def test_the_gateway_keeps_at_most_256_names_per_provider(tmp_path):
    (one, two), clock = workers(tmp_path)
    for i in range(200):
        one.circuit("p", f"a{i}")
        clock.now += 1
    failing = two.circuit("p", "b0")
    ticket = failing.allow()
    assert ticket is not None
    ticket.done(F, "502")  # a name with a failure counted: forgotten after the others
    for i in range(1, 200):
        two.circuit("p", f"b{i}")
        clock.now += 1
    table = one.table
    assert isinstance(table, CircuitTable)
    names = [c.provider_model for c in table.view() if c.provider == "p" and c.provider_model != "m"]
    assert len(names) == MAX_CIRCUITS_PER_PROVIDER
    assert "b0" in names and "b199" in names and "a0" not in names  # the least recently used first
    # A worker whose name's row was given away finds out at its next lookup, and gets a fresh circuit.
    assert one.circuit("p", "a0").failures == 0


def test_a_circuit_another_worker_made_is_among_the_providers_circuits(tmp_path):
    (one, two), _ = workers(tmp_path, failures=1)
    ticket = one.circuit("p", "named").allow()
    assert ticket is not None
    ticket.done(F, "502")
    [seen] = [c for c in two.of_provider("p") if c.shown == "named"]  # as the health check looks for open ones
    assert seen.state() is State.OPEN
    seen.health_ok(seen.generation)
    assert one.circuit("p", "named").state() is State.HALF_OPEN
