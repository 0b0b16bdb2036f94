"""attest/verify against what an attacker would try (docs/verify.md): a relay that forges
the whole answer, a server that drips, answers too large or too deep, callers that
hog /attestation, a local directory that cannot be written. Real processes, loopback.
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import test_attest
import test_tls
from fake_tdx import tdx_quote_v4  # attest/, put on the path by test_attest
from relay import Relay
from test_attest import UNVERIFIED, always_answering, nonce_hex, verify, verify_signed
from test_tls import self_signed, spki_of

from conftest import call, wait_until

measured, attested = test_attest.measured, test_tls.attested  # their gateways, as fixtures here too

DCAP_SAMPLE = Path(__file__).parent / "data" / "dcap-sample"


def forged_answer(path: str, cert_pem: str, artifact_sha384: str, config_sha256: str) -> bytes:
    """What a relay with its own key can answer: everything consistent, bound to its own key,
    the expected artifact in a log that replays, in a quote that nobody signed."""
    nonce = bytes.fromhex(path.split("nonce=")[1])
    spki = spki_of(cert_pem.encode())
    data = hashlib.sha512(b"tinygw.attest.v2" + nonce + bytes.fromhex(config_sha256) + bytes.fromhex(spki)).digest()
    rtmr3 = hashlib.sha384(bytes(48) + bytes.fromhex(artifact_sha384)).digest()
    return json.dumps(
        {
            "version": "0.1.0",
            "config_sha256": config_sha256,
            "nonce": nonce.hex(),
            "report_data": data.hex(),
            "event_log": [{"register": "rtmr3", "type": "tinygw.artifact", "digest_sha384": artifact_sha384}],
            "evidence": {"provider": "tdx_guest", "outblob": base64.b64encode(tdx_quote_v4(rtmr3, data)).decode()},
            "tls_spki_sha256": spki,
            "tls_certificate": cert_pem,
        }
    ).encode()


def verify_through_forging_relay(measured, cert: Path, key: Path, claimed: str, *flags: str):
    """attest/verify of `measured`'s release through a relay on loopback that serves `cert` and
    answers with evidence forged to bind `claimed` (PEM), as the gateway's would."""
    sha384, config = measured.release["artifact"]["sha384"], measured.config_sha256
    relay = Relay(cert, key, 1, replay=lambda path: forged_answer(path, claimed, sha384, config))
    try:
        return verify("--release", str(measured.release_path), "--url", f"https://127.0.0.1:{relay.port}", *flags)
    finally:
        relay.close()


@pytest.mark.parametrize(
    "flags",
    [
        [],
        ["--accept-unverified"],
        ["--allow-no-evidence", "--accept-unverified"],
        ["--accept-tcb", "OutOfDate"],
        ["--expect-mrtd", "00" * 48, "--accept-unverified"],
        ["--collateral", str(DCAP_SAMPLE / "tdx_quote_collateral.json"), "--now", "1751328000", "--accept-unverified"],
    ],
)
def test_a_forging_relay_never_gets_its_certificate_saved(measured, tmp_path, flags):
    cert, key = self_signed(tmp_path / "relay")
    saved = tmp_path / "gateway.pem"
    code, verdicts, output = verify_through_forging_relay(
        measured,
        cert,
        key,
        cert.read_text(),
        "--config-sha256",
        measured.config_sha256,
        "--save-cert",
        str(saved),
        *flags,
    )
    assert verdicts["tls channel"] == "PASS" and verdicts["report_data"] == "PASS", output  # the forgery holds up...
    assert verdicts["event log replays to RTMR3"] == "PASS" and verdicts["artifact measured"] == "PASS", output
    assert verdicts["quote signature"] in ("SKIP", "FAIL"), output  # ...except for its signature
    assert code in (1, 4) and not saved.exists(), output
    assert verdicts["quote signature"] == "FAIL" or "not writing the certificate" in output, output
    assert "Traceback" not in output


@pytest.fixture
def dripping():
    """A server that answers the headers, then one byte of body every half second."""
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                connection, _ = server.accept()
            except OSError:
                return
            with connection:
                connection.recv(65536)
                connection.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n")
                while not stop.wait(0.5):
                    try:
                        connection.sendall(b" ")
                    except OSError:
                        break

    threading.Thread(target=serve, daemon=True).start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    server.close()


def test_a_dripping_server_ends_verify_within_its_timeout(dripping, tmp_path):
    artifact = tmp_path / "artifact"
    artifact.write_bytes(b"x")
    started = time.monotonic()
    code, verdicts, output = verify("--artifact", str(artifact), "--url", dripping, "--timeout", "2")
    elapsed = time.monotonic() - started
    assert code == 1 and verdicts == {"fetch": "FAIL"}, output
    assert "FAIL fetch: timed out after 2 s" in output and "Traceback" not in output
    assert elapsed < 2 + 10, elapsed  # the interpreter's start (slow on a loaded machine), and nothing more


@pytest.mark.parametrize(
    "body, reason",
    [
        (b'{"a": "' + b"x" * (2 << 20) + b'"}', "the answer is over 1048576 bytes"),
        (b"[" * (900 << 10), "the answer is nested deeper than 64 levels"),
        (b'{"a": ' + b"[" * 70 + b"]" * 70 + b"}", "the answer is nested deeper than 64 levels"),
        (b"\xff\xfe not json", "the answer is not JSON"),
        (b'"a string"', "the answer is not a JSON object"),
    ],
)
def test_a_hostile_answer_is_one_line_fail(tmp_path, body, reason):
    artifact = tmp_path / "artifact"
    artifact.write_bytes(b"x")
    with always_answering(body) as url:
        code, verdicts, output = verify("--artifact", str(artifact), "--url", url)
    assert code == 1 and verdicts == {"fetch": "FAIL"}, output[:2000]
    assert f"FAIL fetch: {reason}" in output and "Traceback" not in output, output[:2000]
    assert len(output.splitlines()) == 2, output[:2000]  # the failure, and the verdict
    assert output.splitlines()[-1] == "verdict: FAIL: 1 of 1 checks FAILed (fetch); exit 1", output[:2000]


def test_an_unwritable_save_cert_directory_is_one_line_exit_2(attested, tmp_path):
    gateway, release, _ = attested
    code, verdicts, output = verify_signed(
        release,
        gateway.url,
        "--save-cert",
        str(tmp_path / "no-such-dir" / "gw.pem"),
    )
    assert code == 2 and set(verdicts.values()) == {"PASS"}, output
    assert "Traceback" not in output
    assert output.splitlines()[-1].startswith("attest/verify: cannot write") and "no-such-dir" in output


@pytest.fixture
def busy_then_genuine(measured):
    """A server that answers 503 + Retry-After: 1 twice, then passes requests to the gateway."""
    asked = []

    def answer(path: str):
        asked.append(path)
        if len(asked) <= 2:
            return 503, {"Retry-After": "1"}, b'{"error": {"message": "busy"}}'
        return 200, {}, call("GET", f"{measured.gateway.url}{path}")[2]

    with always_answering(answer) as url:
        yield url, asked


def test_verify_retries_a_busy_gateway_within_its_deadline(measured, busy_then_genuine):
    url, asked = busy_then_genuine
    code, verdicts, output = verify("--release", str(measured.release_path), "--url", url)
    assert code == UNVERIFIED and len(asked) == 3, output  # every check but the signature PASSed
    assert verdicts["nonce echoed"] == "PASS" and verdicts["report_data"] == "PASS", output
    del asked[:]
    code, verdicts, output = verify("--release", str(measured.release_path), "--url", url, "--timeout", "0.5")
    assert code == 1 and verdicts == {"fetch": "FAIL"} and "past the deadline" in output, output


def test_looping_callers_cannot_make_a_verifier_fail(measured):
    """Four unauthenticated callers hammer /attestation; a verifier waits its turn."""
    stop = threading.Event()
    answered = []

    def hog():
        connection = http.client.HTTPConnection("127.0.0.1", measured.gateway.port, timeout=30)
        while not stop.is_set():
            connection.request("GET", f"/attestation?nonce={nonce_hex()}")
            response = connection.getresponse()
            response.read()
            answered.append(response.status)

    hogs = [threading.Thread(target=hog, daemon=True) for _ in range(4)]
    for thread in hogs:
        thread.start()
    try:
        wait_until(lambda: len(answered) >= 20, seconds=20, what="the callers to loop")
        for _ in range(5):
            code, _, output = verify("--release", str(measured.release_path), "--url", measured.gateway.url)
            assert code == UNVERIFIED and "FAIL" not in output, output
    finally:
        stop.set()
        for thread in hogs:
            thread.join(30)
    logged = measured.gateway.logs().count('"msg":"attestation failed"')
    assert logged <= 2, logged  # the refusals, if any, a line a minute


def test_a_collateral_server_that_drips_is_bounded_by_the_same_timeout(dripping):
    started = time.monotonic()
    code, verdicts, output = verify("--quote", str(DCAP_SAMPLE / "tdx_quote"), "--pccs", dripping, "--timeout", "2")
    assert code == 1 and verdicts == {"fetch": "FAIL"}, output
    assert "FAIL fetch: timed out after 2 s" in output and "Traceback" not in output
    assert time.monotonic() - started < 2 + 10


def test_a_flood_of_callers_is_refused_with_retry_after_and_logged_once_a_minute(measured):
    """More callers than the queue holds: the surplus gets 503 + Retry-After, and the log one line."""
    before = measured.gateway.logs().count('"msg":"attestation failed"')
    refusals, lock = [], threading.Lock()

    def caller():
        connection = http.client.HTTPConnection("127.0.0.1", measured.gateway.port, timeout=30)
        for _ in range(6):
            connection.request("GET", f"/attestation?nonce={nonce_hex()}")
            response = connection.getresponse()
            response.read()
            if response.status == 503:
                with lock:
                    refusals.append(response.getheader("retry-after"))

    callers = [threading.Thread(target=caller) for _ in range(24)]
    for thread in callers:
        thread.start()
    for thread in callers:
        thread.join(60)
    assert refusals and set(refusals) == {"1"}, refusals
    wait_until(lambda: measured.gateway.logs().count('"msg":"attestation failed"') > before, what="the warning")
    logged = measured.gateway.logs().count('"msg":"attestation failed"') - before
    assert logged == 1 and len(refusals) > 1, (logged, len(refusals))  # old code: a line per refusal


SAMPLE_QUOTE = ["--quote", str(DCAP_SAMPLE / "tdx_quote")]
SAMPLE_COLLATERAL = ["--collateral", str(DCAP_SAMPLE / "tdx_quote_collateral.json"), "--now", "1751328000"]


@pytest.mark.parametrize(
    "args",
    [
        ["--quote", "/no/such/quote", "--platform-verifier", "true"],
        ["--release", "/no/such/release.json", "--url", "http://127.0.0.1:1"],
        [*SAMPLE_QUOTE, "--collateral", "/no/such/collateral.json"],
        [*SAMPLE_QUOTE, *SAMPLE_COLLATERAL, "--policy", "/no/such/policy.json"],
        [*SAMPLE_QUOTE, *SAMPLE_COLLATERAL, "--learn-policy", "/no/such/dir/policy.json"],
        ["--artifact", "/bin/sh", "--url", "ftp://127.0.0.1/"],
        ["--artifact", "/bin/sh", "--url", "http://127.0.0.1:1", "--timeout", "0"],
        ["--artifact", "/bin/sh", "--url", "http://127.0.0.1:1", "--timeout", "soon"],
    ],
)
def test_a_local_error_or_bad_usage_is_exit_2_never_a_traceback(args):
    code, _, output = verify(*args)
    assert code == 2 and "Traceback" not in output, output
    assert output.splitlines()[-1].startswith("attest/verify: "), output


# ---- a receipt is trusted only with a verified attestation -------------------------------------


def forged_receipt(tmp_path: Path, provider: str = "none", record: dict | None = None) -> list[str]:
    """What anyone can make: a key of their own, evidence that binds it consistently (report_data
    v3 over its own fields) but that no hardware signed, and a receipt signed by that key;
    `record`: what --save-attestation would have recorded of a run. attest/verify receipt's args."""
    from tinygw.trust.receipts import Signer

    signer, nonce, config = Signer.generate(), os.urandom(32), "cd" * 32
    data = hashlib.sha512(
        b"tinygw.attest.v3"
        + nonce
        + bytes.fromhex(config)
        + bytes(32)
        + bytes(32)
        + bytes.fromhex(signer.public_key_sha256)
    )
    evidence = {
        "nonce": nonce.hex(),
        "config_sha256": config,
        "report_data": data.hexdigest(),
        "receipt_public_key": signer.public_key.hex(),
        "receipt_key_sha256": signer.public_key_sha256,
        "evidence": {"provider": provider, "outblob": ""},
        **({"attest_verify": record} if record is not None else {}),
    }
    request, response = b'{"model": "m"}', b'{"answer": "forged"}'
    fields = {
        "v": 1, "id": "ab" * 16, "created": 1796000000, "client": "default", "route": "/v1/chat/completions",
        "model": "m", "provider": "up", "provider_model": "m", "status": 200,
        "request_sha256": hashlib.sha256(request).hexdigest(), "response_sha256": hashlib.sha256(response).hexdigest(),
    }  # fmt: skip
    files = {"evidence.json": json.dumps(evidence).encode(), "request": request, "response": response}
    files["receipt.json"] = signer.signed(json.dumps(fields).encode())
    for name, content in files.items():
        (tmp_path / name).write_bytes(content)
    return [
        "receipt", str(tmp_path / "receipt.json"), "--attestation", str(tmp_path / "evidence.json"),
        "--request", str(tmp_path / "request"), "--response", str(tmp_path / "response"),
    ]  # fmt: skip


ALL_PASSED = [
    {"name": n, "result": "PASS"} for n in ("nonce echoed", "report_data", "receipt key bound", "quote signature")
]


@pytest.mark.parametrize(
    "provider, record, says",
    [
        ("none", None, "provider 'none'"),  # an /attestation answer as it came, from no TEE
        ("tdx_guest", None, "not one that attest/verify verified and saved"),  # never verified
        ("none", {"verdict": "PASS", "checks": ALL_PASSED}, "provider 'none'"),
        (
            "tdx_guest",
            {"verdict": "FAIL", "checks": [*ALL_PASSED[:3], {"name": "quote signature", "result": "FAIL"}]},
            "quote signature",
        ),
        (
            "tdx_guest",
            {"verdict": "UNVERIFIED", "checks": [*ALL_PASSED[:3], {"name": "quote signature", "result": "SKIP"}]},
            "quote signature",
        ),
        ("tdx_guest", {"verdict": "PASS", "checks": ALL_PASSED[:3]}, "did not check quote signature"),
    ],
)
def test_a_receipt_key_from_unverified_evidence_is_skip_exit_4_never_pass(tmp_path, provider, record, says):
    """Before: five PASS lines and exit 0, against a key anyone could make, and no verdict line."""
    code, verdicts, output = verify(*forged_receipt(tmp_path, provider, record))
    assert code == 4, output
    assert verdicts == {
        "receipt key bound": "SKIP",
        "receipt fields": "PASS",
        "receipt signature": "SKIP",
        "request hash": "PASS",
        "response hash": "PASS",
    }, output
    assert says in next(line for line in output.splitlines() if line.startswith("SKIP receipt key bound")), output
    assert output.splitlines()[-1] == (
        "verdict: UNVERIFIED: 2 of 5 checks SKIPped (receipt key bound, receipt signature), "
        "the others PASSed: not proven; exit 4"
    ), output


def test_a_receipt_whose_signature_does_not_hold_fails_even_under_an_unverified_key(tmp_path):
    args = forged_receipt(tmp_path)
    receipt = json.loads((tmp_path / "receipt.json").read_bytes())
    (tmp_path / "receipt.json").write_text(json.dumps({**receipt, "status": 201}))
    code, verdicts, output = verify(*args)
    assert code == 1 and verdicts["receipt signature"] == "FAIL", output
    assert output.splitlines()[-1].startswith("verdict: FAIL: "), output


@pytest.mark.parametrize(
    "args, says",
    [
        (["receipt", "/no/such/receipt.json", "--attestation", "/no/such/evidence.json"], "cannot read the receipt"),
        (["receipt", "/no/such/receipt.json"], "bad usage: the following arguments are required: --attestation"),
        (["receipt", "/no/such/receipt.json", "--attestation", "x", "--bogus"], "bad usage: unrecognized arguments"),
    ],
)
def test_every_receipt_run_ends_with_its_verdict_line(args, says):
    """Before: bad usage left from inside argparse, and no run printed a verdict line."""
    done = subprocess.run(
        [sys.executable, str(test_attest.VERIFY), *args], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    last = done.stdout.splitlines()[-1]
    assert last.startswith(f"verdict: ERROR: nothing was verified: {says}") and last.endswith("; exit 2"), done.stdout


# ---- the verifier runs its own code only -------------------------------------------------------

ATTEST_MODULES = sorted(path.stem for path in (test_attest.ROOT / "attest").glob("*.py"))
# what attest/verify imports besides its own: stdlib modules that start-up has not loaded, its packages
OTHERS = ["json", "hashlib", "ssl", "tempfile", "argparse", "base64", "cryptography", "dcap_qvl"]
SAMPLE_QUOTE = (
    "--quote",
    str(DCAP_SAMPLE / "tdx_quote"),
    "--collateral",
    str(DCAP_SAMPLE / "tdx_quote_collateral.json"),
    "--now",
    "1751328000",
)


def hostile_modules(tmp_path: Path, *extra: str) -> tuple[Path, Path, Path]:
    """A PYTHONPATH directory and a working directory, each holding a module of every name that
    attest/verify imports (its own: policy.py, snp_chain.py, ...; the stdlib's; its packages'),
    each of which, once imported, writes its name to the returned marker file and exits 99."""
    marker = tmp_path / "imported"
    hostile = f"open({str(marker)!r}, 'a').write(__name__ + '\\n')\nraise SystemExit(99)\n"
    directories = tmp_path / "pythonpath", tmp_path / "cwd"
    for directory in directories:
        directory.mkdir()
        for name in (*ATTEST_MODULES, *OTHERS, *extra):
            (directory / f"{name}.py").write_text(hostile)
    return *directories, marker


def test_verify_imports_no_module_from_pythonpath_or_the_working_directory(tmp_path):
    pythonpath, cwd, marker = hostile_modules(tmp_path)
    assert {"policy", "snp_chain", "checks", "options"} <= set(ATTEST_MODULES)
    done = subprocess.run(
        [sys.executable, str(test_attest.VERIFY), *SAMPLE_QUOTE],
        cwd=cwd,
        env={"PATH": os.environ["PATH"], "PYTHONPATH": f"{pythonpath}:"},  # the empty entry: the working directory
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert not marker.exists(), marker.read_text()
    assert done.returncode == 0 and "PASS quote signature" in done.stdout, done.stdout + done.stderr


def test_verify_run_as_a_program_is_isolated_from_its_start(tmp_path):
    """./attest/verify starts its interpreter isolated (python3 -I): not even the interpreter's
    start-up hooks (sitecustomize, usercustomize) come from PYTHONPATH or the user's site."""
    pythonpath, cwd, marker = hostile_modules(tmp_path, "sitecustomize", "usercustomize")
    interpreter = Path(sys.executable).parent  # its python3 has the verifier's packages
    done = subprocess.run(
        [str(test_attest.VERIFY), *SAMPLE_QUOTE],
        cwd=cwd,
        env={"PATH": f"{interpreter}:{os.environ['PATH']}", "PYTHONPATH": f"{pythonpath}:", "HOME": str(cwd)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert not marker.exists(), marker.read_text()
    assert done.returncode == 0 and "PASS quote signature" in done.stdout, done.stdout + done.stderr
