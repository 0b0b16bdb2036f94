"""The keys of EHBP and of receipts (docs/confidential.md): made once by serve, before its
workers start, so that every worker serves the same ones; and what one worker holds of them.
With EHBP on, a third: the key under which the names a sealed body carried are shown
(`shown_name`), the same in every worker so that each name is shown the same everywhere.

Made at random, or, with a key seed (TINYGW_KEY_SEED_FILE, which the platform releases to
attested replicas), derived from it: HKDF-SHA256 of the seed with a label per key that
names the key and the derivation's version (`SEED_LABELS`), so that every replica given
the seed serves the same key configuration and signs with the same receipt key. The TLS
key is never derived: each replica's stays its own.

serve makes them in memory and hands them to its workers as the attested TLS key is handed
(tinygw.trust.tls): a 0600 file each in a fresh 0700 directory on a memory file system,
locked while serve lives and removed at exit; never logged, shown, or put in a page, a
metric or an error. A worker not started by serve (a test's) makes its own.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import shutil

import msgspec
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from msgspec import Struct

from tinygw import lifecycle
from tinygw.errors import ConfigError
from tinygw.trust import ehbp, receipts, tls

HPKE_FILE, RECEIPT_FILE, NAMES_FILE = "hpke.key", "receipt.key", "names.key"
KEY_BYTES = 32
# HKDF's `info` for each key made from a seed (no salt: the seed is a uniformly random
# secret). A new version of a label is a new key: a replica that derives with another
# version serves another key configuration, and its clients see that as for a new key.
SEED_LABELS = {HPKE_FILE: b"tinygw key seed v1: EHBP X25519", RECEIPT_FILE: b"tinygw key seed v1: receipt Ed25519"}
# A name a sealed body carried is shown as this prefix and the first SHOWN_DIGITS hex
# digits of its HMAC-SHA256 (docs/confidential.md): 48 bits, so that the names of one
# gateway stay distinct, and short enough for a label.
SHOWN_PREFIX = "*#"
SHOWN_DIGITS = 12


def shown_name(key: bytes, name: str) -> str:
    """`name` (an upstream model a sealed body carried) as metrics, logs and the status page
    show it: `*#` and the first hex digits of HMAC-SHA256(key, name). Distinct names stay
    distinct; without the key nobody can tell which name it is, nor try names to find out."""
    digest = hmac.new(key, name.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()
    return SHOWN_PREFIX + digest[:SHOWN_DIGITS]


class Made(Struct, frozen=True):
    """The directory serve made for the keys, and the descriptor that holds its lock."""

    directory: str
    lock: int


def derived(seed: bytes, name: str) -> bytes:
    """The private key `name` (HPKE_FILE, RECEIPT_FILE) that the seed gives: 32 bytes, which
    X25519 and Ed25519 both take as a private key."""
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=SEED_LABELS[name]).derive(seed)


def make(ehbp_on: bool, receipts_on: bool, candidates: list[str], seed: bytes | None = None) -> Made:
    """The keys that are on, made (from `seed` when given) and written for the workers (see
    the module's doc)."""
    try:
        # 0700, locked before it bears its name: serve holds it (tinygw.lifecycle tells dead gateways' by it)
        directory, lock = lifecycle.make_held(tls.memory_directory(candidates), "tinygw-keys-")
    except OSError as e:
        raise ConfigError("TINYGW_EHBP", f"cannot make the keys' directory: {e.strerror}") from None
    try:
        if ehbp_on:
            raw = derived(seed, HPKE_FILE) if seed is not None else ehbp.KeyPair.generate().private_bytes()
            _write_new(os.path.join(directory, HPKE_FILE), raw)
            _write_new(os.path.join(directory, NAMES_FILE), os.urandom(KEY_BYTES))
        if receipts_on:
            raw = derived(seed, RECEIPT_FILE) if seed is not None else receipts.Signer.generate().private_bytes()
            _write_new(os.path.join(directory, RECEIPT_FILE), raw)
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        lifecycle.release(lock)
        raise
    return Made(directory, lock)


def remove(made: Made | None) -> None:
    if made is not None:
        shutil.rmtree(made.directory, ignore_errors=True)


class Confidential:
    """One worker's EHBP key, names key, receipt key and receipt ring (None for what is off)."""

    def __init__(
        self,
        ehbp_mode: str,
        receipts_on: bool,
        keys_dir: str | None,
        ring_dir: str | None,
        slot: int,
        workers: int,
    ) -> None:
        self.ehbp_mode = ehbp_mode  # "off" | "on" | "required"
        self.hpke: ehbp.KeyPair | None = None
        self._names_key: bytes | None = None
        self.signer: receipts.Signer | None = None
        self.ring: receipts.Ring | None = None
        if ehbp_mode != "off":
            raw = _read(keys_dir, HPKE_FILE)
            self.hpke = ehbp.KeyPair.from_private_bytes(raw) if raw else ehbp.KeyPair.generate()
            self._names_key = _read(keys_dir, NAMES_FILE) or os.urandom(KEY_BYTES)
        if receipts_on:
            raw = _read(keys_dir, RECEIPT_FILE)
            self.signer = receipts.Signer.from_private_bytes(raw) if raw else receipts.Signer.generate()
            count, size = receipts.shares(workers)
            self.ring = receipts.Ring(ring_dir, slot, count, size)

    def conceal(self, name: str) -> str:
        """`name`, a name a sealed body carried, as others may see it (`shown_name`)."""
        if self._names_key is None:
            raise RuntimeError("EHBP is off: no body is sealed")
        return shown_name(self._names_key, name)

    def allocate(self) -> str:
        """A new receipt's id (receipts on)."""
        if self.ring is None:
            raise RuntimeError("receipts are off")
        return self.ring.allocate()

    def keep(self, receipt_id: str, owner: bytes, fields: dict) -> None:
        """Keep a receipt's fields (receipts on), for the client whose key digest is `owner`."""
        if self.ring is not None:
            self.ring.put(receipt_id, owner, msgspec.json.encode(fields))

    def receipt_header(self, fields: dict) -> bytes:
        """The receipt of `fields` (receipts on), signed, as x-tinygw-receipt's value."""
        if self.signer is None:
            raise RuntimeError("receipts are off")
        return receipts.header_value(self.signer.signed_fields(fields))

    def receipt(self, receipt_id: str, owner: bytes) -> bytes | None:
        """The signed receipt, JSON, when it is kept and `owner` made its request; else None."""
        if self.ring is None or self.signer is None:
            return None
        found = self.ring.find(receipt_id)
        if found is None or not hmac.compare_digest(found[0], owner):
            return None
        return self.signer.signed(found[1])

    def close(self) -> None:
        if self.ring is not None:
            self.ring.close()


def _read(directory: str | None, name: str) -> bytes | None:
    if directory is None:
        return None
    with open(os.path.join(directory, name), "rb") as f:
        raw = f.read(KEY_BYTES + 1)
    if len(raw) != KEY_BYTES:
        raise ValueError(f"the key file {name} does not hold {KEY_BYTES} bytes")
    return raw


def _write_new(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
