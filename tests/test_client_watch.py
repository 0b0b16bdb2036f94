"""api/body.ClientWatch on an injected clock: how often its timer wakes while a body is
read slowly, and when the watch for the client leaving starts."""

from __future__ import annotations

import pytest

from tinygw.api.body import ClientWatch
from tinygw.worker.record import Record

TIMEOUT = 30.0
EVERY = 0.05


class Clock:
    """The loop's calls a ClientWatch makes: timers on a clock the test moves."""

    def __init__(self) -> None:
        self.now = 0.0
        self.timers: list[list] = []  # [when, callback, args, cancelled]
        self.wake_ups = 0
        self.tasks: list = []

    def time(self) -> float:
        return self.now

    def call_later(self, delay: float, callback, *args):
        return self.call_at(self.now + delay, callback, *args)

    def call_at(self, when: float, callback, *args):
        timer = [when, callback, args, False]
        self.timers.append(timer)
        clock = self

        class Handle:
            def cancel(self) -> None:
                timer[3] = True
                clock.timers.remove(timer) if timer in clock.timers else None

        return Handle()

    def create_task(self, coroutine):
        coroutine.close()
        self.tasks.append(coroutine)
        return Task()

    def advance(self, seconds: float) -> None:
        """Run every timer due within `seconds`, in order."""
        end = self.now + seconds
        while self.timers and min(t[0] for t in self.timers) <= end:
            timer = min(self.timers, key=lambda t: t[0])
            self.timers.remove(timer)
            self.now = timer[0]
            self.wake_ups += 1
            timer[1](*timer[2])
        self.now = end


class Task:
    cancelled = 0

    def cancel(self) -> None:
        self.cancelled += 1

    def uncancel(self) -> int:
        self.cancelled -= 1
        return self.cancelled

    def cancelling(self) -> int:
        return self.cancelled


async def _receive():
    return {"type": "http.disconnect"}


@pytest.fixture
def watched():
    clock, task = Clock(), Task()
    return clock, task, ClientWatch(_receive, task, clock, Record(b"id", 0.0), TIMEOUT, EVERY)  # type: ignore[arg-type]


def test_a_body_that_comes_slowly_costs_a_wake_up_per_timeout_not_twenty_a_second(watched):
    """A client that sends a byte every 29 s holds the request without ever timing out:
    the worker must not pay for it every 50 ms (thousands of such clients held a core)."""
    clock, task, watch = watched
    for _ in range(10):  # 290 s of a body that never ends
        clock.advance(29.0)
        watch.waiting_since = clock.now  # a message came
    assert task.cancelled == 0
    assert clock.wake_ups <= 2 * 10 + 1, clock.wake_ups


def test_a_body_with_no_message_for_the_timeout_cancels_the_request(watched):
    clock, task, watch = watched
    clock.advance(TIMEOUT - 0.01)
    assert task.cancelled == 0
    clock.advance(0.02)
    assert task.cancelled == 1 and watch.timed_out() == TIMEOUT


def test_the_watch_for_leaving_starts_at_the_first_look_after_a_quick_body(watched):
    clock, _, watch = watched
    watch.body_read(_receive)
    assert clock.tasks == []
    clock.advance(EVERY)
    assert len(clock.tasks) == 1


def test_the_watch_for_leaving_starts_when_a_slow_body_ends_not_at_its_deadline(watched):
    clock, _, watch = watched
    clock.advance(2.0)  # past the first look: the timer waits for the body's deadline
    watch.waiting_since = clock.now
    watch.body_read(_receive)
    assert len(clock.tasks) == 1
    assert [when for when, *_ in clock.timers] == [2.0 + TIMEOUT]  # the look at the answer's sends, only


def test_a_send_the_client_does_not_take_within_the_timeout_cuts_the_request(watched):
    clock, task, watch = watched
    record = watch._record
    watch.body_read(_receive)
    clock.advance(EVERY)  # the first look: the watch over the answer starts
    record.sending_since = clock.now  # a send begins, and the client takes none of it
    clock.advance(TIMEOUT - 0.01)
    assert task.cancelled == 0 and not watch.stalled
    clock.advance(0.02)
    assert task.cancelled == 1 and watch.stalled
    assert watch.took_back() and task.cancelled == 0  # the watch's own cancellation: a client that stalled


def test_a_stream_whose_client_takes_every_send_is_looked_at_once_a_timeout(watched):
    """A long stream read as it comes is never cut, and costs a wake-up per client timeout."""
    clock, task, watch = watched
    record = watch._record
    watch.body_read(_receive)
    clock.advance(EVERY)
    wake_ups = clock.wake_ups
    for _ in range(10 * 100):  # 10 timeouts of events every TIMEOUT / 100, each taken at once
        record.sending_since = clock.now
        record.sending_since = None
        clock.advance(TIMEOUT / 100)
    assert task.cancelled == 0 and not watch.stalled
    assert clock.wake_ups - wake_ups <= 11


def test_a_timeout_that_meets_the_server_s_cancellation_never_takes_that_back(watched):
    """The client timeout and the server's stop cancel the request together: asked (once
    by the discard after a 413, again by read_body), the watch takes back its own
    cancellation only, and the server's stays, so the request ends as the server asked."""
    clock, task, watch = watched
    task.cancel()  # the server is stopping
    clock.advance(TIMEOUT + 1)  # and the body's time is over
    assert task.cancelled == 2
    assert watch.timed_out() is None
    assert watch.timed_out() is None
    assert task.cancelled == 1


def test_the_watch_moves_by_its_table_only(watched):
    """Its phases follow one table: a quick body, the first look, the client leaving; any
    move the table has no row for (the body read twice) is a bug, and raises."""
    from tinygw.api.body import Phase
    from tinygw.resilience.breaker import IllegalTransition

    clock, task, watch = watched
    assert watch.phase is Phase.BODY
    watch.body_read(_receive)
    assert watch.phase is Phase.BODY_READ
    with pytest.raises(IllegalTransition):
        watch.body_read(_receive)
    clock.advance(EVERY)
    assert watch.phase is Phase.ANSWER and task.cancelled == 0
    assert watch.timed_out() is None and watch.phase is Phase.ANSWER  # a question, not a move
