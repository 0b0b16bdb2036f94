"""A provider as the proxy uses it (`Upstream`): its pool, its keys, and the parts of
every request to it worked out once from the configuration (the headers it always gets
and those a client may not send, its query, its credentials, the timeouts of each model
that uses it). Made for each worker by tinygw.worker.gateway."""

from __future__ import annotations

import asyncio
import re
import ssl
import time
from collections.abc import Callable
from urllib.parse import quote, unquote_to_bytes

from msgspec import Struct

from tinygw.config.settings import Provider, Settings, Target, plain
from tinygw.headers import ACCOUNT
from tinygw.protocol.clouds import cloud_request
from tinygw.protocol.request import rewrite_model
from tinygw.protocol.wire import NOT_FORWARDED, forward_headers
from tinygw.resilience.breaker import Clock
from tinygw.resilience.keys import KeyRing
from tinygw.resilience.rows import Floats
from tinygw.secret import Secret
from tinygw.trust.redact import Redactor
from tinygw.upstream.pool import Authorize, Pool, Timeouts, UpstreamRequest
from tinygw.worker import credentials
from tinygw.worker.record import Inbound


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
    # own, and the provider's `api_key_header`); what comes before and after a route's path
    # in its request target when the client sent no query: the base_url's path, and the
    # provider's query with its "?" (b"" when none).
    fixed_headers: tuple[list[tuple[bytes, bytes]], ...] = ()
    not_forwarded: frozenset[bytes] = NOT_FORWARDED
    base_path: bytes = b""
    query_suffix: bytes = b""
    rotates_keys: bool = False  # more than one key: `keys.pick` moves the rotation on
    cloud: bool = False  # the provider's `cloud`: Claude on Bedrock or Vertex
    lets_clients_choose_account: bool = False  # the provider's `client_account_headers`
    # A vertex provider's token endpoint (tinygw.worker.credentials): its own pool.
    token_pool: Pool | None = None

    def __repr__(self) -> str:  # its headers and query hold the provider's credentials
        return f"Upstream({self.provider.name!r})"

    __str__ = __repr__

    def request_for(self, inbound: Inbound, target: Target, key_index: int, timeouts: Timeouts) -> UpstreamRequest:
        """The request for `inbound` at `target` on this provider, with the key of
        `key_index`: the client's body with the target's model (a cloud's whole path and
        body are the gateway's, the model in the path: tinygw.protocol.clouds), the
        client's headers less those never forwarded, the provider's own and the request id."""
        if self.cloud:
            doc, api = self.provider.doc, inbound.route.api
            path, body = cloud_request(doc, api, inbound.body, inbound.stream, target.upstream_model)
        else:
            path = self.path(inbound.route.upstream_path, inbound.query)
            body = rewrite_model(inbound.body, inbound.model, target.upstream_model)
        headers = [
            *forward_headers(inbound.headers, self.not_forwarded),
            *self.fixed_headers[key_index],
            (b"x-request-id", inbound.request_id),
        ]
        return UpstreamRequest(b"POST", path, headers, body, timeouts, inbound.stream)

    def path(self, upstream_path: str, client_query: bytes = b"") -> bytes:
        """The request target for a route's `upstream_path` (its base_url's path first) with
        the provider's query and the client's (`target`)."""
        if not client_query:  # the usual request
            return self.base_path + upstream_path.encode() + self.query_suffix
        return self.target(self.base_path + upstream_path.encode(), client_query)

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


def make_upstream(
    p: Provider,
    context: ssl.SSLContext | None,
    loop: asyncio.AbstractEventLoop | None,
    max_connections: int,
    on_wait: Callable[[int, float | None], None],
    on_redacted: Callable[[int], None],
    on_rest: Callable[[int, float], None],
    clock: Clock = time.monotonic,
    wall_clock: Clock = time.time,
    rest_until: Floats | None = None,
) -> Upstream:
    """`rest_until`: its keys' rests, shared by the gateway's workers (tinygw.resilience.keys)."""
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
    query = encode_query({k: plain(v) for k, v in p.query.items()})
    return Upstream(
        provider=p,
        pool=pool,
        keys=KeyRing(len(p.keys), on_rest, p.doc.affinity, rest_until),
        redactor=Redactor(_secrets(p), on_redacted),
        query=query,
        query_names=frozenset(k.lower().encode() for k in p.query),
        fixed_headers=tuple(static_headers + auth for auth in auth_headers),
        not_forwarded=NOT_FORWARDED | operators | account,
        base_path=p.origin.path.encode(),
        query_suffix=b"?" + query if query else b"",
        rotates_keys=len(p.keys) > 1,
        cloud=p.cloud,
        lets_clients_choose_account=p.doc.client_account_headers,
        token_pool=token_pool,
    )


def encode_query(query: dict[str, str]) -> bytes:
    """`name=value&...` in the configured order, each part percent-encoded."""
    return "&".join(f"{quote(k, safe='')}={quote(v, safe='')}" for k, v in query.items()).encode()


def _provider_timeouts(p: Provider) -> Timeouts:
    doc = p.doc
    return Timeouts(
        doc.connect_timeout_s,
        doc.first_byte_timeout_s,
        doc.timeout_s,
        doc.stall_timeout_s,
        doc.pool_timeout_s,
        doc.head_timeout_s,
    )


def model_timeouts(settings: Settings) -> dict[tuple[str, str], Timeouts]:
    """The timeouts of each (model as Resolution names it, provider): the provider's,
    with those the model sets in their place (docs/design.md section 16). A
    provider-qualified request (`provider/*`) has its provider's."""
    timeouts = {(f"{name}/*", name): _provider_timeouts(p) for name, p in settings.providers.items()}
    for model in settings.models.values():
        total, first_byte, stall, head = model.timeouts
        for target in (*model.targets, *model.context_fallback):
            own = timeouts[(f"{target.provider}/*", target.provider)]
            timeouts[(model.name, target.provider)] = Timeouts(
                own.connect_seconds,
                first_byte if first_byte is not None else own.first_byte_seconds,
                total if total is not None else own.total_seconds,
                stall if stall is not None else own.stall_seconds,
                own.pool_seconds,
                head if head is not None else own.head_seconds,
            )
    return timeouts
