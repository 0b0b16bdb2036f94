"""Routing strategies: the order in which one request tries a model's targets."""

from __future__ import annotations

import collections
import hashlib
import json
import random

import msgspec
import pytest

from tinygw.config.environment import from_environ
from tinygw.resilience.strategy import Strategies, rendezvous


def settings(strategy: str, weights=(1, 1, 1)):
    names = "abc"[: len(weights)]
    doc = {
        "providers": {
            n: {"base_url": f"https://{n}.test", "api": "openai", "weight": w}
            for n, w in zip(names, weights, strict=True)
        },
        "models": {"m": {"targets": [f"{n}:up-{n}" for n in names], "strategy": strategy}},
    }
    return from_environ({"TINYGW_CONFIG": json.dumps(doc)})


def firsts(strategies: Strategies, model, calls: int) -> list[str]:
    return [strategies.order(model)[0].provider for _ in range(calls)]


def providers(targets) -> list[str]:
    return [t.provider for t in targets]


def test_failover_keeps_the_configured_order():
    s = settings("failover")
    strategies, model = Strategies(s), s.models["m"]
    for _ in range(3):
        assert providers(strategies.order(model)) == ["a", "b", "c"]


def test_round_robin_rotates_the_first_target_per_call():
    s = settings("round_robin")
    strategies, model = Strategies(s), s.models["m"]
    orders = [providers(strategies.order(model)) for _ in range(4)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]


def test_weighted_follows_smooth_weighted_round_robin():
    # nginx, weights a=2 b=1 (total 3), current weights before -> pick -> after:
    # [2,1] a [-1,1]; [1,2] b [1,-1]; [3,0] a [0,0]; then the cycle repeats.
    s = settings("weighted", weights=(2, 1))
    strategies, model = Strategies(s), s.models["m"]
    orders = [providers(strategies.order(model)) for _ in range(6)]
    assert [o[0] for o in orders] == ["a", "b", "a", "a", "b", "a"]
    assert all(sorted(o) == ["a", "b"] for o in orders)


def test_weighted_breaks_ties_by_configured_order_and_keeps_the_rest_in_it():
    # a=1 b=1 c=3 (total 5): [1,1,3] c [1,1,-2]; [2,2,1] a (tie: the first wins) [-3,2,1];
    # [-2,3,4] c [-2,3,-1]; [-1,4,2] b [-1,-1,2]; [0,0,5] c [0,0,0].
    s = settings("weighted", weights=(1, 1, 3))
    strategies, model = Strategies(s), s.models["m"]
    orders = [providers(strategies.order(model)) for _ in range(5)]
    assert [o[0] for o in orders] == ["c", "a", "c", "b", "c"]
    for order in orders:
        assert order[1:] == [p for p in ["a", "b", "c"] if p != order[0]]


def test_shuffle_returns_a_permutation_that_varies():
    s = settings("shuffle")
    strategies, model = Strategies(s, random.Random(7)), s.models["m"]
    orders = [tuple(providers(strategies.order(model))) for _ in range(20)]
    assert all(sorted(o) == ["a", "b", "c"] for o in orders)
    assert len(set(orders)) > 1
    assert providers(model.targets) == ["a", "b", "c"]  # the configuration is left as it was


# ---- conversation affinity: rendezvous hashing ----------------------------------------------

NAMES = [b"a:up-a", b"b:up-b", b"c:up-c"]
CONVERSATIONS = [hashlib.sha256(b"conversation %d" % i).digest() for i in range(10_000)]


def first_choices(names, weights) -> collections.Counter:
    return collections.Counter(names[rendezvous(c, names, weights)[0]] for c in CONVERSATIONS)


@pytest.mark.parametrize(
    ("names", "weights"),
    [
        (NAMES, [1, 1, 1]),
        (NAMES, [1, 2, 5]),
        (NAMES[:2], [1, 1]),
        ([b"0", b"1", b"2"], [1, 1, 1]),  # a key pool's names
    ],
)
def test_rendezvous_is_a_stable_order_of_every_candidate(names, weights):
    for conversation in CONVERSATIONS[:200]:
        order = rendezvous(conversation, names, weights)
        assert sorted(order) == list(range(len(names)))
        assert all(rendezvous(conversation, names, weights) == order for _ in range(3))  # stable across calls
        # the same order whatever the candidates' order in the list
        shuffled = list(reversed(names))
        assert [shuffled[i] for i in rendezvous(conversation, shuffled, list(reversed(weights)))] == [
            names[i] for i in order
        ]


@pytest.mark.parametrize(
    ("weights", "removed"),
    [([1, 1, 1], 0), ([1, 1, 1], 2), ([1, 2, 5], 2), ([1, 2, 5], 0)],
)
def test_a_removed_candidate_moves_only_its_conversations(weights, removed):
    kept = [i for i in range(3) if i != removed]
    moved = 0
    for conversation in CONVERSATIONS:
        before = NAMES[rendezvous(conversation, NAMES, weights)[0]]
        after_names = [NAMES[i] for i in kept]
        after = after_names[rendezvous(conversation, after_names, [weights[i] for i in kept])[0]]
        if before != NAMES[removed]:
            assert after == before  # a conversation of a candidate that stayed did not move
        else:
            moved += 1
            # it goes to its own second choice: where it would go back from when the candidate returns
            assert after == NAMES[rendezvous(conversation, NAMES, weights)[1]]
    assert moved > 0


@pytest.mark.parametrize("weights", [[1, 1, 1], [1, 2, 5], [3, 1, 1], [10, 1, 1]])
def test_conversations_spread_in_proportion_to_the_weights(weights):
    counts = first_choices(NAMES, weights)
    for name, weight in zip(NAMES, weights, strict=True):
        expected = len(CONVERSATIONS) * weight / sum(weights)
        assert abs(counts[name] - expected) < 0.05 * len(CONVERSATIONS), (name, counts, expected)


def test_a_spreading_strategy_orders_by_the_conversation():
    for strategy in ("round_robin", "weighted", "shuffle"):
        s = settings(strategy, weights=(1, 2, 1))
        strategies, model = Strategies(s, random.Random(7)), s.models["m"]
        for conversation in CONVERSATIONS[:50]:
            order = providers(strategies.order(model, conversation))
            assert all(providers(strategies.order(model, conversation)) == order for _ in range(3))
            expected = rendezvous(conversation, [t.name.encode() for t in model.targets], [1, 2, 1])
            assert order == [model.targets[i].provider for i in expected]


def test_without_a_conversation_or_affinity_the_strategy_turns_as_before():
    s = settings("round_robin")
    strategies, model = Strategies(s), s.models["m"]
    assert [strategies.order(model)[0].provider for _ in range(3)] == ["a", "b", "c"]
    off = msgspec.structs.replace(model, affinity=False)
    assert [strategies.order(off, CONVERSATIONS[0])[0].provider for _ in range(3)] == ["a", "b", "c"]
    failover = settings("failover")
    assert providers(Strategies(failover).order(failover.models["m"], CONVERSATIONS[0])) == ["a", "b", "c"]
