"""Inbound authentication: the client's gateway key, compared in constant time."""

from __future__ import annotations

import hashlib
import hmac

from tinygw.secret import Secret


class InboundAuth:
    """Accepts `Authorization: Bearer KEY` or `x-api-key: KEY` for a configured KEY.

    Keys are kept as sha256 digests, and a presented key is compared against every one
    of them, so the time taken says nothing about which key, or how much of it, matched.
    """

    def __init__(self, keys: tuple[Secret, ...]) -> None:
        self._digests = tuple(hashlib.sha256(k.reveal().encode()).digest() for k in keys)

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def allows(self, headers: list[tuple[bytes, bytes]]) -> bool:
        if not self._digests:
            return True
        presented = None
        for name, value in headers:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer":
                    presented = token.strip()
            elif name == b"x-api-key" and presented is None:
                presented = value.strip()
        if not presented:
            return False
        digest = hashlib.sha256(presented).digest()
        allowed = False
        for reference in self._digests:
            allowed |= hmac.compare_digest(digest, reference)
        return allowed
