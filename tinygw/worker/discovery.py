"""Model discovery and health checks of open circuits: background loops, one round for the gateway.

Started and cancelled by the ASGI lifespan (`start`, `stop`); docs/design.md sections 5 and 6.
`/v1/models` (tinygw.api.app) lists what the listings found.

- Listing, every `PROVIDER_LISTING_SECONDS` (0: off), the first at start: each
  provider with `listing` on gets GET `{base_url}/models` (`{base_url}/v1/models` for
  anthropic) with its key. A 2xx `{"data": [{"id": ...}]}` replaces its entry in
  `gateway.listings` and sets `tinygw_listing_up` to 1; any failure removes the entry
  (its discovered models are hidden) and sets the gauge to 0.
- Health check, every `PROVIDER_HEALTH_CHECK_SECONDS` (0: off): each provider with an
  open circuit gets GET its `health_path` (a path on the provider's host, as given)
  or else its listing path, with its key. A 2xx moves the circuits that were open when
  the check began, and have not moved since, to HALF_OPEN early; a failure changes
  nothing.

Every worker runs both loops, but a round is the gateway's: a worker runs it only when it
takes the turn (`take_turn`: the round's next time, shared by the workers, moved on under
their lock), so a health check runs once per interval for the gateway and a listing once
per refresh. The turn's listing is written into the run's directory (`listing-N.json`)
and its result into the shared runs (`listed:PROVIDER`: a version and the models' count,
-1 when it failed), which every worker reads (`synced`): /v1/models, `tinygw_listing_up`
and the status page show the gateway's last listing, whichever worker ran it.

Neither passes through a breaker or is counted by one. Each request is bounded by the
pool's connect, first-byte and total timeouts; a round asks its providers at once, so
a slow one delays no other. A failure is logged with the provider and the exception
type or status, never a body or a key.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable

import msgspec

from tinygw import errors, logs
from tinygw.config.settings import Provider
from tinygw.resilience.breaker import Circuit, State
from tinygw.resilience.rows import Runs
from tinygw.worker.gateway import Gateway
from tinygw.worker.upstreams import Upstream

# A listing or health answer over this size is a failure: room for thousands of model
# entries with descriptions and prices, and a bound on what a worker reads whole.
MAX_ANSWER_BYTES = 16 * 1024 * 1024

# Anthropic refuses a request without this header; clients send it on their own
# requests, but a listing is the gateway's own. A provider's `headers` may override it.
ANTHROPIC_VERSION = (b"anthropic-version", b"2023-06-01")


class _Entry(msgspec.Struct):
    id: str


class _Listing(msgspec.Struct):
    data: list[_Entry]


_decode_listing = msgspec.json.Decoder(_Listing)
_decode_ids = msgspec.json.Decoder(list[str])

# The shared runs of discovery (tinygw.worker.gateway.shared_runs): "discovery", when each
# round is next due (monotonic); "listed:PROVIDER", its last listing's version and models' count.
LISTING_TURN, HEALTH_TURN = 0, 1


def take_turn(shared: Runs, round_: int, now: float, seconds: float) -> bool:
    """Is the round `round_` (LISTING_TURN, HEALTH_TURN) this worker's to run now? It is when
    it is due; it is then next due in `seconds`, for every worker."""
    due = shared.run("discovery")
    shared.lock()
    try:
        if now < due[round_]:
            return False
        due[round_] = now + seconds
        return True
    finally:
        shared.unlock()


def listing_path(provider: Provider) -> str:
    return provider.origin.path + ("/v1/models" if provider.doc.api == "anthropic" else "/models")


def health_path(provider: Provider) -> str:
    return provider.doc.health_path or listing_path(provider)


class _ErrorStatus(Exception):
    """The provider answered, but not with a 2xx."""

    def __init__(self, status: int) -> None:
        self.status = status


def _why(e: Exception) -> dict:
    return {"status": e.status} if isinstance(e, _ErrorStatus) else {"error": type(e).__name__}


async def _get(gateway: Gateway, upstream: Upstream, path: str) -> bytes:
    """The body of a 2xx answer to a GET with the provider's key (the one its next
    request would use; the rotation of request keys is left as it was); raises
    UpstreamError, or _ErrorStatus for any other status."""
    headers = upstream.fixed_headers[upstream.keys.peek(gateway.clock())]
    if upstream.provider.doc.api == "anthropic" and not any(k == ANTHROPIC_VERSION[0] for k, _ in headers):
        headers = [*headers, ANTHROPIC_VERSION]
    response = await upstream.pool.request(b"GET", upstream.target(path.encode()), headers, b"")
    try:
        body = await response.read(MAX_ANSWER_BYTES)
    finally:
        await response.aclose()
    if not 200 <= response.status < 300:
        raise _ErrorStatus(response.status)
    return body


# ---- listing -------------------------------------------------------------------------


async def list_models(gateway: Gateway, name: str) -> None:
    """One listing of provider `name`, for the gateway: its result is published to every
    worker (`publish`), and its entry in `gateway.listings` replaced or removed."""
    upstream = gateway.upstreams[name]
    try:
        body = await _get(gateway, upstream, listing_path(upstream.provider))
        ids = list(dict.fromkeys(e.id for e in _decode_listing.decode(body).data if e.id))
    except (errors.UpstreamError, msgspec.DecodeError, _ErrorStatus) as e:
        publish(gateway, name, None)
        logs.log(logging.WARNING, "provider listing failed", provider=name, **_why(e))
        return
    publish(gateway, name, ids)


def _listing_file(gateway: Gateway, name: str) -> str | None:
    directory = gateway.run_directory
    return (
        None if directory is None else os.path.join(directory, f"listing-{sorted(gateway.upstreams).index(name)}.json")
    )


def publish(gateway: Gateway, name: str, ids: list[str] | None) -> None:
    """The gateway's listing of provider `name` is `ids` (None: it failed): its models in the
    run's directory (written whole, then renamed), then its count and a new version."""
    path = _listing_file(gateway, name)
    if path is not None and ids is not None:
        with open(path + ".new", "wb") as f:
            f.write(msgspec.json.encode(ids))
        os.replace(path + ".new", path)
    listed, shared = gateway.shared.run(f"listed:{name}"), gateway.shared
    shared.lock()
    try:
        listed[0] += 1
        listed[1] = -1.0 if ids is None else float(len(ids))
        gateway.listed_versions[name] = listed[0]
    finally:
        shared.unlock()
    _take(gateway, name, ids)


def _take(gateway: Gateway, name: str, ids: list[str] | None) -> None:
    if ids is None:
        gateway.listings.pop(name, None)
    else:
        gateway.listings[name] = ids


def listed(gateway: Gateway, name: str) -> int | None:
    """The models the gateway's last listing of `name` found; None before one, or when it failed."""
    version, count = gateway.shared.run(f"listed:{name}")
    return int(count) if version and count >= 0 else None


def listings_up(gateway: Gateway) -> dict[str, bool]:
    """Whether the gateway's last listing of each provider that had one succeeded (tinygw_listing_up)."""
    return {name: listed(gateway, name) is not None for name in gateway.settings.providers if _version(gateway, name)}


def _version(gateway: Gateway, name: str) -> float:
    return float(gateway.shared.run(f"listed:{name}")[0])


def synced(gateway: Gateway) -> dict[str, list[str]]:
    """`gateway.listings`, brought up to the gateway's last listings (another worker may have run them)."""
    for name, version in gateway.listed_versions.items():
        current = gateway.shared.run(f"listed:{name}")[0]
        if current == version:
            continue
        gateway.listed_versions[name] = current
        path = _listing_file(gateway, name)
        try:
            if path is None or listed(gateway, name) is None:
                raise OSError
            with open(path, "rb") as f:
                _take(gateway, name, _decode_ids.decode(f.read()))
        except (OSError, msgspec.DecodeError):
            _take(gateway, name, None)
    return gateway.listings


def lists_models(provider: Provider) -> bool:
    """Whether a provider is asked for its models: `listing` on, and not Claude on a cloud
    (Bedrock's and Vertex's model lists are on other hosts, under other credentials)."""
    return provider.doc.listing and not provider.cloud


async def list_all(gateway: Gateway) -> None:
    names = [n for n, u in gateway.upstreams.items() if lists_models(u.provider)]
    await asyncio.gather(*(_guarded(name, list_models(gateway, name)) for name in names))


# ---- health checks -------------------------------------------------------------------


async def check_health(gateway: Gateway, name: str, circuits: list[Circuit]) -> None:
    """One health check of provider `name`, whose `circuits` are open now."""
    upstream = gateway.upstreams[name]
    generations = [(c, c.generation) for c in circuits]
    try:
        await _get(gateway, upstream, health_path(upstream.provider))
    except (errors.UpstreamError, _ErrorStatus) as e:
        logs.log(logging.INFO, "provider health check failed", provider=name, **_why(e))
        return
    for circuit, generation in generations:
        circuit.health_ok(generation)  # only if it has not moved during the check


async def check_all(gateway: Gateway) -> None:
    checks = []
    for name, upstream in gateway.upstreams.items():
        if upstream.provider.cloud and upstream.provider.doc.health_path is None:  # no listing path to look at
            continue
        circuits = [c for c in gateway.breakers.of_provider(name) if c.state() is State.OPEN]
        if circuits:
            checks.append(_guarded(name, check_health(gateway, name, circuits)))
    await asyncio.gather(*checks)


# ---- the loops -----------------------------------------------------------------------


async def _guarded(name: str, work: Awaitable[None]) -> None:
    """Run one provider's `work`; a bug in it is logged (its type only), and the other
    providers and the loop go on."""
    try:
        await work
    except Exception as e:
        logs.log(logging.WARNING, "provider discovery raised", provider=name, error=type(e).__name__)


async def _every(
    seconds: float, round_: Callable[[Gateway], Awaitable[None]], turn: int, gateway: Gateway, *, now: bool
) -> None:
    """Run `round_` every `seconds` (the first at once if `now`) until cancelled, when this
    worker takes the gateway's turn (`take_turn`)."""
    if not now:
        await asyncio.sleep(seconds)
    while True:
        try:
            if take_turn(gateway.shared, turn, gateway.clock(), seconds):
                await round_(gateway)
        except Exception as e:
            logs.log(logging.WARNING, "discovery round raised", round=round_.__name__, error=type(e).__name__)
        await asyncio.sleep(seconds)


def start(gateway: Gateway) -> list[asyncio.Task]:
    """The background loops of this worker; call from the lifespan, on its event loop.
    With breakers off (`PROVIDER_BREAKER_FAILURES=0`) no circuit opens: no health loop."""
    s = gateway.settings
    tasks = []
    if s.listing_seconds > 0 and any(lists_models(p) for p in s.providers.values()):
        listing = _every(s.listing_seconds, list_all, LISTING_TURN, gateway, now=True)
        tasks.append(asyncio.create_task(listing, name="listing"))
    if s.health_check_seconds > 0 and s.breaker.failures > 0:
        health = _every(s.health_check_seconds, check_all, HEALTH_TURN, gateway, now=False)
        tasks.append(asyncio.create_task(health, name="health"))
    return tasks


async def stop(tasks: list[asyncio.Task]) -> None:
    """Cancel the loops and wait until they have ended (a request in flight is closed)."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
