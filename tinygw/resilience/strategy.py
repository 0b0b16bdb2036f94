"""Routing strategies: the order in which one request tries a model's targets.

A strategy only orders; skipping open circuits is the attempt loop's job, the same
for every strategy. `failover` keeps the configured order; `round_robin` rotates the
starting target per request; `weighted` picks the first target by smooth weighted
round robin over the providers' weights (nginx's algorithm: over any window the picks
follow the weights, evenly interleaved), the rest following in configured order;
`shuffle` draws a random order. The counters of `round_robin` and `weighted` are the
gateway's, shared by its workers (tinygw.resilience.rows.Runs, `runs`), so that they
spread the gateway's requests, not each worker's: each turn is taken under their lock.

With conversation affinity (a spreading strategy's default), a request that carries a
conversation key (tinygw.protocol.conversation.conversation_key) is ordered by `rendezvous`
instead: the same conversation gets the same first target at every turn, in every
worker and replica, with no state kept (docs/design.md section 4).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from hashlib import blake2b

from tinygw.config.settings import Model, Settings, Target
from tinygw.resilience.rows import Floats, LocalRuns, Runs

_SCALE = 2.0**64  # a candidate's hash, read as an integer, over this is a number in (0, 1)


def rendezvous(conversation: bytes, names: Sequence[bytes], weights: Sequence[int]) -> list[int]:
    """The indexes of `names` in a conversation's order of preference: weighted
    rendezvous (highest random weight) hashing. Each candidate's score is
    weight / -ln(u), u uniform in (0, 1) drawn from a hash of (conversation, name);
    the highest comes first. A candidate that drops out takes only the conversations
    it was first for, which go to their second, and get them back when it returns;
    over many conversations each candidate is first in proportion to its weight.
    `conversation` is fixed-length (32 bytes), so no two (conversation, name) pairs
    hash the same input."""
    scores = [
        weight / -math.log((int.from_bytes(blake2b(conversation + name, digest_size=8).digest()) + 0.5) / _SCALE)
        for name, weight in zip(names, weights, strict=True)
    ]
    return sorted(range(len(scores)), key=scores.__getitem__, reverse=True)


def runs(settings: Settings) -> dict[str, int]:
    """The shared counters the strategies keep: per model that spreads, its turn
    (round_robin) or its current weights, one per target (weighted)."""
    counters = {}
    for model in settings.models.values():
        if model.strategy == "round_robin":
            counters[f"turn:{model.name}"] = 1
        elif model.strategy == "weighted":
            counters[f"weights:{model.name}"] = len(model.targets)
    return counters


class Strategies:
    def __init__(self, settings: Settings, rng: random.Random | None = None, shared: Runs | None = None) -> None:
        self._settings = settings
        self._rng = rng or random.Random()
        self._shared = shared if shared is not None else LocalRuns(runs(settings))
        counters = runs(settings)
        self._turn: dict[str, Floats] = {n[5:]: self._shared.run(n) for n in counters if n.startswith("turn:")}
        # smooth WRR's current weights, per model
        self._current: dict[str, Floats] = {n[8:]: self._shared.run(n) for n in counters if n.startswith("weights:")}

    def order(self, model: Model, conversation: bytes | None = None) -> list[Target]:
        """`model`'s targets in the order one request tries them; `conversation`: the
        request's conversation key, when it chooses (tinygw.protocol.routing.Resolution.affinity)."""
        targets = list(model.targets)
        if model.order_is_fixed():
            return targets
        if conversation is not None and model.affinity:
            providers = self._settings.providers
            weights = [providers[t.provider].doc.weight for t in targets]
            return [targets[i] for i in rendezvous(conversation, [t.name.encode() for t in targets], weights)]
        if model.strategy == "round_robin":
            turn = self._take_turn(model.name, len(targets))
            return targets[turn:] + targets[:turn]
        if model.strategy == "weighted":
            first = self._smooth_weighted(model.name, targets)
            return [targets[first], *targets[:first], *targets[first + 1 :]]
        self._rng.shuffle(targets)
        return targets

    def _take_turn(self, name: str, count: int) -> int:
        counter, shared = self._turn.setdefault(name, [0.0]), self._shared  # a model of the configuration's
        shared.lock()
        try:
            turn = int(counter[0]) % count
            counter[0] = float((turn + 1) % count)
        finally:
            shared.unlock()
        return turn

    def _smooth_weighted(self, name: str, targets: list[Target]) -> int:
        weights = [self._settings.providers[t.provider].doc.weight for t in targets]
        current, shared = self._current.setdefault(name, [0.0] * len(targets)), self._shared
        shared.lock()
        try:
            for i, w in enumerate(weights):
                current[i] += w
            best = max(range(len(targets)), key=current.__getitem__)
            current[best] -= sum(weights)
        finally:
            shared.unlock()
        return best
