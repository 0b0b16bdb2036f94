"""A named client's limits (docs/design.md section 16), decided from counts and `now`.

Pure, in the breaker's shape: no timers and no state of its own; the counts live in a
flat sequence of floats that the caller owns (a list in one process, a map shared by
the workers: tinygw.observe.clienttable), and `now` is passed in (a monotonic clock
that every process of the machine shares).

A minute of counts is BUCKETS one-second buckets, each two floats: the second
(`floor(now)`) it counts, and its count. A count made at second `s` is in the window
while `s > now - WINDOW_SECONDS`: a sliding minute, to the second. A bucket whose second
has left the window is reused, its count started again from 0.

A request is admitted while every limit it has is not reached: in flight below
`max_concurrent`, admitted requests of the minute below `requests_per_minute`, tokens
of the minute below `tokens_per_minute` (a request's tokens are charged when its answer
ends: they are not known before). Over one, it is refused with the limit's name and the
whole seconds until it would pass (1 for `max_concurrent`: a request in flight may end
at any moment).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from msgspec import Struct

from tinygw.config.settings import Client

WINDOW_SECONDS = 60
BUCKETS = WINDOW_SECONDS  # one a second
MINUTE_FLOATS = 2 * BUCKETS  # (second, count) per bucket

Buckets = Iterable[tuple[float, float]]  # (second, count) of buckets in the window
Floats = Any  # where counts live: a list of floats, or a memoryview of a map's doubles


class OverLimit(Struct, frozen=True):
    """A request over a limit: the limit's name (a field of Client) and the whole
    seconds until a request would pass it, at least 1."""

    limit: str
    retry_after: int


def add(values: Floats, at: int, now: float, amount: float) -> None:
    """Count `amount` at `now` in the minute at `values[at : at + MINUTE_FLOATS]`."""
    second = int(now)  # floor: the monotonic clock is positive
    place = at + 2 * (second % BUCKETS)
    if values[place] != second:  # a bucket of a second that has left the window
        values[place + 1] = 0.0  # the count first: a reader never sees the old count under the new second
        values[place] = second
    values[place + 1] += amount


def in_window(values: Floats, at: int, now: float) -> list[tuple[float, float]]:
    """The (second, count) buckets of the minute at `values[at:]` that are in the window at `now`."""
    minute = values[at : at + MINUTE_FLOATS]
    cutoff = now - WINDOW_SECONDS
    return [(s, c) for s, c in zip(minute[0::2], minute[1::2], strict=True) if s > cutoff and c]


def total(buckets: Buckets) -> float:
    return sum(count for _, count in buckets)


def seconds_until_below(buckets: Buckets, limit: int, now: float) -> int:
    """Whole seconds from `now` until the buckets still in the window count less than
    `limit` (at least 1): the oldest leave first."""
    ordered = sorted(buckets)
    left = total(ordered)
    for second, count in ordered:
        left -= count
        if left < limit:  # once this bucket is out of the window, at second + WINDOW_SECONDS
            return max(1, math.ceil(second + WINDOW_SECONDS - now))
    return 1


def decide(client: Client, in_flight: float, requests: Buckets, tokens: Buckets, now: float) -> OverLimit | None:
    """Whether a request of `client` is admitted (None) or refused, given its requests in
    flight and the minute's admitted requests and tokens of every worker (buckets in the
    window; a bucket's second may appear once per worker)."""
    if client.max_concurrent is not None and in_flight >= client.max_concurrent:
        return OverLimit("max_concurrent", 1)
    for limit, buckets in (("requests_per_minute", requests), ("tokens_per_minute", tokens)):
        value = getattr(client, limit)
        if value is not None:
            counted = list(buckets)
            if total(counted) >= value:
                return OverLimit(limit, seconds_until_below(counted, value, now))
    return None
