"""attest/verify against an attacker who picks the evidence (docs/verify.md): a genuine
machine of the other platform, a relay whose answer carries more than the certificate
that was checked. Real gateways and relays on loopback; `--platform-verifier` stands in
for a genuine signature, as a compromised but genuine machine would have one.
"""

from __future__ import annotations

import http.client
import json
import ssl
import threading

import pytest
import test_attest
import test_snp
from test_attest import (
    COLLATERAL,
    DCAP_SAMPLE,
    SIMULATED_SIGNATURE,
    UNVERIFIED,
    nonce_hex,
    run_verify,
    verify,
    verify_sample,
    verify_signed,
)
from test_tls import self_signed
from test_verify_hostile import verify_through_forging_relay

from conftest import wait_until

measured = test_attest.measured  # its gateway (simulated TDX), as a fixture here too
snp_gateway = test_snp.snp_gateway  # a gateway on a simulated SEV-SNP guest
SAMPLE_MRTD = "91eb2b44d141d4ece09f0c75c2c53d247a3c68edd7fafe8a3520c942a604a407de03ae6dc5f87f27428b2538873118b7"
HOGS = 40  # looping callers: more than the queue holds (16)
HOG_ADDRESS = "127.0.0.2"  # theirs, on loopback; the verifier's is 127.0.0.1


def write_policy(tmp_path, policy: dict) -> str:
    path = tmp_path / "policy.json"
    path.write_text(json.dumps(policy))
    return str(path)


def test_a_policy_pinning_sev_snp_is_not_sidestepped_by_tdx_evidence(measured, tmp_path):
    """The client pinned its SEV-SNP image; a relay answers with TDX evidence of any TD that
    extends RTMR3 with the artifact's digest. The SEV-SNP pins must not silently vanish."""
    policy = write_policy(tmp_path, {"snp": {"measurement": ["ab" * 48], "vmpl": [0]}})
    saved = tmp_path / "gateway.pem"
    code, verdicts, output = verify_signed(
        measured.release_path,
        measured.gateway.url,
        "--policy",
        policy,
        "--learn-policy",
        str(saved),
    )
    assert code == 1 and not saved.exists(), output
    assert verdicts["snp.measurement"] == verdicts["snp.vmpl"] == "FAIL", output
    assert "the evidence is Intel TDX" in output and "Traceback" not in output


def test_a_policy_pinning_tdx_is_not_sidestepped_by_sev_snp_evidence(snp_gateway, tmp_path):
    gateway, _ = snp_gateway
    artifact = tmp_path / "tinygw"
    artifact.write_bytes(b"a stand-in")
    policy = write_policy(tmp_path, {"rtmr1": ["00" * 48]})
    code, verdicts, output = verify(
        "--artifact",
        str(artifact),
        "--url",
        gateway.url,
        "--policy",
        policy,
        "--expect-mrtd",
        "00" * 48,
        "--accept-unverified",
        simulated_ark=tmp_path / "simulated-ark.pem",
    )
    assert code == 1, output  # before: exit 0, UNVERIFIED, with the pinned MRTD never looked at
    assert verdicts["MRTD"] == verdicts["RTMR1"] == "FAIL", output
    assert "the evidence is AMD SEV-SNP" in output


def test_a_policy_for_both_platforms_judges_each_by_its_own_fields(measured, tmp_path):
    policy = write_policy(tmp_path, {"mrtd": ["00" * 48], "snp": {"measurement": ["ab" * 48]}})
    code, verdicts, output = verify_signed(measured.release_path, measured.gateway.url, "--policy", policy)
    assert code == 0 and verdicts["MRTD"] == "PASS" and "snp.measurement" not in verdicts, output


def test_save_cert_writes_the_certificate_the_connection_was_served_with_and_no_other(measured, tmp_path):
    """Only the served certificate's key is checked: bytes around it in the answer (here a
    second certificate, which a client would then trust as a CA) are never saved."""
    cert, key = self_signed(tmp_path / "served")
    stowaway, _ = self_signed(tmp_path / "stowaway")
    claimed = cert.read_text() + stowaway.read_text()
    saved = tmp_path / "gateway.pem"
    code, verdicts, output = verify_through_forging_relay(
        measured, cert, key, claimed, "--platform-verifier", "true", "--save-cert", str(saved)
    )
    assert code == 0 and verdicts["tls channel"] == "PASS", output
    text = saved.read_text()
    assert text.count("BEGIN CERTIFICATE") == 1, text
    assert ssl.PEM_cert_to_DER_cert(text) == ssl.PEM_cert_to_DER_cert(cert.read_text())


def test_callers_that_ignore_retry_after_cannot_starve_a_verifier(measured):
    """More looping callers than the queue holds, from one address, each asking again at once
    when refused: a verifier from another address, which waits as Retry-After says, still
    gets its turn within its deadline."""
    stop = threading.Event()
    answered = []

    def hog():
        connection = http.client.HTTPConnection(
            "127.0.0.1", measured.gateway.port, timeout=30, source_address=(HOG_ADDRESS, 0)
        )
        while not stop.is_set():
            connection.request("GET", f"/attestation?nonce={nonce_hex()}")
            response = connection.getresponse()
            response.read()
            answered.append(response.status)

    hogs = [threading.Thread(target=hog, daemon=True) for _ in range(HOGS)]
    for thread in hogs:
        thread.start()
    try:
        wait_until(lambda: answered.count(503) >= 20, seconds=20, what="the callers to fill the queue")
        for _ in range(3):
            code, _, output = verify(
                "--release", str(measured.release_path), "--url", measured.gateway.url, "--timeout", "10"
            )
            assert code == UNVERIFIED and "FAIL" not in output, output
    finally:
        stop.set()
        for thread in hogs:
            thread.join(30)


@pytest.mark.parametrize(
    "text, says",
    [
        # A reader sees the first tcb; json.loads kept the last, which accepts OutOfDate.
        (
            '{"tcb": ["UpToDate"], "mrtd": ["%s"], "tcb": ["UpToDate", "OutOfDate"]}' % SAMPLE_MRTD,  # noqa: UP031 (JSON braces)
            "policy: tcb is given twice",
        ),
        (
            '{"snp": {"measurement": ["%s"], "measurement": ["%s"]}}' % ("ab" * 48, "cd" * 48),  # noqa: UP031 (JSON braces)
            "policy: measurement is given twice",
        ),
        ('{"tcb": [{"status": "OutOfDate", "grace_days": %d}]}' % 10**400, "grace_days of OutOfDate must be a whole"),  # noqa: UP031
    ],
)
def test_a_policy_that_reads_two_ways_or_counts_past_time_is_one_line_exit_2(tmp_path, text, says):
    policy = tmp_path / "policy.json"
    policy.write_text(text)
    code, verdicts, output = verify_sample(
        "--policy",
        str(policy),
    )
    assert code == 2 and verdicts == {} and says in output, output
    assert output.count("\n") == 2 and "Traceback" not in output, output  # the error, and the verdict
    assert output.startswith("verdict: ERROR: nothing was verified: "), output


def test_a_tdx_run_that_pins_no_image_says_that_rtmr3_is_then_anyones_word(measured):
    """Without MRTD and RTMR0-2 pinned, a TD of any image on any genuine TDX machine (a rented
    one) can extend RTMR3 with the published artifact digest: every check PASSes, so say it."""
    base = [
        "--release",
        str(measured.release_path),
        "--url",
        measured.gateway.url,
        "--platform-verifier",
        SIMULATED_SIGNATURE,
    ]
    code, _, output = verify(*base)
    assert code == 0 and "the policy pins no mrtd, rtmr0, rtmr1, rtmr2: RTMR3 is then only the word" in output, output
    code, _, output = verify(*base, "--expect-mrtd", "00" * 48)
    assert code == 0 and "the policy pins no rtmr0, rtmr1, rtmr2:" in output, output


@pytest.mark.parametrize("now", ["-5", "99999999999999", "99999999999999999999"])
def test_a_now_that_no_clock_can_show_is_bad_usage(now):
    code, verdicts, output = verify("--quote", str(DCAP_SAMPLE / "tdx_quote"), "--collateral", COLLATERAL, "--now", now)
    assert code == 2 and verdicts == {} and "--now" in output.splitlines()[-1], output
    assert "internal error" not in output and "Traceback" not in output, output


def test_json_is_one_document_on_bad_usage_too():
    """A program that asked for --json reads stdout: bad usage is a document as well (exit 2)."""
    done = run_verify("--json", "--artifact", "/bin/sh", "--url", "ftp://127.0.0.1/")
    assert done.returncode == 2, done.stdout + done.stderr
    document = json.loads(done.stdout)
    assert (document["verdict"], document["exit"], document["checks"]) == ("ERROR", 2, []), done.stdout
    assert "--url: not an http(s) URL" in done.stderr and "Traceback" not in done.stderr


def test_a_run_that_checks_no_configuration_says_so(measured):
    """The operator chooses the configuration, and with it where prompts go: unchecked, say it."""
    base = ["--release", str(measured.release_path), "--url", measured.gateway.url]
    code, _, output = verify(*base)
    assert code == UNVERIFIED and "note: no --config-sha256: the configuration (config_sha256 " in output, output
    code, verdicts, output = verify(*base, "--config-sha256", measured.config_sha256)
    assert verdicts["config"] == "PASS" and "no --config-sha256" not in output, output


def test_the_gateway_may_be_given_as_the_url_alone(measured):
    """`attest/verify https://HOST:PORT/ ...`, as docs/design.md writes it, is --url's run."""
    code, verdicts, output = verify("--release", str(measured.release_path), measured.gateway.url)
    assert code == UNVERIFIED and verdicts["nonce echoed"] == verdicts["artifact measured"] == "PASS", output
    code, verdicts, output = verify(
        "--release", str(measured.release_path), "--url", measured.gateway.url, "https://127.0.0.1:1/"
    )
    assert code == 2 and verdicts == {} and "two gateways" in output.splitlines()[-1], output
