"""The evidence a client checks us with (the page that serves it is tinygw.api.attestation).

The gateway vouches for nothing itself: it binds the client's nonce, its config hash
and (with TLS on) the digest of the key its connections are served with into
`report_data`, has the hardware sign that in a quote (configfs-tsm: a fresh
entry per request, `report_data` into `inblob`, the quote from `outblob`, `generation`
read before and after), and hands over the launcher's event log, which a verifier
replays to the quote's RTMR3. Its own executable's hashes are informational only.
On SEV-SNP (provider `sev_guest`) the outblob is the 1,184-byte report, handed over as
`report` too, with the certificates that the host supplies in `auxblob` (docs/design.md
section 12). A bad nonce is a 400; no evidence now, a 503 that names the step, never a secret.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
import os
import re
import secrets
import ssl
import struct
import sys
import uuid
from urllib.parse import parse_qs

import msgspec

from tinygw import logs
from tinygw.errors import EvidenceUnavailable, Raced

# report_data = SHA-512(DOMAIN || nonce || config_sha256): 64 bytes, the quote's REPORTDATA;
# with TLS on, SHA-512(DOMAIN_TLS || nonce || config_sha256 || tls_spki_sha256) (docs/design.md section 9).
DOMAIN = b"tinygw.attest.v1"
DOMAIN_TLS = b"tinygw.attest.v2"
# With EHBP or receipts on, SHA-512(DOMAIN_KEYS || nonce || config_sha256 || tls_spki_sha256 ||
# hpke_key_sha256 || receipt_key_sha256), 32 zero bytes for each key that is off (docs/confidential.md).
DOMAIN_KEYS = b"tinygw.attest.v3"
_OFF = "00" * 32
NONCE_MIN_BYTES, NONCE_MAX_BYTES = 32, 64
# A kernel makes the quote during the read of `outblob`; a slower provider (or a test's
# fake) may take a moment. This bounds the whole fetch.
EVIDENCE_SECONDS = 5.0
POLL_SECONDS = 0.02
# A TDX quote with its certificate chain is 5 to 10 KiB; an event log, a line per launch.
BLOB_MAX_BYTES = EVENT_LOG_MAX_BYTES = 1 << 20

SEV_GUEST = "sev_guest"
SNP_CERT_GUIDS = {
    uuid.UUID(guid).bytes: name
    for guid, name in (
        ("63da758d-e664-4564-adc5-f4b93be8accd", "vcek"),
        ("4ab7b379-bbac-4fe4-a02f-05aef327c782", "ask"),
        ("c0b406a4-a803-4952-9743-3fb6014cd0ae", "ark"),
    )
}

_HEX = re.compile(r"(?:[0-9a-fA-F]{2})+")


def parse_nonce(query_string: bytes) -> bytes:
    """The nonce of `?nonce=HEX`; ValueError, a message for the client, when it is bad."""
    values = parse_qs(query_string.decode("latin-1"), keep_blank_values=True).get("nonce", [])
    if len(values) != 1:
        raise ValueError(f"give one nonce: /attestation?nonce=HEX ({NONCE_MIN_BYTES} to {NONCE_MAX_BYTES} bytes)")
    if not _HEX.fullmatch(values[0]):
        raise ValueError("the nonce must be hex: an even number of digits 0-9, a-f")
    nonce = bytes.fromhex(values[0])
    if not NONCE_MIN_BYTES <= len(nonce) <= NONCE_MAX_BYTES:
        raise ValueError(f"the nonce must be {NONCE_MIN_BYTES} to {NONCE_MAX_BYTES} bytes, got {len(nonce)}")
    return nonce


def report_data(
    nonce: bytes,
    config_sha256: str,
    tls_spki_sha256: str | None = None,
    hpke_key_sha256: str | None = None,
    receipt_key_sha256: str | None = None,
) -> bytes:
    """The digests enter as raw bytes, not hex."""
    if hpke_key_sha256 is not None or receipt_key_sha256 is not None:
        digests = (config_sha256, tls_spki_sha256 or _OFF, hpke_key_sha256 or _OFF, receipt_key_sha256 or _OFF)
        return hashlib.sha512(DOMAIN_KEYS + nonce + b"".join(bytes.fromhex(d) for d in digests)).digest()
    if tls_spki_sha256 is None:
        return hashlib.sha512(DOMAIN + nonce + bytes.fromhex(config_sha256)).digest()
    return hashlib.sha512(DOMAIN_TLS + nonce + bytes.fromhex(config_sha256) + bytes.fromhex(tls_spki_sha256)).digest()


def artifact_digests() -> tuple[str | None, str | None]:
    """(sha256, sha384) of the running executable when frozen, else (None, None)."""
    if not getattr(sys, "frozen", False):
        return None, None
    try:
        with open(sys.executable, "rb") as f:
            sha256 = hashlib.file_digest(f, "sha256").hexdigest()
            f.seek(0)
            return sha256, hashlib.file_digest(f, "sha384").hexdigest()
    except OSError as e:
        raise EvidenceUnavailable(f"cannot read the gateway's own executable: {e.strerror}") from None


def read_event_log(path: str) -> list:
    """The launcher's events, one JSON value per line; [] when there is no log."""
    try:
        raw = _read(path, EVENT_LOG_MAX_BYTES, "the event log")
    except OSError as e:
        raise EvidenceUnavailable(f"cannot read the event log: {e.strerror}") from None
    events = []
    for number, line in enumerate(raw.splitlines(), 1):
        if line.strip():
            try:
                events.append(msgspec.json.decode(line))
            except msgspec.DecodeError:
                raise EvidenceUnavailable(f"the event log's line {number} is not JSON") from None
    return events


async def fetch_evidence(report_dir: str, data: bytes) -> dict:
    """{"provider", "outblob"} from configfs-tsm (on SEV-SNP also "platform", "report" and the
    host's certificates), or {"provider": "none"} without it."""
    if not await asyncio.to_thread(os.path.isdir, report_dir):
        return {"provider": "none"}
    deadline = asyncio.get_running_loop().time() + EVIDENCE_SECONDS
    entry = os.path.join(report_dir, f"tinygw-{secrets.token_hex(8)}")
    try:
        try:
            await asyncio.to_thread(os.mkdir, entry)
        except OSError as e:
            raise EvidenceUnavailable(f"cannot create a TSM report entry: {e.strerror}") from None
        await asyncio.to_thread(_write, os.path.join(entry, "inblob"), data)
        before = await _read_when_ready(entry, "generation", deadline)
        outblob = await _read_when_ready(entry, "outblob", deadline)
        provider = (await _read_when_ready(entry, "provider", deadline)).decode("ascii", "replace").strip()
        auxblob = b""
        if provider == SEV_GUEST:  # the host's certificates, when it supplies them (else no file, or empty)
            auxblob = await asyncio.to_thread(_read, os.path.join(entry, "auxblob"), BLOB_MAX_BYTES, "auxblob")
        after = await _read_when_ready(entry, "generation", deadline)
    except OSError as e:
        raise EvidenceUnavailable(f"the TSM report failed: {e.strerror}") from None
    finally:
        await asyncio.to_thread(_remove_entry, entry)
    # A fresh entry that only we wrote to is at generation 1; anything else means another
    # writer changed the request, before or while the quote was made.
    if before != after or before.strip() != b"1":
        raise Raced("attestation raced; retry")
    evidence = {"provider": provider, "outblob": base64.b64encode(outblob).decode()}
    if provider == SEV_GUEST:  # docs/design.md section 12
        evidence.update(platform="sev-snp", report=evidence["outblob"], **snp_certificates(auxblob))
    return evidence


def snp_certificates(auxblob: bytes) -> dict[str, str]:
    """{"vcek", "ask", "ark": PEM} from the host's certificate table, those it holds.

    The table (AMD's GHCB specification): 24-byte entries, a GUID (RFC 4122 byte order), then
    the offset from the table's start and the length (u32 little-endian) of a certificate,
    ended by an all-zero entry. Entries that point outside the blob are left out; the
    certificates are handed on as they are (DER made PEM), for the verifier to judge."""
    certificates = {}
    for at in range(0, len(auxblob) - 23, 24):
        guid, (offset, length) = auxblob[at : at + 16], struct.unpack_from("<II", auxblob, at + 16)
        if guid == bytes(16):
            break
        name = SNP_CERT_GUIDS.get(guid)
        if name is None or name in certificates or not length or offset + length > len(auxblob):
            continue
        blob = auxblob[offset : offset + length]
        if blob.startswith(b"-----BEGIN"):
            certificates[name] = blob.decode("ascii", "replace")
        else:
            certificates[name] = ssl.DER_cert_to_PEM_cert(blob)
    return certificates


async def _read_when_ready(entry: str, name: str, deadline: float) -> bytes:
    """A report attribute's content, waiting (up to `deadline`) while it is missing or empty."""
    loop = asyncio.get_running_loop()
    while not (content := await asyncio.to_thread(_read, os.path.join(entry, name), BLOB_MAX_BYTES, name)):
        if loop.time() > deadline:
            raise EvidenceUnavailable(f"the TSM provider gave no {name} within {EVIDENCE_SECONDS:g} s")
        await asyncio.sleep(POLL_SECONDS)
    return content


def _read(path: str, limit: int, what: str) -> bytes:
    """The file's content, b"" when there is no such file."""
    try:
        with open(path, "rb") as f:
            content = f.read(limit + 1)
    except FileNotFoundError:
        return b""
    if len(content) > limit:
        raise EvidenceUnavailable(f"{what} is over {limit} bytes")
    return content


def _write(path: str, data: bytes) -> None:
    """`data` in one write(2); configfs takes it when the file is closed."""
    with open(path, "wb", buffering=0) as f:
        if f.write(data) != len(data):
            raise EvidenceUnavailable("the TSM report interface took part of report_data")


def _remove_entry(entry: str) -> None:
    """configfs drops an entry's attributes with it; a plain directory (tests) needs them unlinked."""
    try:
        os.rmdir(entry)
    except OSError:
        try:
            for name in os.listdir(entry):
                os.unlink(os.path.join(entry, name))
            os.rmdir(entry)
        except OSError as e:
            logs.log(logging.WARNING, "TSM report entry left behind", entry=entry, reason=e.strerror)
