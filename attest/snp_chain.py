"""attest/snp_chain.py: AMD's certificates of an SEV-SNP report (docs/design.md section 12).

ARK -> ASK -> VCEK up to one of AMD's roots pinned here, neither the ASK nor the VCEK on
AMD's revocation list when one is given, the report's signature by the VCEK, and the
VCEK's AMD extensions (hwID, TCB SPLs) against the report. On the
`cryptography` library alone: the only DER read here by hand is the value of those
extensions, which `cryptography` hands over as bytes by OID: a small INTEGER, or hwID's
raw chip id.
"""

from __future__ import annotations

import datetime
import hashlib
import warnings
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature
from snp_report import (
    COMPONENT_BYTES,
    ECDSA_P384_SHA384,
    MASK_CHIP_KEY,
    R_AT,
    S_AT,
    SIGNED_BYTES,
    SIGNING_KEY_VCEK,
    Check,
    Report,
    failed,
    passed,
    skipped,
    tcb,
)

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
NO_CRL = "revocation not checked: no --snp-crl (AMD's CRL for the product, from its KDS /vcek/v1/PRODUCT/crl)"


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


def builtin_arks(ark_dir: Path = ARK_DIR) -> dict[str, x509.Certificate]:
    """The ARKs of attest/amd-ark whose fingerprint is the pinned one; a changed file is left out."""
    arks = {}
    for product, pinned in ARK_SHA256.items():
        try:
            cert = load_certificate((ark_dir / f"{product.lower()}.pem").read_bytes())
        except (OSError, ValueError):
            continue
        if fingerprint(cert) == pinned:
            arks[product] = cert
    return arks


def load_crl(data: bytes) -> x509.CertificateRevocationList:
    """A CRL, PEM or DER (AMD's KDS serves DER); ValueError when it is neither."""
    if data.lstrip().startswith(b"-----BEGIN"):
        return x509.load_pem_x509_crl(data)
    return x509.load_der_x509_crl(data)


def signed_by(cert: x509.Certificate, issuer: x509.Certificate) -> str | None:
    """None when `issuer` issued `cert` with RSA-PSS SHA-384 (salt 48), else why not."""
    if cert.issuer != issuer.subject:
        return f"{_cn(cert)} is issued by {_cn_of(cert.issuer)}, not by {_cn(issuer)}"
    if not _pss_signed(cert.signature, cert.tbs_certificate_bytes, issuer):
        return f"the signature of {_cn(cert)} by {_cn(issuer)} (RSA-PSS SHA-384) does not verify"
    return None


def _pss_signed(signature: bytes, signed: bytes, issuer: x509.Certificate) -> bool:
    """Whether `issuer`'s RSA key made `signature` over `signed`, RSA-PSS SHA-384 with AMD's salt of
    48. (`cryptography`'s is_signature_valid would take whatever PSS parameters the signed object
    names; the chain and its CRL are held to the ones AMD uses, in this one place.)"""
    key = issuer.public_key()
    if not isinstance(key, rsa.RSAPublicKey):
        return False
    try:
        key.verify(signature, signed, PSS_SHA384, hashes.SHA384())
    except InvalidSignature:
        return False
    return True


def revoked(
    crl: x509.CertificateRevocationList,
    ark: x509.Certificate,
    certs: dict[str, x509.Certificate],
    now: datetime.datetime,
) -> str | None:
    """None when `crl` is the chain's ARK's own, current, and lists none of `certs` ({"ASK": ...,
    "VCEK": ...}) by serial number; else why not. A CRL that its ARK did not sign says nothing."""
    if crl.issuer != ark.subject or not _pss_signed(crl.signature, crl.tbs_certlist_bytes, ark):
        return (
            f"the CRL (issued as {_cn_of(crl.issuer)}) is not signed by the chain's pinned ARK {_cn(ark)} "
            f"(sha256 {fingerprint(ark)[:16]}..., RSA-PSS SHA-384): it is not AMD's revocation list for this product"
        )
    if crl.next_update_utc is None:
        return "the CRL has no next update: it cannot say that it is current"
    if not crl.last_update_utc <= now <= crl.next_update_utc:
        return (
            f"the CRL is current from {crl.last_update_utc:%Y-%m-%d %H:%M} to {crl.next_update_utc:%Y-%m-%d %H:%M} "
            f"UTC, not at {now:%Y-%m-%d %H:%M} UTC: fetch AMD's current one"
        )
    for role, cert in certs.items():
        entry = crl.get_revoked_certificate_by_serial_number(cert.serial_number)
        if entry is not None:
            return (
                f"the {role} ({_cn(cert)}, serial 0x{cert.serial_number:x}, sha256 {fingerprint(cert)[:16]}...) "
                f"is revoked by AMD's CRL since {entry.revocation_date_utc:%Y-%m-%d}"
            )
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


def _root(ask, ark, simulated_ark, ark_dir) -> tuple[x509.Certificate | None, str | None, str | None]:
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
    for product, cert in builtin_arks(ark_dir).items():
        if cert.subject == ask.issuer:
            return cert, product, None
    return (
        None,
        None,
        (f"the ASK's issuer ({ask.issuer.rfc4514_string()}) is none of AMD's pinned ARKs ({', '.join(ARK_SHA256)})"),
    )


def verify_chain(
    vcek, ask, ark=None, *, simulated_ark=None, crl=None, now=None, ark_dir=ARK_DIR
) -> tuple[Check, str | None]:
    """The `certificate chain` check, and the product (Milan, Genoa, Turin) whose ARK it ends in.

    `ark`, when given, must be one of the pinned ARKs; else the built-in one that issued the
    ASK is used (from `ark_dir`). `simulated_ark` (tests, make rehearse) is a root that is not AMD's: a chain
    ending there is a SKIP that says so, never a PASS (its TCB is read in Milan's layout).
    `crl` (AMD's CRL for the product): a revoked ASK or VCEK, or a CRL that the chain's ARK did
    not sign, FAILs; without one, the PASS says that revocation was not checked."""
    name = "certificate chain"
    now = now or datetime.datetime.now(datetime.UTC)
    values = {"vcek_sha256": fingerprint(vcek), "ask_sha256": fingerprint(ask)}
    root, product, reason = _root(ask, ark, simulated_ark, ark_dir)
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
    if crl is not None:
        if reason := revoked(crl, root, {"ASK": ask, "VCEK": vcek}, now):
            return failed(name, reason, **values), layout
        values["crl_last_update"] = f"{crl.last_update_utc:%Y-%m-%dT%H:%M:%SZ}"
        values["crl_entries"] = len(crl)
    if product is None:
        return skipped(
            name,
            f"the chain ends in a simulated ARK (sha256 {fingerprint(root)[:16]}...), not one of "
            "AMD's: nothing here is signed by AMD",
            **values,
        ), layout
    return passed(name, None if crl is not None else NO_CRL, product=product, **values), product


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
