"""Whose turn it is to have a quote made, and how loudly to say no (docs/design.md section 11).

The platform makes one quote at a time, slowly (milliseconds to a second), and anyone
may ask for one: `/attestation` needs no key. So callers wait their turn in a bounded
FIFO with a bounded wait; past either bound the answer is a 503 with Retry-After, which
attest/verify retries within its own deadline. A caller looping on the page can then
delay a verifier by a few quotes, never refuse it; and one address holds at most a few
places, so that callers that ask again at once when refused (ignoring Retry-After) fill
their own places, not a verifier's. The refusals are logged at most once
a minute, with how many there were, so that the same callers cannot flood the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
from collections.abc import AsyncIterator

from tinygw.errors import EvidenceUnavailable

# At most this many callers wait for a quote, each at most this long: a verifier queued
# behind a few looping callers still gets its turn, and a flood holds only this much.
WAITING_MAX = 16
WAIT_SECONDS = 10.0
RETRY_AFTER_SECONDS = 1
# Places (waiting or being served) that one client address may hold at once.
PER_ADDRESS_MAX = 2
# One warning line per this many seconds, carrying the count of what it stands for.
WARNING_EVERY_SECONDS = 60.0


class EvidenceQueue:
    """`async with queue.turn(address):` holds the one quote slot; EvidenceUnavailable when the
    queue is full, the address holds its share of places, or the wait is too long.
    asyncio.Lock wakes its waiters in order. `held` has an entry per address that holds a
    place, so at most waiting_max + 1 of them."""

    def __init__(self, waiting_max: int = WAITING_MAX, wait_seconds: float = WAIT_SECONDS,
                 per_address_max: int = PER_ADDRESS_MAX) -> None:
        self.waiting_max = waiting_max
        self.wait_seconds = wait_seconds
        self.per_address_max = per_address_max
        self.waiting = 0
        self.held: dict[str, int] = {}
        self._slot = asyncio.Lock()

    @contextlib.asynccontextmanager
    async def turn(self, address: str | None = None) -> AsyncIterator[None]:
        """`address`: the caller's, whose places are counted; None: not counted."""
        address = place_key(address)
        if address is not None and self.held.get(address, 0) >= self.per_address_max:
            raise EvidenceUnavailable(f"busy: {self.per_address_max} attestations of this address are under way; "
                                      "retry")
        if self.waiting >= self.waiting_max:
            raise EvidenceUnavailable(f"busy: {self.waiting} attestations are waiting; retry")
        if address is not None:
            self.held[address] = self.held.get(address, 0) + 1
        try:
            async with self._slot_within_bound():
                yield
        finally:
            if address is not None and (left := self.held.pop(address) - 1):
                self.held[address] = left

    @contextlib.asynccontextmanager
    async def _slot_within_bound(self) -> AsyncIterator[None]:
        self.waiting += 1
        try:
            async with asyncio.timeout(self.wait_seconds):
                await self._slot.acquire()
        except TimeoutError:
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

