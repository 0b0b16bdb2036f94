"""A provider's key pool: round robin, skipping keys that rest after a 429."""

from __future__ import annotations

import collections
import hashlib

from tinygw.resilience.keys import DEFAULT_REST_SECONDS, KeyRing
from tinygw.resilience.strategy import rendezvous


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


# ---- conversation affinity ------------------------------------------------------------------

CONVERSATIONS = [hashlib.sha256(b"conversation %d" % i).digest() for i in range(3_000)]


def test_with_affinity_a_conversation_keeps_its_key_and_the_keys_spread():
    ring = KeyRing(3, affinity=True)
    chosen = [ring.pick(0.0, c) for c in CONVERSATIONS]
    assert all(ring.pick(0.0, c) == k for c, k in zip(CONVERSATIONS, chosen, strict=True))
    counts = collections.Counter(chosen)
    assert all(abs(counts[k] - 1_000) < 150 for k in range(3)), counts
    assert chosen == [rendezvous(c, [b"0", b"1", b"2"], [1, 1, 1])[0] for c in CONVERSATIONS]


def test_with_affinity_only_a_resting_keys_conversations_move_and_they_come_back():
    ring = KeyRing(3, affinity=True)
    before = [ring.pick(0.0, c) for c in CONVERSATIONS]
    ring.rest(1, now=10.0, seconds=5.0)
    during = [ring.pick(12.0, c) for c in CONVERSATIONS]
    for b, d in zip(before, during, strict=True):
        assert d == b if b != 1 else d != 1
    assert [ring.pick(15.0, c) for c in CONVERSATIONS] == before  # key 1 rested its 5 s


def test_with_affinity_every_key_resting_gives_the_one_free_soonest():
    ring = KeyRing(3, affinity=True)
    ring.rest(0, now=0.0, seconds=30.0)
    ring.rest(1, now=0.0, seconds=10.0)
    ring.rest(2, now=0.0, seconds=20.0)
    assert {ring.pick(1.0, c) for c in CONVERSATIONS[:50]} == {1}


def test_without_affinity_or_a_conversation_the_keys_go_in_turn():
    assert [KeyRing(3).pick(0.0, CONVERSATIONS[0]) for _ in range(1)] == [0]
    ring = KeyRing(3, affinity=False)
    assert [ring.pick(0.0, CONVERSATIONS[0]) for _ in range(4)] == [0, 1, 2, 0]
    ring = KeyRing(3, affinity=True)
    assert [ring.pick(0.0) for _ in range(4)] == [0, 1, 2, 0]
