"""TINYGW_EHBP, TINYGW_RECEIPTS and TINYGW_KEY_SEED_FILE (docs/confidential.md), as
Settings fields.

`serve` makes the keys of what is on before its workers start, and tells them where
(`CONFIDENTIAL_KEYS_VARIABLE`, honoured only with one of them on, as the served TLS
certificate is only with TLS on). The key seed's file is only named here: serve (and
`tinygw check`) read it once, with `read_key_seed`, and the workers get the keys made from it.
"""

from __future__ import annotations

from collections.abc import Mapping

from tinygw.config.files import MAX_SECRET_FILE_BYTES, read_bytes
from tinygw.config.settings import CONFIDENTIAL_KEYS_VARIABLE
from tinygw.errors import ConfigError

EHBP_MODES = ("off", "on", "required")
_RECEIPT_MODES = {"off": False, "on": True}
KEY_SEED_VARIABLE = "TINYGW_KEY_SEED_FILE"
# The seed's least length: 256 bits, the strength of the keys made from it.
MIN_SEED_BYTES = 32


def sealing_fields(env: Mapping[str, str]) -> dict:
    mode = env.get("TINYGW_EHBP", "off").strip().lower() or "off"
    if mode not in EHBP_MODES:
        raise ConfigError("TINYGW_EHBP", f"must be one of {', '.join(EHBP_MODES)}, got {mode!r}")
    word = env.get("TINYGW_RECEIPTS", "off").strip().lower() or "off"
    if word not in _RECEIPT_MODES:
        raise ConfigError("TINYGW_RECEIPTS", f"must be on or off, got {word!r}")
    receipts = _RECEIPT_MODES[word]
    keys = (env.get(CONFIDENTIAL_KEYS_VARIABLE) or None) if mode != "off" or receipts else None
    seed_file = env.get(KEY_SEED_VARIABLE)
    if seed_file is not None and not seed_file.strip():  # set, and meant: not silently random keys
        raise ConfigError(KEY_SEED_VARIABLE, "empty: give the path of the key seed's file, or unset it")
    return {"ehbp": mode, "receipts": receipts, "confidential_keys": keys, "key_seed_file": seed_file}


def read_key_seed(path: str) -> bytes:
    """The key seed's bytes, as they are; ConfigError naming the variable (never a byte of
    the seed) when the file cannot be read or holds fewer than MIN_SEED_BYTES."""
    seed = read_bytes(KEY_SEED_VARIABLE, path, MAX_SECRET_FILE_BYTES)
    if len(seed) < MIN_SEED_BYTES:
        raise ConfigError(
            KEY_SEED_VARIABLE, f"{path!r} holds {len(seed)} bytes: a key seed is at least {MIN_SEED_BYTES}"
        )
    return seed
