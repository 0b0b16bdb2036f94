"""attest/snp.py: an AMD SEV-SNP attestation report, checked as attest/verify checks a TDX quote.

(docs/design.md section 12; docs/verify.md says what each check proves.) On the
`cryptography` library alone: no signature or certificate code of our own. The only
DER read here by hand is the value of the VCEK's AMD extensions, which `cryptography`
hands over as bytes by OID: a small INTEGER, or hwID's raw chip id.

    checks = verify_report(load_report(data), vcek, ask, ark=None, report_data=..., policy=parse_policy(...))

attest/verify uses it as the platform module of provider `sev_guest`, beside attest/tdx.py:
`Quote.from_evidence` and `check` at the end of this file.

Each check is a `Check(name, result, reason, values)`, result PASS, FAIL or SKIP:

  snp report               the report is 1,184 bytes, of version 2 to 5
  certificate chain        ARK -> ASK -> VCEK, each RSA-PSS SHA-384 (salt 48) and valid now; the
                           ARK one of AMD's, pinned here by SHA-256 (Milan, Genoa, Turin)
  report signature         the VCEK's key signed the report's first 0x2A0 bytes
  VCEK matches report      the VCEK's hwID is the report's chip_id and its TCB extensions are the
                           report's reported_tcb (AMD issues one VCEK per chip and TCB)
  guest not in debug mode  policy bit DEBUG clear (the host can read a debug guest's memory)
  no migration agent       policy bit MIGRATE_MA clear and no agent bound (report_id_ma unset)
  report_data              (when expected) REPORT_DATA is the one recomputed for this nonce
  snp.measurement, snp.host_data, snp.vmpl, snp.min_tcb, snp.chip_ids   (those the policy names)
  artifact measured        SEV-SNP has no runtime measurement register: only a pinned launch
                           measurement of an image that contains the binary binds it
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature

# SHA-256 of the DER of AMD's root keys (ARK). The certificates are attest/amd-ark/*.pem,
# from github.com/virtee/sev @9cf2adbf, src/certs/snp/builtin/<product>/ark.pem (see the
# README there); the Milan one is also the ARK of tests/data/snp-sample/omne. A chain is
# trusted only when it ends in one of these: the files alone can narrow trust, never widen it.
ARK_SHA256 = {
    "Milan": "69d063b45344d26a2e94e1f4210de49ef555308287d4c174445c95639a540bcd",
    "Genoa": "4c6598d19c18719c5dfd4a7d335f674e5bfe1d8f800cea2cf270c10d103db2f1",
    "Turin": "1f084161a44bb6d93778a904877d4819cafa5d05ef4193b2ded9dd9c73dd3f6a",
}
ARK_DIR = Path(__file__).resolve().parent / "amd-ark"

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
# The VCEK's extensions (AMD's "Versioned Chip Endorsement Key" spec): TCB SPLs, and hwID,
# the chip id (64 bytes; Turin's VCEKs carry its first 8).
SPL_OIDS = {
    "bootloader": "1.3.6.1.4.1.3704.1.3.1",
    "tee": "1.3.6.1.4.1.3704.1.3.2",
    "snp": "1.3.6.1.4.1.3704.1.3.3",
    "microcode": "1.3.6.1.4.1.3704.1.3.8",
    "fmc": "1.3.6.1.4.1.3704.1.3.9",
}
HWID_OID = "1.3.6.1.4.1.3704.1.4"
HWID_BYTES = {"Milan": 64, "Genoa": 64, "Turin": 8}

PSS_SHA384 = padding.PSS(mgf=padding.MGF1(hashes.SHA384()), salt_length=48)
POLICY_FIELDS = ("measurement", "host_data", "vmpl", "min_tcb", "chip_ids")
_HEX = re.compile(rb"[0-9a-fA-F]+")


class ReportError(ValueError):
    """The bytes are not an SEV-SNP attestation report this module reads."""


class PolicyError(ValueError):
    """The `snp` part of a policy file is malformed; the message names the field."""


@dataclass(frozen=True)
class Check:
    name: str
    result: str  # "PASS", "FAIL" or "SKIP"
    reason: str | None = None
    values: dict = field(default_factory=dict)


def passed(name: str, **values) -> Check:
    return Check(name, "PASS", None, values)


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


# ---- certificates ---------------------------------------------------------------------------


def load_certificate(data: bytes) -> x509.Certificate:
    """PEM or DER. AMD's VCEKs have serial number 0, which `cryptography` accepts with a warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if data.lstrip().startswith(b"-----BEGIN"):
            return x509.load_pem_x509_certificate(data)
        return x509.load_der_x509_certificate(data)


def fingerprint(cert: x509.Certificate) -> str:
    return hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest()


def builtin_arks() -> dict[str, x509.Certificate]:
    """The ARKs of attest/amd-ark whose fingerprint is the pinned one; a changed file is left out."""
    arks = {}
    for product, pinned in ARK_SHA256.items():
        try:
            cert = load_certificate((ARK_DIR / f"{product.lower()}.pem").read_bytes())
        except (OSError, ValueError):
            continue
        if fingerprint(cert) == pinned:
            arks[product] = cert
    return arks


def signed_by(cert: x509.Certificate, issuer: x509.Certificate) -> str | None:
    """None when `issuer` issued `cert` with RSA-PSS SHA-384 (salt 48), else why not."""
    key = issuer.public_key()
    if cert.issuer != issuer.subject:
        return f"{_cn(cert)} is issued by {_cn_of(cert.issuer)}, not by {_cn(issuer)}"
    if not isinstance(key, rsa.RSAPublicKey):
        return f"the issuer {_cn(issuer)} has no RSA key"
    try:
        key.verify(cert.signature, cert.tbs_certificate_bytes, PSS_SHA384, hashes.SHA384())
    except InvalidSignature:
        return f"the signature of {_cn(cert)} by {_cn(issuer)} (RSA-PSS SHA-384) does not verify"
    return None


def _cn(cert: x509.Certificate) -> str:
    return _cn_of(cert.subject)


def _cn_of(name: x509.Name) -> str:
    names = name.get_attributes_for_oid(x509.NameOID.COMMON_NAME)
    return str(names[0].value) if names else name.rfc4514_string()


def _valid_at(certs: list[x509.Certificate], now: datetime.datetime) -> str | None:
    for cert in certs:
        if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
            return (
                f"{_cn(cert)} is valid from {cert.not_valid_before_utc:%Y-%m-%d} to "
                f"{cert.not_valid_after_utc:%Y-%m-%d}, not at {now:%Y-%m-%d %H:%M} UTC"
            )
    return None


def _root(ask, ark, simulated_ark) -> tuple[x509.Certificate | None, str | None, str | None]:
    """(the chain's root, its product or None when simulated, why there is none)."""
    if ark is not None:
        product = next((p for p, pin in ARK_SHA256.items() if fingerprint(ark) == pin), None)
        if product is None:
            return (
                None,
                None,
                (
                    f"the given ARK (sha256 {fingerprint(ark)[:16]}...) is none of AMD's pinned ARKs "
                    f"({', '.join(ARK_SHA256)})"
                ),
            )
        return ark, product, None
    if simulated_ark is not None and ask.issuer == simulated_ark.subject:
        return simulated_ark, None, None
    for product, cert in builtin_arks().items():
        if cert.subject == ask.issuer:
            return cert, product, None
    return (
        None,
        None,
        (f"the ASK's issuer ({ask.issuer.rfc4514_string()}) is none of AMD's pinned ARKs ({', '.join(ARK_SHA256)})"),
    )


def verify_chain(vcek, ask, ark=None, *, simulated_ark=None, now=None) -> tuple[Check, str | None]:
    """The `certificate chain` check, and the product (Milan, Genoa, Turin) whose ARK it ends in.

    `ark`, when given, must be one of the pinned ARKs; else the built-in one that issued the
    ASK is used. `simulated_ark` (tests, make rehearse) is a root that is not AMD's: a chain
    ending there is a SKIP that says so, never a PASS (its TCB is read in Milan's layout)."""
    name = "certificate chain"
    now = now or datetime.datetime.now(datetime.UTC)
    values = {"vcek_sha256": fingerprint(vcek), "ask_sha256": fingerprint(ask)}
    root, product, reason = _root(ask, ark, simulated_ark)
    if root is None:
        return failed(name, reason, **values), None
    values["ark_sha256"] = fingerprint(root)
    layout = product or "Milan"
    for cert, issuer in ((root, root), (ask, root), (vcek, ask)):
        if reason := signed_by(cert, issuer):
            return failed(name, reason, **values), layout
    if reason := _valid_at([root, ask, vcek], now):
        return failed(name, reason, **values), layout
    key = vcek.public_key()
    if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name != "secp384r1":
        return failed(name, "the VCEK's key is not ECDSA P-384", **values), layout
    if product is None:
        return skipped(
            name,
            f"the chain ends in a simulated ARK (sha256 {fingerprint(root)[:16]}...), not one of "
            "AMD's: nothing here is signed by AMD",
            **values,
        ), layout
    return passed(name, product=product, **values), product


# ---- the report --------------------------------------------------------------------------


def report_signature(report: Report, vcek: x509.Certificate) -> Check:
    """ECDSA P-384 with SHA-384 over the first 0x2A0 bytes; r and s little-endian, 72 bytes each."""
    name = "report signature"
    if report.signature_algo != ECDSA_P384_SHA384:
        return failed(name, f"signature algorithm {report.signature_algo}, not 1 (ECDSA P-384 with SHA-384)")
    if report.key_info & MASK_CHIP_KEY:
        return failed(name, "the firmware masked its key (MASK_CHIP_KEY): the report is not signed")
    if report.signing_key != SIGNING_KEY_VCEK:
        kind = {1: "a VLEK", 7: "no key"}.get(report.signing_key, f"key {report.signing_key}")
        return failed(name, f"signed with {kind}; this verifier checks reports signed with a VCEK")
    key = vcek.public_key()
    if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name != "secp384r1":
        return failed(name, "the VCEK's key is not ECDSA P-384")
    r = int.from_bytes(report.raw[R_AT : R_AT + COMPONENT_BYTES], "little")
    s = int.from_bytes(report.raw[S_AT : S_AT + COMPONENT_BYTES], "little")
    try:
        key.verify(encode_dss_signature(r, s), report.raw[:SIGNED_BYTES], ec.ECDSA(hashes.SHA384()))
    except (InvalidSignature, ValueError):
        return failed(
            name, f"the report's signature does not verify under this VCEK (sha256 {fingerprint(vcek)[:16]}...)"
        )
    return passed(name, signed_sha384=hashlib.sha384(report.raw[:SIGNED_BYTES]).hexdigest())


def _extension(cert: x509.Certificate, oid: str) -> bytes:
    try:
        value = cert.extensions.get_extension_for_oid(x509.ObjectIdentifier(oid)).value
    except x509.ExtensionNotFound:
        raise ValueError(f"the VCEK has no extension {oid}") from None
    if not isinstance(value, x509.UnrecognizedExtension):
        raise ValueError(f"the VCEK's extension {oid} is not AMD's")
    return value.value


def _spl(cert: x509.Certificate, oid: str) -> int:
    """An SPL extension: a DER INTEGER of one or two content bytes, 0 to 255."""
    der = _extension(cert, oid)
    if len(der) not in (3, 4) or der[0] != 0x02 or der[1] != len(der) - 2:
        raise ValueError(f"the VCEK's extension {oid} is not a small INTEGER")
    value = int.from_bytes(der[2:], "big", signed=True)
    if not 0 <= value <= 255:
        raise ValueError(f"the VCEK's extension {oid} holds {value}, not an SPL (0 to 255)")
    return value


def _hwid(cert: x509.Certificate, size: int) -> bytes:
    """hwID: the raw chip id (as AMD's KDS issues it), or the same inside an OCTET STRING."""
    der = _extension(cert, HWID_OID)
    if len(der) == size + 2 and der[0] == 0x04 and der[1] == size:
        return der[2:]
    return der


def vcek_matches(report: Report, vcek: x509.Certificate, product: str) -> Check:
    """AMD issues a VCEK per chip and per TCB: its hwID and SPLs must be the report's."""
    name = "VCEK matches report"
    size = HWID_BYTES[product]
    chip_id = report.field("chip_id")
    reported = tcb(report.field("reported_tcb"), product)
    try:
        hwid = _hwid(vcek, size)
        certified = {component: _spl(vcek, SPL_OIDS[component]) for component in reported}
    except ValueError as e:
        return failed(name, str(e))
    values = {"chip_id": chip_id.hex(), "reported_tcb": reported}
    if chip_id == bytes(64):
        return failed(name, "the report's chip_id is masked (zero): the VCEK cannot be tied to it", **values)
    if hwid != chip_id[:size]:
        return failed(
            name,
            f"the VCEK is for chip {hwid.hex()[:16]}..., the report comes from chip {chip_id.hex()[:16]}...",
            vcek_hwid=hwid.hex(),
            **values,
        )
    if certified != reported:
        return failed(
            name,
            f"the VCEK is for TCB {_tcb_text(certified)}, the report's reported_tcb is {_tcb_text(reported)}",
            vcek_tcb=certified,
            **values,
        )
    return passed(name, **values)


def _tcb_text(spls: dict[str, int]) -> str:
    return " ".join(f"{component}={value}" for component, value in spls.items())


def debug_off(report: Report) -> Check:
    name = "guest not in debug mode"
    if report.policy & POLICY_DEBUG:
        return failed(
            name,
            f"the guest policy (0x{report.policy:x}) allows debugging: the host can read and change "
            "the guest's memory, so nothing in it is protected",
            policy=f"0x{report.policy:x}",
        )
    return passed(name, policy=f"0x{report.policy:x}")


def migration_agent_off(report: Report) -> Check:
    name = "no migration agent"
    if report.policy & POLICY_MIGRATE_MA:
        return failed(
            name,
            f"the guest policy (0x{report.policy:x}) allows a migration agent, which can move the guest's memory out",
            policy=f"0x{report.policy:x}",
        )
    if report.field("report_id_ma") != b"\xff" * 32:
        return failed(
            name,
            "a migration agent is bound to this guest (report_id_ma is set)",
            report_id_ma=report.field("report_id_ma").hex(),
        )
    return passed(name)


def report_data_check(report: Report, expected: bytes) -> Check:
    got = report.field("report_data")
    if got != expected:
        return failed(
            "report_data",
            "the report's REPORT_DATA is not the one recomputed for this nonce",
            report=got.hex(),
            expected=expected.hex(),
        )
    return passed("report_data")


# ---- policy ------------------------------------------------------------------------------

HEX_FIELDS = {"measurement": 48, "host_data": 32, "chip_ids": 64}  # policy field: bytes of each value
MIN_TCB_FIELDS = ("bootloader", "tee", "snp", "microcode")
MAX_VMPL = 3


def parse_policy(snp: object) -> dict:
    """The `snp` object of a policy file, checked: one list of allowed values per field, and
    `min_tcb` an object of floors. {} for None. PolicyError names the field that is wrong."""
    if snp is None:
        return {}
    if not isinstance(snp, dict):
        raise PolicyError("policy snp: give an object of SEV-SNP fields (" + ", ".join(POLICY_FIELDS) + ")")
    policy = {}
    for key, value in snp.items():
        where = f"policy snp.{key}"
        if key in HEX_FIELDS:
            policy[key] = _hex_values(where, value, HEX_FIELDS[key])
        elif key == "vmpl":
            policy[key] = _int_values(where, value, MAX_VMPL)
        elif key == "min_tcb":
            if not isinstance(value, dict) or not value or set(value) - set(MIN_TCB_FIELDS):
                raise PolicyError(f"{where}: give an object of floors, keys among {', '.join(MIN_TCB_FIELDS)}")
            policy[key] = {k: _int_values(f"{where}.{k}", [v], 255)[0] for k, v in value.items()}
        else:
            raise PolicyError(f"{where}: unknown field (known: {', '.join(POLICY_FIELDS)})")
    return policy


def _hex_values(where: str, value: object, size: int) -> list[str]:
    if not isinstance(value, list) or not value:
        raise PolicyError(f"{where}: give a non-empty list of allowed values")
    for item in value:
        if not isinstance(item, str) or len(item) != 2 * size or not _HEX.fullmatch(item.encode()):
            raise PolicyError(f"{where}: {str(item)[:40]!r} is not {size} bytes of hex")
    return [item.lower() for item in value]


def _int_values(where: str, value: object, top: int) -> list[int]:
    if not isinstance(value, list) or not value:
        raise PolicyError(f"{where}: give a non-empty list of allowed values")
    for item in value:
        if type(item) is not int or not 0 <= item <= top:
            raise PolicyError(f"{where}: {item!r} is not an integer from 0 to {top}")
    return list(value)


def policy_checks(report: Report, product: str, policy: dict) -> list[Check]:
    """One check per field the policy names, called by the field's name; a FAIL gives both values."""
    checks = []
    got = {
        "measurement": report.field("measurement").hex(),
        "host_data": report.field("host_data").hex(),
        "chip_ids": report.field("chip_id").hex(),
        "vmpl": report.vmpl,
    }
    for key in ("measurement", "host_data", "vmpl", "chip_ids"):
        if key in policy:
            name = f"snp.{key}"
            if got[key] in policy[key]:
                checks.append(passed(name, report=got[key]))
            else:
                allowed = ", ".join(str(v) for v in policy[key])
                checks.append(
                    failed(
                        name,
                        f"policy {name}: the report has {got[key]}, the policy allows {allowed}",
                        report=got[key],
                        allowed=policy[key],
                    )
                )
    if "min_tcb" in policy:
        reported = tcb(report.field("reported_tcb"), product)
        low = [f"{k} {reported[k]} < {floor}" for k, floor in policy["min_tcb"].items() if reported[k] < floor]
        checks.append(
            failed(
                "snp.min_tcb",
                "policy snp.min_tcb: the reported TCB is below the floor: " + ", ".join(low),
                report=reported,
                floor=policy["min_tcb"],
            )
            if low
            else passed("snp.min_tcb", report=reported, floor=policy["min_tcb"])
        )
    return checks


def artifact_measured(report: Report, policy: dict) -> Check:
    """SEV-SNP measures the guest at launch only: the binary is bound through that measurement."""
    name, measurement = "artifact measured", report.field("measurement").hex()
    if "measurement" not in policy:
        return skipped(
            name,
            "SEV-SNP has no runtime measurement register: the binary is bound only by the launch "
            "measurement of an image that contains it, and the policy pins no snp.measurement "
            "(docs/verify.md: how to compute it)",
            measurement=measurement,
        )
    if measurement not in policy["measurement"]:
        return failed(
            name,
            f"the launch measurement {measurement[:16]}... is not a pinned one: another image runs",
            measurement=measurement,
        )
    return passed(name, measurement=measurement, through="the pinned launch measurement of the image")


def learned_policy(report: Report, product: str) -> dict:
    """The `snp` policy that this report satisfies, to pin on first use (after its signature PASSed)."""
    reported = tcb(report.field("reported_tcb"), product)
    return {
        "measurement": [report.field("measurement").hex()],
        "host_data": [report.field("host_data").hex()],
        "vmpl": [report.vmpl],
        "min_tcb": {k: reported[k] for k in MIN_TCB_FIELDS},
        "chip_ids": [report.field("chip_id").hex()],
    }


# ---- all of it ---------------------------------------------------------------------------


def verify_report(
    raw: bytes,
    vcek: bytes | None,
    ask: bytes | None,
    ark: bytes | None = None,
    *,
    report_data: bytes | None = None,
    policy: dict | None = None,
    simulated_ark: bytes | None = None,
    now: datetime.datetime | None = None,
) -> list[Check]:
    """Every check of a report, in order. Certificates are PEM or DER bytes; `policy` is
    parse_policy's result; `report_data`, when given, is what REPORT_DATA must be."""
    policy = policy or {}
    try:
        report = parse_report(raw)
    except ReportError as e:
        return [failed("snp report", str(e))]
    checks = [
        passed(
            "snp report",
            version=report.version,
            measurement=report.field("measurement").hex(),
            reported_tcb=report.field("reported_tcb").hex(),
            chip_id=report.field("chip_id").hex(),
        )
    ]
    certs, reason = _certificates(vcek, ask, ark, simulated_ark)
    if reason is not None:
        checks.append(failed("certificate chain", reason))
        checks += [
            failed("report signature", "no VCEK to check it with"),
            failed("VCEK matches report", "no VCEK to check it with"),
        ]
        product = "Milan"
    else:
        chain, product = verify_chain(
            certs["vcek"], certs["ask"], certs["ark"], simulated_ark=certs["simulated"], now=now
        )
        product = product or "Milan"
        checks += [chain, report_signature(report, certs["vcek"]), vcek_matches(report, certs["vcek"], product)]
    checks += [debug_off(report), migration_agent_off(report)]
    if report_data is not None:
        checks.append(report_data_check(report, report_data))
    return checks + policy_checks(report, product, policy) + [artifact_measured(report, policy)]


def _certificates(vcek, ask, ark, simulated_ark) -> tuple[dict, str | None]:
    """The certificates read, or why one cannot be."""
    if vcek is None:
        return {}, (
            "no VCEK: the host supplies none; fetch the one for this chip_id and reported_tcb from AMD's "
            "KDS (kdsintf.amd.com/vcek/v1) and give it with --vcek"
        )
    if ask is None:
        return {}, "no ASK: give AMD's ASK of this product with --ask"
    certs = {}
    for key, data in (("vcek", vcek), ("ask", ask), ("ark", ark), ("simulated", simulated_ark)):
        try:
            certs[key] = None if data is None else load_certificate(data)
        except ValueError as e:
            return {}, f"cannot read the {key.upper()} certificate: {e}"
    return certs, None


# ---- the platform module of attest/verify (beside attest/tdx.py) ----------------------------

PROVIDER = "sev_guest"
RUNTIME_REGISTER = False  # no event log to replay: `artifact measured` is this module's
SIGNATURE_CHECK = "report signature"


@dataclass(frozen=True)
class Quote:
    """SEV-SNP evidence as attest/verify handles a platform's: the report, and the host's certificates."""

    report: Report
    host_certificates: dict = field(default_factory=dict)

    @classmethod
    def from_evidence(cls, evidence: dict) -> tuple[Quote | None, str | None]:
        try:
            raw = base64.b64decode(evidence.get("report", ""), validate=True)
            report = parse_report(raw)
        except (TypeError, ValueError) as e:  # ReportError included
            return None, str(e) if isinstance(e, ReportError) else "the evidence's report is not base64"
        host = {name: evidence[name].encode() for name in ("vcek", "ask") if isinstance(evidence.get(name), str)}
        return cls(report, host), None

    @property
    def report_data(self) -> bytes:
        return self.report.field("report_data")


def check(quote: Quote, policy, run, checks) -> dict | None:
    """The SEV-SNP checks, in order; returns {"snp": the policy this report satisfies} when its
    chain and signature PASSed, else None. `policy.snp` is parse_policy's result; `run` carries
    `snp_certificates` ({"vcek", "ask", "ark", "simulated_ark": bytes} from files, each optional;
    given ones take the place of the host's) and `now` (Unix seconds)."""
    given = getattr(run, "snp_certificates", None) or {}
    now = datetime.datetime.fromtimestamp(run.now, datetime.UTC) if getattr(run, "now", None) is not None else None
    results = verify_report(
        quote.report.raw,
        given.get("vcek") or quote.host_certificates.get("vcek"),
        given.get("ask") or quote.host_certificates.get("ask"),
        given.get("ark"),
        policy=policy.snp or {},
        simulated_ark=given.get("simulated_ark"),
        now=now,
    )
    for result in results:
        checks.report(result.name, result.reason, skip=result.result == "SKIP", **result.values)
    verdict = {result.name: result for result in results}
    if all(verdict[name].result == "PASS" for name in ("certificate chain", "report signature", "VCEK matches report")):
        return {"snp": learned_policy(quote.report, verdict["certificate chain"].values["product"])}
    return None
