"""Signed receipts (docs/confidential.md): what the gateway answered whom, signed with an
Ed25519 key that /attestation binds.

A receipt is `{"v": 1, "id", "created", "client", "route", "model", "provider",
"provider_model", "status", "request_sha256", "response_sha256", "signature"}`; the
signature is Ed25519 over the RFC 8785 canonical JSON of every other field (`canonical`).
The gateway keeps a receipt's fields (JSON, as msgspec writes it) when its answer ends,
before the answer's last bytes go out, and makes their canonical form and signs it when the
receipt is fetched (Ed25519 is deterministic: the same receipt every time), so that a
request waits for neither.

Kept in memory, bounded, readable from every worker (`Ring`): each worker writes its own
ring in the run's directory (the metrics' one, on /dev/shm), as the metric store keeps its
values; an id names the worker's slot and the receipt's sequence number, so a fetch on any
worker reads one entry of one file, and a random part drawn when the worker started, so
that no two replicas (nor two starts of one) ever give the same id. Oldest dropped; lost
at restart.

A held answer also carries its whole signed receipt (`RECEIPT_HEADER`, base64url of its
JSON), so that a client behind a balancer needs no second request, which the balancer
may send to another replica.
"""

from __future__ import annotations

import base64
import hashlib
import json
import mmap
import os
import re
import struct
import zlib

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

VERSION = 1
RECEIPT_ID_HEADER = b"x-tinygw-receipt-id"
RECEIPT_HEADER = b"x-tinygw-receipt"
# Every field but the signature, in the order a reader expects them (the signed form sorts them).
FIELDS = (
    "v",
    "id",
    "created",
    "client",
    "route",
    "model",
    "provider",
    "provider_model",
    "status",
    "request_sha256",
    "response_sha256",
)

# Kept at most, over all workers (docs/design.md section 17): each worker's ring holds its share.
MAX_RECEIPTS = 100_000
MAX_BYTES = 64 * 1024 * 1024
# A worker's share never falls below these (many workers: a few more in all, never unbounded).
MIN_RECEIPTS, MIN_BYTES = 1_000, 1024 * 1024

# An id: 16 bytes as 32 hex digits: the writer's slot (u16), the receipt's sequence number
# in that slot (u48), and 8 random bytes drawn when the writer started (`START_BYTES`), so
# that ids are unique across replicas, and an id of a receipt that a worker which died in
# the slot wrote is never mistaken for the one that took its place.
_ID = re.compile(r"[0-9a-f]{32}")
_INDEX = struct.Struct("<QII")  # sequence number + 1 (0: empty), offset, length
_ENTRY = struct.Struct("<II")  # crc32 of the rest, length of the owner's digest
_RING_PREFIX, _RING_SUFFIX = "receipts-", ".ring"
START_BYTES = 8


def canonical(fields: dict) -> bytes:
    """RFC 8785 (JCS) of an object of strings and integers (below 2**53), which is what a
    receipt holds: keys sorted (ASCII here, so code points and UTF-16 units sort alike), no
    whitespace, strings escaped as ECMAScript's JSON.stringify does (`"`, `\\`, the short
    escapes \\b \\f \\n \\r \\t, other controls as lowercase \\u00xx, everything else as
    UTF-8), integers in decimal: Python's json with these options writes exactly that."""
    return json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


class Signer:
    """The receipt key: made at start, the same in every worker; never shown."""

    def __init__(self, private: Ed25519PrivateKey) -> None:
        self._private = private
        self.public_key = private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        self.public_key_sha256 = hashlib.sha256(self.public_key).hexdigest()

    @classmethod
    def generate(cls) -> Signer:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_private_bytes(cls, raw: bytes) -> Signer:
        return cls(Ed25519PrivateKey.from_private_bytes(raw))

    def private_bytes(self) -> bytes:
        """For serve to hand the key to its workers (tinygw.trust.confidential), nothing else."""
        return self._private.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        )

    def signed(self, kept: bytes) -> bytes:
        """The receipt, JSON, from its other fields as kept (any JSON of them): the signature
        is over their canonical form."""
        return self.signed_fields(json.loads(kept))

    def signed_fields(self, fields: dict) -> bytes:
        """The receipt, JSON, of its other fields."""
        signature = base64.b64encode(self._private.sign(canonical(fields))).decode()
        return json.dumps(
            {**{name: fields[name] for name in FIELDS}, "signature": signature}, ensure_ascii=False
        ).encode()

    def __repr__(self) -> str:
        return f"Signer(public_key_sha256={self.public_key_sha256[:16]}...)"


def new_id(slot: int, sequence: int, start: bytes) -> str:
    """An id (see _ID); `start`: the writer's START_BYTES random bytes."""
    return f"{slot & 0xFFFF:04x}{sequence & 0xFFFFFFFFFFFF:012x}{start.hex()}"


def header_value(receipt: bytes) -> bytes:
    """RECEIPT_HEADER's value: the signed receipt's JSON, base64url (with padding)."""
    return base64.urlsafe_b64encode(receipt)


def parse_id(receipt_id: str) -> tuple[int, int] | None:
    """(slot, sequence number) of a well-formed id, else None."""
    if not _ID.fullmatch(receipt_id):
        return None
    return int(receipt_id[:4], 16), int(receipt_id[4:16], 16)


def shares(workers: int) -> tuple[int, int]:
    """(receipts, bytes) that one worker's ring holds."""
    workers = max(1, workers)
    return max(MIN_RECEIPTS, MAX_RECEIPTS // workers), max(MIN_BYTES, MAX_BYTES // workers)


class Ring:
    """One worker's receipts, the oldest overwritten: an index of `count` entries (by
    sequence number, modulo) and `size` bytes of entries written one after another, from
    the start again when the next does not fit. An entry is [crc32][owner length][owner
    digest][the receipt's fields, JSON]; it is found through the index and kept
    only while its crc and its id still match (a newer entry may have overwritten it).

    In `directory` (the run's, shared by the workers) as `receipts-SLOT.ring`, mapped into
    memory, so that every worker reads it (`find`); without one, in this process only."""

    def __init__(self, directory: str | None, slot: int, count: int, size: int) -> None:
        self.directory, self.slot, self.count, self.size = directory, slot, count, size
        self._data_at = count * _INDEX.size
        total = self._data_at + size
        self._file = None
        if directory is None:
            self._map: mmap.mmap | bytearray = bytearray(total)
        else:
            # Opened anew by a worker that takes the slot of one that died: its receipts
            # stay findable until overwritten (ids carry each start's bytes: never mistaken).
            self._file = open(os.path.join(directory, f"{_RING_PREFIX}{slot}{_RING_SUFFIX}"), "a+b")  # noqa: SIM115
            if os.fstat(self._file.fileno()).st_size != total:
                self._file.truncate(total)
            self._map = mmap.mmap(self._file.fileno(), total)
        self._next = 0  # the next sequence number
        self._start = os.urandom(START_BYTES)  # this start's part of every id (see _ID)
        self._write_at = 0  # offset in the data part

    def allocate(self) -> str:
        """A new receipt's id, given in the answer's head, before its receipt is written."""
        sequence = self._next
        self._next += 1
        return new_id(self.slot, sequence, self._start)

    def put(self, receipt_id: str, owner: bytes, fields: bytes) -> None:
        """Keep a receipt (its fields but the signature, JSON) for the client whose key digest is `owner`."""
        sequence = int(receipt_id[4:16], 16)  # an id this ring allocated: well formed
        entry = struct.pack("<I", len(owner)) + owner + fields
        entry = _ENTRY.pack(zlib.crc32(entry), len(entry)) + entry
        if len(entry) > self.size:
            return  # cannot be: a receipt is a few hundred bytes (a model name is at most 256)
        if self._write_at + len(entry) > self.size:
            self._write_at = 0
        at = self._write_at
        self._map[self._data_at + at : self._data_at + at + len(entry)] = entry
        self._write_at += len(entry)
        index = (sequence % self.count) * _INDEX.size
        self._map[index : index + _INDEX.size] = _INDEX.pack(sequence + 1, at, len(entry))

    def find(self, receipt_id: str) -> tuple[bytes, bytes] | None:
        """(owner digest, its fields as kept) of a receipt still kept, by any worker."""
        slot_sequence = parse_id(receipt_id)
        if slot_sequence is None:
            return None
        slot, sequence = slot_sequence
        at = (sequence % self.count) * _INDEX.size
        if slot == self.slot or self.directory is None:
            ring = self._map
            return _entry(lambda offset, n: bytes(ring[offset : offset + n]), at, self._data_at, sequence, receipt_id)
        try:
            fd = os.open(os.path.join(self.directory, f"{_RING_PREFIX}{slot}{_RING_SUFFIX}"), os.O_RDONLY)
        except OSError:
            return None
        try:
            return _entry(lambda offset, n: os.pread(fd, n, offset), at, self._data_at, sequence, receipt_id)
        except OSError:
            return None
        finally:
            os.close(fd)

    def close(self) -> None:
        if isinstance(self._map, mmap.mmap):
            self._map.close()
        if self._file is not None:
            self._file.close()


def _entry(read, at: int, data_at: int, sequence: int, receipt_id: str) -> tuple[bytes, bytes] | None:
    """The entry that the index's entry at `at` points to, if it is still this receipt's;
    `read(offset, n)` reads the ring."""
    index = read(at, _INDEX.size)
    if len(index) != _INDEX.size:
        return None
    stored, offset, length = _INDEX.unpack(index)
    if stored != sequence + 1 or length < _ENTRY.size + 4:
        return None
    raw = read(data_at + offset, length)
    if len(raw) != length:
        return None
    crc, rest_length = _ENTRY.unpack_from(raw, 0)
    rest = raw[_ENTRY.size :]
    if rest_length != len(rest) or zlib.crc32(rest) != crc:
        return None  # overwritten, in part or whole
    (owner_length,) = struct.unpack_from("<I", rest, 0)
    owner, unsigned = rest[4 : 4 + owner_length], rest[4 + owner_length :]
    try:
        if json.loads(unsigned).get("id") != receipt_id:
            return None
    except ValueError:
        return None
    return owner, unsigned
