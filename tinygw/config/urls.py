"""Where a provider (or a token endpoint) lives: a base URL checked into an Origin, and the
rule that plaintext leaves the machine only when asked for (docs/design.md section 13)."""

from __future__ import annotations

import ipaddress
import re
from typing import Literal
from urllib.parse import urlsplit

from tinygw.config.settings import Origin
from tinygw.errors import ConfigError

# A host name as DNS and the URL standard allow it (letters, digits, '-', '.', '_'),
# or an IP address; anything else (a space, a line break, '%') is refused.
_HOST_NAME = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_.])?")


def parse_base_url(where: str, url: str) -> Origin:
    # Visible ASCII only: a space or a line break would end up in the request line.
    if not url or any(not "\x21" <= c <= "\x7e" for c in url):
        raise ConfigError(where, "must be visible ASCII without spaces or control characters")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ConfigError(where, f"must start with http:// or https://, got {url!r}")
    if not parts.hostname:
        raise ConfigError(where, f"has no host: {url!r}")
    if parts.query or parts.fragment or parts.username or parts.password or "?" in url or "#" in url:
        raise ConfigError(where, "must not carry a query, fragment or credentials")
    host = parts.hostname
    if not (
        _HOST_NAME.fullmatch(host)
        and len(host) <= 253
        and all(0 < len(label) <= 63 for label in host.rstrip(".").split("."))
    ):
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise ConfigError(where, f"has a bad host: {url!r}") from None
    try:
        port = parts.port
    except ValueError:
        raise ConfigError(where, f"has a bad port: {url!r}") from None
    if port is None:
        if parts.netloc.endswith(":"):
            raise ConfigError(where, f"has an empty port: {url!r}")
        port = 443 if parts.scheme == "https" else 80
    if not 1 <= port <= 65535:
        raise ConfigError(where, f"has a bad port: {url!r}")
    scheme: Literal["http", "https"] = "https" if parts.scheme == "https" else "http"  # the two allowed above
    return Origin(scheme, host, port, parts.path.rstrip("/"))


def not_plaintext(where: str, origin: Origin, plaintext: bool) -> None:
    if origin.scheme == "http" and not is_loopback(origin.host) and not plaintext:
        raise ConfigError(
            where,
            "http:// to an address that is not loopback: the network (inside a "
            "confidential VM, its host) reads every byte; use https, or say "
            '"plaintext": true',
        )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
