"""What attest/verify accepts: a policy file (JSON), one list of allowed values per field.

    {
      "mrtd": ["<96 hex>"], "rtmr0": [...], "rtmr1": [...], "rtmr2": [...],
      "mrseam": [...], "xfam": ["<16 hex>"], "td_attributes": ["<16 hex>"],
      "fmspc": ["<12 hex>"], "platform_ids": ["<32 hex>"],
      "tcb": ["UpToDate", {"status": "SWHardeningNeeded", "grace_days": 30}],
      "min_tcb_evaluation_data_number": 17,
      "snp": {...}
    }

Every field is optional; a field the policy names must match the evidence, or its check
FAILs naming the field and both values. Hex is as the quote holds the bytes (xfam and
td_attributes too: dcap-qvl prints them so). `tcb` lists the TCB statuses to accept,
each with an optional `grace_days` counted from the collateral's TCB date; without it,
UpToDate only. `snp` holds the SEV-SNP fields (SNP_FIELDS; attest/snp_policy.py checks
the report against them), read here like the others. An unknown
field, a field given twice (JSON readers disagree on which one counts), a malformed value
or an empty list is a PolicyError (exit 2): a typo in a policy must never widen what it
accepts.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace

# Bytes per value of each hex field, in the order the checks run.
HEX_FIELDS = {
    "mrtd": 48,
    "rtmr0": 48,
    "rtmr1": 48,
    "rtmr2": 48,
    "mrseam": 48,
    "xfam": 8,
    "td_attributes": 8,
    "fmspc": 6,
    "platform_ids": 16,
}
# Intel's TCB statuses that a policy may accept; Revoked is never acceptable.
TCB_STATUSES = (
    "UpToDate",
    "SWHardeningNeeded",
    "ConfigurationNeeded",
    "ConfigurationAndSWHardeningNeeded",
    "OutOfDate",
    "OutOfDateConfigurationNeeded",
)
FIELDS = (*HEX_FIELDS, "tcb", "min_tcb_evaluation_data_number", "snp")
# The `snp` object's fields: bytes per value of its hex ones, the TCB components of min_tcb.
SNP_FIELDS = ("measurement", "host_data", "vmpl", "min_tcb", "chip_ids")
SNP_HEX_FIELDS = {"measurement": 48, "host_data": 32, "chip_ids": 64}
SNP_MIN_TCB_FIELDS = ("bootloader", "tee", "snp", "microcode")
SNP_MAX_VMPL = 3
POLICY_MAX_BYTES = 1 << 20
# Ten years: longer than any collateral lives, and a date that a clock can still print.
GRACE_DAYS_MAX = 3650


class PolicyError(ValueError):
    """The policy file cannot be read or says something that is not a policy."""


@dataclass(frozen=True)
class TcbAllowance:
    status: str
    grace_days: int | None = None


@dataclass(frozen=True)
class Policy:
    allowed: dict[str, tuple[str, ...]] = field(default_factory=dict)  # hex field -> allowed values
    tcb: tuple[TcbAllowance, ...] | None = None  # None: the policy does not name it (UpToDate only)
    min_tcb_evaluation_data_number: int | None = None
    snp: dict | None = None  # parse_snp's: field -> allowed values, min_tcb -> {component: floor}

    def names(self, name: str) -> bool:
        return (
            name in self.allowed
            or (name == "tcb" and self.tcb is not None)
            or (name == "min_tcb_evaluation_data_number" and self.min_tcb_evaluation_data_number is not None)
        )

    def tcb_allowances(self) -> tuple[TcbAllowance, ...]:
        return self.tcb if self.tcb is not None else (TcbAllowance("UpToDate"),)


def load(path: str) -> Policy:
    try:
        with open(path, "rb") as f:
            raw = f.read(POLICY_MAX_BYTES + 1)
    except OSError as e:
        raise PolicyError(f"cannot read the policy {path}: {e.strerror}") from None
    if len(raw) > POLICY_MAX_BYTES:
        raise PolicyError(f"the policy {path} is over {POLICY_MAX_BYTES} bytes")
    try:
        document = json.loads(raw, object_pairs_hook=_object)
    except PolicyError:
        raise
    except (ValueError, RecursionError) as e:
        raise PolicyError(f"the policy {path} is not JSON: {e}") from None
    return parse(document)


def _object(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object whose every name is given once."""
    document = dict(pairs)
    if len(document) != len(pairs):
        twice = next(name for number, (name, _) in enumerate(pairs) if name in dict(pairs[:number]))
        raise PolicyError(f"policy: {str(twice)[:60]} is given twice")
    return document


def parse(document) -> Policy:
    if not isinstance(document, dict):
        raise PolicyError("the policy is not a JSON object")
    unknown = sorted(set(document) - set(FIELDS))
    if unknown:
        raise PolicyError(f"the policy has unknown fields {unknown}; known: {', '.join(FIELDS)}")
    allowed = {name: _hex_list(name, document[name], size) for name, size in HEX_FIELDS.items() if name in document}
    tcb = _tcb(document["tcb"]) if "tcb" in document else None
    number = document.get("min_tcb_evaluation_data_number")
    if number is not None and (not isinstance(number, int) or isinstance(number, bool) or number < 0):
        raise PolicyError("policy min_tcb_evaluation_data_number: give a whole number >= 0")
    snp = document.get("snp")
    return Policy(allowed, tcb, number, None if snp is None else parse_snp(snp))


def parse_snp(snp: object) -> dict:
    """The `snp` object of a policy file, checked: one list of allowed values per field, and
    `min_tcb` an object of floors. {} for None. PolicyError names the field that is wrong."""
    if snp is None:
        return {}
    if not isinstance(snp, dict):
        raise PolicyError("policy snp: give an object of SEV-SNP fields (" + ", ".join(SNP_FIELDS) + ")")
    policy = {}
    for key, value in snp.items():
        where = f"policy snp.{key}"
        if key in SNP_HEX_FIELDS:
            policy[key] = list(_hex_list(f"snp.{key}", value, SNP_HEX_FIELDS[key]))
        elif key == "vmpl":
            policy[key] = _int_values(where, value, SNP_MAX_VMPL)
        elif key == "min_tcb":
            if not isinstance(value, dict) or not value or set(value) - set(SNP_MIN_TCB_FIELDS):
                raise PolicyError(f"{where}: give an object of floors, keys among {', '.join(SNP_MIN_TCB_FIELDS)}")
            policy[key] = {k: _int_values(f"{where}.{k}", [v], 255)[0] for k, v in value.items()}
        else:
            raise PolicyError(f"{where}: unknown field (known: {', '.join(SNP_FIELDS)})")
    return policy


def _hex_list(name: str, values, size: int) -> tuple[str, ...]:
    pattern = re.compile(f"[0-9a-fA-F]{{{2 * size}}}")
    if not isinstance(values, list) or not values:
        raise PolicyError(f"policy {name}: give a non-empty list of allowed values")
    for value in values:
        if not isinstance(value, str) or not pattern.fullmatch(value):
            raise PolicyError(f"policy {name}: {str(value)[:120]!r} is not {size} bytes in hex")
    return tuple(v.lower() for v in values)


def _int_values(where: str, value: object, top: int) -> list[int]:
    if not isinstance(value, list) or not value:
        raise PolicyError(f"{where}: give a non-empty list of allowed values")
    for item in value:
        if type(item) is not int or not 0 <= item <= top:
            raise PolicyError(f"{where}: {item!r} is not an integer from 0 to {top}")
    return list(value)


def _tcb(values) -> tuple[TcbAllowance, ...]:
    if not isinstance(values, list) or not values:
        raise PolicyError("policy tcb: give a non-empty list of TCB statuses")
    allowances = []
    for value in values:
        entry = {"status": value} if isinstance(value, str) else value
        if not isinstance(entry, dict) or set(entry) - {"status", "grace_days"}:
            raise PolicyError(
                f'policy tcb: {str(value)[:120]!r} is neither a status nor {{"status": ..., "grace_days": N}}'
            )
        status, grace = entry.get("status"), entry.get("grace_days")
        if status not in TCB_STATUSES:
            raise PolicyError(
                f"policy tcb: {str(status)[:60]!r} is not a status to accept; one of {', '.join(TCB_STATUSES)}"
            )
        if grace is not None and (
            not isinstance(grace, int) or isinstance(grace, bool) or not 0 <= grace <= GRACE_DAYS_MAX
        ):
            raise PolicyError(f"policy tcb: grace_days of {status} must be a whole number from 0 to {GRACE_DAYS_MAX}")
        allowances.append(TcbAllowance(status, grace))
    return tuple(allowances)


def with_shorthands(policy: Policy, expect_mrtd: str | None, accept_tcb: str | None) -> Policy:
    """--expect-mrtd HEX is `"mrtd": [HEX]`; --accept-tcb A,B is `"tcb": ["UpToDate", "A", "B"]`."""
    if expect_mrtd is not None:
        if "mrtd" in policy.allowed:
            raise PolicyError("give mrtd in the policy or --expect-mrtd, not both")
        policy = replace(policy, allowed={**policy.allowed, "mrtd": _hex_list("mrtd", [expect_mrtd], 48)})
    if accept_tcb is not None:
        if policy.tcb is not None:
            raise PolicyError("give tcb in the policy or --accept-tcb, not both")
        statuses = ["UpToDate", *(s.strip() for s in accept_tcb.split(",") if s.strip())]
        policy = replace(policy, tcb=_tcb(list(dict.fromkeys(statuses))))
    return policy
