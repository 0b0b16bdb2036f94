"""TINYGW_TLS and its companions (docs/design.md section 9), as Settings fields.

Checked in full in the process that starts (`check` and `serve` alike, so that a green
`check` means a start): the files of `files` are regular, readable, belong together
and their key is strong enough; `attested` has a memory file system to write its key
in. Workers are told what serve serves, and check nothing again.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping

from tinygw.config.files import MAX_SECRET_FILE_BYTES, read_file
from tinygw.config.settings import SERVED_CERT_VARIABLE, SERVED_NOT_AFTER_VARIABLE, SERVED_SPKI_VARIABLE
from tinygw.errors import ConfigError

_TLS_MODES = ("off", "attested", "files")
_DNS_NAME = re.compile(
    r"(?=.{1,253}$)(?:\*\.)?[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*"
)


def tls_fields(env: Mapping[str, str]) -> dict:
    """TINYGW_TLS and its companions (docs/design.md section 9), as Settings fields."""
    mode = env.get("TINYGW_TLS", "off").strip().lower() or "off"
    if mode not in _TLS_MODES:
        raise ConfigError("TINYGW_TLS", f"must be one of {', '.join(_TLS_MODES)}, got {mode!r}")
    raw_names = env.get("TINYGW_TLS_NAMES", "localhost,127.0.0.1")
    names = tuple(n.strip() for n in raw_names.split(",") if n.strip())
    if not names:
        raise ConfigError("TINYGW_TLS_NAMES", "holds no name")
    for name in names:
        if not _DNS_NAME.fullmatch(name):
            try:
                ipaddress.ip_address(name)
            except ValueError:
                raise ConfigError("TINYGW_TLS_NAMES", f"not a DNS name or IP address: {name!r}") from None
    fields: dict[str, object] = {"tls_mode": mode, "tls_names": names}
    cert_file, key_file = env.get("TINYGW_TLS_CERT_FILE"), env.get("TINYGW_TLS_KEY_FILE")
    # Set by serve for its own workers only (serve removes any it inherited), and
    # honoured only with TLS on: with TLS off nothing may make a worker attest a key.
    served = (env.get(SERVED_CERT_VARIABLE) or None) if mode != "off" else None
    if mode == "files":
        if not cert_file:
            raise ConfigError("TINYGW_TLS_CERT_FILE", "unset, and TINYGW_TLS=files needs it")
        if not key_file:
            raise ConfigError("TINYGW_TLS_KEY_FILE", "unset, and TINYGW_TLS=files needs it")
        if served is None:
            from tinygw.trust import tls  # cryptography is imported only when TLS is on, and not by workers

            tls.check_files(
                cert_file,
                key_file,
                read_file("TINYGW_TLS_CERT_FILE", cert_file, MAX_SECRET_FILE_BYTES).encode(),
                read_file("TINYGW_TLS_KEY_FILE", key_file, MAX_SECRET_FILE_BYTES).encode(),
            )
        fields.update(tls_cert_file=cert_file, tls_key_file=key_file)
    elif cert_file or key_file:
        raise ConfigError(
            "TINYGW_TLS_CERT_FILE" if cert_file else "TINYGW_TLS_KEY_FILE",
            f"set, but TINYGW_TLS is {mode!r}, not 'files'",
        )
    # attest/launch points TMPDIR at its private directory in guest memory.
    # Parents for mkdtemp's private directory (tinygw.trust.tls), in memory, never on disk.
    key_dirs = [d for d in (env.get("TMPDIR"), env.get("XDG_RUNTIME_DIR"), "/run", "/dev/shm") if d]  # noqa: S108 -- parents only, see above
    fields["tls_key_dirs"] = tuple(key_dirs)
    if mode == "attested" and served is None:
        from tinygw.trust import tls

        tls.memory_directory(key_dirs)  # exists, and the key can be written there
    fields["served_cert"] = served
    fields["served_spki_sha256"] = (env.get(SERVED_SPKI_VARIABLE) or None) if served else None
    fields["served_not_after"] = _timestamp(env.get(SERVED_NOT_AFTER_VARIABLE)) if served else None
    return fields


def _timestamp(raw: str | None) -> float | None:
    try:
        return float(raw) if raw else None
    except ValueError:
        return None  # serve's own variable: never wrong, unless set by hand
