"""attest/snp_policy.py: the `snp` fields of a policy file, and the checks they make (docs/verify.md).

`parse_policy` reads them (PolicyError names the field that is wrong), `policy_checks`
compares the report with each, `artifact_measured` binds the binary through the pinned
launch measurement, and `learned_policy` is what a report satisfies, to pin on first use.
"""

from __future__ import annotations

from snp_report import _HEX, Check, Report, failed, passed, skipped, tcb

POLICY_FIELDS = ("measurement", "host_data", "vmpl", "min_tcb", "chip_ids")


class PolicyError(ValueError):
    """The `snp` part of a policy file is malformed; the message names the field."""


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
