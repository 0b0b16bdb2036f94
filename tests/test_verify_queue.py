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
    settings = environment.from_environ({"TINYGW_CONFIG": "{}", "TINYGW_TSM_REPORT_DIR": str(tmp_path / "none"),
                                         "TINYGW_EVENT_LOG": str(tmp_path / "no-log")})
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


def test_one_address_holds_at_most_its_share_and_the_count_leaves_no_trace():
    async def scenario():
        queue = EvidenceQueue(waiting_max=8, wait_seconds=30, per_address_max=2)
        release = asyncio.Event()

        async def caller(address):
            async with queue.turn(address):
                await release.wait()

        hogs = [asyncio.create_task(caller("192.0.2.1")) for _ in range(2)]
        while queue.held.get("192.0.2.1") != 2:
            await asyncio.sleep(0)
        with pytest.raises(EvidenceUnavailable, match="2 attestations of this address"):
            async with queue.turn("192.0.2.1"):
                pass
        other = asyncio.create_task(caller("192.0.2.2"))  # another address still gets a place
        while "192.0.2.2" not in queue.held:
            await asyncio.sleep(0)
        release.set()
        await asyncio.gather(*hogs, other)
        return queue.held, queue.waiting

    assert asyncio.run(scenario()) == ({}, 0)



def test_an_ipv6_host_counts_as_its_64_and_a_mapped_ipv4_as_itself():
    async def scenario():
        queue = EvidenceQueue(waiting_max=8, wait_seconds=30, per_address_max=2)
        release = asyncio.Event()

        async def caller(address):
            async with queue.turn(address):
                await release.wait()

        async def refused(address) -> str:
            """Refused at once for its address, or (old code) admitted to wait."""
            try:
                async with asyncio.timeout(0.5), queue.turn(address):
                    return "served"
            except EvidenceUnavailable as e:
                return str(e)
            except TimeoutError:
                return "waiting"

        holders = [asyncio.create_task(caller(address)) for address in
                   ("2001:db8:1:2::a", "2001:db8:1:2:ffff::b", "::ffff:192.0.2.1", "192.0.2.1")]
        while queue.waiting < 3:
            await asyncio.sleep(0)
        verdicts = [await refused("2001:db8:1:2::c"), await refused("::ffff:192.0.2.1")]  # one host: a whole /64
        others = [asyncio.create_task(caller(address)) for address in ("2001:db8:1:3::a", "::ffff:192.0.2.2")]
        while queue.waiting < 5:
            await asyncio.sleep(0)
        release.set()
        await asyncio.gather(*holders, *others)
        return verdicts, queue.held

    assert asyncio.run(scenario()) == (["busy: 2 attestations of this address are under way; retry"] * 2, {})
