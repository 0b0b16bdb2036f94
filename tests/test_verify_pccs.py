"""attest/verify --pccs URL against a PCCS on loopback that serves the Intel-signed sample's
collateral (tests/data/dcap-sample) the way Intel's PCS API does, or breaks it on purpose."""

from __future__ import annotations

import json
import urllib.parse

import pytest
from test_attest import DCAP_SAMPLE, SAMPLE_TIME, always_answering, verify

COLLATERAL = json.loads((DCAP_SAMPLE / "tdx_quote_collateral.json").read_text())


def pccs_answer(path: str, broken: str | None) -> tuple[int, dict, bytes]:
    """(status, headers, body) of PCS API v4 for the sample's collateral; `broken` names the
    resource answered wrongly."""
    c, quote = COLLATERAL, urllib.parse.quote
    resources = {
        "/pckcrl": ({"SGX-PCK-CRL-Issuer-Chain": quote(c["pck_crl_issuer_chain"])}, bytes.fromhex(c["pck_crl"])),
        "/rootcacrl": ({}, c["root_ca_crl"].encode()),  # hex, as the PCS gives it
        "/tcb": (
            {"TCB-Info-Issuer-Chain": quote(c["tcb_info_issuer_chain"])},
            f'{{"tcbInfo":{c["tcb_info"]},"signature":"{c["tcb_info_signature"]}"}}'.encode(),
        ),
        "/qe/identity": (
            {"SGX-Enclave-Identity-Issuer-Chain": quote(c["qe_identity_issuer_chain"])},
            f'{{"enclaveIdentity":{c["qe_identity"]},"signature":"{c["qe_identity_signature"]}"}}'.encode(),
        ),
    }
    for suffix, (headers, body) in resources.items():
        if urllib.parse.urlsplit(path).path.endswith(suffix):
            if broken == suffix:
                return 200, headers, b"\x00\xff not what was asked"
            return 200, headers, body
    return 404, {}, b""


def pccs(broken: str | None = None):
    """A PCCS on loopback: its URL, for a `with`."""
    return always_answering(lambda path: pccs_answer(path, broken))


def test_collateral_from_a_pccs_verifies_the_intel_signed_quote():
    with pccs() as url:
        code, verdicts, output = verify("--quote", str(DCAP_SAMPLE / "tdx_quote"), "--pccs", url, "--now", SAMPLE_TIME)
    assert code == 0 and verdicts == {"quote signature": "PASS"}, output
    assert "TCB status UpToDate" in output


@pytest.mark.parametrize("broken", ["/pckcrl", "/rootcacrl", "/tcb", "/qe/identity"])
def test_broken_collateral_from_a_pccs_is_one_line_fail(broken):
    with pccs(broken) as url:
        code, verdicts, output = verify("--quote", str(DCAP_SAMPLE / "tdx_quote"), "--pccs", url, "--now", SAMPLE_TIME)
    assert code == 1 and verdicts == {"quote signature": "FAIL"}, output  # not a crash (a negative code)
    assert len(output.splitlines()) == 2 and "Traceback" not in output, output  # the failure, and the verdict
    assert output.splitlines()[-1].startswith("verdict: FAIL: 1 of 1 checks FAILed (quote signature)"), output
