"""Attested TLS (docs/design.md section 9), black-box: real gateway processes serving HTTPS on
loopback, attest/verify over one TLS connection, a relay that terminates TLS with its
own key, and the official OpenAI SDK trusting exactly the attested certificate."""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import json
import os
import re
import ssl
import subprocess
import sys
from pathlib import Path

import openai
import pytest
import test_attest  # noqa: F401 -- puts attest/ on the path, for relay below
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID
from relay import Relay  # attest/relay.py
from test_attest import (
    SIMULATED_SIGNATURE,
    two_workers_on_fake_tdx,
    verify,
    verify_signed,
)

from conftest import ROOT, Gateway, call, free_port, metric_value, run_tinygw

SECRET = "sk-attest-never-shown"  # test_attest's gateway_config names it


def self_signed(directory: Path, name: str = "127.0.0.1", key=None, days: float = 1) -> tuple[Path, Path]:
    """A certificate and key made here (not by the gateway): (cert path, key path). The
    certificate expires `days` from now (in the past when negative)."""
    key = key or ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=30))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(name))]), critical=False)
        .sign(key, hashes.SHA256())
    )
    directory.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


def spki_of(cert_pem: bytes) -> str:
    cert = x509.load_pem_x509_certificate(cert_pem)
    return hashlib.sha256(
        cert.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    ).hexdigest()


@pytest.fixture(scope="module")
def attested(tmp_path_factory):
    """A gateway with attested TLS and 2 workers, started by attest/launch on the fake
    TDX platform, and its release.json."""
    root = tmp_path_factory.mktemp("attested-tls")
    with two_workers_on_fake_tdx(root, {"TINYGW_TLS": "attested"}) as (gateway, _, _):
        yield gateway, root / "release.json", root


def served_key_dir(gateway: Gateway) -> Path:
    """The directory of the key the gateway serves, found as a local attacker with root
    would: on the memory file systems, the one whose certificate is the attested one."""
    attested = json.loads(call("GET", f"{gateway.url}/attestation?nonce={'01' * 32}")[2])["tls_spki_sha256"]
    for parent in ("/dev/shm", "/run", os.environ.get("XDG_RUNTIME_DIR") or "/run"):
        for cert in Path(parent).glob("tinygw-tls-*/cert.pem"):
            if spki_of(cert.read_bytes()) == attested:
                return cert.parent
    raise AssertionError("the served key is in none of the memory file systems looked at")


# ---- attest/verify over TLS -----------------------------------------------------------------


def test_verify_passes_over_https_and_saves_the_attested_certificate(attested, tmp_path):
    gateway, release, _ = attested
    saved = tmp_path / "gateway.pem"
    # Unverified, a certificate is never saved, even when the SKIP is accepted (docs/verify.md)...
    code, verdicts, output = verify(
        "--release", str(release), "--url", gateway.url, "--accept-unverified", "--save-cert", str(saved)
    )
    assert code == 4 and not saved.exists() and "not writing the certificate" in output, output
    assert verdicts["tls channel"] == "PASS" and verdicts["report_data"] == "PASS", output
    assert verdicts["quote signature"] == "SKIP", output
    # ...and once the quote's signature is checked (here by the SIMULATED check), it is.
    code, verdicts, output = verify(
        "--release",
        str(release),
        "--url",
        gateway.url,
        "--save-cert",
        str(saved),
        "--platform-verifier",
        SIMULATED_SIGNATURE,
    )
    assert code == 0 and set(verdicts.values()) == {"PASS"} and "SIMULATED" in output, output
    # Both workers serve and attest the same key: new connections land on either.
    answers = [json.loads(call("GET", f"{gateway.url}/attestation?nonce={os.urandom(32).hex()}")[2]) for _ in range(12)]
    assert {a["tls_spki_sha256"] for a in answers} == {spki_of(saved.read_bytes())}
    pem = ssl.get_server_certificate(("127.0.0.1", gateway.port)).encode()
    assert spki_of(pem) == spki_of(saved.read_bytes())


def test_report_data_binds_the_tls_key(attested):
    gateway, _, _ = attested
    nonce = os.urandom(32)
    answer = json.loads(call("GET", f"{gateway.url}/attestation?nonce={nonce.hex()}")[2])
    expected = hashlib.sha512(
        b"tinygw.attest.v2" + nonce + bytes.fromhex(answer["config_sha256"]) + bytes.fromhex(answer["tls_spki_sha256"])
    ).hexdigest()
    assert answer["report_data"] == expected
    assert spki_of(answer["tls_certificate"].encode()) == answer["tls_spki_sha256"]


def test_verify_fails_behind_a_relay_that_terminates_tls(attested, tmp_path):
    gateway, release, _ = attested
    relay = Relay(*self_signed(tmp_path / "relay"), gateway.port)
    try:
        url = f"https://127.0.0.1:{relay.port}"
        # The relay passes the genuine gateway's answer through unchanged...
        status, _, body = call("GET", f"{url}/attestation?nonce={'ab' * 32}")
        assert status == 200 and json.loads(body)["nonce"] == "ab" * 32, body
        code, verdicts, output = verify(
            "--release", str(release), "--url", url, "--accept-unverified", "--save-cert", str(tmp_path / "never.pem")
        )
    finally:
        relay.close()
    # ...but this connection was not served with the attested key.
    assert code == 1 and verdicts["tls channel"] == "FAIL", output
    assert verdicts["nonce echoed"] == "PASS" and verdicts["report_data"] == "PASS", output
    assert "terminates TLS" in output
    assert not (tmp_path / "never.pem").exists()
    assert "not writing the certificate" in output and "a check FAILed" in output, output


def test_verify_fails_a_replayed_answer(attested, tmp_path):
    gateway, release, _ = attested
    old = call("GET", f"{gateway.url}/attestation?nonce={os.urandom(32).hex()}")[2]
    relay = Relay(*self_signed(tmp_path / "replay"), gateway.port, replay=old)
    try:
        code, verdicts, output = verify(
            "--release", str(release), "--url", f"https://127.0.0.1:{relay.port}", "--accept-unverified"
        )
    finally:
        relay.close()
    assert code == 1, output
    assert verdicts["nonce echoed"] == "FAIL" and verdicts["report_data"] == "FAIL", output
    assert verdicts["tls channel"] == "FAIL", output


# ---- the private key stays inside ----------------------------------------------------------


def key_fingerprints(key_pem: bytes) -> list[str]:
    """Ways the key could leak: its PEM body lines, its private scalar in hex and decimal."""
    key = serialization.load_pem_private_key(key_pem, password=None)
    scalar = key.private_numbers().private_value
    body = [line for line in key_pem.decode().splitlines() if line and not line.startswith("-----")]
    return [*body, f"{scalar:x}", str(scalar)]


def test_the_private_key_appears_nowhere_the_gateway_writes(attested, tmp_path):
    gateway, _, _ = attested
    key_pem = (served_key_dir(gateway) / "key.pem").read_bytes()
    places = {
        "log": gateway.logs(),
        "check": run_tinygw(["check"], gateway.env).stdout,
    }
    for path in (
        "/status",
        "/status.json",
        "/metrics",
        "/healthz",
        "/v1/models",
        "/nowhere",
        f"/attestation?nonce={'cd' * 32}",
        "/attestation?nonce=zz",
    ):
        places[path] = call("GET", f"{gateway.url}{path}")[2].decode()
    places["chat"] = call("POST", f"{gateway.url}/v1/chat/completions", {"model": "m"})[2].decode()
    for fingerprint in key_fingerprints(key_pem):
        for where, text in places.items():
            assert fingerprint not in text, f"the TLS key shows in {where}"


def test_the_attested_key_lives_in_a_private_memory_directory_removed_at_exit(fake, start_gateway):
    gateway = start_gateway(
        {"providers": {"p": {"base_url": f"{fake.url}/v1", "api": "openai"}}, "models": {"m": {"targets": ["p:x"]}}},
        TINYGW_TLS="attested",
    )
    cert = served_key_dir(gateway) / "cert.pem"
    key = cert.parent / "key.pem"
    mounts = {line.split()[1]: line.split()[2] for line in Path("/proc/self/mounts").read_text().splitlines()}
    mount = max((m for m in mounts if str(key).startswith(m.rstrip("/") + "/")), key=len)
    assert mounts[mount] in ("tmpfs", "ramfs")
    assert key.stat().st_mode & 0o777 == 0o600 and cert.parent.stat().st_mode & 0o777 == 0o700
    assert gateway.stop() == 0
    assert not cert.parent.exists()


# ---- TINYGW_TLS=files ------------------------------------------------------------------------


def files_config(fake) -> dict:
    return {"providers": {"p": {"base_url": f"{fake.url}/v1", "api": "openai"}}, "models": {"m": {"targets": ["p:x"]}}}


def test_files_mode_serves_the_given_certificate_and_attests_it(fake, start_gateway, tmp_path):
    cert, key = self_signed(tmp_path / "ca-issued")
    gateway = start_gateway(
        files_config(fake), TINYGW_TLS="files", TINYGW_TLS_CERT_FILE=str(cert), TINYGW_TLS_KEY_FILE=str(key)
    )
    answer = json.loads(call("GET", f"{gateway.url}/attestation?nonce={'ef' * 32}")[2])
    assert answer["tls_spki_sha256"] == spki_of(cert.read_bytes())
    assert spki_of(ssl.get_server_certificate(("127.0.0.1", gateway.port)).encode()) == spki_of(cert.read_bytes())


@pytest.mark.parametrize(
    "fault,variable",
    [
        ("mismatched key", "TINYGW_TLS_KEY_FILE"),
        ("not a certificate", "TINYGW_TLS_CERT_FILE"),
        ("not a key", "TINYGW_TLS_KEY_FILE"),
        ("no key file", "TINYGW_TLS_KEY_FILE"),
    ],
)
def test_files_mode_with_a_bad_certificate_or_key_exits_2_naming_it(fake, tmp_path, fault, variable):
    cert, key = self_signed(tmp_path / "good")
    other_cert, other_key = self_signed(tmp_path / "other")
    env = {"TINYGW_TLS": "files", "TINYGW_TLS_CERT_FILE": str(cert), "TINYGW_TLS_KEY_FILE": str(key)}
    if fault == "mismatched key":
        env["TINYGW_TLS_KEY_FILE"] = str(other_key)
    elif fault == "not a certificate":
        env["TINYGW_TLS_CERT_FILE"] = str(key)
    elif fault == "not a key":
        env["TINYGW_TLS_KEY_FILE"] = str(other_cert)
    else:
        del env["TINYGW_TLS_KEY_FILE"]
    for command in ("check", "serve"):
        done = run_tinygw([command], {"TINYGW_CONFIG": json.dumps(files_config(fake)), **env})
        assert done.returncode == 2, done.stderr
        assert done.stderr.startswith(f"tinygw: configuration error: {variable}: "), done.stderr
        assert "PRIVATE KEY" not in done.stderr and "BEGIN" not in done.stderr


# ---- a client that trusts exactly the attested certificate ---------------------------------


def test_the_openai_sdk_works_through_the_pinned_certificate_and_refuses_another(attested, tmp_path):
    gateway, release, _ = attested
    saved = tmp_path / "gateway.pem"
    code, _, output = verify_signed(
        release,
        gateway.url,
        "--save-cert",
        str(saved),
    )
    assert code == 0, output
    base_url = f"{gateway.url}/v1"
    with openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=saved)) as pinned:  # no CA but it
        client = openai.OpenAI(base_url=base_url, api_key="unused", http_client=pinned, max_retries=0)
        answer = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        assert answer.choices[0].message.content
        words = [
            c.choices[0].delta.content or ""
            for c in client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], stream=True
            )
            if c.choices
        ]
        assert "".join(words)

    other, _ = self_signed(tmp_path / "someone-else")
    with openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=other)) as wrong:
        client = openai.OpenAI(base_url=base_url, api_key="unused", http_client=wrong, max_retries=0)
        with pytest.raises(openai.APIConnectionError):
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert re.search(r"CERTIFICATE", saved.read_text())


def test_the_rehearsal_runs_the_whole_flow_and_says_it_is_simulated():
    artifact = ["--artifact", os.environ["TINYGW_BINARY"]] if os.environ.get("TINYGW_BINARY") else []
    done = subprocess.run(
        [sys.executable, str(ROOT / "attest" / "rehearse"), *artifact],
        capture_output=True,
        text=True,
        timeout=180,
        env={"PATH": os.environ["PATH"]},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert "SIMULATED" in lines[1] and "SIMULATED" in lines[-3]
    assert "PASS tls channel" in done.stdout and "FAIL tls channel" in done.stdout
    # the honest flow: unverified, nothing is pinned; the SIMULATED signature check, then pinned
    assert "not writing the certificate" in done.stdout and "SIMULATED signature check" in done.stdout
    assert "saved the attested certificate" in done.stdout
    # the SEV-SNP round, SIMULATED too: a test-only root is a SKIP, never a PASS, and without it a FAIL
    assert "no SEV-SNP here" in done.stdout and "evidence from 'sev_guest'" in done.stdout
    assert "SKIP certificate chain: the chain ends in a simulated ARK" in done.stdout
    assert "PASS artifact measured" in done.stdout and "FAIL certificate chain" in done.stdout


# ---- what the environment may not do -------------------------------------------------------


def test_inherited_internal_variables_cannot_make_a_tls_off_gateway_attest_a_key(fake, start_gateway, tmp_path):
    """serve tells its workers which certificate they serve; the same variables coming
    from outside (a host, a pod spec) must not make the gateway attest someone's key."""
    cert, _ = self_signed(tmp_path / "host")
    gateway = start_gateway(
        files_config(fake), TINYGW_TLS_SERVED_CERT=str(cert), TINYGW_TLS_SERVED_SPKI=spki_of(cert.read_bytes())
    )
    nonce = os.urandom(32)
    answer = json.loads(call("GET", f"{gateway.url}/attestation?nonce={nonce.hex()}")[2])
    assert "tls_spki_sha256" not in answer and "tls_certificate" not in answer
    assert (
        answer["report_data"]
        == hashlib.sha512(b"tinygw.attest.v1" + nonce + bytes.fromhex(answer["config_sha256"])).hexdigest()
    )


def test_inherited_internal_variables_do_not_replace_the_attested_key(fake, start_gateway, tmp_path):
    cert, _ = self_signed(tmp_path / "host")
    gateway = start_gateway(
        files_config(fake),
        TINYGW_TLS="attested",
        TINYGW_TLS_SERVED_CERT=str(cert),
        TINYGW_TLS_SERVED_SPKI=spki_of(cert.read_bytes()),
    )
    served = spki_of(ssl.get_server_certificate(("127.0.0.1", gateway.port)).encode())
    answer = json.loads(call("GET", f"{gateway.url}/attestation?nonce={'11' * 32}")[2])
    assert answer["tls_spki_sha256"] == served != spki_of(cert.read_bytes())


def test_save_cert_only_after_every_check_passed_and_only_over_https(attested, tmp_path):
    gateway, release, _ = attested
    saved = tmp_path / "gateway.pem"
    code, verdicts, output = verify("--release", str(release), "--url", gateway.url, "--save-cert", str(saved))
    assert code == 4 and verdicts["quote signature"] == "SKIP", output  # unverified, and not accepted
    assert not saved.exists()
    code, _, output = verify(
        "--release", str(release), "--url", gateway.url.replace("https", "http"), "--save-cert", str(saved)
    )
    assert code == 2 and "https" in output and not saved.exists()


def test_a_long_first_name_and_a_pem_file_with_text_around_it_start(fake, start_gateway, tmp_path):
    long_name = "a" * 63 + ".example.com"  # over a CN's 64 characters, a valid DNS name
    gateway = start_gateway(files_config(fake), TINYGW_TLS="attested", TINYGW_TLS_NAMES=f"{long_name},127.0.0.1")
    assert call("GET", f"{gateway.url}/healthz")[0] == 200

    cert, key = self_signed(tmp_path / "bags")
    cert.write_bytes("Bag Attributes\n    friendlyName: café\n".encode() + cert.read_bytes())
    gateway = start_gateway(
        files_config(fake), TINYGW_TLS="files", TINYGW_TLS_CERT_FILE=str(cert), TINYGW_TLS_KEY_FILE=str(key)
    )
    answer = json.loads(call("GET", f"{gateway.url}/attestation?nonce={'22' * 32}")[2])
    assert answer["tls_certificate"].startswith("-----BEGIN CERTIFICATE-----")
    assert spki_of(answer["tls_certificate"].encode()) == answer["tls_spki_sha256"]


# ---- every start-up failure is exit 2, and check makes serve's checks (docs/design.md section 13) ----


@pytest.mark.parametrize(
    "key,named",
    [
        (lambda: rsa.generate_private_key(65537, 1024), "an RSA key of 1024 bits"),
        (lambda: ec.generate_private_key(ec.SECP224R1()), "an EC key on secp224r1"),
    ],
)
def test_files_mode_with_a_weak_key_exits_2_in_check_and_serve(fake, tmp_path, key, named):
    cert, key_file = self_signed(tmp_path / "weak", key=key())
    env = {
        "TINYGW_CONFIG": json.dumps(files_config(fake)),
        "TINYGW_TLS": "files",
        "TINYGW_TLS_CERT_FILE": str(cert),
        "TINYGW_TLS_KEY_FILE": str(key_file),
        "TINYGW_PORT": str(free_port()),
    }
    for command in ("check", "serve"):
        done = run_tinygw([command], env)
        assert done.returncode == 2, done.stdout + done.stderr
        assert (
            done.stderr.startswith(f"tinygw: configuration error: TINYGW_TLS_KEY_FILE: {str(key_file)!r} holds {named}")
            and len(done.stderr.splitlines()) == 1
        ), done.stderr


def test_files_mode_with_rsa_2048_starts(fake, start_gateway, tmp_path):
    cert, key_file = self_signed(tmp_path / "rsa", key=rsa.generate_private_key(65537, 2048))
    gateway = start_gateway(
        files_config(fake), TINYGW_TLS="files", TINYGW_TLS_CERT_FILE=str(cert), TINYGW_TLS_KEY_FILE=str(key_file)
    )
    assert call("GET", f"{gateway.url}/healthz")[0] == 200


@pytest.mark.parametrize(
    "variable",
    ["TINYGW_TLS_CERT_FILE", "TINYGW_TLS_KEY_FILE", "TINYGW_CONFIG_FILE", "TINYGW_API_KEYS_FILE", "P_KEY_FILE"],
)
def test_a_file_variable_naming_a_directory_exits_2_naming_it(fake, tmp_path, variable):
    cert, key_file = self_signed(tmp_path / "good")
    config = files_config(fake)
    config["providers"]["p"]["api_key_env"] = "P_KEY"
    env = {
        "TINYGW_CONFIG": json.dumps(config),
        "TINYGW_TLS": "files",
        "TINYGW_TLS_CERT_FILE": str(cert),
        "TINYGW_TLS_KEY_FILE": str(key_file),
        "P_KEY": "k",
        "TINYGW_PORT": str(free_port()),
    }
    env.pop("TINYGW_CONFIG" if variable == "TINYGW_CONFIG_FILE" else "P_KEY" if variable == "P_KEY_FILE" else "", None)
    env[variable] = str(tmp_path)
    for command in ("check", "serve"):
        done = run_tinygw([command], env)
        assert done.returncode == 2, done.stderr
        assert (
            done.stderr.startswith(f"tinygw: configuration error: {variable}: ") and len(done.stderr.splitlines()) == 1
        ), done.stderr


# A private mount namespace with a read-only tmpfs at $0, then the command.
READ_ONLY_TMPFS = ["unshare", "--mount", "sh", "-c", 'mount -t tmpfs -o ro tmpfs "$0" && exec "$@"']


def test_attested_tls_with_a_read_only_key_directory_exits_2_in_check_and_serve(fake, tmp_path):
    if subprocess.run([*READ_ONLY_TMPFS, str(tmp_path), "true"], capture_output=True).returncode != 0:
        pytest.skip("no private mount namespace here (unshare --mount needs privileges)")
    env = {
        "TINYGW_CONFIG": json.dumps(files_config(fake)),
        "TINYGW_TLS": "attested",
        "TMPDIR": str(tmp_path),
        "TINYGW_PORT": str(free_port()),
    }
    for command in ("check", "serve"):
        done = run_tinygw([command], env, prefix=[*READ_ONLY_TMPFS, str(tmp_path)])
        assert done.returncode == 2, done.stdout + done.stderr
        assert (
            done.stderr.startswith(
                f"tinygw: configuration error: TINYGW_TLS: attested: cannot write the key in {str(tmp_path)!r}"
            )
            and len(done.stderr.splitlines()) == 1
        ), done.stderr


def test_the_served_certificate_expiry_is_a_metric_and_an_expired_one_is_said_at_start(fake, start_gateway, tmp_path):
    cert, key_file = self_signed(tmp_path / "expired", days=-2)
    gateway = start_gateway(
        files_config(fake),
        TINYGW_TLS="files",
        TINYGW_TLS_CERT_FILE=str(cert),
        TINYGW_TLS_KEY_FILE=str(key_file),
        TINYGW_WORKERS="2",
    )
    not_after = x509.load_pem_x509_certificate(cert.read_bytes()).not_valid_after_utc.timestamp()
    assert metric_value(gateway, "tinygw_tls_certificate_expiry_seconds") == not_after
    [said] = [r for r in gateway.log_records() if "EXPIRED" in r["msg"]]
    assert said["level"] == "error"

    attested = start_gateway(files_config(fake), TINYGW_TLS="attested")
    expiry = metric_value(attested, "tinygw_tls_certificate_expiry_seconds")
    assert 364 * 86400 < expiry - datetime.datetime.now(datetime.UTC).timestamp() < 366 * 86400
    assert not [r for r in attested.log_records() if "certificate" in r["msg"] and r["level"] != "info"]
    plain = start_gateway(files_config(fake))
    assert metric_value(plain, "tinygw_tls_certificate_expiry_seconds") is None
