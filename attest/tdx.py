"""The Intel TDX checks of attest/verify: a quote's fields, its policy, its signature.

attest/verify does what every platform shares (nonce, TLS channel, report_data in the
answer, the artifact in the event log, config); the evidence of one platform is read
and judged by its own module, this one for TDX (configfs-tsm provider `tdx_guest`),
attest/snp.py beside it for SEV-SNP. A module gives `PROVIDER`, `Quote.from_evidence`
(the evidence, or why there is none), and `check(evidence, policy, run, checks)`,
which makes its platform's checks and returns the policy that the evidence satisfies.

The signature is Intel DCAP verification by dcap-qvl (collateral from a file or a
PCCS/PCS), or a --platform-verifier command that exits 0; dcap-qvl reports the TCB
status, which the policy's `tcb` must allow. fmspc and the platform ID come from the
PCK certificate inside the quote, which that verification checks.
"""

from __future__ import annotations

import base64
import datetime
import inspect
import json
import os
import shlex
import subprocess
import tempfile
from dataclasses import dataclass

PROVIDER = "tdx_guest"
RUNTIME_REGISTER = True  # RTMR3: attest/verify replays the event log to it
SIGNATURE_CHECK = "quote signature"
# TDX quote v4: a 48-byte header, then the TD quote body; v5 puts a 6-byte body
# descriptor (type, size) between them.
QUOTE_HEADER_BYTES = 48
TDX_TEE_TYPE = 0x81
# The TD quote body (TDX 1.0 TDREPORT fields): (offset, bytes), in the order checked.
BODY_FIELDS = {
    "mrtd": (136, 48),
    "rtmr0": (328, 48),
    "rtmr1": (376, 48),
    "rtmr2": (424, 48),
    "mrseam": (16, 48),
    "xfam": (128, 8),
    "td_attributes": (120, 8),
}
RTMR3_AT, REPORT_DATA_AT, BODY_BYTES = 472, 520, 584
DEBUG_BIT = 1  # bit 0 of TDATTRIBUTES: the host can read and write the TD's memory and registers
CHECK_NAMES = {
    "mrtd": "MRTD",
    "rtmr0": "RTMR0",
    "rtmr1": "RTMR1",
    "rtmr2": "RTMR2",
    "mrseam": "MRSEAM",
    "xfam": "XFAM",
    "td_attributes": "TD attributes",
    "fmspc": "FMSPC",
    "platform_ids": "platform ID",
    "min_tcb_evaluation_data_number": "TCB evaluation data number",
}
# The TD's image: firmware (MRTD) and boot chain (RTMR0-2). Unpinned, RTMR3 is only the word
# of whatever image ran: any TD on a genuine TDX machine can extend it with any digest.
IMAGE_FIELDS = ("mrtd", "rtmr0", "rtmr1", "rtmr2")
PLATFORM_VERIFIER_SECONDS = 300
DAY_SECONDS = 86400


@dataclass
class Quote:
    raw: bytes
    body: bytes

    @classmethod
    def from_bytes(cls, raw: bytes) -> Quote:
        """ValueError when `raw` is not a TDX quote v4 or v5."""
        version = int.from_bytes(raw[0:2], "little")
        start = QUOTE_HEADER_BYTES + (6 if version == 5 else 0)
        if version not in (4, 5) or int.from_bytes(raw[4:8], "little") != TDX_TEE_TYPE:
            raise ValueError("the outblob is not a TDX quote v4 or v5")
        if len(raw) < start + BODY_BYTES:
            raise ValueError("the quote is too short")
        return cls(raw, raw[start : start + BODY_BYTES])

    @classmethod
    def from_evidence(cls, evidence: dict) -> tuple[Quote | None, str | None]:
        try:
            raw = base64.b64decode(evidence.get("outblob", ""), validate=True)
        except (TypeError, ValueError):
            return None, "the outblob is not base64"
        try:
            return cls.from_bytes(raw), None
        except ValueError as e:
            return None, str(e)

    def value(self, name: str) -> str:
        at, size = BODY_FIELDS[name]
        return self.body[at : at + size].hex()

    @property
    def report_data(self) -> bytes:
        return self.body[REPORT_DATA_AT : REPORT_DATA_AT + 64]

    @property
    def rtmr3(self) -> bytes:
        return self.body[RTMR3_AT : RTMR3_AT + 48]


@dataclass
class Signature:
    reason: str | None = None  # None: the signature PASSed
    skipped: bool = False
    status: str | None = None  # TCB status, with DCAP only
    tcb_date: datetime.datetime | None = None
    evaluation_data_number: int | None = None


def check(quote: Quote, policy, run, checks) -> dict:
    """The TDX checks, in order; returns the policy fields this quote satisfies (--learn-policy).
    `run`: the run's settings (collateral, pccs, platform_verifier, now)."""
    debug = quote.body[BODY_FIELDS["td_attributes"][0]] & DEBUG_BIT
    checks.report(
        "TD not in debug mode",
        "the quote is from a debug TD" if debug else None,
        td_attributes=quote.value("td_attributes"),
    )
    learned = {name: [quote.value(name)] for name in BODY_FIELDS}
    if unpinned := [name for name in IMAGE_FIELDS if not policy.names(name)]:
        checks.note(
            f"note: the policy pins no {', '.join(unpinned)}: RTMR3 is then only the word of whatever image "
            "ran (any TD on a genuine TDX machine can extend it with the artifact's digest); pin them "
            "(docs/verify.md)"
        )
    for name in BODY_FIELDS:
        if policy.names(name):
            checks.report(
                CHECK_NAMES[name],
                mismatch(name, quote.value(name), policy.allowed[name]),
                quote=quote.value(name),
                allowed=list(policy.allowed[name]),
            )
    signature = check_signature(quote.raw, policy, run, checks)
    platform = pck_facts(quote.raw)
    learned.update({name: [value] for name, value in platform.items() if value is not None})
    for name in ("fmspc", "platform_ids"):
        if policy.names(name):
            value = platform[name]
            reason = (
                f"policy {name}: the quote carries no PCK certificate to read it from"
                if value is None
                else mismatch(name, value, policy.allowed[name])
            )
            checks.report(CHECK_NAMES[name], reason, quote=value, allowed=list(policy.allowed[name]))
    if policy.names("min_tcb_evaluation_data_number"):
        number, floor = signature.evaluation_data_number, policy.min_tcb_evaluation_data_number
        reason = (
            "policy min_tcb_evaluation_data_number: no collateral was checked (--collateral or --pccs)"
            if number is None
            else None
            if number >= floor
            else f"policy min_tcb_evaluation_data_number: the collateral's is {number}, the policy wants >= {floor}"
        )
        checks.report(CHECK_NAMES["min_tcb_evaluation_data_number"], reason, collateral=number, minimum=floor)
    if signature.status is not None:
        learned["tcb"] = list(dict.fromkeys(["UpToDate", signature.status]))
    if signature.evaluation_data_number is not None:
        learned["min_tcb_evaluation_data_number"] = signature.evaluation_data_number
    return learned


def mismatch(name: str, value: str, allowed) -> str | None:
    return None if value in allowed else f"policy {name}: the quote has {value}, the policy allows {', '.join(allowed)}"


def check_signature(raw: bytes, policy, run, checks) -> Signature:
    if run.collateral or run.pccs:
        signature = dcap_signature(raw, policy, run, checks)
    elif run.platform_verifier:
        reason, said = run_platform_verifier(run.platform_verifier, raw)
        signature = Signature(reason)
        if reason is None and said:
            checks.note(f"platform verifier: {said}")
    else:
        signature = Signature(
            "no collateral given (--collateral FILE or --pccs URL): "
            "the quote's Intel DCAP signature chain is not checked",
            skipped=True,
        )
    checks.report(
        "quote signature",
        signature.reason,
        skip=signature.skipped,
        tcb_status=signature.status,
        tcb_date=signature.tcb_date.isoformat() if signature.tcb_date else None,
    )
    if policy.tcb is not None and not (run.collateral or run.pccs) and run.platform_verifier:
        checks.report(
            "TCB status",
            "policy tcb: only Intel DCAP collateral (--collateral or --pccs) tells the TCB "
            "status, and --platform-verifier gives none",
        )
    return signature


def dcap_signature(raw: bytes, policy, run, checks) -> Signature:
    """Intel DCAP verification of the quote, then the policy's tcb."""
    try:
        import dcap_qvl
    except ImportError:
        return Signature("dcap-qvl is not installed (make verifier)")
    try:
        if run.collateral:
            with open(run.collateral, encoding="utf-8") as f:
                collateral = dcap_qvl.QuoteCollateralV3.from_json(f.read())
        else:
            collateral = fetch_collateral(dcap_qvl, run.pccs, raw)
        report = dcap_qvl.verify(raw, collateral, int(run.now))
        tcb_date, number = tcb_info_facts(collateral.tcb_info)
    except OSError as e:
        return Signature(f"cannot read the collateral: {e.strerror or e}")
    except (ValueError, RuntimeError, TypeError, KeyError, AttributeError) as e:
        return Signature(f"dcap-qvl: {str(e)[:300]}")
    advisories = ", ".join(report.advisory_ids) or "none"
    checks.note(f"TCB status {report.status}, advisories: {advisories}")
    reason = tcb_verdict(report.status, tcb_date, run.now, policy.tcb_allowances())
    if reason is not None:
        reason += f" (advisories: {advisories})"
    return Signature(reason, status=report.status, tcb_date=tcb_date, evaluation_data_number=number)


def fetch_collateral(dcap_qvl, url: str, raw: bytes):
    """The quote's collateral from a PCCS/PCS. dcap-qvl's fetch is a coroutine that needs a
    running loop; the run's deadline (a signal) interrupts it like any other wait."""
    import asyncio

    async def fetch():
        collateral = dcap_qvl.get_collateral(url, raw)
        return await collateral if inspect.isawaitable(collateral) else collateral

    return asyncio.run(fetch())


def tcb_info_facts(tcb_info: str) -> tuple[datetime.datetime | None, int | None]:
    """(the newest TCB level's date, tcbEvaluationDataNumber) of the collateral's TCB info."""
    info = json.loads(tcb_info)
    dates = [datetime.datetime.fromisoformat(level["tcbDate"]) for level in info.get("tcbLevels", [])]
    number = info.get("tcbEvaluationDataNumber")
    return (max(dates) if dates else None), (number if isinstance(number, int) else None)


def tcb_verdict(status: str, tcb_date, now: float, allowances) -> str | None:
    """None when a policy allowance takes `status` at `now`; its grace starts at `tcb_date`,
    the date of the newest TCB level in the collateral (since when an older one is behind)."""
    for allowance in allowances:
        if allowance.status != status:
            continue
        if allowance.grace_days is None:
            return None
        if tcb_date is None:
            return (
                f"policy tcb: {status} is allowed for {allowance.grace_days} days, and the collateral has no TCB date"
            )
        limit = tcb_date.timestamp() + allowance.grace_days * DAY_SECONDS
        if now <= limit:
            return None
        return (
            f"policy tcb: TCB status {status}, allowed {allowance.grace_days} days from the TCB date "
            f"{tcb_date.date()}, that is until {_day(limit)}; it is {_day(now)}"
        )
    allowed = ", ".join(a.status + (f" ({a.grace_days} days)" if a.grace_days is not None else "") for a in allowances)
    return (
        f"policy tcb: the TCB status is {status}, the policy allows {allowed}; accept it with --accept-tcb or a policy"
    )


def _day(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")


def pck_facts(raw: bytes) -> dict:
    """fmspc and platform ID (the PCK certificate's platform instance ID on multi-package
    platforms, else its PPID), hex; None each when the quote carries no PCK certificate."""
    try:
        import dcap_qvl

        extension = dcap_qvl.parse_quote(raw).pck_extension()
    except Exception:  # noqa: BLE001 (not installed, or no certificate chain in the quote: nothing to read)
        return {"fmspc": None, "platform_ids": None}
    instance = bytes(extension.platform_instance_id or b"")
    platform_id = instance if any(instance) else bytes(extension.ppid)
    return {"fmspc": bytes(extension.fmspc).hex(), "platform_ids": platform_id.hex()}


def run_platform_verifier(command: str, raw: bytes) -> tuple[str | None, str | None]:
    """(None when it exited 0, else why not; the last line it said)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "quote.bin")
        with open(path, "wb") as f:
            f.write(raw)
        try:
            argv = [*shlex.split(command), path]  # the user's own --platform-verifier, run as given
            done = subprocess.run(argv, capture_output=True, timeout=PLATFORM_VERIFIER_SECONDS, check=False)  # noqa: S603
        except (OSError, ValueError, subprocess.TimeoutExpired) as e:
            return f"could not run it: {e}", None
    said = (done.stdout if done.returncode == 0 else done.stderr or done.stdout).decode(errors="replace")
    last = said.strip().splitlines()[-1][:300] if said.strip() else None
    if done.returncode != 0:
        return f"exit {done.returncode}" + (f": {last}" if last else ""), last
    return None, last
