"""A provider's key pool: the next key in turn, skipping keys that rest after a 429; with
conversation affinity, the conversation's key among those that do not rest. The rests are
the gateway's: in the gateway, `rest_until` is shared by its workers (tinygw.observe.shared),
so a key that rests rests for every worker."""

from __future__ import annotations

from collections.abc import Callable

from tinygw.resilience.rows import Floats
from tinygw.resilience.strategy import rendezvous

# A key answered 429 without a Retry-After rests this long.
DEFAULT_REST_SECONDS = 1.0


class KeyRing:
    """Indexes into a provider's keys (the keys themselves stay in the Gateway). `on_rest`
    is told each rest, (index, until), for the status page."""

    def __init__(
        self,
        size: int,
        on_rest: Callable[[int, float], None] | None = None,
        affinity: bool = False,
        rest_until: Floats | None = None,
    ) -> None:
        """`rest_until`: until when each key rests (monotonic), `size` floats; the ring's own when None."""
        self.size = max(1, size)
        self._next = 0
        self._rest_until = [0.0] * self.size if rest_until is None else rest_until
        self._on_rest = on_rest
        self.affinity = affinity and self.size > 1  # a conversation keeps its key (the provider's `affinity`)
        # Each key's name to rendezvous hashing: its place in the pool; the keys weigh the same.
        self._names = [b"%d" % index for index in range(self.size)]
        self._weights = [1] * self.size

    def peek(self, now: float) -> int:
        """The key `pick` would return now, without moving the rotation on (for the
        gateway's own requests, such as listings and health checks)."""
        for step in range(self.size):
            index = (self._next + step) % self.size
            if self._rest_until[index] <= now:
                return index
        return min(range(self.size), key=self._rest_until.__getitem__)

    def pick(self, now: float, conversation: bytes | None = None) -> int:
        """The next key in turn that is not resting, or with affinity the `conversation`'s
        first that is not (tinygw.resilience.strategy.rendezvous); if all rest, the one
        free soonest."""
        if self.size == 1:  # resting or not, the one key
            return 0
        if conversation is not None and self.affinity:
            for index in rendezvous(conversation, self._names, self._weights):
                if self._rest_until[index] <= now:
                    return index
            return min(range(self.size), key=self._rest_until.__getitem__)
        index = self.peek(now)
        if self._rest_until[index] <= now:
            self._next = (index + 1) % self.size
        return index

    def rest(self, index: int, now: float, seconds: float | None) -> None:
        self._rest_until[index] = now + (DEFAULT_REST_SECONDS if seconds is None else max(0.0, seconds))
        if self._on_rest is not None:
            self._on_rest(index, self._rest_until[index])

    def has_other(self, index: int, now: float) -> bool:
        """Is a key other than `index` free to use now?"""
        return any(i != index and until <= now for i, until in enumerate(self._rest_until))
