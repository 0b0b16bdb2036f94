"""The gateway's per-worker state, built in the ASGI lifespan from the Settings.

Holds what every request reaches: the settings, the inbound auth, one upstream pool
per provider, the metrics. There is no module-level state: tests build their own.
"""

from __future__ import annotations

from msgspec import Struct

from tinygw import __version__
from tinygw.auth import InboundAuth
from tinygw.config import Provider, Settings
from tinygw.metrics import Metrics
from tinygw.pool import Pool, Timeouts, tls_context


class Upstream(Struct, frozen=True):
    """A provider as the proxy uses it: its pool and the headers it always gets."""

    provider: Provider
    pool: Pool
    static_headers: list[tuple[bytes, bytes]]
    auth_headers: tuple[list[tuple[bytes, bytes]], ...]  # one per key of its key pool


def _auth_headers(provider: Provider) -> tuple[list[tuple[bytes, bytes]], ...]:
    if not provider.keys:
        return ([],)
    if provider.doc.api == "anthropic":
        return tuple([(b"x-api-key", k.reveal().encode())] for k in provider.keys)
    return tuple([(b"authorization", b"Bearer " + k.reveal().encode())] for k in provider.keys)


class Gateway:
    def __init__(self, settings: Settings, *, artifact_sha256: str = "") -> None:
        self.settings = settings
        self.auth = InboundAuth(settings.api_keys)
        self.metrics = Metrics(__version__, artifact_sha256)
        context = tls_context() if any(p.origin.scheme == "https" for p in settings.providers.values()) else None
        self.upstreams = {
            name: Upstream(
                provider=p,
                pool=Pool(
                    p.origin,
                    max_connections=p.doc.max_connections,
                    timeouts=Timeouts(p.doc.connect_timeout_s, p.doc.first_byte_timeout_s, p.doc.timeout_s),
                    ssl_context=context,
                ),
                static_headers=[(b"accept-encoding", b"identity")]
                + [(k.lower().encode(), v.encode()) for k, v in p.doc.headers.items()],
                auth_headers=_auth_headers(p),
            )
            for name, p in settings.providers.items()
        }

    async def aclose(self) -> None:
        for upstream in self.upstreams.values():
            await upstream.pool.aclose()
