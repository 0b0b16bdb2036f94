"""/attestation's queue and its rate-limited warning, in process (docs/verify.md): callers
wait their turn within bounds, a refusal is a 503 with Retry-After, and the warning
about refusals is one line a minute with a count, on an injected clock."""

from __future__ import annotations

import asyncio
import json
import logging
import os

import pytest

from tinygw.api.attestation import attestation_page
from tinygw.config import environment
from tinygw.errors import EvidenceUnavailable
from tinygw.trust.evidence_queue import EvidenceQueue, RateLimitedWarning
from tinygw.worker.gateway import Gateway


def test_the_warning_is_one_line_a_minute_with_its_count():
    warning = RateLimitedWarning()
    assert warning.note(100.0) == 1  # the first at once
    assert [warning.note(100.0 + s) for s in range(1, 60)] == [None] * 59
    assert warning.note(160.0) == 60  # the 59 held back, and this one
    assert warning.note(170.0) is None
    assert warning.note(500.0) == 2


def test_callers_wait_their_turn_in_order_and_the_queue_is_bounded():
    async def scenario():
        queue = EvidenceQueue(waiting_max=2, wait_seconds=30)
        order = []
        release = asyncio.Event()

        async def caller(name, hold=False):
            async with queue.turn():
                order.append(name)
                if hold:
                    await release.wait()

        first = asyncio.create_task(caller("first", hold=True))
        await asyncio.sleep(0)
        waiting = [asyncio.create_task(caller(name)) for name in ("second", "third")]
        while queue.waiting < 2:
            await asyncio.sleep(0)
        with pytest.raises(EvidenceUnavailable, match="busy: 2 attestations are waiting"):
            async with queue.turn():
                pass
        release.set()
        await asyncio.gather(first, *waiting)
        return order, queue.waiting

    assert asyncio.run(scenario()) == (["first", "second", "third"], 0)


def test_a_wait_past_its_bound_is_refused_and_leaves_the_queue():
    async def scenario():
        queue = EvidenceQueue(waiting_max=4, wait_seconds=0.05)
        async with queue.turn():
            with pytest.raises(EvidenceUnavailable, match="no turn within 0.05 s"):
                async with queue.turn():
                    pass
        async with queue.turn():  # the slot is free again
            return queue.waiting

    assert asyncio.run(scenario()) == 0


def test_a_refusal_is_a_503_with_retry_after_and_a_rate_limited_warning(tmp_path, caplog):
    now = [1000.0]
    settings = environment.from_environ(
        {
            "TINYGW_CONFIG": "{}",
            "TINYGW_TSM_REPORT_DIR": str(tmp_path / "none"),
            "TINYGW_EVENT_LOG": str(tmp_path / "no-log"),
        }
    )
    gateway = Gateway(settings, clock=lambda: now[0])
    gateway.evidence_queue = EvidenceQueue(waiting_max=0)  # every caller is refused

    async def ask():
        sent = []

        async def send(message):
            sent.append(message)

        await attestation_page(gateway, {"query_string": b"nonce=" + os.urandom(32).hex().encode()}, send)
        return sent

    caplog.set_level(logging.WARNING, logger="tinygw")
    for seconds in (0, 1, 30, 59, 61):
        now[0] = 1000.0 + seconds
        start, body = asyncio.run(ask())
        assert start["status"] == 503 and (b"retry-after", b"1") in start["headers"]
        assert json.loads(body["body"])["error"]["code"] == "evidence_unavailable"
    warnings = [r for r in caplog.records if r.getMessage() == "attestation failed"]
    assert [r.fields["count"] for r in warnings] == [1, 4]  # at 0 s; at 61 s, for 1, 30, 59 and 61


async def _full_queue_of(queue: EvidenceQueue, addresses: list[str | None], release: asyncio.Event) -> list:
    """Callers from `addresses` (the first holds the slot, the others wait), until `release`."""

    async def caller(address):
        async with queue.turn(address):
            await release.wait()

    tasks = []
    for address in addresses:
        tasks.append(asyncio.create_task(caller(address)))
        while queue.waiting + 1 < len(tasks):
            await asyncio.sleep(0)
    return tasks


async def _outcome(queue: EvidenceQueue, address: str | None) -> str:
    """Refused at once ("busy: ..."), or admitted to wait ("waiting")."""
    try:
        async with asyncio.timeout(0.2), queue.turn(address):
            return "served"
    except EvidenceUnavailable as e:
        return str(e)
    except TimeoutError:
        return "waiting"


def test_in_a_full_queue_a_newcomer_takes_the_place_of_the_newest_waiter_of_the_heaviest_address():
    async def scenario():
        queue = EvidenceQueue(waiting_max=4, wait_seconds=30, per_address_share=2)
        release = asyncio.Event()
        tasks = await _full_queue_of(queue, ["192.0.2.1"] * 5, release)  # one in the slot, 4 waiting: full
        same = await _outcome(queue, "192.0.2.1")  # its own address makes no room for it
        other = asyncio.create_task(_outcome(queue, "192.0.2.2"))  # another does: the newest hog gives way
        while not tasks[-1].done():
            await asyncio.sleep(0)
        gave_way = str(tasks[-1].exception())
        outcome = await other
        release.set()
        await asyncio.gather(*tasks[:-1])
        return same, gave_way, outcome, queue.held, queue.waiters, queue.waiting

    same, gave_way, outcome, held, waiters, waiting = asyncio.run(scenario())
    assert same == "busy: 4 attestations are waiting; retry"
    assert gave_way == "busy: callers of this address hold more than its share of the queue; retry"
    assert outcome == "waiting" and (held, waiters, waiting) == ({}, [], 0)


@pytest.mark.parametrize(
    "hogs, same, other",
    [
        ([f"2001:db8:1:2::{n}" for n in range(1, 6)], "2001:db8:1:2:ffff::1", "2001:db8:1:3::1"),  # one host: a /64
        (["192.0.2.1", "::ffff:192.0.2.1"] * 2 + ["192.0.2.3"], "::ffff:192.0.2.1", "192.0.2.2"),  # mapped: itself
    ],
)
def test_an_ipv6_host_counts_as_its_64_and_a_mapped_ipv4_as_itself(hogs, same, other):
    async def scenario():
        queue = EvidenceQueue(waiting_max=4, wait_seconds=30, per_address_share=2)
        release = asyncio.Event()
        tasks = await _full_queue_of(queue, hogs, release)
        outcomes = [await _outcome(queue, same), await _outcome(queue, other)]
        release.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        return outcomes

    assert asyncio.run(scenario()) == ["busy: 4 attestations are waiting; retry", "waiting"]
