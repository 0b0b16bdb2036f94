"""attest/snp_report.py: the layout of an AMD SEV-SNP attestation report, read (docs/design.md section 12).

The report's fields by offset, its versions, the TCB_VERSION layout of each product, and
`Check`, the verdict every SEV-SNP check returns (attest/snp.py lists them all).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# ATTESTATION_REPORT (AMD SEV-SNP firmware ABI, table "ATTESTATION_REPORT Structure"):
# little-endian integers at these offsets; the signature covers [0, SIGNED_BYTES).
REPORT_BYTES, SIGNED_BYTES = 0x4A0, 0x2A0
VERSIONS = range(2, 6)
ECDSA_P384_SHA384 = 1
FIELDS = {  # name: (offset, size)
    "report_data": (0x50, 64),
    "measurement": (0x90, 48),
    "host_data": (0xC0, 32),
    "id_key_digest": (0xE0, 48),
    "author_key_digest": (0x110, 48),
    "report_id": (0x140, 32),
    "report_id_ma": (0x160, 32),
    "reported_tcb": (0x180, 8),
    "chip_id": (0x1A0, 64),
    "current_tcb": (0x38, 8),
    "launch_tcb": (0x1F0, 8),
}
R_AT, S_AT, COMPONENT_BYTES = 0x2A0, 0x2E8, 72  # r and s, little-endian, zero-padded to 72 bytes
POLICY_MIGRATE_MA, POLICY_DEBUG = 1 << 18, 1 << 19
SIGNING_KEY_VCEK = 0  # KEY_INFO bits 4:2; 1 is a VLEK, 7 no key
MASK_CHIP_KEY = 1 << 1  # KEY_INFO: the firmware signed with zeros

# The SPLs inside an 8-byte TCB_VERSION, by product: Turin moved them and added fmc.
TCB_LAYOUT = {
    "Milan": {"bootloader": 0, "tee": 1, "snp": 6, "microcode": 7},
    "Genoa": {"bootloader": 0, "tee": 1, "snp": 6, "microcode": 7},
    "Turin": {"fmc": 0, "bootloader": 1, "tee": 2, "snp": 3, "microcode": 7},
}
_HEX = re.compile(rb"[0-9a-fA-F]+")


class ReportError(ValueError):
    """The bytes are not an SEV-SNP attestation report this module reads."""


@dataclass(frozen=True)
class Check:
    name: str
    result: str  # "PASS", "FAIL" or "SKIP"
    reason: str | None = None  # why it FAILed or was SKIPped; on a PASS, what it did not cover (or None)
    values: dict = field(default_factory=dict)


def passed(name: str, caveat: str | None = None, **values) -> Check:
    """A PASS; `caveat`, its reason, says what it did not cover."""
    return Check(name, "PASS", caveat, values)


def failed(name: str, reason: str, **values) -> Check:
    return Check(name, "FAIL", reason, values)


def skipped(name: str, reason: str, **values) -> Check:
    return Check(name, "SKIP", reason, values)


@dataclass(frozen=True)
class Report:
    raw: bytes
    version: int
    guest_svn: int
    policy: int
    vmpl: int
    signature_algo: int
    key_info: int
    cpuid: tuple[int, int, int] | None  # family, model, stepping: version 3 and later

    def field(self, name: str) -> bytes:
        at, size = FIELDS[name]
        return self.raw[at : at + size]

    @property
    def signing_key(self) -> int:
        return (self.key_info >> 2) & 7


def load_report(data: bytes) -> bytes:
    """A report file's bytes: the raw 1,184 bytes, or their hex (whitespace ignored)."""
    if len(data) == REPORT_BYTES:
        return data
    text = b"".join(data.split())
    if len(text) == 2 * REPORT_BYTES and _HEX.fullmatch(text):
        return bytes.fromhex(text.decode("ascii"))
    raise ReportError(f"not an SEV-SNP report: {len(data)} bytes, neither the raw {REPORT_BYTES} nor their hex")


def parse_report(raw: bytes) -> Report:
    if len(raw) != REPORT_BYTES:
        raise ReportError(f"an SEV-SNP report is {REPORT_BYTES} bytes, this one {len(raw)}")

    def u32(at: int) -> int:
        return int.from_bytes(raw[at : at + 4], "little")

    version = u32(0)
    if version not in VERSIONS:
        raise ReportError(f"report version {version}: this verifier reads versions 2 to 5")
    return Report(
        raw=bytes(raw),
        version=version,
        guest_svn=u32(4),
        policy=int.from_bytes(raw[8:16], "little"),
        vmpl=u32(0x30),
        signature_algo=u32(0x34),
        key_info=u32(0x48),
        cpuid=(raw[0x188], raw[0x189], raw[0x18A]) if version >= 3 else None,
    )


def tcb(raw: bytes, product: str) -> dict[str, int]:
    """An 8-byte TCB_VERSION as {component: SPL} in `product`'s layout."""
    return {name: raw[at] for name, at in TCB_LAYOUT[product].items()}
