"""Which attempt follows another (tinygw.worker.proxy._next_attempt), in-process, on a
fake clock: docs/design.md section 4's attempt loop, one case per rule. The circuits are
real (tinygw.resilience.breaker), the gateway a stand-in holding what the rule reads."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from tinygw import errors
from tinygw.config.settings import Breaker, Target
from tinygw.protocol.routing import Resolution
from tinygw.resilience import outcome
from tinygw.resilience.breaker import Outcome
from tinygw.resilience.breakers import Breakers
from tinygw.worker import proxy
from tinygw.worker.record import Attempt

A, B, C = Target("a", "m"), Target("b", "m"), Target("c", "long")
FAST = 0.1


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def gateway(retry_fast_failures: bool = True, failures: int = 3):
    clock = FakeClock()
    breakers = Breakers(Breaker(failures=failures, open_seconds=30.0), clock, configured=[(A.provider, "m")])
    return SimpleNamespace(breakers=breakers, settings=SimpleNamespace(retry_fast_failures=retry_fast_failures)), clock


def after(judged: outcome.Judgement, other_key: bool = False) -> Attempt:
    return Attempt(judged, other_key=other_key)


def next_attempt(gw, last: Attempt, targets=(A, B), index: int = 0, quick_used: bool = False, longer=()):
    resolution = Resolution("m", tuple(targets), context_fallback=tuple(longer))
    circuit = gw.breakers.by_target[targets[index]]
    following = asyncio.run(
        proxy._next_attempt(gw, resolution, targets, index, circuit, last, quick_used)  # type: ignore[arg-type]
    )
    if following is None:
        return None
    retry, on, at, ticket = following
    ticket.done(Outcome.NEUTRAL)  # the slot is given back: the test only looks
    return retry, on[at]


@pytest.fixture(autouse=True)
def no_pause(monkeypatch):
    monkeypatch.setattr(proxy, "QUICK_RETRY_DELAY_SECONDS", 0.0)


def test_a_failure_that_may_fall_back_goes_to_the_next_target():
    gw, _ = gateway()
    assert next_attempt(gw, after(outcome.of_answer(500, FAST, b"{}"))) == (proxy.Retry.FALLBACK, B)


def test_an_answer_that_may_not_fall_back_is_final():
    gw, _ = gateway()
    assert next_attempt(gw, after(outcome.of_answer(400, FAST, b"{}"))) is None
    assert next_attempt(gw, after(outcome.of_answer(200, FAST, b"{}"))) is None


def test_a_429_with_another_key_free_tries_the_same_target_with_it():
    gw, _ = gateway()
    last = after(outcome.of_answer(429, FAST, b"{}"), other_key=True)
    assert next_attempt(gw, last) == (proxy.Retry.KEY_ROTATION, A)


def test_a_target_whose_circuit_is_open_is_skipped():
    gw, _ = gateway(failures=1)
    gw.breakers.by_target[B].allow().done(Outcome.FAILURE)  # b's circuit opens
    last = after(outcome.of_answer(500, FAST, b"{}"))
    assert next_attempt(gw, last, targets=(A, B, C)) == (proxy.Retry.FALLBACK, C)


def test_a_quick_failure_with_no_target_left_is_retried_once_on_the_same_target():
    gw, _ = gateway()
    quick = after(outcome.of_error(errors.ConnectError("refused")))
    assert next_attempt(gw, quick, targets=(A,)) == (proxy.Retry.QUICK, A)
    assert next_attempt(gw, quick, targets=(A,), quick_used=True) is None


@pytest.mark.parametrize(
    "judged",
    [outcome.of_error(errors.FirstByteTimeout("slow")), outcome.of_answer(503, 6.0, b"{}")],
    ids=["timeout", "slow_503"],
)
def test_a_failure_that_is_not_quick_is_not_retried(judged):
    gw, _ = gateway()
    assert next_attempt(gw, after(judged), targets=(A,)) is None


def test_no_quick_retry_when_it_is_off_or_the_failure_opened_the_circuit():
    quick = after(outcome.of_error(errors.ConnectError("refused")))
    gw, _ = gateway(retry_fast_failures=False)
    assert next_attempt(gw, quick, targets=(A,)) is None
    gw, _ = gateway(failures=1)
    gw.breakers.by_target[A].allow().done(Outcome.FAILURE)  # this failure opened it
    assert next_attempt(gw, quick, targets=(A,)) is None


def test_a_prompt_too_long_goes_to_the_context_fallback_in_order_and_only_there():
    gw, _ = gateway()
    too_long = after(outcome.of_answer(400, FAST, b'{"error": {"code": "context_length_exceeded"}}'))
    assert next_attempt(gw, too_long, longer=(C, B)) == (proxy.Retry.FALLBACK, C)
    assert next_attempt(gw, too_long, targets=(C, B), index=0, longer=()) is None  # none configured: final
    longer = (C, B)  # a prompt too long for the first of them goes on to the next
    assert next_attempt(gw, too_long, targets=longer, index=0, longer=longer) == (proxy.Retry.FALLBACK, B)


def test_a_circuit_that_opens_meanwhile_is_skipped_when_the_pause_is_not_over():
    gw, clock = gateway(failures=1)
    gw.breakers.by_target[B].allow().done(Outcome.FAILURE)
    last = after(outcome.of_answer(500, FAST, b"{}"))
    assert next_attempt(gw, last) is None
    clock.now += 31  # the pause is over: b admits a probe
    assert next_attempt(gw, last) == (proxy.Retry.FALLBACK, B)
