"""attest/snp.py: an AMD SEV-SNP attestation report, checked as attest/verify checks a TDX quote.

(docs/design.md section 12; docs/verify.md says what each check proves.) On the
`cryptography` library alone: no signature or certificate code of our own. The only
DER read here by hand is the value of the VCEK's AMD extensions, which `cryptography`
hands over as bytes by OID: a small INTEGER, or hwID's raw chip id.

    checks = verify_report(load_report(data), vcek, ask, ark=None, report_data=..., policy=parse_policy(...))

attest/verify uses it as the platform module of provider `sev_guest`, beside attest/tdx.py:
`Quote.from_evidence` and `check` at the end of this file.

Read in this order: attest/snp_report.py (the report's layout, parsing, the TCB layouts),
attest/snp_chain.py (the pinned ARKs, the certificate chain, the report's signature, the
VCEK's extensions against the report), attest/snp_policy.py (the checks of the policy's `snp`
fields, which attest/policy.py reads), then this file (the guest policy bits, all checks in order, the platform glue).

Each check is a `Check(name, result, reason, values)`, result PASS, FAIL or SKIP:

  snp report               the report is 1,184 bytes, of version 2 to 5
  certificate chain        ARK -> ASK -> VCEK, each RSA-PSS SHA-384 (salt 48) and valid now; the
                           ARK one of AMD's, pinned by SHA-256 in attest/snp_chain.py (Milan, Genoa, Turin);
                           with AMD's CRL, neither the ASK nor the VCEK revoked (without, its PASS says so)
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
from dataclasses import dataclass, field

import snp_chain
from snp_chain import (
    ARK_DIR,
    ARK_SHA256,
    fingerprint,
    load_certificate,
    load_crl,
    report_signature,
    signed_by,
    vcek_matches,
    verify_chain,
)
from snp_policy import (
    POLICY_FIELDS,
    PolicyError,
    artifact_measured,
    learned_policy,
    parse_policy,
    policy_checks,
)
from snp_report import (
    FIELDS,
    POLICY_DEBUG,
    POLICY_MIGRATE_MA,
    REPORT_BYTES,
    TCB_LAYOUT,
    VERSIONS,
    Check,
    Report,
    ReportError,
    failed,
    load_report,
    parse_report,
    passed,
    skipped,
    tcb,
)

__all__ = [  # what attest/verify and the tests reach as snp.NAME, wherever it is defined
    "ARK_DIR",
    "ARK_SHA256",
    "FIELDS",
    "POLICY_FIELDS",
    "REPORT_BYTES",
    "TCB_LAYOUT",
    "VERSIONS",
    "Check",
    "PolicyError",
    "Quote",
    "Report",
    "ReportError",
    "builtin_arks",
    "check",
    "fingerprint",
    "learned_policy",
    "load_certificate",
    "load_crl",
    "load_report",
    "parse_policy",
    "parse_report",
    "report_signature",
    "signed_by",
    "skipped",
    "tcb",
    "vcek_matches",
    "verify_chain",
    "verify_report",
]


def builtin_arks() -> dict:
    """The ARKs of ARK_DIR (attest/amd-ark) whose fingerprint is the pinned one; a changed file is left out.
    ARK_DIR is read here at each call, so that a test may point it at a changed copy."""
    return snp_chain.builtin_arks(ARK_DIR)


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
    crl: bytes | None = None,
) -> list[Check]:
    """Every check of a report, in order. Certificates are PEM or DER bytes; `policy` is
    parse_policy's result; `report_data`, when given, is what REPORT_DATA must be; `crl`, when
    given, AMD's revocation list for the product (DER or PEM), signed by the chain's ARK."""
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
    certs, reason = _certificates(vcek, ask, ark, simulated_ark, crl)
    if reason is not None:
        checks.append(failed("certificate chain", reason))
        checks += [
            failed("report signature", "no VCEK to check it with"),
            failed("VCEK matches report", "no VCEK to check it with"),
        ]
        product = "Milan"
    else:
        chain, product = verify_chain(
            certs["vcek"],
            certs["ask"],
            certs["ark"],
            simulated_ark=certs["simulated"],
            crl=certs["crl"],
            now=now,
            ark_dir=ARK_DIR,
        )
        product = product or "Milan"
        checks += [chain, report_signature(report, certs["vcek"]), vcek_matches(report, certs["vcek"], product)]
    checks += [debug_off(report), migration_agent_off(report)]
    if report_data is not None:
        checks.append(report_data_check(report, report_data))
    return checks + policy_checks(report, product, policy) + [artifact_measured(report, policy)]


def _certificates(vcek, ask, ark, simulated_ark, crl=None) -> tuple[dict, str | None]:
    """The certificates (and the CRL) read, or why one cannot be."""
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
    try:
        certs["crl"] = None if crl is None else load_crl(crl)
    except ValueError as e:
        return {}, f"cannot read the CRL (--snp-crl): {e}"
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
    `snp_certificates` ({"vcek", "ask", "ark", "snp_crl": bytes} from files, and "simulated_ark"
    from attest/verify's caller, each optional; given certificates take the place of the host's)
    and `now` (Unix seconds)."""
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
        crl=given.get("snp_crl"),
    )
    for result in results:
        passed_ = result.result == "PASS"  # a PASS's reason is its caveat
        checks.report(
            result.name,
            None if passed_ else result.reason,
            skip=result.result == "SKIP",
            caveat=result.reason if passed_ else None,
            **result.values,
        )
    verdict = {result.name: result for result in results}
    if all(verdict[name].result == "PASS" for name in ("certificate chain", "report signature", "VCEK matches report")):
        return {"snp": learned_policy(quote.report, verdict["certificate chain"].values["product"])}
    return None
