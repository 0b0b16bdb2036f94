"""A provider's key pool: round robin, skipping keys that rest after a 429."""

from __future__ import annotations

from tinygw.resilience.keys import DEFAULT_REST_SECONDS, KeyRing


def test_round_robin_across_keys():
    ring = KeyRing(3)
    assert [ring.pick(now=0.0) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_a_resting_key_is_skipped_until_its_rest_ends():
    ring = KeyRing(3)
    ring.rest(1, now=10.0, seconds=5.0)
    assert [ring.pick(now=12.0) for _ in range(4)] == [0, 2, 0, 2]
    assert [ring.pick(now=15.0) for _ in range(3)] == [0, 1, 2]  # key 1 is free again at 15


def test_rest_without_retry_after_uses_the_default():
    ring = KeyRing(2)
    ring.rest(0, now=10.0, seconds=None)
    assert ring.pick(now=10.0 + DEFAULT_REST_SECONDS / 2) == 1
    assert ring.pick(now=10.0 + DEFAULT_REST_SECONDS) == 0


def test_when_every_key_rests_the_one_free_soonest():
    ring = KeyRing(3)
    ring.rest(0, now=0.0, seconds=30.0)
    ring.rest(1, now=0.0, seconds=10.0)
    ring.rest(2, now=0.0, seconds=20.0)
    assert ring.pick(now=5.0) == 1
    assert ring.pick(now=5.0) == 1


def test_has_other():
    ring = KeyRing(2)
    assert ring.has_other(0, now=0.0)
    ring.rest(1, now=0.0, seconds=5.0)
    assert not ring.has_other(0, now=1.0)
    assert ring.has_other(1, now=1.0)  # key 0 is free
    assert ring.has_other(0, now=5.0)
    assert not KeyRing(1).has_other(0, now=0.0)


def test_peek_is_the_key_pick_would_return_without_moving_the_rotation():
    ring = KeyRing(3)
    assert [ring.peek(now=0.0) for _ in range(3)] == [0, 0, 0]
    assert ring.pick(now=0.0) == 0
    assert ring.peek(now=0.0) == 1
    ring.rest(1, now=0.0, seconds=5.0)
    assert ring.peek(now=1.0) == 2  # skips a resting key, as pick does
    assert [ring.pick(now=1.0) for _ in range(3)] == [2, 0, 2]  # the rotation is where peek left it
    ring.rest(0, now=1.0, seconds=30.0)
    ring.rest(2, now=1.0, seconds=20.0)
    assert ring.peek(now=2.0) == ring.pick(now=2.0) == 1  # all rest: the one free soonest


def test_each_rest_is_told_with_its_end_for_the_status_page():
    told: list[tuple[int, float]] = []
    ring = KeyRing(2, lambda index, until: told.append((index, until)))
    ring.rest(1, now=10.0, seconds=30.0)
    ring.rest(0, now=11.0, seconds=None)
    assert told == [(1, 40.0), (0, 11.0 + DEFAULT_REST_SECONDS)]
