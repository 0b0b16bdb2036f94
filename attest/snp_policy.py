"""attest/snp_policy.py: the checks that the `snp` fields of a policy file make (docs/verify.md).

attest/policy.py reads those fields with the rest of the file (`parse_policy` here is its
`parse_snp`: PolicyError names the field that is wrong); `policy_checks` compares the
report with each, `artifact_measured` binds the binary through the pinned launch
measurement, and `learned_policy` is what a report satisfies, to pin on first use.
"""

from __future__ import annotations

from policy import SNP_FIELDS as POLICY_FIELDS
from policy import SNP_MIN_TCB_FIELDS as MIN_TCB_FIELDS
from policy import PolicyError
from policy import parse_snp as parse_policy
from snp_report import Check, Report, failed, passed, skipped, tcb

__all__ = ["POLICY_FIELDS", "PolicyError", "artifact_measured", "learned_policy", "parse_policy", "policy_checks"]


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
