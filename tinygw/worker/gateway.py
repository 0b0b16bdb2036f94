"""The gateway's per-worker state, built in the ASGI lifespan from the Settings.

Holds what every request reaches: the settings, the inbound auth, one upstream pool
and key ring per provider, the circuit breakers, the routing strategies' state, the
model listings, the metrics. There is no module-level state: tests build their own.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from tinygw import __version__, logs
from tinygw.config.settings import DEFAULT_CLIENT, Client, Settings
from tinygw.observe.board import Board
from tinygw.observe.circuittable import CircuitTable
from tinygw.observe.clienttable import ClientTable
from tinygw.observe.metrics import Metrics
from tinygw.observe.metricstore import FileStore
from tinygw.observe.shared import SharedRuns
from tinygw.protocol.routing import WILDCARD, Resolver
from tinygw.protocol.wire import RequestIds
from tinygw.resilience import strategy
from tinygw.resilience.breaker import Circuit, Clock, State
from tinygw.resilience.breakers import Breakers
from tinygw.resilience.strategy import Strategies
from tinygw.trust.attestation import artifact_digests
from tinygw.trust.auth import InboundAuth
from tinygw.trust.evidence_queue import EvidenceQueue, RateLimitedWarning
from tinygw.upstream.pool import default_max_connections, open_file_limit, tls_context
from tinygw.worker.upstreams import make_upstream, model_timeouts

if TYPE_CHECKING:
    from tinygw.trust.confidential import Confidential

_FIRST_CERTIFICATE = re.compile(rb"-----BEGIN CERTIFICATE-----[A-Za-z0-9+/=\s]+-----END CERTIFICATE-----")


def _configured_circuits(settings: Settings) -> list[tuple[str, str]]:
    """(provider, upstream model) of every configured target (a model's context fallbacks
    included). A target of `*` has a circuit per name as sent, made by the first attempt:
    none up front."""
    return sorted(
        {
            (t.provider, t.upstream_model)
            for m in settings.models.values()
            for t in (*m.targets, *m.context_fallback)
            if t.upstream_model != WILDCARD
        }
    )


def shared_runs(settings: Settings) -> dict[str, int]:
    """The gateway's small shared numbers (tinygw.observe.shared): each provider's keys'
    rests (tinygw.resilience.keys), the spreading strategies' counters, and discovery's
    turns and listings (tinygw.worker.discovery)."""
    return {
        **{f"keys:{name}": max(1, len(p.keys)) for name, p in settings.providers.items()},
        **strategy.runs(settings),
        "discovery": 2,
        **{f"listed:{name}": 2 for name in settings.providers},
    }


class Gateway:
    def __init__(
        self,
        settings: Settings,
        *,
        artifact_sha256: str = "",
        clock: Clock = time.monotonic,
        wall_clock: Clock = time.time,  # what AWS and Google check a signature's time against
    ) -> None:
        """The worker's parts, in the order they need each other: who may call and what
        is counted, the gateway's circuits and shared numbers, what this worker serves of
        itself (attestation, TLS, EHBP and receipts), and the providers."""
        self.settings = settings
        self.clock = clock
        self.pid = os.getpid()
        # The worker's loop, handed to what schedules on it (docs/performance.md, speed choices)
        try:
            self.loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:  # built outside a loop (tests): looked up where needed
            self.loop = None
        self.request_ids = RequestIds()
        self.metrics = Metrics(__version__, artifact_sha256, settings.metrics_dir)
        store = self.metrics.store
        # The run's directory, where the workers share what they count (None: this worker alone)
        self.run_directory = store.directory if isinstance(store, FileStore) else None
        # What the status page shows of this worker, in the shared store; wall clock for display only.
        self.started_at = time.time()
        self.board = Board(store, self.started_at)
        self._callers(settings)
        self._circuits(settings, clock)
        self._served(settings)
        self._providers(settings, clock, wall_clock)

    def _callers(self, settings: Settings) -> None:
        """Who may call (the gateway keys, by client), and each named client's counts,
        shared with the other workers (docs/design.md section 16)."""
        clients = settings.clients or {DEFAULT_CLIENT: Client(name=DEFAULT_CLIENT, keys=settings.api_keys)}
        self.auth = InboundAuth({c.name: c.keys for c in clients.values()}, DEFAULT_CLIENT)
        # None without configured clients (`clients` names none, and sets no limit on the
        # default one): a request then counts no client, and pays for none
        named = any(c.name != DEFAULT_CLIENT or c.limited for c in clients.values())
        self.clients = ClientTable(clients, self.run_directory, self.metrics.store.slot) if named else None

    def _circuits(self, settings: Settings, clock: Clock) -> None:
        """The gateway's circuits, one whatever the number of workers (docs/design.md section
        4), its shared numbers (key rests, strategies' counters, discovery's turns), and
        what orders and resolves a request's targets."""
        configured = _configured_circuits(settings)
        by_provider: dict[str, list[str]] = {name: [] for name in settings.providers}
        for provider, provider_model in configured:
            by_provider.setdefault(provider, []).append(provider_model)
        shared, slot = self.run_directory, self.metrics.store.slot
        self.circuit_table = CircuitTable(settings.breaker, by_provider, shared, slot)
        self.shared = SharedRuns(shared_runs(settings), shared)
        self.listed_versions = {name: 0.0 for name in settings.providers}  # tinygw.worker.discovery.synced
        self.breakers = Breakers(settings.breaker, clock, self._on_transition, configured, table=self.circuit_table)
        self.strategies = Strategies(settings, shared=self.shared)
        self.resolver = Resolver(settings)  # a request's route and model to its targets
        # provider -> model ids of its last successful listing, absent before one (tinygw.worker.discovery)
        self.listings: dict[str, list[str]] = {}
        self.timeouts = model_timeouts(settings)  # (Resolution.model, provider) -> the exchange's bounds

    def _served(self, settings: Settings) -> None:
        """What this worker serves of itself: /attestation's digests and queue, the
        certificate it serves (docs/design.md section 9), and EHBP's key, the receipt key
        and its receipts (docs/confidential.md; None with both off)."""
        self.artifact_digests: tuple[str | None, str | None] | None = None  # computed once
        self.evidence_queue = EvidenceQueue()  # one quote at a time, the others queued
        self.attestation_refusals = RateLimitedWarning()
        self.tls_certificate: str | None = None  # PEM
        self.tls_spki_sha256: str | None = None
        if settings.served_cert and settings.served_spki_sha256:
            with open(settings.served_cert, "rb") as f:
                pem = _FIRST_CERTIFICATE.search(f.read())  # a file may carry text around it
            if pem is None:
                raise ValueError("the served certificate file holds no PEM certificate")
            self.tls_certificate, self.tls_spki_sha256 = pem.group().decode("ascii") + "\n", settings.served_spki_sha256
            if settings.served_not_after is not None:
                self.metrics.set_tls_certificate_expiry(settings.served_not_after)
        self.confidential: Confidential | None = None
        if settings.ehbp != "off" or settings.receipts:
            from tinygw.trust.confidential import Confidential  # noqa: F811 -- cryptography only then

            store = self.metrics.store  # receipts are shared as the metrics are: same directory, same slot
            self.confidential = Confidential(
                settings.ehbp,
                settings.receipts,
                settings.confidential_keys,
                getattr(store, "directory", None),
                store.slot,
                settings.workers,
            )

    def _providers(self, settings: Settings, clock: Clock, wall_clock: Clock) -> None:
        """Each provider as the proxy uses it: its pool, keys and fixed parts (tinygw.worker.upstreams)."""
        origins = [o for p in settings.providers.values() for o in (p.origin, p.token_origin) if o is not None]
        context = tls_context() if any(o.scheme == "https" for o in origins) else None
        # A provider's connections when its configuration does not bound them: what the
        # worker's open-file limit allows (tinygw.upstream.pool.default_max_connections).
        derived = default_max_connections(open_file_limit())
        self.upstreams = {
            name: make_upstream(
                p,
                context,
                self.loop,
                p.doc.max_connections or derived,
                self._pool_watch(name),
                self._on_redacted(name),
                functools.partial(self.board.publish_key_rest, name),  # for the status page
                clock,
                wall_clock,
                self.shared.run(f"keys:{name}"),
            )
            for name, p in settings.providers.items()
        }

    def _pool_watch(self, provider: str) -> Callable[[int, float | None], None]:
        """What the pool of `provider` tells of requests waiting for a connection: the
        gauge and histogram, and the warning, logged when a request first has to wait and
        then at most once a minute, with the count of requests that waited meanwhile."""
        exhausted = RateLimitedWarning()

        def waiting(change: int, waited: float | None) -> None:
            self.metrics.add_pool_waiting(provider, change)
            if waited is not None:
                self.metrics.observe_pool_wait(provider, waited)
                return
            count = exhausted.note(self.clock())
            if count is not None:
                pool = self.upstreams[provider].pool
                logs.log(
                    logging.WARNING,
                    "provider connections exhausted",
                    provider=provider,
                    max_connections=pool.max_connections,
                    waited=count,
                    pool_timeout_s=self.settings.providers[provider].doc.pool_timeout_s,
                )

        return waiting

    def circuits_open_until(self) -> dict[tuple[str, str], float]:
        """tinygw_circuit_open's values, read from the gateway's circuit table."""
        return self.circuit_table.open_until()

    def _on_redacted(self, provider: str) -> Callable[[int], None]:
        """What follows a secret of `provider` found in its answer: counted, and a warning
        naming the provider (at most one line a minute, with the count of answers)."""
        warning = RateLimitedWarning()

        def found(places: int) -> None:
            self.metrics.count_redactions(provider, places)
            answers = warning.note(self.clock())
            if answers is not None:
                logs.log(logging.WARNING, "provider answer held a secret", provider=provider, answers=answers)

        return found

    def _on_transition(self, circuit: Circuit, old: State, new: State) -> None:
        """Told once per transition of the gateway's circuit, by the worker that made it."""
        self.metrics.count_transition(circuit.provider, circuit.label, new.value)
        if new is State.OPEN:
            logs.log(
                logging.WARNING,
                "provider circuit opened",
                provider=circuit.provider,
                provider_model=circuit.shown,
                failures=circuit.failures if old is State.CLOSED else None,
                after_probe=old is State.HALF_OPEN,
                pause_seconds=circuit.pause_seconds,
                last_error=circuit.last_error,
            )
        elif new is State.CLOSED:
            logs.log(
                logging.INFO,
                "provider circuit closed",
                provider=circuit.provider,
                provider_model=circuit.shown,
                probes=self.settings.breaker.half_open_probes,
            )
        else:
            logs.log(
                logging.INFO,
                "provider circuit half-open",
                provider=circuit.provider,
                provider_model=circuit.shown,
                pause_seconds=circuit.pause_seconds,
            )

    async def artifact_hashes(self) -> tuple[str | None, str | None]:
        """(sha256, sha384) of the running executable (None, None from source), hashed off
        the loop once: it does not change while it runs. EvidenceUnavailable when it
        cannot be read (tried again at the next call)."""
        if self.artifact_digests is None:
            self.artifact_digests = await asyncio.to_thread(artifact_digests)
        return self.artifact_digests

    async def aclose(self) -> None:
        for upstream in self.upstreams.values():
            await upstream.pool.aclose()
            if upstream.token_pool is not None:
                await upstream.token_pool.aclose()
        if self.clients is not None:
            self.clients.close()
        self.circuit_table.close()
        self.shared.close()
        if self.confidential is not None:
            self.confidential.close()
