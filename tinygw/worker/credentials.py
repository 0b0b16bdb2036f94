"""A cloud provider's credentials, made for each request as its pool writes it
(docs/design.md section 18): Bedrock's requests signed with AWS Signature Version 4,
Vertex's carrying an OAuth 2.0 access token from Google's JWT bearer grant.

The signature and the assertion are pure (tinygw.upstream.signing); here is their I/O:
the wall clock they are made at, and a token fetched from the service account's
`token_uri`, kept in a `TokenSource` per provider and worker: used until 60 s before it
expires (half its life for a short one, signing.Token), renewed in the background from a
few minutes before that (requests do not wait for it), and fetched while requests wait
only when there is none to use, each no longer than its attempt may wait. A token that
cannot be had (refused, unreachable, late, an answer over 64 KiB, or no token to put in
a header) is `ProviderCredentials`: a failure of the provider, 502 for the client.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import msgspec

from tinygw import errors, logs
from tinygw.config.settings import AwsCredentials, Origin, ServiceAccount
from tinygw.upstream import signing
from tinygw.upstream.pool import Authorize, Pool

# What the token endpoint may answer, read whole (an access token is a few KiB).
MAX_TOKEN_ANSWER_BYTES = 64 * 1024

Clock = Callable[[], float]


def aws_signer(credentials: AwsCredentials, region: str, wall_clock: Clock, service: str = "bedrock") -> Authorize:
    """The pool's `authorize` for a bedrock provider: every request signed at its time."""

    async def sign(method: bytes, target: bytes, head: list[tuple[bytes, bytes]], body: bytes, seconds: float):
        return signing.sigv4_headers(method, target, head, body, credentials, region, service, wall_clock())

    return sign


class TokenSource:
    """One provider's access token: the one in use, and at most one fetch under way
    (every request that needs a token while there is none waits for the same fetch)."""

    __slots__ = ("_fetch", "_clock", "_provider", "_token", "_fetching", "_warned")

    def __init__(self, fetch: Callable[[], Awaitable[signing.Token]], clock: Clock, provider: str) -> None:
        self._fetch = fetch  # a new token (its life on `clock`), or ProviderCredentials
        self._clock = clock
        self._provider = provider
        self._token: signing.Token | None = None
        self._fetching: asyncio.Future[signing.Token] | None = None
        self._warned = False  # of a short-lived token: once

    async def token(self, seconds: float) -> str:
        """The token to send, waited for at most `seconds` when there is none to use (the
        fetch goes on for the requests after this one)."""
        now = self._clock()
        token = self._token
        if token is not None and token.usable(now):
            if token.due(now) and self._fetching is None:  # renewed ahead, while this one is used
                self._start().add_done_callback(self._renewed)
            return token.value.reveal()
        fetching = self._fetching or self._start()
        try:
            async with asyncio.timeout(seconds):
                # shielded: a request that stops waiting does not cancel the fetch that others wait for
                return (await asyncio.shield(fetching)).value.reveal()
        except TimeoutError:
            raise errors.ProviderCredentials(
                f"its token endpoint gave no token within the attempt's {seconds:g} s"
            ) from None

    def _start(self) -> asyncio.Future[signing.Token]:
        self._fetching = fetching = asyncio.ensure_future(self._fetch())
        fetching.add_done_callback(self._fetched)
        return fetching

    def _fetched(self, fetching: asyncio.Future[signing.Token]) -> None:
        self._fetching = None
        if not fetching.cancelled() and fetching.exception() is None:
            self._token = token = fetching.result()
            if token.short_lived and not self._warned:  # a fetch and a signature every minute or less
                self._warned = True
                logs.log(logging.WARNING, "provider token short-lived", provider=self._provider)

    def _renewed(self, fetching: asyncio.Future[signing.Token]) -> None:
        """A renewal ahead of time ended: a failure is logged (the token in use stays until its end)."""
        if not fetching.cancelled() and (e := fetching.exception()) is not None:
            logs.log(logging.WARNING, "provider token renewal failed", provider=self._provider, reason=str(e))

    async def authorize(
        self, method: bytes, target: bytes, head: list[tuple[bytes, bytes]], body: bytes, seconds: float
    ):
        """The pool's `authorize` for a vertex provider: its token as a bearer, waited for
        at most `seconds` (its attempt's bound)."""
        return [*head, (b"authorization", b"Bearer " + (await self.token(seconds)).encode())]


class _TokenAnswer(msgspec.Struct):
    access_token: str
    expires_in: float = 3600.0


_decode_answer = msgspec.json.Decoder(_TokenAnswer)


class _TokenError(msgspec.Struct):
    error: str = ""


_decode_error = msgspec.json.Decoder(_TokenError)


def google_fetch(
    account: ServiceAccount, token_origin: Origin, pool: Pool, clock: Clock, wall_clock: Clock
) -> Callable[[], Awaitable[signing.Token]]:
    """A fetch of an access token for `account` from its token endpoint (on `pool`)."""
    key = signing.load_private_key(account)
    path = (token_origin.path or "/").encode()
    headers = [(b"content-type", b"application/x-www-form-urlencoded"), (b"accept-encoding", b"identity")]

    async def fetch() -> signing.Token:
        started = clock()
        body = signing.token_request_body(signing.jwt_assertion(account, key, wall_clock()))
        try:
            response = await pool.request(b"POST", path, headers, body)
            answer = await response.read(MAX_TOKEN_ANSWER_BYTES)
        except errors.ResponseTooLarge:
            raise errors.ProviderCredentials("its token endpoint's answer is over 64 KiB") from None
        except errors.UpstreamError as e:
            raise errors.ProviderCredentials(f"its token endpoint could not be reached ({e.cause})") from None
        if response.status != 200:
            try:  # Google's own word for it (`invalid_grant`): never the answer's text
                code = _decode_error.decode(answer).error
            except (msgspec.MsgspecError, RecursionError):
                code = ""
            reason = f"{response.status} {code}" if code.replace("_", "a").isalnum() else str(response.status)
            raise errors.ProviderCredentials(f"its token endpoint refused the service account ({reason})")
        try:
            token = _decode_answer.decode(answer)
        except (msgspec.MsgspecError, RecursionError):
            raise errors.ProviderCredentials("its token endpoint answered no access token") from None
        if (fault := signing.access_token_fault(token.access_token)) is not None:
            raise errors.ProviderCredentials(f"its token endpoint answered {fault}")
        return signing.Token.received(token.access_token, token.expires_in, started)

    return fetch
