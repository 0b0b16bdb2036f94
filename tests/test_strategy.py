"""Routing strategies: the order in which one request tries a model's targets."""

from __future__ import annotations

import json
import random

from tinygw.config.environment import from_environ
from tinygw.resilience.strategy import Strategies


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
