"""TINYGW_EHBP and TINYGW_RECEIPTS (docs/confidential.md), as Settings fields.

`serve` makes the keys of what is on before its workers start, and tells them where
(`CONFIDENTIAL_KEYS_VARIABLE`, honoured only with one of them on, as the served TLS
certificate is only with TLS on).
"""

from __future__ import annotations

from collections.abc import Mapping

from tinygw.config.settings import CONFIDENTIAL_KEYS_VARIABLE
from tinygw.errors import ConfigError

EHBP_MODES = ("off", "on", "required")
_RECEIPT_MODES = {"off": False, "on": True}


def sealing_fields(env: Mapping[str, str]) -> dict:
    mode = env.get("TINYGW_EHBP", "off").strip().lower() or "off"
    if mode not in EHBP_MODES:
        raise ConfigError("TINYGW_EHBP", f"must be one of {', '.join(EHBP_MODES)}, got {mode!r}")
    word = env.get("TINYGW_RECEIPTS", "off").strip().lower() or "off"
    if word not in _RECEIPT_MODES:
        raise ConfigError("TINYGW_RECEIPTS", f"must be on or off, got {word!r}")
    receipts = _RECEIPT_MODES[word]
    keys = (env.get(CONFIDENTIAL_KEYS_VARIABLE) or None) if mode != "off" or receipts else None
    return {"ehbp": mode, "receipts": receipts, "confidential_keys": keys}
