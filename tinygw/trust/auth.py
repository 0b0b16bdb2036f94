"""Inbound authentication: which client a presented gateway key belongs to, found in
constant time."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping

from tinygw.secret import Secret


class InboundAuth:
    """Accepts `Authorization: Bearer KEY` or `x-api-key: KEY` for a configured KEY, and
    says whose it is: `keys` is each client's keys by its name (a key belongs to one
    client); with none at all every request is the client `everyone`.

    Keys are kept as sha256 digests, and a presented key is compared against every one
    of them, with no branch on the outcome, so the time taken says nothing about which
    key, whose, or how much of it, matched.
    """

    def __init__(self, keys: Mapping[str, tuple[Secret, ...]], everyone: str) -> None:
        owners: dict[bytes, str] = {}  # each digest once (a key listed twice), so that one at most matches
        for name, client_keys in keys.items():
            for key in client_keys:
                owners.setdefault(hashlib.sha256(key.reveal().encode()).digest(), name)
        self._digests = tuple(owners)
        self._owners = ("", *owners.values())  # by 1 + the digest's index; "" for none
        self._everyone = everyone

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def client(self, headers: list[tuple[bytes, bytes]]) -> str | None:
        """The name of the client whose key the request presents, None when it presents none
        of them (with no key configured, `everyone`)."""
        if not self._digests:
            return self._everyone
        presented = None
        for name, value in headers:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer":
                    presented = token.strip()
            elif name == b"x-api-key" and presented is None:
                presented = value.strip()
        if not presented:
            return None
        digest = hashlib.sha256(presented).digest()
        found = 0
        for index, reference in enumerate(self._digests, 1):  # at most one matches: the sum is its index
            found += index * hmac.compare_digest(digest, reference)
        return self._owners[found] or None

    def allows(self, headers: list[tuple[bytes, bytes]]) -> bool:
        return self.client(headers) is not None
