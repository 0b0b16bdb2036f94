"""attest/verify --policy, --learn-policy and --json (docs/verify.md), with Intel's signed
sample quote (tests/data/dcap-sample, at a fixed time) and with simulated quotes.

A field the policy names and the quote does not match FAILs naming the field and both
values; a debug TD FAILs whatever the policy says; TCB grace is judged at --now.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest
import test_attest
from fake_tdx import BODY_FIELDS, tdx_quote_v4  # attest/, put on the path by test_attest
from tdx import CHECK_NAMES as CHECK  # the check each policy field names in the output
from test_attest import (
    COLLATERAL,
    DCAP_SAMPLE,
    SAMPLE_TIME,
    SIMULATED_SIGNATURE,
    UNVERIFIED,
    run_verify,
    verify,
    verify_sample,
    verify_signed,
)

measured = test_attest.measured  # its gateway, as a fixture here too

# What dcap-qvl reads in the sample quote (its VerifiedReport) and its PCK certificate.
SAMPLE = {
    "mrtd": "91eb2b44d141d4ece09f0c75c2c53d247a3c68edd7fafe8a3520c942a604a407de03ae6dc5f87f27428b2538873118b7",
    "rtmr0": "44c0197b39157fdd7a4dcc44767f9d6b0bb3977c7a8e347b8492f827fe9d9e5c48aca29b220b80b6a540cf994b9bc9c0",
    "rtmr1": "0084452c01668329d4bc06acdf58a7205c26743304509973949e5619bf81a6a7aea8c323c173019b3093d54e579e9378",
    "rtmr2": "d833feef2cd945148aa38ead2c53e9b7f138190aaaebfc551dccd829fc207aa3ba80b70870d7330733642e01d48c3132",
    "mrseam": "5b38e33a6487958b72c3c12a938eaa5e3fd4510c51aeeab58c7d5ecee41d7c436489d6c8e4f92f160b7cad34207b00c1",
    "xfam": "e702060000000000",
    "td_attributes": "0000001000000000",
    "fmspc": "b0c06f000000",
    "platform_ids": "07828474603e7019dc930775ffe8cdd2",
}
TCB_DATE = datetime.datetime(2024, 3, 13, tzinfo=datetime.UTC)  # the newest tcbLevel of the sample's TCB info
DAY = 86400


def other(value: str) -> str:
    return ("f" if value[0] != "f" else "e") + value[1:]


def with_policy(tmp_path: Path, policy: dict) -> str:
    path = tmp_path / f"policy-{len(list(tmp_path.glob('policy-*')))}.json"
    path.write_text(json.dumps(policy))
    return str(path)


def sample(tmp_path, policy: dict, *flags: str, now: str = SAMPLE_TIME):
    return verify_sample("--policy", with_policy(tmp_path, policy), *flags, now=now)


def simulated(tmp_path, policy: dict, fields: dict[str, bytes] | None = None, borrow_pck: bool = False):
    """A simulated quote with `fields`; with `borrow_pck` it carries the sample's signature data
    (its PCK certificate: fmspc, platform ID), and `true` stands in for the signature check."""
    signature = (DCAP_SAMPLE / "tdx_quote").read_bytes()[636:] if borrow_pck else None
    quote = tdx_quote_v4(bytes(48), bytes(64), fields, **({"signature": signature} if signature else {}))
    path = tmp_path / "simulated.quote"
    path.write_bytes(quote)
    return verify(
        "--quote",
        str(path),
        "--platform-verifier",
        "true" if borrow_pck else SIMULATED_SIGNATURE,
        "--policy",
        with_policy(tmp_path, policy),
    )


@pytest.mark.parametrize("field", list(SAMPLE))
def test_each_field_with_the_intel_signed_quote(tmp_path, field):
    code, verdicts, output = sample(tmp_path, {field: [SAMPLE[field]]})
    assert code == 0 and verdicts[CHECK[field]] == "PASS" and verdicts["quote signature"] == "PASS", output
    wrong = other(SAMPLE[field])
    code, verdicts, output = sample(tmp_path, {field: [wrong, wrong.upper()[::-1]]})
    assert code == 1 and verdicts[CHECK[field]] == "FAIL", output
    assert f"FAIL {CHECK[field]}: policy {field}: the quote has {SAMPLE[field]}, the policy allows {wrong}" in output
    assert [n for n, v in verdicts.items() if v == "FAIL"] == [CHECK[field]], output


@pytest.mark.parametrize("field", list(BODY_FIELDS))
def test_each_measurement_field_with_a_simulated_quote(tmp_path, field):
    size = BODY_FIELDS[field][1]
    value = bytes([0x5A] * size) if field != "td_attributes" else bytes([0x00, 0, 0, 0x10, 0, 0, 0, 0])
    code, verdicts, output = simulated(tmp_path, {field: [value.hex()]}, {field: value})
    assert code == 0 and verdicts[CHECK[field]] == "PASS" and "SIMULATED" in output, output
    code, verdicts, output = simulated(tmp_path, {field: ["00" * size]}, {field: value})
    assert code == 1 and verdicts[CHECK[field]] == "FAIL", output
    assert f"policy {field}: the quote has {value.hex()}, the policy allows {'00' * size}" in output


@pytest.mark.parametrize("field", ["fmspc", "platform_ids"])
def test_the_platform_fields_with_a_simulated_quote(tmp_path, field):
    code, verdicts, output = simulated(tmp_path, {field: [SAMPLE[field]]}, borrow_pck=True)
    assert code == 0 and verdicts[CHECK[field]] == "PASS", output
    code, verdicts, output = simulated(tmp_path, {field: [other(SAMPLE[field])]}, borrow_pck=True)
    assert code == 1 and f"the quote has {SAMPLE[field]}, the policy allows {other(SAMPLE[field])}" in output
    # A quote without a PCK certificate cannot say which machine made it: that FAILs, never passes.
    code, verdicts, output = simulated(tmp_path, {field: [SAMPLE[field]]})
    assert code == 1 and verdicts[CHECK[field]] == "FAIL" and "no PCK certificate" in output, output


def test_a_debug_td_fails_whatever_the_policy_says(tmp_path):
    debug = bytes([0x01, 0, 0, 0x10, 0, 0, 0, 0])
    code, verdicts, output = simulated(tmp_path, {"td_attributes": [debug.hex()]}, {"td_attributes": debug})
    assert code == 1, output
    assert verdicts["TD attributes"] == "PASS" and verdicts["TD not in debug mode"] == "FAIL", output


def test_tcb_statuses_and_the_evaluation_data_number(tmp_path):
    code, verdicts, output = sample(tmp_path, {"tcb": ["UpToDate"], "min_tcb_evaluation_data_number": 17})
    assert code == 0 and verdicts["TCB evaluation data number"] == "PASS", output
    code, verdicts, output = sample(tmp_path, {"tcb": ["OutOfDate", "SWHardeningNeeded"]})
    assert code == 1 and verdicts["quote signature"] == "FAIL", output
    assert "policy tcb: the TCB status is UpToDate, the policy allows OutOfDate, SWHardeningNeeded" in output
    code, verdicts, output = sample(tmp_path, {"min_tcb_evaluation_data_number": 18})
    assert code == 1 and verdicts["TCB evaluation data number"] == "FAIL", output
    assert "the collateral's is 17, the policy wants >= 18" in output
    # The TCB status comes from Intel's collateral only: a platform verifier cannot satisfy a tcb policy.
    code, verdicts, output = simulated(tmp_path, {"tcb": ["UpToDate"]})
    assert code == 1 and verdicts["TCB status"] == "FAIL" and "policy tcb" in output, output


@pytest.mark.parametrize("days_past_the_limit, passes", [(-1, True), (1, False)])
def test_tcb_grace_days_at_fixed_times_on_both_sides_of_the_limit(tmp_path, days_past_the_limit, passes):
    grace_days = 470  # from 2024-03-13: until 2025-06-26, inside the sample collateral's validity
    limit = TCB_DATE.timestamp() + grace_days * DAY
    now = str(int(limit + days_past_the_limit * DAY))
    code, verdicts, output = sample(tmp_path, {"tcb": [{"status": "UpToDate", "grace_days": grace_days}]}, now=now)
    assert (code, verdicts["quote signature"]) == ((0, "PASS") if passes else (1, "FAIL")), output
    if not passes:
        assert "allowed 470 days from the TCB date 2024-03-13, that is until 2025-06-26" in output


def test_the_shorthands_remain(tmp_path, measured):
    code, verdicts, output = verify_sample(
        "--expect-mrtd",
        SAMPLE["mrtd"].upper(),
    )
    assert code == 0 and verdicts["MRTD"] == "PASS", output
    code, verdicts, output = verify_sample("--accept-tcb", "SWHardeningNeeded")
    assert code == 0 and verdicts == {"quote signature": "PASS"}, output
    code, _, output = sample(tmp_path, {"mrtd": [SAMPLE["mrtd"]]}, "--expect-mrtd", SAMPLE["mrtd"])
    assert code == 2 and "not both" in output, output


@pytest.mark.parametrize(
    "policy, says",
    [
        ({"mrtd": ["00"]}, "policy mrtd: '00' is not 48 bytes in hex"),
        ({"rtmr0": []}, "policy rtmr0: give a non-empty list"),
        ({"mrtdd": ["00" * 48]}, "unknown fields ['mrtdd']"),
        ({"tcb": ["Revoked"]}, "'Revoked' is not a status to accept"),
        ({"tcb": [{"status": "OutOfDate", "grace_days": -1}]}, "grace_days of OutOfDate must be a whole number"),
        ({"min_tcb_evaluation_data_number": "17"}, "min_tcb_evaluation_data_number: give a whole number"),
        ({"snp": ["not an object"]}, "policy snp: give an object"),
        (["mrtd"], "the policy is not a JSON object"),
    ],
)
def test_a_bad_policy_is_one_line_exit_2(tmp_path, policy, says):
    code, verdicts, output = sample(tmp_path, policy)
    assert code == 2 and verdicts == {} and says in output, output
    assert output.count("\n") == 2 and "Traceback" not in output, output  # the error, and the verdict
    assert output.startswith("verdict: ERROR: nothing was verified: "), output


def test_the_snp_object_is_left_to_the_snp_checks(tmp_path):
    code, verdicts, output = sample(tmp_path, {"mrtd": [SAMPLE["mrtd"]], "snp": {"measurement": ["00" * 48]}})
    assert code == 0 and verdicts["MRTD"] == "PASS", output


def test_learn_policy_writes_what_the_signed_evidence_satisfies(tmp_path):
    learned = tmp_path / "learned.json"
    code, _, output = verify_sample(
        "--learn-policy",
        str(learned),
    )
    assert code == 0 and learned.exists(), output
    policy = json.loads(learned.read_text())
    assert policy == {
        **{field: [value] for field, value in SAMPLE.items()},
        "tcb": ["UpToDate"],
        "min_tcb_evaluation_data_number": 17,
    }
    code, verdicts, output = verify_sample(
        "--policy",
        str(learned),
    )
    assert code == 0 and len(verdicts) == 12 and set(verdicts.values()) == {"PASS"}, output


def test_learn_policy_from_a_gateway_only_once_its_signature_passed(measured, tmp_path):
    learned = tmp_path / "learned.json"
    base = ["--release", str(measured.release_path), "--url", measured.gateway.url, "--learn-policy", str(learned)]
    code, _, output = verify(*base, "--accept-unverified")
    assert code == UNVERIFIED and not learned.exists() and "not writing the policy" in output, output
    code, _, output = verify(*base, "--platform-verifier", SIMULATED_SIGNATURE)
    assert code == 0 and json.loads(learned.read_text())["mrtd"] == ["00" * 48], output
    code, verdicts, output = verify_signed(
        measured.release_path,
        measured.gateway.url,
        "--policy",
        str(learned),
    )
    assert code == 0 and verdicts["RTMR2"] == "PASS" and "FMSPC" not in verdicts, output  # no PCK: not learnt


def test_json_prints_the_checks_as_one_document(tmp_path):
    done = run_verify(
        "--quote",
        str(DCAP_SAMPLE / "tdx_quote"),
        "--collateral",
        COLLATERAL,
        "--now",
        SAMPLE_TIME,
        "--json",
        "--policy",
        with_policy(tmp_path, {"mrtd": [other(SAMPLE["mrtd"])]}),
    )
    assert done.returncode == 1, done.stdout + done.stderr
    document = json.loads(done.stdout)
    assert (document["verdict"], document["exit"]) == ("FAIL", 1)
    assert [set(c) for c in document["checks"]] == [{"name", "result", "reason", "values"}] * 3
    mrtd = next(c for c in document["checks"] if c["name"] == "MRTD")
    assert mrtd["result"] == "FAIL" and mrtd["values"] == {"quote": SAMPLE["mrtd"], "allowed": [other(SAMPLE["mrtd"])]}
    assert "TCB status UpToDate, advisories: none" in document["notes"]


def test_help_lists_the_options():
    done = run_verify("--help")
    assert done.returncode == 0
    for option in ("--policy", "--learn-policy", "--json", "--timeout"):
        assert option in done.stdout, option
