"""A simulated SEV-SNP platform for tests and `make rehearse`: never part of the gateway.

`FakeSnp` makes a test-only chain with `cryptography` (an "ARK" and "ASK" with RSA keys, a
"VCEK" with an ECDSA P-384 key carrying AMD's hwID and TCB extensions, each certificate
signed RSA-PSS SHA-384 as AMD's are) and answers a configfs-tsm report directory as the
`sev_guest` provider does: for each new entry with a 64-byte `inblob` a thread writes
`generation`, `provider`, an `auxblob` in the host's certificate-table format (GUID,
offset, length entries ended by an all-zero one, then the DER certificates) and, last, an
`outblob`: a 1,184-byte report with the inblob as REPORT_DATA, signed by the VCEK.

Its ARK is not AMD's, so no report it makes passes attest/verify's `certificate chain`.
attest/verify's command line offers no way to trust it: `verify_with_simulated_ark` runs
attest/verify through its Python entry point, `main(argv, simulated_ark=...)`, and the
check is then a SKIP that says so, never a PASS. `Chain.crl` makes revocation lists as
AMD's KDS publishes them (signed by the ARK, RSA-PSS SHA-384), for `--snp-crl`.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import struct
import sys
import threading
import uuid
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature
from fake_tdx import answer_reports  # attest/, beside this file

# The host's certificate table (AMD's GHCB specification), GUIDs in RFC 4122 byte order.
CERT_GUIDS = {
    "vcek": uuid.UUID("63da758d-e664-4564-adc5-f4b93be8accd"),
    "ask": uuid.UUID("4ab7b379-bbac-4fe4-a02f-05aef327c782"),
    "ark": uuid.UUID("c0b406a4-a803-4952-9743-3fb6014cd0ae"),
}
PSS_SHA384 = padding.PSS(mgf=padding.MGF1(hashes.SHA384()), salt_length=48)
MILAN_TCB = {"bootloader": 0, "tee": 1, "snp": 6, "microcode": 7}  # the SPLs' bytes in a TCB_VERSION
SPL_OIDS = {
    "bootloader": "1.3.6.1.4.1.3704.1.3.1",
    "tee": "1.3.6.1.4.1.3704.1.3.2",
    "snp": "1.3.6.1.4.1.3704.1.3.3",
    "microcode": "1.3.6.1.4.1.3704.1.3.8",
}
HWID_OID = "1.3.6.1.4.1.3704.1.4"
SIMULATED_MEASUREMENT = hashlib.sha384(b"tinygw: a simulated SEV-SNP launch, no image").digest()
VERIFY = Path(__file__).resolve().parent / "verify"
# attest/verify (a script, no .py) loaded as a module by an isolated interpreter, and run with
# the simulated root as main's argument: sys.argv is [-c, verify's path, the root's file, verify's arguments].
_WITH_SIMULATED_ARK = (
    "import importlib.machinery, importlib.util, sys\n"
    "path, ark = sys.argv[1], sys.argv[2]\n"
    "loader = importlib.machinery.SourceFileLoader('attest_verify', path)\n"
    "module = importlib.util.module_from_spec(importlib.util.spec_from_loader('attest_verify', loader))\n"
    "loader.exec_module(module)\n"
    "sys.exit(module.main(sys.argv[3:], simulated_ark=open(ark, 'rb').read()))\n"
)


def verify_with_simulated_ark(ark: Path) -> list[str]:
    """The command that runs attest/verify with the root in file `ark` (PEM or DER) as a simulated
    SEV-SNP ARK; append verify's arguments. For tests and make rehearse: attest/verify's own
    command line has no such option, and reads no variable that would name one."""
    return [sys.executable, "-I", "-c", _WITH_SIMULATED_ARK, str(VERIFY), str(ark)]


def tcb_version(spls: dict[str, int]) -> bytes:
    raw = bytearray(8)
    for component, at in MILAN_TCB.items():
        raw[at] = spls[component]
    return bytes(raw)


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(x509.NameOID.ORGANIZATION_NAME, "tinygw test-only, not AMD"),
            x509.NameAttribute(x509.NameOID.COMMON_NAME, common_name),
        ]
    )


def _certificate(subject, issuer, key, issuer_key, serial: int, extensions=()) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(serial)
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=30))
    )
    for extension in extensions:
        builder = builder.add_extension(extension, critical=False)
    return builder.sign(issuer_key, hashes.SHA384(), rsa_padding=PSS_SHA384)


class Chain:
    """ARK -> ASK -> VCEK, test-only, for one chip at one TCB."""

    def __init__(self, chip_id: bytes, spls: dict[str, int]) -> None:
        self.ark_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.ask_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.vcek_key = ec.generate_private_key(ec.SECP384R1())
        ark_name, ask_name = _name("ARK-Milan"), _name("SEV-Milan")
        self.ark = _certificate(ark_name, ark_name, self.ark_key, self.ark_key, 1)
        self.ask = _certificate(ask_name, ark_name, self.ask_key, self.ark_key, 2)
        amd = [
            x509.UnrecognizedExtension(x509.ObjectIdentifier(oid), _der_integer(spls[component]))
            for component, oid in SPL_OIDS.items()
        ]
        amd.append(x509.UnrecognizedExtension(x509.ObjectIdentifier(HWID_OID), chip_id))
        self.vcek = _certificate(_name("SEV-VCEK"), ask_name, self.vcek_key, self.ask_key, 3, amd)

    def der(self, name: str) -> bytes:
        return getattr(self, name).public_bytes(serialization.Encoding.DER)

    def crl(self, revoked: tuple[str, ...] = (), *, signer=None, days: int = 7) -> bytes:
        """A revocation list as AMD's KDS publishes one (DER, issued by the ARK, RSA-PSS SHA-384,
        current for `days`), listing the certificates named in `revoked` ("ask", "vcek") by
        serial number; `signer`, a private key other than the ARK's, makes one nobody should trust."""
        now = datetime.datetime.now(datetime.UTC)
        builder = (
            x509.CertificateRevocationListBuilder()
            .issuer_name(self.ark.subject)
            .last_update(now - datetime.timedelta(days=1))
            .next_update(now + datetime.timedelta(days=days))
        )
        for name in revoked:
            entry = x509.RevokedCertificateBuilder().serial_number(getattr(self, name).serial_number)
            builder = builder.add_revoked_certificate(entry.revocation_date(now - datetime.timedelta(hours=1)).build())
        crl = builder.sign(signer or self.ark_key, hashes.SHA384(), rsa_padding=PSS_SHA384)
        return crl.public_bytes(serialization.Encoding.DER)

    def pem(self, name: str) -> bytes:
        return getattr(self, name).public_bytes(serialization.Encoding.PEM)


def _der_integer(value: int) -> bytes:
    """An SPL as AMD's VCEKs carry it: a DER INTEGER, 0 to 255."""
    return b"\x02\x01" + bytes([value]) if value < 0x80 else b"\x02\x02\x00" + bytes([value])


def snp_report(
    key: ec.EllipticCurvePrivateKey,
    report_data: bytes,
    *,
    chip_id: bytes,
    reported_tcb: bytes,
    measurement: bytes = SIMULATED_MEASUREMENT,
    policy: int = 0x30000,
    vmpl: int = 0,
    host_data: bytes = bytes(32),
    version: int = 3,
) -> bytes:
    """An ATTESTATION_REPORT laid out as AMD's firmware makes it, signed with `key`."""
    raw = bytearray(0x4A0)
    struct.pack_into("<IIQ", raw, 0, version, 0, policy)
    struct.pack_into("<II", raw, 0x30, vmpl, 1)  # ECDSA P-384 with SHA-384
    raw[0x38:0x40] = reported_tcb  # current_tcb
    raw[0x50:0x90] = report_data
    raw[0x90:0xC0] = measurement
    raw[0xC0:0xE0] = host_data
    raw[0x160:0x180] = b"\xff" * 32  # report_id_ma: no migration agent
    raw[0x180:0x188] = reported_tcb
    if version >= 3:
        raw[0x188:0x18B] = bytes([0x19, 0x01, 0x01])  # CPUID family, model, stepping: Milan
    raw[0x1A0:0x1E0] = chip_id
    raw[0x1E0:0x1E8] = raw[0x1F0:0x1F8] = reported_tcb  # committed_tcb, launch_tcb
    r, s = decode_dss_signature(key.sign(bytes(raw[:0x2A0]), ec.ECDSA(hashes.SHA384())))
    raw[0x2A0:0x2E8], raw[0x2E8:0x330] = r.to_bytes(72, "little"), s.to_bytes(72, "little")
    return bytes(raw)


def cert_table(certificates: dict[str, bytes]) -> bytes:
    """The host's certificate table: (GUID, offset, length) entries, a zero entry, the certificates."""
    offset = 24 * (len(certificates) + 1)
    entries, blobs = b"", b""
    for name, der in certificates.items():
        entries += CERT_GUIDS[name].bytes + struct.pack("<II", offset + len(blobs), len(der))
        blobs += der
    return entries + bytes(24) + blobs


class FakeSnp:
    def __init__(self, root: Path, *, policy: int = 0x30000, with_certificates: bool = True) -> None:
        self.report_dir = root / "tsm" / "report"
        self.report_dir.mkdir(parents=True)
        self._scratch = root / "platform"  # where answers are written before they are moved in
        self._scratch.mkdir()
        self.chip_id = os.urandom(64)
        self.spls = {"bootloader": 4, "tee": 0, "snp": 23, "microcode": 213}
        self.chain = Chain(self.chip_id, self.spls)
        self.policy, self.measurement = policy, SIMULATED_MEASUREMENT
        self.auxblob = cert_table({n: self.chain.der(n) for n in ("vcek", "ask", "ark")}) if with_certificates else b""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._tsm, daemon=True)
        self._thread.start()

    def env(self) -> dict[str, str]:
        return {"TINYGW_TSM_REPORT_DIR": str(self.report_dir)}

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def report(self, report_data: bytes) -> bytes:
        return snp_report(
            self.chain.vcek_key,
            report_data,
            chip_id=self.chip_id,
            reported_tcb=tcb_version(self.spls),
            policy=self.policy,
        )

    def _tsm(self) -> None:
        answer_reports(self.report_dir, self._scratch, self._stop, self._answer)

    def _answer(self, inblob: bytes) -> dict[str, bytes]:
        files = {"generation": b"1\n", "provider": b"sev_guest\n"}
        if self.auxblob:
            files["auxblob"] = self.auxblob
        return {**files, "outblob": self.report(inblob)}
