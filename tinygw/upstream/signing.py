"""The credentials of the clouds that sell Claude (docs/design.md section 18): AWS
Signature Version 4 for Bedrock, and Google's OAuth 2.0 JWT bearer grant for Vertex.

Pure functions of a request, the credentials and `now` (Unix seconds, the wall clock
that AWS and Google check a signature's time against), and the one rule of a cached
token's life. No I/O here: the pool calls `sigv4_headers` on the head it is about to
write (tinygw.upstream.pool), and tinygw.worker.credentials fetches and caches tokens.
HMAC and SHA-256 from the standard library, RSA from `cryptography`.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
import time
from urllib.parse import quote, unquote_to_bytes

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from msgspec import Struct

from tinygw.config.settings import AwsCredentials, ServiceAccount
from tinygw.secret import Secret

# ---- AWS Signature Version 4 ----------------------------------------------------------

ALGORITHM = "AWS4-HMAC-SHA256"
# The headers signed besides `host`: the time, and the session token of temporary credentials.
AMZ_DATE = b"x-amz-date"
AMZ_SECURITY_TOKEN = b"x-amz-security-token"


def amz_date(now: float) -> str:
    """`now` as SigV4 writes it: YYYYMMDD'T'HHMMSS'Z', UTC."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))


def canonical_uri(path: bytes) -> str:
    """The request's path as SigV4 signs it for every service but S3: dot segments
    removed, then URI-encoded (so a path already percent-encoded on the wire is encoded
    twice, as botocore and AWS's documentation do it)."""
    segments: list[bytes] = []
    for segment in path.split(b"/")[1:]:
        if segment == b"..":
            if segments:
                segments.pop()
        elif segment != b".":
            segments.append(segment)
    if path.endswith((b"/.", b"/..")):
        segments.append(b"")
    normalized = b"/" + b"/".join(segments)
    return quote(normalized, safe="/~")


def canonical_query(query: bytes) -> str:
    """The query's parameters, each name and value URI-encoded (RFC 3986 unreserved kept),
    sorted by name, then value."""
    if not query:
        return ""
    pairs = []
    for part in query.split(b"&"):
        name, _, value = part.partition(b"=")
        pairs.append((quote(unquote_to_bytes(name), safe="-_.~"), quote(unquote_to_bytes(value), safe="-_.~")))
    return "&".join(f"{name}={value}" for name, value in sorted(pairs))


def _canonical_headers(headers: list[tuple[bytes, bytes]], signed: list[bytes]) -> str:
    values: dict[bytes, list[str]] = {}
    for name, value in headers:
        name = name.lower()
        if name in signed:
            values.setdefault(name, []).append(" ".join(value.decode("latin-1").split()))
    return "".join(f"{name.decode()}:{','.join(values[name])}\n" for name in signed)


def canonical_request(
    method: bytes, target: bytes, headers: list[tuple[bytes, bytes]], signed: list[bytes], body: bytes
) -> str:
    """SigV4's canonical request for `target` (path and query as sent), the `signed`
    headers (lower case, sorted) of `headers`, and the body's SHA-256."""
    path, _, query = target.partition(b"?")
    return "\n".join(
        [
            method.decode(),
            canonical_uri(path),
            canonical_query(query),
            _canonical_headers(headers, signed),
            ";".join(name.decode() for name in signed),
            hashlib.sha256(body).hexdigest(),
        ]
    )


def _hmac(key: bytes, text: str) -> bytes:
    return hmac.new(key, text.encode(), hashlib.sha256).digest()


def signature(secret_access_key: str, date: str, region: str, service: str, string_to_sign: str) -> str:
    """HMAC-SHA256 of `string_to_sign` with the key derived for the day, region and service."""
    key = _hmac(("AWS4" + secret_access_key).encode(), date[:8])
    for part in (region, service, "aws4_request"):
        key = _hmac(key, part)
    return hmac.new(key, string_to_sign.encode(), hashlib.sha256).hexdigest()


def authorization(
    method: bytes,
    target: bytes,
    headers: list[tuple[bytes, bytes]],
    body: bytes,
    credentials: AwsCredentials,
    region: str,
    service: str,
    date: str,
    signed: list[bytes],
) -> str:
    """The `Authorization` header's value for a request whose `headers` carry
    `x-amz-date: date` (and any other of `signed`)."""
    scope = f"{date[:8]}/{region}/{service}/aws4_request"
    request = canonical_request(method, target, headers, signed, body)
    string_to_sign = f"{ALGORITHM}\n{date}\n{scope}\n{hashlib.sha256(request.encode()).hexdigest()}"
    signed_names = ";".join(name.decode() for name in signed)
    value = signature(credentials.secret_access_key.reveal(), date, region, service, string_to_sign)
    credential = f"{credentials.access_key_id.reveal()}/{scope}"
    return f"{ALGORITHM} Credential={credential}, SignedHeaders={signed_names}, Signature={value}"


def sigv4_headers(
    method: bytes,
    target: bytes,
    head: list[tuple[bytes, bytes]],
    body: bytes,
    credentials: AwsCredentials,
    region: str,
    service: str,
    now: float,
) -> list[tuple[bytes, bytes]]:
    """`head` (the request's headers as they will be written, `host` among them) signed
    at `now`: with `x-amz-date`, the session token if any, and `authorization` added.
    Signed: host, the time and the token; the body by its SHA-256. Headers of the same
    names already in `head` (a client's) are replaced."""
    date = amz_date(now)
    added = [(AMZ_DATE, date.encode())]
    if credentials.session_token is not None:
        added.append((AMZ_SECURITY_TOKEN, credentials.session_token.reveal().encode()))
    replaced = {name for name, _ in added} | {b"authorization"}
    head = [(name, value) for name, value in head if name not in replaced] + added
    signed = sorted({b"host", *(name for name, _ in added)})
    value = authorization(method, target, head, body, credentials, region, service, date, signed)
    return [*head, (b"authorization", value.encode())]


# ---- Google's JWT bearer grant (RFC 7523) ----------------------------------------------

GRANT_TYPE = "urn:ietf:params:oauth:grant-type:jwt-bearer"
CLOUD_PLATFORM_SCOPE = "https://www.googleapis.com/auth/cloud-platform"
# An assertion's life: Google accepts at most an hour.
ASSERTION_SECONDS = 3600


def load_private_key(account: ServiceAccount) -> rsa.RSAPrivateKey:
    """The account's RSA key (tinygw.config.environment checked it at start)."""
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    key = load_pem_private_key(account.private_key.reveal().encode(), password=None)
    if not isinstance(key, rsa.RSAPrivateKey):
        raise ValueError("the service account's private_key is not an RSA key")
    return key


def _b64url(data: bytes) -> bytes:
    return base64.urlsafe_b64encode(data).rstrip(b"=")


def jwt_assertion(account: ServiceAccount, key: rsa.RSAPrivateKey, now: float) -> bytes:
    """A JWT, RS256-signed with the account's key, asking `token_uri` for an access token
    of the cloud-platform scope, valid from `now` for ASSERTION_SECONDS."""
    header = {"alg": "RS256", "typ": "JWT"}
    if account.private_key_id:
        header["kid"] = account.private_key_id
    issued = int(now)
    claims = {
        "iss": account.client_email,
        "scope": CLOUD_PLATFORM_SCOPE,
        "aud": account.token_uri,
        "iat": issued,
        "exp": issued + ASSERTION_SECONDS,
    }
    signing_input = b".".join(_b64url(json.dumps(part, separators=(",", ":")).encode()) for part in (header, claims))
    signed = key.sign(signing_input, padding.PKCS1v15(), hashes.SHA256())
    return signing_input + b"." + _b64url(signed)


def token_request_body(assertion: bytes) -> bytes:
    """The form the token endpoint is sent (application/x-www-form-urlencoded)."""
    return f"grant_type={quote(GRANT_TYPE, safe='')}&assertion={assertion.decode()}".encode()


# An access token goes into an `Authorization` line as it came: Google's are a few hundred
# characters of visible ASCII. Any other is the token endpoint's fault, never a request's.
MAX_ACCESS_TOKEN_CHARS = 4096
_VISIBLE_ASCII = re.compile(r"[\x21-\x7e]+")


def access_token_fault(value: str) -> str | None:
    """What makes `value` no access token to send, in words that never quote it; None when
    it is one: visible ASCII, of at most MAX_ACCESS_TOKEN_CHARS characters."""
    if not value:
        return "an empty access token"
    if len(value) > MAX_ACCESS_TOKEN_CHARS:
        return f"an access token of {len(value)} characters (at most {MAX_ACCESS_TOKEN_CHARS:,})"
    if not _VISIBLE_ASCII.fullmatch(value):
        return "an access token with characters outside visible ASCII"
    return None


# A token is used until a minute before it expires, or half its life for one that lives
# two minutes or less (a request sent with it must still find it valid), and renewed from
# RENEW_AHEAD_SECONDS before that, while it is still used: requests do not wait for a
# renewal unless the token is past its use.
EXPIRY_MARGIN_SECONDS = 60.0
RENEW_AHEAD_SECONDS = 240.0


class Token(Struct, frozen=True):
    """An access token and the two moments of its life, on the monotonic clock."""

    value: Secret
    renew_from: float  # from here on, a renewal is started while it is still used
    use_until: float  # from here on it is not used: a request waits for a new one
    # It lives two minutes or less: used for half its life, and fetched that often.
    short_lived: bool = False

    @classmethod
    def received(cls, value: str, expires_in: float, now: float) -> Token:
        """A token that came at `now` and expires `expires_in` seconds later: used until
        `expires_in - min(60, expires_in / 2)`. A short-lived one is renewed from half its
        usable life on."""
        use_until = now + max(0.0, expires_in - min(EXPIRY_MARGIN_SECONDS, expires_in / 2))
        renew_from = max(now + (use_until - now) / 2, use_until - RENEW_AHEAD_SECONDS)
        return cls(Secret(value), renew_from, use_until, expires_in <= 2 * EXPIRY_MARGIN_SECONDS)

    def usable(self, now: float) -> bool:
        return now < self.use_until

    def due(self, now: float) -> bool:
        """Time to renew it (it may still be usable)."""
        return now >= self.renew_from
