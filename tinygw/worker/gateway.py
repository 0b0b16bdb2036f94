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
import ssl
import time
from collections.abc import Callable
from typing import TYPE_CHECKING
from urllib.parse import quote, unquote_to_bytes

from msgspec import Struct

from tinygw import __version__, logs
from tinygw.config.settings import DEFAULT_CLIENT, Client, Provider, Settings, plain
from tinygw.headers import ACCOUNT
from tinygw.observe.board import Board
from tinygw.observe.clienttable import ClientTable
from tinygw.observe.metrics import Metrics
from tinygw.observe.metricstore import FileStore
from tinygw.protocol.routing import WILDCARD, Resolver
from tinygw.protocol.wire import NOT_FORWARDED, RequestIds
from tinygw.resilience.breaker import Breakers, Circuit, Clock, State
from tinygw.resilience.keys import KeyRing
from tinygw.resilience.strategy import Strategies
from tinygw.secret import Secret
from tinygw.trust.attestation import artifact_digests
from tinygw.trust.auth import InboundAuth
from tinygw.trust.evidence_queue import EvidenceQueue, RateLimitedWarning
from tinygw.trust.redact import Redactor
from tinygw.upstream.pool import Authorize, Pool, Timeouts, default_max_connections, open_file_limit, tls_context
from tinygw.worker import credentials

if TYPE_CHECKING:
    from tinygw.trust.confidential import Confidential

_FIRST_CERTIFICATE = re.compile(rb"-----BEGIN CERTIFICATE-----[A-Za-z0-9+/=\s]+-----END CERTIFICATE-----")


class Upstream(Struct, frozen=True):
    """A provider as the proxy uses it: its pool and the headers it always gets."""

    provider: Provider
    pool: Pool
    keys: KeyRing
    redactor: Redactor  # the provider's secrets, kept out of its answers (tinygw.trust.redact)
    # The provider's `query`, percent-encoded (b"" when none), and its names (lower case).
    query: bytes = b""
    query_names: frozenset[bytes] = frozenset()
    # Worked out once, for each request: the static headers and a key's, one list per key
    # of its key pool; the names of the client's headers never forwarded (the gateway's
    # own, and the provider's `api_key_header`); a route's request target on this provider
    # for a client request without query: its path and the provider's query (made at the
    # route's first request: as many as the route table has).
    fixed_headers: tuple[list[tuple[bytes, bytes]], ...] = ()
    not_forwarded: frozenset[bytes] = NOT_FORWARDED
    paths: dict[str, bytes] = {}
    rotates_keys: bool = False  # more than one key: `keys.pick` moves the rotation on
    lets_clients_choose_account: bool = False  # the provider's `client_account_headers`
    # A vertex provider's token endpoint (tinygw.worker.credentials): its own pool.
    token_pool: Pool | None = None

    def __repr__(self) -> str:  # its headers and query hold the provider's credentials
        return f"Upstream({self.provider.name!r})"

    __str__ = __repr__

    def path(self, upstream_path: str, client_query: bytes = b"") -> bytes:
        """The request target for a route's `upstream_path` (its base_url's path first) with
        the provider's query and the client's (`target`); kept in `paths` when the client
        sent no query."""
        path = self.target((self.provider.origin.path + upstream_path).encode(), client_query)
        if not client_query:
            self.paths[upstream_path] = path
        return path

    def target(self, path: bytes, client_query: bytes = b"") -> bytes:
        """`path` with the provider's query and the client's: the provider's parameters
        first, then the client's (percent-encoded where it is not visible ASCII), less any
        whose name the provider's query has, in any case (an operator's `api-version` is
        not the client's to change)."""
        if client_query:
            client_query = percent_encoded(client_query)
        if not self.query:
            return path + b"?" + client_query if client_query else path
        if client_query:
            kept = [part for part in client_query.split(b"&") if part and _name_of(part) not in self.query_names]
            if kept:
                return path + b"?" + self.query + b"&" + b"&".join(kept)
        return path + b"?" + self.query


# Bytes a request target may hold as they are (visible ASCII); any other is percent-encoded.
_NOT_VISIBLE = re.compile(rb"[^\x21-\x7e]")


def _name_of(parameter: bytes) -> bytes:
    """A query parameter's name as a server reads it: decoded, in lower case."""
    return unquote_to_bytes(parameter.partition(b"=")[0].replace(b"+", b" ")).lower()


def percent_encoded(query: bytes) -> bytes:
    """A client's query with every byte outside visible ASCII percent-encoded (RFC 3986),
    as a browser sends it: a raw UTF-8 byte is the client's to have sent, and is
    forwarded encoded, never judged against the provider."""
    return _NOT_VISIBLE.sub(lambda byte: b"%%%02X" % byte[0][0], query)


def _auth_headers(provider: Provider) -> tuple[list[tuple[bytes, bytes]], ...]:
    if not provider.keys:
        return ([],)
    if provider.doc.api_key_header is not None:  # Azure-style: the raw key, no "Bearer"
        name = provider.doc.api_key_header.lower().encode()
        return tuple([(name, k.reveal().encode())] for k in provider.keys)
    if provider.doc.api == "anthropic":
        return tuple([(b"x-api-key", k.reveal().encode())] for k in provider.keys)
    return tuple([(b"authorization", b"Bearer " + k.reveal().encode())] for k in provider.keys)


def _secrets(p: Provider) -> list[str]:
    """Every secret the provider is sent: its keys and the credentials of its headers and
    query, a bedrock provider's access key id and session token."""
    credentials = [v for v in (*p.headers.values(), *p.query.values()) if isinstance(v, Secret)]
    if p.aws is not None:
        credentials += [s for s in (p.aws.access_key_id, p.aws.session_token) if s is not None]
    return [secret.reveal() for secret in (*p.keys, *credentials)]


# A token endpoint's bounds: a token is small and quick, or it is not coming.
TOKEN_TIMEOUTS = Timeouts(connect_seconds=10.0, first_byte_seconds=30.0, total_seconds=30.0)
TOKEN_CONNECTIONS = 4


def _credentials(
    p: Provider,
    context: ssl.SSLContext | None,
    loop: asyncio.AbstractEventLoop | None,
    clock: Clock,
    wall_clock: Clock,
) -> tuple[Authorize | None, Pool | None]:
    """A cloud provider's credentials, made per request (tinygw.worker.credentials): the
    pool's `authorize`, and the pool of a vertex provider's token endpoint."""
    if p.aws is not None:
        return credentials.aws_signer(p.aws, p.doc.region or "", wall_clock), None
    if p.google is None or p.token_origin is None:
        return None, None
    pool = Pool(
        p.token_origin, max_connections=TOKEN_CONNECTIONS, timeouts=TOKEN_TIMEOUTS, ssl_context=context, loop=loop
    )
    fetch = credentials.google_fetch(p.google, p.token_origin, pool, clock, wall_clock)
    return credentials.TokenSource(fetch, clock, p.name).authorize, pool


def _upstream(
    p: Provider,
    context: ssl.SSLContext | None,
    loop: asyncio.AbstractEventLoop | None,
    max_connections: int,
    on_wait: Callable[[int, float | None], None],
    on_redacted: Callable[[int], None],
    on_rest: Callable[[int, float], None],
    clock: Clock = time.monotonic,
    wall_clock: Clock = time.time,
) -> Upstream:
    authorize, token_pool = _credentials(p, context, loop, clock, wall_clock)
    pool = Pool(
        p.origin,
        max_connections=max_connections,
        timeouts=_provider_timeouts(p),
        ssl_context=context,
        loop=loop,
        on_wait=on_wait,
        authorize=authorize,
    )
    static_headers = [(b"accept-encoding", b"identity")] + [
        (k.lower().encode(), plain(v).encode()) for k, v in p.headers.items()
    ]
    auth_headers = _auth_headers(p)
    # What a client may not send: the gateway's own, and every header the operator sets for
    # this provider (its key's, its static ones, and the account headers unless it lets
    # clients choose them), whatever their case (ASGI lowers the client's names).
    operators = {name for name, _ in static_headers} | {name for name, _ in auth_headers[0]}
    if p.doc.api_key_header is not None:
        operators.add(p.doc.api_key_header.lower().encode())
    account = set() if p.doc.client_account_headers else {name.encode() for name in ACCOUNT}
    return Upstream(
        provider=p,
        pool=pool,
        keys=KeyRing(len(p.keys), on_rest),
        redactor=Redactor(_secrets(p), on_redacted),
        query=encode_query({k: plain(v) for k, v in p.query.items()}),
        query_names=frozenset(k.lower().encode() for k in p.query),
        fixed_headers=tuple(static_headers + auth for auth in auth_headers),
        not_forwarded=NOT_FORWARDED | operators | account,
        paths={},
        rotates_keys=len(p.keys) > 1,
        lets_clients_choose_account=p.doc.client_account_headers,
        token_pool=token_pool,
    )


def encode_query(query: dict[str, str]) -> bytes:
    """`name=value&...` in the configured order, each part percent-encoded."""
    return "&".join(f"{quote(k, safe='')}={quote(v, safe='')}" for k, v in query.items()).encode()


def _provider_timeouts(p: Provider) -> Timeouts:
    doc = p.doc
    return Timeouts(
        doc.connect_timeout_s, doc.first_byte_timeout_s, doc.timeout_s, doc.stall_timeout_s, doc.pool_timeout_s
    )


def model_timeouts(settings: Settings) -> dict[tuple[str, str], Timeouts]:
    """The timeouts of each (model as Resolution names it, provider): the provider's,
    with those the model sets in their place (docs/design.md section 16). A
    provider-qualified request (`provider/*`) has its provider's."""
    timeouts = {(f"{name}/*", name): _provider_timeouts(p) for name, p in settings.providers.items()}
    for model in settings.models.values():
        total, first_byte, stall = model.timeouts
        for target in model.targets:
            own = timeouts[(f"{target.provider}/*", target.provider)]
            timeouts[(model.name, target.provider)] = Timeouts(
                own.connect_seconds,
                first_byte if first_byte is not None else own.first_byte_seconds,
                total if total is not None else own.total_seconds,
                stall if stall is not None else own.stall_seconds,
                own.pool_seconds,
            )
    return timeouts


def _configured_circuits(settings: Settings) -> list[tuple[str, str]]:
    """(provider, upstream model) of every configured target. A target of `*` has a circuit
    per name as sent, made by the first attempt: none up front."""
    return sorted(
        {
            (t.provider, t.upstream_model)
            for m in settings.models.values()
            for t in m.targets
            if t.upstream_model != WILDCARD
        }
    )


class Gateway:
    def __init__(
        self,
        settings: Settings,
        *,
        artifact_sha256: str = "",
        clock: Clock = time.monotonic,
        wall_clock: Clock = time.time,  # what AWS and Google check a signature's time against
    ) -> None:
        self.settings = settings
        self.clock = clock
        clients = settings.clients or {DEFAULT_CLIENT: Client(name=DEFAULT_CLIENT, keys=settings.api_keys)}
        self.auth = InboundAuth({c.name: c.keys for c in clients.values()}, DEFAULT_CLIENT)
        self.request_ids = RequestIds()
        self.metrics = Metrics(__version__, artifact_sha256, settings.metrics_dir)
        # Each client's counts, shared with the other workers where the metrics are (docs/design.md section 16)
        store = self.metrics.store
        shared = store.directory if isinstance(store, FileStore) else None
        self.clients = ClientTable(clients, shared, store.slot)
        configured = _configured_circuits(settings)
        # What the status page shows of this worker, in the shared store; wall clock for display only.
        self.started_at = time.time()
        self.board = Board(self.metrics.store, self.started_at)
        self.breakers = Breakers(settings.breaker, clock, self._on_transition, configured, self._on_change)
        for provider, provider_model in configured:  # a series per circuit from the start
            self.metrics.set_circuit_open_until(provider, provider_model, 0.0)
        self.pid = os.getpid()
        # The worker's loop, looked up once: each lookup is a getpid(2) on Python 3.11 (~1/10 of a request's CPU)
        try:
            self.loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:  # built outside a loop (tests): looked up where needed
            self.loop = None
        # /attestation: the executable's digests, computed once; one quote at a time, the others queued
        self.artifact_digests: tuple[str | None, str | None] | None = None
        self.evidence_queue = EvidenceQueue()
        self.attestation_refusals = RateLimitedWarning()
        # The certificate this worker serves, PEM, and its SPKI digest (docs/design.md section 9)
        self.tls_certificate: str | None = None
        self.tls_spki_sha256: str | None = None
        if settings.served_cert and settings.served_spki_sha256:
            with open(settings.served_cert, "rb") as f:
                pem = _FIRST_CERTIFICATE.search(f.read())  # a file may carry text around it
            if pem is None:
                raise ValueError("the served certificate file holds no PEM certificate")
            self.tls_certificate, self.tls_spki_sha256 = pem.group().decode("ascii") + "\n", settings.served_spki_sha256
            if settings.served_not_after is not None:
                self.metrics.set_tls_certificate_expiry(settings.served_not_after)
        # EHBP's key, the receipt key and this worker's receipts (docs/confidential.md); None with both off
        self.confidential: Confidential | None = None
        if settings.ehbp != "off" or settings.receipts:
            from tinygw.trust.confidential import Confidential  # noqa: F811 -- pyhpke and cryptography only then

            store = self.metrics.store  # receipts are shared as the metrics are: same directory, same slot
            self.confidential = Confidential(
                settings.ehbp,
                settings.receipts,
                settings.confidential_keys,
                getattr(store, "directory", None),
                store.slot,
                settings.workers,
            )
        self.strategies = Strategies(settings)
        self.resolver = Resolver(settings)  # a request's route and model to its targets
        # provider -> model ids of its last successful listing, absent before one (tinygw.worker.discovery)
        self.listings: dict[str, list[str]] = {}
        origins = [o for p in settings.providers.values() for o in (p.origin, p.token_origin) if o is not None]
        context = tls_context() if any(o.scheme == "https" for o in origins) else None
        # A provider's connections when its configuration does not bound them: what the
        # worker's open-file limit allows (tinygw.upstream.pool.default_max_connections).
        derived = default_max_connections(open_file_limit())
        self.upstreams = {
            name: _upstream(
                p,
                context,
                self.loop,
                p.doc.max_connections or derived,
                self._pool_watch(name),
                self._on_redacted(name),
                functools.partial(self.board.publish_key_rest, name),  # for the status page
                clock,
                wall_clock,
            )
            for name, p in settings.providers.items()
        }
        self.timeouts = model_timeouts(settings)  # (Resolution.model, provider) -> the exchange's bounds

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

    def _on_change(self, circuit: Circuit) -> None:
        """What the status page shows of `circuit` changed (or it was forgotten: then its
        gauge is 0, as for a circuit that is not open)."""
        self.board.publish_circuit(circuit)
        if circuit.forgotten:
            self.metrics.set_circuit_open_until(circuit.provider, circuit.label, 0.0)

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
        self.metrics.count_transition(circuit.provider, circuit.label, new.value)
        open_until = (circuit.opened_at or 0.0) + circuit.pause_seconds if new is State.OPEN else 0.0
        self.metrics.set_circuit_open_until(circuit.provider, circuit.label, open_until)
        if new is State.OPEN:
            logs.log(
                logging.WARNING,
                "provider circuit opened",
                provider=circuit.provider,
                provider_model=circuit.provider_model,
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
                provider_model=circuit.provider_model,
                probes=self.settings.breaker.half_open_probes,
            )
        else:
            logs.log(
                logging.INFO,
                "provider circuit half-open",
                provider=circuit.provider,
                provider_model=circuit.provider_model,
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
        self.clients.close()
        if self.confidential is not None:
            self.confidential.close()
