"""Units: AWS Signature Version 4 against AWS's published test vectors and against
botocore's signer; Google's JWT bearer grant; a Vertex token's life on an injected
clock (tinygw/upstream/signing.py, tinygw/worker/credentials.py)."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import urllib.parse

import pytest
from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from hypothesis import given
from hypothesis import strategies as st

from conftest import ROOT
from tinygw import errors
from tinygw.config.settings import AwsCredentials, ServiceAccount
from tinygw.secret import Secret
from tinygw.upstream import signing
from tinygw.worker.credentials import TokenSource

VECTORS = json.loads((ROOT / "tests" / "data" / "aws-sigv4" / "vectors.json").read_text())
SUITE = AwsCredentials(Secret("AKIDEXAMPLE"), Secret("wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY"))


@pytest.mark.parametrize("case", VECTORS, ids=[c["name"] for c in VECTORS])
def test_sigv4_gives_the_aws_test_suites_signatures(case):
    headers = [(k.encode(), v.encode()) for k, v in case["headers"].items()]
    signed = sorted(k for k, _ in headers)
    value = signing.authorization(
        case["method"].encode(),
        case["target"].encode(),
        headers,
        case["body"].encode(),
        SUITE,
        "us-east-1",
        "service",
        "20150830T123600Z",
        signed,
    )
    assert value == case["authorization"]


def botocore_signature(method, target, head, body, credentials: Credentials, region: str) -> str:
    """botocore's SigV4 `Authorization` for the same request, signed headers and time."""
    fields = dict((k.decode(), v.decode()) for k, v in head)
    names = fields["authorization"].partition("SignedHeaders=")[2].partition(",")[0].split(";")
    request = AWSRequest(
        method=method.decode(),
        url=f"https://{fields['host']}{target.decode()}",
        data=body,
        headers={n: fields[n] for n in names},
    )
    request.context["timestamp"] = fields["x-amz-date"]
    request.context["payload_signing_enabled"] = True
    signer = SigV4Auth(credentials, "bedrock", region)
    string_to_sign = signer.string_to_sign(request, signer.canonical_request(request))
    return signer.signature(string_to_sign, request)


_SEGMENT = st.text(st.characters(codec="utf-8", exclude_characters="/?#%"), min_size=1, max_size=12).map(
    lambda s: urllib.parse.quote(s, safe=":@")
)


@given(
    segments=st.lists(_SEGMENT, min_size=1, max_size=4),
    query=st.dictionaries(st.text("abcXYZ-_.~ =&", min_size=1, max_size=6), st.text(max_size=6), max_size=3),
    body=st.binary(max_size=64),
    now=st.integers(0, 4_000_000_000),
    token=st.booleans(),
)
def test_sigv4_agrees_with_botocore(segments, query, body, now, token):
    from urllib.parse import quote, urlencode

    credentials = Credentials("AKIDTEST", "secret/key+1", "session" if token else None)
    ours = AwsCredentials(Secret("AKIDTEST"), Secret("secret/key+1"), Secret("session") if token else None)
    # a query as SDKs encode it (a space as %20: a `+` is read as a space by some servers, as itself by others)
    target = ("/" + "/".join(segments) + (f"?{urlencode(query, quote_via=quote)}" if query else "")).encode()
    head = [(b"host", b"bedrock-runtime.eu-west-3.amazonaws.com"), (b"content-type", b"application/json")]
    signed = signing.sigv4_headers(b"POST", target, head, body, ours, "eu-west-3", "bedrock", now)
    authorization = dict(signed)[b"authorization"].decode()
    assert authorization.endswith(
        "Signature=" + botocore_signature(b"POST", target, signed, body, credentials, "eu-west-3")
    )


def test_sigv4_replaces_a_clients_own_signing_headers():
    head = [(b"host", b"h"), (b"x-amz-date", b"19700101T000000Z"), (b"authorization", b"mine")]
    signed = signing.sigv4_headers(b"POST", b"/", head, b"", SUITE, "us-east-1", "bedrock", 1440938160)
    names = [k for k, _ in signed]
    assert names.count(b"x-amz-date") == 1 and names.count(b"authorization") == 1
    assert dict(signed)[b"x-amz-date"] == b"20150830T123600Z"


# ---- Google's JWT bearer grant ----------------------------------------------------------------


def test_the_jwt_assertion_is_rs256_for_the_token_endpoint():
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    account = ServiceAccount("sa@p.iam.gserviceaccount.com", Secret(pem.decode()), "https://oauth2.example/token", "k1")
    assertion = signing.jwt_assertion(account, signing.load_private_key(account), 1_700_000_000.7)
    header, claims, signature = assertion.split(b".")

    def decoded(part: bytes) -> bytes:
        return base64.urlsafe_b64decode(part + b"=" * (-len(part) % 4))

    key.public_key().verify(decoded(signature), header + b"." + claims, padding.PKCS1v15(), hashes.SHA256())
    assert json.loads(decoded(header)) == {"alg": "RS256", "typ": "JWT", "kid": "k1"}
    assert json.loads(decoded(claims)) == {
        "iss": "sa@p.iam.gserviceaccount.com",
        "scope": "https://www.googleapis.com/auth/cloud-platform",
        "aud": "https://oauth2.example/token",
        "iat": 1_700_000_000,
        "exp": 1_700_003_600,
    }
    body = signing.token_request_body(assertion)
    assert body.startswith(b"grant_type=urn%3Aietf%3Aparams%3Aoauth%3Agrant-type%3Ajwt-bearer&assertion=")


# ---- a token's life, on an injected clock ------------------------------------------------------


# A request's wait for a token, as its attempt bounds it: longer than any of these stories.
WAIT = 30.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_token_is_used_until_a_minute_before_it_expires_and_renewed_ahead():
    clock = Clock()
    fetched: list[float] = []
    gate: asyncio.Event | None = None

    async def fetch() -> signing.Token:
        fetched.append(clock.now)
        if gate is not None:
            await gate.wait()
        return signing.Token.received(f"token-{len(fetched)}", 3600, clock.now)

    async def story() -> None:
        nonlocal gate
        source = TokenSource(fetch, clock, "vertex")
        # concurrent first requests share one fetch
        assert await asyncio.gather(source.token(WAIT), source.token(WAIT)) == ["token-1", "token-1"]
        assert fetched == [1000.0]
        clock.now = 1000 + 3600 - 60 - 240 - 1  # before the renewal is due: kept
        assert await source.token(WAIT) == "token-1" and len(fetched) == 1
        clock.now += 2  # due: the token in use is still given, a renewal starts in the background
        gate = asyncio.Event()
        assert await source.token(WAIT) == "token-1"
        await asyncio.sleep(0)  # the renewal's task runs
        assert len(fetched) == 2
        assert await source.token(WAIT) == "token-1" and len(fetched) == 2  # one renewal at a time
        gate.set()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert await source.token(WAIT) == "token-2"
        gate = None
        clock.now = fetched[-1] + 3600 - 60  # past its use: a request waits for a new one
        assert await source.token(WAIT) == "token-3"

    asyncio.run(story())


def test_a_token_that_cannot_be_had_fails_each_waiting_request_and_is_tried_again():
    clock = Clock()
    calls = 0

    async def fetch() -> signing.Token:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise errors.ProviderCredentials("its token endpoint refused the service account (400 invalid_grant)")
        return signing.Token.received("ok", 3600, clock.now)

    async def story() -> None:
        source = TokenSource(fetch, clock, "vertex")
        results = await asyncio.gather(source.token(WAIT), source.token(WAIT), return_exceptions=True)
        assert all(isinstance(r, errors.ProviderCredentials) for r in results) and calls == 1
        assert await source.token(WAIT) == "ok"

    asyncio.run(story())


def test_a_short_lived_token_is_said_once(caplog):
    clock = Clock()

    async def fetch() -> signing.Token:
        return signing.Token.received("short", 60, clock.now)

    async def story() -> None:
        source = TokenSource(fetch, clock, "vertex")
        for _ in range(3):
            assert await source.token(WAIT) == "short"
            clock.now += 31  # past half its life: fetched again
            await asyncio.sleep(0)

    with caplog.at_level(logging.WARNING, logger="tinygw"):
        asyncio.run(story())
    said = [r for r in caplog.records if r.getMessage() == "provider token short-lived"]
    assert len(said) == 1
    assert signing.Token.received("long", 3600, 0.0).short_lived is False


def test_a_short_lived_token_is_renewed_from_half_its_life():
    token = signing.Token.received("t", 120, 0.0)
    assert (token.renew_from, token.use_until) == (30.0, 60.0)
    assert not token.due(29.9) and token.due(30.0) and token.usable(59.9) and not token.usable(60.0)
    assert repr(token.value) == "***"


@pytest.mark.parametrize(
    "expires_in,use_until,renew_from",
    [(3600, 3540.0, 3300.0), (120, 60.0, 30.0), (60, 30.0, 15.0), (20, 10.0, 5.0), (0, 0.0, 0.0)],
)
def test_a_token_is_used_until_expires_in_less_the_smaller_of_a_minute_and_half(expires_in, use_until, renew_from):
    token = signing.Token.received("t", expires_in, 0.0)
    assert (token.use_until, token.renew_from) == (use_until, renew_from)


@pytest.mark.parametrize(
    "value,fault",
    [
        ("ya29.a0-_~+/=", None),
        ("a" * 4096, None),
        ("a" * 4097, "an access token of 4097 characters (at most 4,096)"),
        ("", "an empty access token"),
        ("a\r\nb", "an access token with characters outside visible ASCII"),
        ("a b", "an access token with characters outside visible ASCII"),
        ("a\tb", "an access token with characters outside visible ASCII"),
        ("tök", "an access token with characters outside visible ASCII"),
    ],
)
def test_an_access_token_is_visible_ascii_of_at_most_4096_characters(value, fault):
    assert signing.access_token_fault(value) == fault


def test_a_request_waits_for_a_token_no_longer_than_it_is_given_and_the_fetch_goes_on():
    clock = Clock()
    gate = asyncio.Event()
    fetched = 0

    async def fetch() -> signing.Token:
        nonlocal fetched
        fetched += 1
        await gate.wait()
        return signing.Token.received("late", 3600, clock.now)

    async def story() -> None:
        source = TokenSource(fetch, clock, "vertex")
        with pytest.raises(errors.ProviderCredentials, match="no token within the attempt's 0.01 s"):
            await source.token(0.01)
        gate.set()  # the fetch was not cancelled: the next request has its token
        assert await source.token(0.01) == "late" and fetched == 1

    asyncio.run(story())
