"""A provider's secrets, kept out of what it answers (docs/design.md section 15).

A provider may echo what it was sent: a self-hosted server's error quoting the request's
`Authorization` header, a debugging proxy, a query credential in an echoed URL. The
gateway knows its own secrets (a provider's keys, the `{"env": NAME}` credentials of its
`headers` and `query`), so it looks for them in the headers it relays and in the body of
an answer it holds, and writes `[redacted]` in their place before the client sees them.

A `Redactor` is made once per provider from its secrets. The usual answer holds none,
and costs one `in` (a C search) per secret: a provider with one key, one search of the
body and one of the headers. What it found is reported to `on_found` (the number of
places), which the worker turns into a metric and a warning; never the secret itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from itertools import chain
from urllib.parse import quote

REDACTED = b"[redacted]"

# A secret shorter than this is not looked for: it would match ordinary text (and a
# credential this short is no secret). Keys are checked elsewhere to be visible ASCII.
MIN_SECRET_BYTES = 8

Headers = list[tuple[bytes, bytes]]


class Redactor:
    """The secrets of one provider, each as sent (raw, and percent-encoded as a query
    carries it), longest first, so that a secret holding another is replaced whole."""

    __slots__ = ("_secrets", "_on_found")

    def __init__(self, secrets: Iterable[str], on_found: Callable[[int], None]) -> None:
        forms = {form for s in secrets for form in (s.encode(), quote(s, safe="").encode())}
        self._secrets = tuple(sorted((f for f in forms if len(f) >= MIN_SECRET_BYTES), key=len, reverse=True))
        self._on_found = on_found

    def __repr__(self) -> str:  # it holds the secrets
        return f"Redactor({len(self._secrets)} forms)"

    __str__ = __repr__

    def body(self, data: bytes) -> bytes:
        """`data` with every secret in it replaced by `[redacted]`."""
        for secret in self._secrets:
            if secret in data:
                return self._replaced(data)
        return data

    def headers(self, headers: Headers) -> Headers:
        """`headers` with every secret in a name or value replaced by `[redacted]`."""
        if not self._secrets or not headers:
            return headers
        joined = b"\n".join(chain.from_iterable(headers))  # one search over all of them
        for secret in self._secrets:
            if secret in joined:
                break
        else:
            return headers
        found = 0
        redacted = []
        for name, value in headers:
            for secret in self._secrets:
                found += name.count(secret) + value.count(secret)
                name, value = name.replace(secret, REDACTED), value.replace(secret, REDACTED)
            redacted.append((name, value))
        self._on_found(found)
        return redacted

    def _replaced(self, data: bytes) -> bytes:
        found = 0
        for secret in self._secrets:
            found += data.count(secret)
            data = data.replace(secret, REDACTED)
        self._on_found(found)
        return data
