"""Tinfoil's Encrypted HTTP Body Protocol, the server's half, sans I/O (docs/confidential.md).

EHBP (github.com/tinfoilsh/encrypted-http-body-protocol, its protocol document) seals HTTP bodies end to
end while headers stay in the clear: the client seals its request body to the gateway's
X25519 HPKE key (RFC 9180 base mode, HKDF-SHA256, AES-256-GCM, info "ehbp request") and
sends the encapsulated key in `Ehbp-Encapsulated-Key`; the body is frames of
`LEN (u32, big-endian) || CIPHERTEXT`, each sealed in turn with empty AAD. The answer's key
is derived as OHTTP's (RFC 9458): the request context exports 32 bytes ("ehbp response"),
a random 32-byte response nonce goes out in `Ehbp-Response-Nonce`, and HKDF over
(salt = enc || nonce) gives the AES-256-GCM key ("key") and base nonce ("nonce"); frame i
is sealed with the base nonce XOR i. Streams stay streams: each piece of the answer is
one frame.

Here, over bytes only: the key configuration served at /.well-known/hpke-keys (`KeyPair`),
a request body opened whole (`open_request`, `KeyPair.open`, which raises `SealedBodyRefused`: 422
key-config when the first frame cannot be opened, as Tinfoil's server answers, so that a
client re-fetches the key; 400 for bad framing, a bad encapsulated key or a later frame;
its frames are counted from their length prefixes first, and bounded, `frames`),
and an answer's sealer fed its pieces (`Opened.sealer`). The HTTP side (headers, the
problem answers) is tinygw.api.sealed's; this module is imported only when EHBP is on.

The HPKE recipient (`Recipient`: RFC 9180 base mode, this one suite) is the RFC's key
schedule written here over cryptography's X25519, HKDF and AES-GCM, as AWS SigV4 is over
HMAC (tinygw.upstream.signing): cryptography's own HPKE is single-shot, without the
secret export that the answer's key comes from, and pyhpke's Python context took 183 µs to
open a request where this one takes 125, the X25519 itself ~60 of them (docs/confidential.md).
tests/test_ehbp_hpke.py checks it against the RFC's test vector, pyhpke and Tinfoil's client.
"""

from __future__ import annotations

import hashlib
import os
import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF, HKDFExpand

from tinygw.errors import SealedBodyRefused

# The suite, as RFC 9180 numbers it, and the labels: the protocol's, never to be changed.
KEY_ID = 0
KEM_X25519_HKDF_SHA256 = 0x0020
KDF_HKDF_SHA256 = 0x0001
AEAD_AES_256_GCM = 0x0002
REQUEST_INFO = b"ehbp request"
EXPORT_LABEL = b"ehbp response"
EXPORT_BYTES = 32
ENC_BYTES = 32  # an X25519 public key
RESPONSE_NONCE_BYTES = 32  # max(Nn, Nk) for AES-256-GCM, as OHTTP
AEAD_KEY_BYTES, AEAD_NONCE_BYTES = 32, 12
_LENGTH = struct.Struct(">I")
_SHA256 = hashes.SHA256()


# ---- HPKE, RFC 9180: the recipient of base mode, DHKEM(X25519, HKDF-SHA256), HKDF-SHA256 ----

HPKE_VERSION = b"HPKE-v1"
MODE_BASE = 0
SECRET_BYTES = 32  # Nsecret of the KEM and Nh of the KDF: SHA-256's length
KEM_SUITE_ID = b"KEM" + struct.pack(">H", KEM_X25519_HKDF_SHA256)


def _labeled_extract(suite_id: bytes, salt: bytes, label: bytes, ikm: bytes) -> bytes:
    return HKDF.extract(_SHA256, salt, HPKE_VERSION + suite_id + label + ikm)


def _labeled_expand(suite_id: bytes, prk: bytes, label: bytes, info: bytes, length: int) -> bytes:
    labeled_info = struct.pack(">H", length) + HPKE_VERSION + suite_id + label + info
    return HKDFExpand(_SHA256, length, labeled_info).derive(prk)


def sequence_nonce(base: int, sequence: int) -> bytes:
    """The nonce of message number `sequence` under a base nonce: RFC 9180's ComputeNonce,
    which the answer's frames use too (OHTTP's derivation, RFC 9458)."""
    return (base ^ sequence).to_bytes(AEAD_NONCE_BYTES, "big")


def hpke_suite_id(aead: int) -> bytes:
    return b"HPKE" + struct.pack(">HHH", KEM_X25519_HKDF_SHA256, KDF_HKDF_SHA256, aead)


class Recipient:
    """The HPKE recipient of one key pair, for the suite X25519 / HKDF-SHA256 and an AES-GCM
    of `key_bytes` (32: AES-256-GCM, EHBP's; 16 for the RFC's own test vectors), with `info`
    fixed: what does not depend on the request (the public key, and the key schedule's
    hashes of the empty PSK id and of `info`) is computed once."""

    def __init__(self, private: X25519PrivateKey, info: bytes, aead: int, key_bytes: int) -> None:
        self._private = private
        self.public = private.public_key().public_bytes_raw()
        self._suite_id = hpke_suite_id(aead)
        self._key_bytes = key_bytes
        psk_id_hash = _labeled_extract(self._suite_id, b"", b"psk_id_hash", b"")
        info_hash = _labeled_extract(self._suite_id, b"", b"info_hash", info)
        self._context = bytes([MODE_BASE]) + psk_id_hash + info_hash

    def setup(self, enc: bytes) -> Context:
        """SetupBaseR(enc, skR, info): the context of the sender who sent `enc`. Raises
        ValueError for an `enc` that is not a key, or a low-order one (cryptography refuses
        an all-zero shared secret, as RFC 9180 section 7.1.4 asks)."""
        dh = self._private.exchange(X25519PublicKey.from_public_bytes(enc))
        eae_prk = _labeled_extract(KEM_SUITE_ID, b"", b"eae_prk", dh)
        shared = _labeled_expand(KEM_SUITE_ID, eae_prk, b"shared_secret", enc + self.public, SECRET_BYTES)
        suite_id, context = self._suite_id, self._context
        secret = _labeled_extract(suite_id, shared, b"secret", b"")  # the PSK: empty in base mode
        return Context(
            suite_id,
            _labeled_expand(suite_id, secret, b"key", context, self._key_bytes),
            _labeled_expand(suite_id, secret, b"base_nonce", context, AEAD_NONCE_BYTES),
            _labeled_expand(suite_id, secret, b"exp", context, SECRET_BYTES),
        )


class Context:
    """A recipient's HPKE context: opens the sender's messages in order, and exports secrets."""

    def __init__(self, suite_id: bytes, key: bytes, base_nonce: bytes, exporter_secret: bytes) -> None:
        self._suite_id = suite_id
        self._aead = AESGCM(key)
        self._base_nonce = int.from_bytes(base_nonce, "big")
        self._exporter_secret = exporter_secret
        self._sequence = 0

    def open(self, ciphertext: bytes | memoryview, aad: bytes) -> bytes:
        """The next message's plaintext; cryptography's InvalidTag when it does not authenticate
        (the sequence number then stays, as the RFC's ContextR.Open)."""
        plaintext = self._aead.decrypt(sequence_nonce(self._base_nonce, self._sequence), ciphertext, aad)
        self._sequence += 1
        return plaintext

    def export(self, exporter_context: bytes, length: int) -> bytes:
        return _labeled_expand(self._suite_id, self._exporter_secret, b"sec", exporter_context, length)


class KeyPair:
    """The gateway's HPKE key: made at start, the same in every worker. Its private half is
    never shown (`repr` included)."""

    def __init__(self, private: X25519PrivateKey) -> None:
        self._private = private
        self._recipient = Recipient(private, REQUEST_INFO, AEAD_AES_256_GCM, AEAD_KEY_BYTES)
        # RFC 9458's key_config, one of them, as Tinfoil's server serves it: key id, KEM,
        # public key, then the length of the cipher suites and the one suite (KDF, AEAD).
        self.config = (
            struct.pack(">BH", KEY_ID, KEM_X25519_HKDF_SHA256)
            + self._recipient.public
            + struct.pack(">HHH", 4, KDF_HKDF_SHA256, AEAD_AES_256_GCM)
        )
        self.config_sha256 = hashlib.sha256(self.config).hexdigest()

    @classmethod
    def generate(cls) -> KeyPair:
        return cls(X25519PrivateKey.generate())

    @classmethod
    def from_private_bytes(cls, raw: bytes) -> KeyPair:
        return cls(X25519PrivateKey.from_private_bytes(raw))

    def private_bytes(self) -> bytes:
        """For serve to hand the key to its workers (tinygw.trust.confidential), nothing else."""
        return self._private.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        )

    def open(self, encapsulated_key: bytes, body: bytes) -> Opened:
        """`open_request` with this key."""
        return open_request(self, encapsulated_key, body)

    def __repr__(self) -> str:
        return f"KeyPair(config_sha256={self.config_sha256[:16]}...)"


class Opened:
    """A request body opened: its plaintext, and what seals the answer to that request."""

    def __init__(self, plaintext: bytes, enc: bytes, exported: bytes) -> None:
        self.plaintext = plaintext
        self._enc = enc
        self._exported = exported

    def sealer(self, nonce: bytes | None = None) -> Sealer:
        """The answer's sealer, with a fresh random response nonce (`nonce` for tests only)."""
        return Sealer(self._enc, self._exported, os.urandom(RESPONSE_NONCE_BYTES) if nonce is None else nonce)


class Sealer:
    """Seals one answer's pieces, in order, one frame each (docs/confidential.md)."""

    def __init__(self, enc: bytes, exported: bytes, nonce: bytes) -> None:
        self.nonce = nonce
        self.nonce_header = nonce.hex().encode()
        prk = HKDF.extract(_SHA256, enc + nonce, exported)
        self._aead = AESGCM(HKDFExpand(_SHA256, AEAD_KEY_BYTES, b"key").derive(prk))
        self._base = int.from_bytes(HKDFExpand(_SHA256, AEAD_NONCE_BYTES, b"nonce").derive(prk), "big")
        self._sequence = 0

    def seal(self, piece: bytes) -> bytes:
        """The frame of the answer's next piece; b"" for an empty piece (no frame)."""
        if not piece:
            return b""
        sealed = self._aead.encrypt(sequence_nonce(self._base, self._sequence), piece, None)
        self._sequence += 1
        return _LENGTH.pack(len(sealed)) + sealed


# The messages a client sees: fixed, so that they tell nothing of which step failed
# (the protocol's section 5.4.4).
KEY_CONFIG_TITLE = "the request was not sealed to this gateway's key configuration: fetch /.well-known/hpke-keys again"
BAD_REQUEST_TITLE = "the encrypted request body is malformed or does not open"


# A sealed body's frames at most: one a KiB of the body as received, and a few more (a
# short last frame, an empty one). Each frame costs an AES-GCM open on the worker's loop,
# whatever its size: without a bound, 10 MiB of empty frames (20 bytes each) held the loop
# for over a second (docs/confidential.md).
FRAME_BYTES_PER_FRAME = 1024
EXTRA_FRAMES = 4
AEAD_TAG_BYTES = 16  # an AES-GCM ciphertext of no plaintext


def max_frames(body_bytes: int) -> int:
    """The most frames a sealed body of `body_bytes` bytes may hold."""
    return -(-body_bytes // FRAME_BYTES_PER_FRAME) + EXTRA_FRAMES


def frames(body: bytes) -> list[tuple[int, int]]:
    """Each frame of a sealed body as (where its ciphertext starts, its length), read from
    the length prefixes alone, before any cryptography; SealedBodyRefused (400) for bad
    framing: a length cut short, a frame longer than the body, more frames than
    `max_frames`, or an empty frame (length 0, or a ciphertext of no plaintext) before the
    last. The scan stops at the bound, so that it is cheap too."""
    found: list[tuple[int, int]] = []
    at, end, most, unpack = 0, len(body), max_frames(len(body)), _LENGTH.unpack_from
    while at < end:
        if end - at < _LENGTH.size or len(found) == most:
            raise SealedBodyRefused(400, BAD_REQUEST_TITLE)
        (length,) = unpack(body, at)
        at += _LENGTH.size
        if length > end - at:
            raise SealedBodyRefused(400, BAD_REQUEST_TITLE)
        found.append((at, length))
        at += length
    for _, length in found[:-1]:
        if length in (0, AEAD_TAG_BYTES):
            raise SealedBodyRefused(400, BAD_REQUEST_TITLE)
    return found


def open_request(key: KeyPair, encapsulated_key: bytes, body: bytes) -> Opened:
    """Open a whole sealed request body. SealedBodyRefused (the client's fault) when it
    does not open: 422 when its first frame fails (a key configuration that is not this
    gateway's), 400 for a bad encapsulated key, bad framing (`frames`) or any later frame."""
    try:
        enc = bytes.fromhex(encapsulated_key.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raise SealedBodyRefused(400, BAD_REQUEST_TITLE) from None
    if len(enc) != ENC_BYTES:
        raise SealedBodyRefused(400, BAD_REQUEST_TITLE)
    framed = frames(body)
    try:
        context = key._recipient.setup(enc)
    except ValueError:  # a low-order point: the client's key, refused
        raise SealedBodyRefused(400, BAD_REQUEST_TITLE) from None
    pieces, view = [], memoryview(body)  # each frame opened where it lies, not copied out first
    for i, (at, length) in enumerate(framed):
        if length == 0:  # an empty last write: ignored, as the protocol says
            continue
        try:
            pieces.append(context.open(view[at : at + length], b""))
        except InvalidTag:  # the frame does not authenticate
            first = i == 0
            raise SealedBodyRefused(422 if first else 400, KEY_CONFIG_TITLE if first else BAD_REQUEST_TITLE) from None
    return Opened(b"".join(pieces), enc, context.export(EXPORT_LABEL, EXPORT_BYTES))
