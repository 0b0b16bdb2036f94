"""Routing strategies: the order in which one request tries a model's targets.

A strategy only orders; skipping open circuits is the attempt loop's job, the same
for every strategy. `failover` keeps the configured order; `round_robin` rotates the
starting target per request; `weighted` picks the first target by smooth weighted
round robin over the providers' weights (nginx's algorithm: over any window the picks
follow the weights, evenly interleaved), the rest following in configured order;
`shuffle` draws a random order.
"""

from __future__ import annotations

import random

from tinygw.config.settings import Model, Settings, Target


class Strategies:
    def __init__(self, settings: Settings, rng: random.Random | None = None) -> None:
        self._settings = settings
        self._rng = rng or random.Random()
        self._turn: dict[str, int] = {}
        self._current: dict[str, list[int]] = {}  # smooth WRR's current weights, per model

    def order(self, model: Model) -> list[Target]:
        targets = list(model.targets)
        if model.order_is_fixed():
            return targets
        if model.strategy == "round_robin":
            turn = self._turn.get(model.name, 0)
            self._turn[model.name] = (turn + 1) % len(targets)
            return targets[turn:] + targets[:turn]
        if model.strategy == "weighted":
            first = self._smooth_weighted(model.name, targets)
            return [targets[first], *targets[:first], *targets[first + 1 :]]
        self._rng.shuffle(targets)
        return targets

    def _smooth_weighted(self, name: str, targets: list[Target]) -> int:
        weights = [self._settings.providers[t.provider].doc.weight for t in targets]
        current = self._current.setdefault(name, [0] * len(targets))
        for i, w in enumerate(weights):
            current[i] += w
        best = max(range(len(targets)), key=current.__getitem__)
        current[best] -= sum(weights)
        return best
