"""attest/verify says exactly what it proved, as an auditor reads it (docs/verify.md): every run
ends with one verdict line, whatever its exit path; a plain http:// URL says that nothing binds
the evidence to the connection. Read as a terminal shows it: stdout and stderr in one stream.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import test_attest
import test_tls
from test_attest import COLLATERAL, DCAP_SAMPLE, SAMPLE_TIME, VERIFY, run_verify

measured, attested = test_attest.measured, test_tls.attested  # their gateways, as fixtures here too
SAMPLE_QUOTE = ("--quote", str(DCAP_SAMPLE / "tdx_quote"), "--collateral", COLLATERAL, "--now", SAMPLE_TIME)
SAMPLE_MRTD = "91eb2b44d141d4ece09f0c75c2c53d247a3c68edd7fafe8a3520c942a604a407de03ae6dc5f87f27428b2538873118b7"


def as_seen(*args: str) -> tuple[int, list[str]]:
    """attest/verify's exit status and its lines as a terminal shows them (stderr and stdout in
    the order they were written)."""
    done = subprocess.run(
        [sys.executable, str(VERIFY), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=60,
        env={"PATH": os.environ["PATH"]},
    )
    return done.returncode, done.stdout.splitlines()


def a_policy(tmp_path, policy: dict) -> str:
    path = tmp_path / "policy.json"
    path.write_text(json.dumps(policy))
    return str(path)


def test_a_failed_run_ends_on_its_verdict_not_on_a_later_pass(tmp_path):
    """The policy's MRTD FAILs, then the signature PASSes: the last line must not be that PASS."""
    code, lines = as_seen(*SAMPLE_QUOTE, "--policy", a_policy(tmp_path, {"mrtd": ["00" * 48]}))
    assert code == 1 and "FAIL MRTD" in "\n".join(lines) and "PASS quote signature" in lines, lines
    assert lines[-1] == "verdict: FAIL: 1 of 3 checks FAILed (MRTD); exit 1", lines


def test_a_passed_run_ends_on_its_verdict(tmp_path):
    code, lines = as_seen(*SAMPLE_QUOTE, "--policy", a_policy(tmp_path, {"mrtd": [SAMPLE_MRTD]}))
    assert code == 0, lines
    assert lines[-1] == "verdict: PASS: every check PASSed (3 checks); exit 0", lines


@pytest.mark.parametrize(
    "args, says",
    [
        (["--artifact", "/bin/sh", "--url", "ftp://127.0.0.1/"], "bad usage: --url: not an http(s) URL: 'ftp://"),
        (["--artifact", "/bin/sh", "--no-such-option"], "bad usage: unrecognized arguments: --no-such-option"),
        (["--url", "http://127.0.0.1:1"], "bad usage: one of the arguments --release --artifact"),
        (["--release", "/no/such/release.json", "--url", "http://127.0.0.1:1"], "cannot read what to expect"),
        ([*SAMPLE_QUOTE, "--policy", "/no/such/policy.json"], "/no/such/policy.json"),
    ],
)
def test_bad_usage_and_a_local_error_end_on_an_error_verdict(args, says):
    code, lines = as_seen(*args)
    assert code == 2 and "Traceback" not in "\n".join(lines), lines
    assert lines[-1].startswith("verdict: ERROR: nothing was verified: ") and lines[-1].endswith("; exit 2"), lines
    assert says in lines[-1], lines
    assert any(line.startswith("attest/verify: ") for line in lines[:-1]), lines  # the reason, on stderr, first


def test_help_is_no_run_and_has_no_verdict():
    code, lines = as_seen("--help")
    assert code == 0 and not any(line.startswith("verdict:") for line in lines), lines


def test_json_keeps_its_one_document_on_every_path(tmp_path):
    """--json: stdout is the document and nothing else, a command line that cannot be parsed too."""
    for args, verdict, code in [
        (["--artifact", "/bin/sh", "--no-such-option", "--json"], "ERROR", 2),
        (["--js", "--release", "/no/such/release.json", "--url", "http://127.0.0.1:1"], "ERROR", 2),
        ([*SAMPLE_QUOTE, "--json", "--policy", a_policy(tmp_path, {"mrtd": ["00" * 48]})], "FAIL", 1),
    ]:
        done = run_verify(*args)
        assert done.returncode == code, done.stdout + done.stderr
        document = json.loads(done.stdout)
        assert (document["verdict"], document["exit"]) == (verdict, code), done.stdout
        assert "verdict:" not in done.stdout + done.stderr
        if code == 2:
            assert document["checks"] == [] and document["error"], document


def test_an_unverified_run_ends_on_its_verdict_accepted_or_not(measured):
    base = ["--release", str(measured.release_path), "--url", measured.gateway.url]
    code, lines = as_seen(*base, "--config-sha256", measured.config_sha256)
    assert code == 4, lines
    unverified = "verdict: UNVERIFIED: 1 of 7 checks SKIPped (quote signature), the others PASSed: not proven"
    assert lines[-1].startswith(unverified), lines
    assert lines[-1].endswith("; exit 4"), lines
    code, lines = as_seen(*base, "--accept-unverified")
    assert code == 0 and "accepted with --accept-unverified" in lines[-1], lines
    assert lines[-1].startswith("verdict: UNVERIFIED: ") and lines[-1].endswith("; exit 0"), lines


def test_plain_http_says_that_nothing_binds_the_evidence_to_the_connection(measured, attested):
    assert measured.gateway.url.startswith("http://")
    code, lines = as_seen(
        "--release",
        str(measured.release_path),
        "--url",
        measured.gateway.url,
        "--platform-verifier",
        test_attest.SIMULATED_SIGNATURE,
    )
    assert code == 0, lines
    assert any(line.startswith("note: plain http://: nothing binds this evidence to this connection") for line in lines)
    assert lines[-1].startswith("verdict: PASS: every check PASSed"), lines
    assert "over plain http:// nothing binds this evidence to this connection" in lines[-1], lines
    done = run_verify("--release", str(measured.release_path), "--url", measured.gateway.url, "--json")
    assert any(note.startswith("note: plain http://") for note in json.loads(done.stdout)["notes"]), done.stdout
    # Over https, `tls channel` binds it: no such note.
    gateway, release, _ = attested
    code, lines = as_seen("--release", str(release), "--url", gateway.url, "--platform-verifier", "true")
    assert code == 0 and "PASS tls channel" in lines, lines
    assert not any("plain http" in line for line in lines), lines


def test_the_documented_tinygw_check_gives_the_hash_that_verify_expects(measured, tmp_path):
    """docs/verify.md shows how a client obtains --config-sha256: `tinygw check | tail -n 1` on the
    published configuration, with a placeholder for each key. Done so, `config` PASSes."""
    doc = (test_attest.ROOT / "docs" / "verify.md").read_text()
    assert "## The expected configuration hash (`--config-sha256`)" in doc
    assert "build/dist/tinygw check | tail -n 1" in doc and "OPENAI_API_KEY=unused" in doc
    published = tmp_path / "gateway.json"
    published.write_text(measured.gateway.env["TINYGW_CONFIG"])  # what the operator publishes
    done = subprocess.run(
        [str(measured.artifact), "check"],
        env={"PATH": os.environ["PATH"], "TINYGW_CONFIG_FILE": str(published), "UP_KEY": "unused"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    label, _, expected = done.stdout.splitlines()[-1].partition(": ")
    assert done.returncode == 0 and label == "config_sha256", done.stdout + done.stderr
    code, lines = as_seen(
        "--release", str(measured.release_path), "--url", measured.gateway.url, "--config-sha256", expected
    )
    assert code == 4 and "PASS config" in lines, lines  # 4: the simulated quote's signature is a SKIP
