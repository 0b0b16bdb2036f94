"""Whose turn it is to have a quote made, and how loudly to say no (docs/design.md section 11).

The platform makes one quote at a time, slowly (milliseconds to a second), and anyone
may ask for one: `/attestation` needs no key. So callers wait their turn in a bounded
FIFO with a bounded wait; past either bound the answer is a 503 with Retry-After, which
attest/verify retries within its own deadline. A caller looping on the page can then
delay a verifier by a few quotes, never refuse it. Callers that ask again at once when
refused (ignoring Retry-After) would keep a full queue theirs: so in a full queue a
newcomer from an address that holds little takes the place of the newest waiter of the
address that holds the most, when that one holds more than its share. The refusals are
logged at most once a minute, with how many there were, so that the same callers cannot
flood the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
from collections.abc import AsyncIterator
from dataclasses import dataclass

from tinygw.errors import EvidenceUnavailable

# At most this many callers wait for a quote, each at most this long: a verifier queued
# behind a few looping callers still gets its turn, and a flood holds only this much.
WAITING_MAX = 16
WAIT_SECONDS = 10.0
RETRY_AFTER_SECONDS = 1
# An address's share of a full queue (places waiting or being served): past it, its newest
# waiter gives way to a newcomer from an address that holds less.
PER_ADDRESS_SHARE = 2
# One warning line per this many seconds, carrying the count of what it stands for.
WARNING_EVERY_SECONDS = 60.0


@dataclass
class _Waiter:
    address: str | None
    timeout: asyncio.Timeout
    evicted: bool = False


class EvidenceQueue:
    """`async with queue.turn(address):` holds the one quote slot; EvidenceUnavailable when the
    queue is full (and no place can be made), the waiter gave way, or the wait is too long.
    asyncio.Lock wakes its waiters in order. `held` has an entry per address that holds a
    place, `waiters` one per caller waiting: both are bounded by the queue."""

    def __init__(
        self,
        waiting_max: int = WAITING_MAX,
        wait_seconds: float = WAIT_SECONDS,
        per_address_share: int = PER_ADDRESS_SHARE,
    ) -> None:
        self.waiting_max = waiting_max
        self.wait_seconds = wait_seconds
        self.per_address_share = per_address_share
        self.waiting = 0
        self.held: dict[str, int] = {}
        self.waiters: list[_Waiter] = []
        self._slot = asyncio.Lock()

    @contextlib.asynccontextmanager
    async def turn(self, address: str | None = None) -> AsyncIterator[None]:
        """`address`: the caller's, whose places are counted; None: not counted."""
        address = place_key(address)
        if self.waiting >= self.waiting_max and not self._make_room(address):
            raise EvidenceUnavailable(f"busy: {self.waiting} attestations are waiting; retry")
        if address is not None:
            self.held[address] = self.held.get(address, 0) + 1
        try:
            async with self._slot_within_bound(address):
                yield
        finally:
            if address is not None and (left := self.held.pop(address) - 1):
                self.held[address] = left

    def _make_room(self, address: str | None) -> bool:
        """Have the newest waiter of the address that holds the most give way to `address`, when
        that one holds more than its share and more than `address` would; True when it does."""
        mine = self.held.get(address, 0) + 1 if address is not None else 1
        heavy = [
            (self.held[w.address], w)
            for w in self.waiters
            if w.address is not None and not w.evicted and self.held[w.address] > max(self.per_address_share, mine)
        ]
        if not heavy:
            return False
        most = max(held for held, _ in heavy)
        victim = next(w for held, w in reversed(heavy) if held == most)
        victim.evicted = True
        victim.timeout.reschedule(asyncio.get_running_loop().time())  # its wait ends now, as a refusal
        return True

    @contextlib.asynccontextmanager
    async def _slot_within_bound(self, address: str | None) -> AsyncIterator[None]:
        self.waiting += 1
        waiter = None
        try:
            async with asyncio.timeout(self.wait_seconds) as timeout:
                waiter = _Waiter(address, timeout)
                self.waiters.append(waiter)
                try:
                    await self._slot.acquire()
                finally:
                    self.waiters.remove(waiter)
        except TimeoutError:
            if waiter is not None and waiter.evicted:
                raise EvidenceUnavailable(
                    "busy: callers of this address hold more than its share of the queue; retry"
                ) from None
            raise EvidenceUnavailable(f"busy: no turn within {self.wait_seconds:g} s; retry") from None
        finally:
            self.waiting -= 1
        try:
            yield
        finally:
            self._slot.release()


def place_key(address: str | None) -> str | None:
    """What a client address's places are counted under: an IPv4 address (mapped into IPv6
    or not) itself; an IPv6 address its /64, which one host commonly holds whole."""
    try:
        ip = ipaddress.ip_address(address) if address is not None else None
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return address


class RateLimitedWarning:
    """note(now) -> None, or the count to log: the first refusal is logged at once, the
    others of the next minute are counted into the first line after it. `now` is a
    monotonic clock reading, passed in."""

    def __init__(self, every_seconds: float = WARNING_EVERY_SECONDS) -> None:
        self.every_seconds = every_seconds
        self._last: float | None = None
        self._count = 0

    def note(self, now: float) -> int | None:
        self._count += 1
        if self._last is not None and now - self._last < self.every_seconds:
            return None
        count, self._count, self._last = self._count, 0, now
        return count
