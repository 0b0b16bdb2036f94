"""AMD SEV-SNP: attest/snp.py on two real Milan reports, the simulated platform, and a real
gateway answering /attestation as an SEV-SNP guest (docs/design.md section 12).

The real data (tests/data/snp-sample, see its README): dstack's report (DEBUG clear) with its
VCEK and ASK, and omne-attest's report (DEBUG set) with its VCEK, ASK and ARK. No ARK is
given for dstack: the verifier's built-in, pinned Milan ARK must carry it.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import json
import os
import shutil
import sys
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_attest import VERIFY, gateway_config, verify, verify_module

from conftest import ROOT, call

sys.path.insert(0, str(ROOT / "attest"))
import fake_snp  # noqa: E402 (attest/ is not a package)
import snp  # noqa: E402
import snp_chain  # noqa: E402

from tinygw.trust.attestation import snp_certificates

SAMPLE = ROOT / "tests" / "data" / "snp-sample"
DSTACK_REPORT = (SAMPLE / "dstack" / "report.bin").read_bytes()
DSTACK_VCEK = (SAMPLE / "dstack" / "sev_snp_vcek.pem").read_bytes()
DSTACK_ASK = (SAMPLE / "dstack" / "sev_snp_ask.pem").read_bytes()
OMNE_REPORT = (SAMPLE / "omne" / "attestation.bin").read_bytes()
OMNE_VCEK = (SAMPLE / "omne" / "kds_vcek.der").read_bytes()
OMNE_ASK = (SAMPLE / "omne" / "milan_ask.der").read_bytes()
OMNE_ARK = (SAMPLE / "omne" / "milan_ark.der").read_bytes()
DSTACK_MEASUREMENT = "7f51e17f72a04d5422cb2c00998166536019a217376f3aa45a630e59c805a599847ff250dbffcd07e1ba639771d6f05d"
SECRET = "sk-snp-never-shown"


def verdicts(checks) -> dict[str, str]:
    return {check.name: check.result for check in checks}


def reasons(checks) -> dict[str, str]:
    return {check.name: check.reason for check in checks if check.reason}


def flipped(data: bytes, at: int, bit: int = 0) -> bytes:
    return data[:at] + bytes([data[at] ^ (1 << bit)]) + data[at + 1 :]


ALL_PASS = {
    "snp report": "PASS",
    "certificate chain": "PASS",
    "report signature": "PASS",
    "VCEK matches report": "PASS",
    "guest not in debug mode": "PASS",
    "no migration agent": "PASS",
}


# ---- the real samples ---------------------------------------------------------------------


def test_the_samples_are_the_documented_bytes():
    digest = hashlib.sha256(DSTACK_REPORT).hexdigest()
    assert digest == "a20e02a2e8198894f3c4d0158276c5ae65e63b1908dd4540e058a2ea54d88d2e"
    assert DSTACK_REPORT == (SAMPLE / "dstack" / "sev_snp_attestation.bin").read_bytes()[4 : 4 + 1184]
    assert hashlib.sha256(OMNE_ARK).hexdigest() == snp.ARK_SHA256["Milan"]
    for product, pin in snp.ARK_SHA256.items():  # the built-in ARKs are the pinned ones, all three
        assert snp.fingerprint(snp.builtin_arks()[product]) == pin


def test_the_dstack_sample_passes_with_the_built_in_ark():
    checks = snp.verify_report(DSTACK_REPORT, DSTACK_VCEK, DSTACK_ASK)
    assert verdicts(checks) == {**ALL_PASS, "artifact measured": "SKIP"}, reasons(checks)
    chain = next(c for c in checks if c.name == "certificate chain")
    assert chain.values["product"] == "Milan" and chain.values["ark_sha256"] == snp.ARK_SHA256["Milan"]
    skip = reasons(checks)["artifact measured"]
    assert "no runtime measurement register" in skip and "snp.measurement" in skip

    policy = snp.parse_policy(
        {
            "measurement": [DSTACK_MEASUREMENT],
            "vmpl": [0],
            "min_tcb": {"bootloader": 4, "tee": 0, "snp": 23, "microcode": 213},
        }
    )
    expected = b"attest-test-fixture-2026".ljust(64, b"\0")
    checks = snp.verify_report(DSTACK_REPORT, DSTACK_VCEK, DSTACK_ASK, report_data=expected, policy=policy)
    assert verdicts(checks) == {
        **ALL_PASS,
        "report_data": "PASS",
        "snp.measurement": "PASS",
        "snp.vmpl": "PASS",
        "snp.min_tcb": "PASS",
        "artifact measured": "PASS",
    }, reasons(checks)


def test_a_report_file_may_be_hex():
    text = DSTACK_REPORT.hex().upper().encode() + b"\n"
    assert snp.load_report(text) == DSTACK_REPORT == snp.load_report(DSTACK_REPORT)
    with pytest.raises(snp.ReportError, match="neither the raw 1184 nor their hex"):
        snp.load_report(text[:-3])


@pytest.mark.parametrize(
    "at,what",
    [
        (0x08, "policy"),
        (0x50, "report_data"),
        (0x90, "measurement"),
        (0xC0, "host_data"),
        (0x180, "reported_tcb"),
        (0x1A0, "chip_id"),
        (0x29F, "the last signed byte"),
        (0x2A0, "r"),
        (0x2E8, "s"),
    ],
)
def test_one_flipped_bit_in_the_signed_part_fails_the_signature(at, what):
    checks = snp.verify_report(flipped(DSTACK_REPORT, at, 1), DSTACK_VCEK, DSTACK_ASK)
    assert verdicts(checks)["report signature"] == "FAIL", what
    assert "does not verify under this VCEK" in reasons(checks)["report signature"]


def test_the_unsigned_tail_is_not_read():
    """Past r and s (0x330 on) the report is reserved and unsigned: nothing here reads it."""
    checks = snp.verify_report(flipped(DSTACK_REPORT, 0x330), DSTACK_VCEK, DSTACK_ASK)
    assert verdicts(checks) == {**ALL_PASS, "artifact measured": "SKIP"}


def test_a_report_checked_under_the_other_samples_vcek_fails():
    checks = snp.verify_report(DSTACK_REPORT, OMNE_VCEK, DSTACK_ASK)
    assert verdicts(checks)["certificate chain"] == "PASS"  # a genuine VCEK, of another chip
    assert verdicts(checks)["report signature"] == "FAIL"
    assert verdicts(checks)["VCEK matches report"] == "FAIL"
    assert (
        "the VCEK is for chip 3ac3fe21e13fb099..., the report comes from chip 38d174589d2dff97"
        in reasons(checks)["VCEK matches report"]
    )
    checks = snp.verify_report(OMNE_REPORT, DSTACK_VCEK, OMNE_ASK, OMNE_ARK)
    assert verdicts(checks)["report signature"] == verdicts(checks)["VCEK matches report"] == "FAIL"


def test_the_omne_sample_fails_for_its_debug_bit():
    checks = snp.verify_report(OMNE_REPORT, OMNE_VCEK, OMNE_ASK, OMNE_ARK)
    assert verdicts(checks) == {**ALL_PASS, "guest not in debug mode": "FAIL", "artifact measured": "SKIP"}
    assert "allows debugging" in reasons(checks)["guest not in debug mode"]
    # Its own ARK is the built-in one: the same verdicts without it.
    assert verdicts(snp.verify_report(OMNE_REPORT, OMNE_VCEK, OMNE_ASK)) == verdicts(checks)


@pytest.fixture(scope="module")
def test_chain():
    """A test-only ARK -> ASK -> VCEK (attest/fake_snp.py), nothing of AMD's."""
    return fake_snp.Chain(bytes(range(64)), {"bootloader": 4, "tee": 0, "snp": 23, "microcode": 213})


def test_a_broken_chain_fails(test_chain, tmp_path, monkeypatch):
    def chain_reason(*certificates):
        checks = snp.verify_report(DSTACK_REPORT, *certificates)
        assert verdicts(checks)["certificate chain"] == "FAIL"
        return reasons(checks)["certificate chain"]

    # an ASK signed by no pinned ARK
    assert "none of AMD's pinned ARKs" in chain_reason(DSTACK_VCEK, test_chain.der("ask"))
    # a pinned ARK, but not the one that signed the ASK
    genoa = (ROOT / "attest" / "amd-ark" / "genoa.pem").read_bytes()
    assert chain_reason(DSTACK_VCEK, DSTACK_ASK, genoa) == "SEV-Milan is issued by ARK-Milan, not by ARK-Genoa"
    # an ARK given that AMD did not make, even one that claims the name
    assert "is none of AMD's pinned ARKs" in chain_reason(DSTACK_VCEK, test_chain.der("ask"), test_chain.der("ark"))
    # one byte of a signature: the ASK's, then the VCEK's
    ask = bytearray(OMNE_ASK)
    ask[-1] ^= 1
    assert "SEV-Milan by ARK-Milan (RSA-PSS SHA-384) does not verify" in chain_reason(DSTACK_VCEK, bytes(ask))
    vcek = bytearray(OMNE_VCEK)
    vcek[-1] ^= 1
    assert "SEV-VCEK by SEV-Milan" in chain_reason(bytes(vcek), DSTACK_ASK)
    # the ARK files alone cannot make a root trusted: a changed built-in ARK is left out
    arks = tmp_path / "amd-ark"
    shutil.copytree(ROOT / "attest" / "amd-ark", arks)
    (arks / "milan.pem").write_bytes(test_chain.pem("ark"))
    monkeypatch.setattr(snp, "ARK_DIR", arks)
    assert "Milan" not in snp.builtin_arks()
    assert "none of AMD's pinned ARKs" in chain_reason(DSTACK_VCEK, DSTACK_ASK)


def test_a_chain_out_of_its_validity_fails():
    later = datetime.datetime(2034, 1, 1, tzinfo=datetime.UTC)
    checks = snp.verify_report(DSTACK_REPORT, DSTACK_VCEK, DSTACK_ASK, now=later)
    assert "SEV-VCEK is valid from 2026-06-17 to 2033-06-17, not at 2034-01-01" in reasons(checks)["certificate chain"]


def test_without_a_vcek_the_chain_and_signature_fail():
    checks = snp.verify_report(DSTACK_REPORT, None, DSTACK_ASK)
    assert verdicts(checks)["certificate chain"] == verdicts(checks)["report signature"] == "FAIL"
    assert "no VCEK" in reasons(checks)["certificate chain"]
    checks = snp.verify_report(DSTACK_REPORT, b"not a certificate", DSTACK_ASK)
    assert "cannot read the VCEK certificate" in reasons(checks)["certificate chain"]


# ---- policy -------------------------------------------------------------------------------


def test_each_policy_field_names_itself_and_both_values_when_it_fails():
    policy = snp.parse_policy(
        {
            "measurement": ["00" * 48],
            "host_data": ["11" * 32],
            "vmpl": [1, 2],
            "chip_ids": ["22" * 64],
            "min_tcb": {"bootloader": 4, "snp": 24, "microcode": 214},
        }
    )
    checks = snp.verify_report(DSTACK_REPORT, DSTACK_VCEK, DSTACK_ASK, policy=policy)
    assert {k: v for k, v in verdicts(checks).items() if k.startswith("snp.")} == {
        "snp.measurement": "FAIL",
        "snp.host_data": "FAIL",
        "snp.vmpl": "FAIL",
        "snp.chip_ids": "FAIL",
        "snp.min_tcb": "FAIL",
    }
    why = reasons(checks)
    assert (
        why["snp.measurement"]
        == f"policy snp.measurement: the report has {DSTACK_MEASUREMENT}, the policy allows {'00' * 48}"
    )
    assert why["snp.vmpl"] == "policy snp.vmpl: the report has 0, the policy allows 1, 2"
    assert (
        why["snp.min_tcb"]
        == "policy snp.min_tcb: the reported TCB is below the floor: snp 23 < 24, microcode 213 < 214"
    )
    assert verdicts(checks)["artifact measured"] == "FAIL"  # a pinned measurement that is not this one


def test_the_learned_policy_is_satisfied_by_the_report_it_came_from():
    report = snp.parse_report(DSTACK_REPORT)
    learned = snp.learned_policy(report, "Milan")
    assert learned["min_tcb"] == {"bootloader": 4, "tee": 0, "snp": 23, "microcode": 213}
    checks = snp.verify_report(DSTACK_REPORT, DSTACK_VCEK, DSTACK_ASK, policy=snp.parse_policy(learned))
    assert set(verdicts(checks).values()) == {"PASS"}, reasons(checks)


@pytest.mark.parametrize(
    "bad,field",
    [
        ({"measurement": "ab" * 48}, "snp.measurement"),
        ({"measurement": ["ab" * 47]}, "snp.measurement"),
        ({"host_data": []}, "snp.host_data"),
        ({"vmpl": [4]}, "snp.vmpl"),
        ({"vmpl": [True]}, "snp.vmpl"),
        ({"min_tcb": {"snp": 256}}, "snp.min_tcb.snp"),
        ({"min_tcb": {"fw": 1}}, "snp.min_tcb"),
        ({"chip_id": ["00" * 64]}, "snp.chip_id"),
        ([], "snp"),
    ],
)
def test_a_malformed_policy_names_the_field(bad, field):
    with pytest.raises(snp.PolicyError, match=f"^policy {field}: "):
        snp.parse_policy(bad)


def test_a_migration_agent_fails(test_chain):
    chip = bytes(range(64))
    tcb = fake_snp.tcb_version({"bootloader": 4, "tee": 0, "snp": 23, "microcode": 213})
    report = fake_snp.snp_report(test_chain.vcek_key, bytes(64), chip_id=chip, reported_tcb=tcb, policy=0x70000)
    checks = snp.verify_report(
        report, test_chain.der("vcek"), test_chain.der("ask"), simulated_ark=test_chain.der("ark")
    )
    assert verdicts(checks)["no migration agent"] == "FAIL" and verdicts(checks)["report signature"] == "PASS"
    assert verdicts(checks)["certificate chain"] == "SKIP"  # a simulated root is never a PASS
    assert "simulated ARK" in reasons(checks)["certificate chain"]


def test_turin_lays_out_its_tcb_differently():
    raw = bytes([1, 2, 3, 4, 0, 0, 0, 5])
    assert snp.tcb(raw, "Turin") == {"fmc": 1, "bootloader": 2, "tee": 3, "snp": 4, "microcode": 5}
    assert snp.tcb(raw, "Milan") == {"bootloader": 1, "tee": 2, "snp": 0, "microcode": 5}


# ---- no traceback on any bytes --------------------------------------------------------------


@given(st.binary(max_size=3000))
def test_the_report_reader_takes_any_bytes(data):
    try:
        report = snp.parse_report(snp.load_report(data))
    except snp.ReportError as e:
        assert str(e)
    else:
        assert report.version in snp.VERSIONS


@given(st.binary(min_size=1184, max_size=1184), st.integers(2, 5), st.integers(0, 2**32 - 1))
def test_any_report_of_a_known_version_gets_a_verdict_per_check(data, version, key_info):
    raw = version.to_bytes(4, "little") + data[4:0x48] + key_info.to_bytes(4, "little") + data[0x4C:]
    checks = snp.verify_report(raw, DSTACK_VCEK, DSTACK_ASK, report_data=bytes(64))
    assert verdicts(checks)["report signature"] == "FAIL"
    assert all(check.result in ("PASS", "FAIL", "SKIP") for check in checks)


@given(
    st.binary(max_size=600),
    st.lists(
        st.tuples(
            st.sampled_from(list(fake_snp.CERT_GUIDS.values())), st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1)
        ),
        max_size=4,
    ),
)
def test_the_gateway_reads_any_certificate_table(tail, entries):
    table = (
        b"".join(
            guid.bytes + offset.to_bytes(4, "little") + length.to_bytes(4, "little") for guid, offset, length in entries
        )
        + tail
    )
    certificates = snp_certificates(table)
    assert set(certificates) <= {"vcek", "ask", "ark"}
    assert all(isinstance(pem, str) for pem in certificates.values())


# ---- a real gateway on a simulated SEV-SNP guest -------------------------------------------


def attest(gateway, nonce: bytes) -> dict:
    status, _, body = call("GET", f"{gateway.url}/attestation?nonce={nonce.hex()}")
    assert status == 200, body
    assert SECRET.encode() not in body
    return json.loads(body)


@pytest.mark.parametrize("tls", ["off", "attested"])
def test_the_gateway_answers_as_an_snp_guest(tmp_path, start_gateway, fake, tls):
    platform = fake_snp.FakeSnp(tmp_path / "snp")
    try:
        gateway = start_gateway(
            gateway_config(fake.url),
            UP_KEY=SECRET,
            TINYGW_TLS=tls,
            TINYGW_EVENT_LOG=str(tmp_path / "no-log"),
            **platform.env(),
        )
        nonce = bytes(range(32))
        answer = attest(gateway, nonce)
    finally:
        platform.stop()
    evidence = answer["evidence"]
    assert (evidence["provider"], evidence["platform"]) == ("sev_guest", "sev-snp")
    report = base64.b64decode(evidence["report"])
    assert len(report) == 1184 and evidence["outblob"] == evidence["report"]
    config = bytes.fromhex(answer["config_sha256"])
    if tls == "off":
        expected = hashlib.sha512(b"tinygw.attest.v1" + nonce + config).digest()
    else:
        expected = hashlib.sha512(b"tinygw.attest.v2" + nonce + config + bytes.fromhex(answer["tls_spki_sha256"]))
        expected = expected.digest()
    assert report[0x50:0x90] == expected and answer["report_data"] == expected.hex()
    for name in ("vcek", "ask", "ark"):
        assert evidence[name] == platform.chain.pem(name).decode()
    for name in ("platform", "report", "vcek", "ask", "ark"):  # also at the top of the answer
        assert answer[name] == evidence[name], name
    checks = snp.verify_report(
        report,
        evidence["vcek"].encode(),
        evidence["ask"].encode(),
        report_data=expected,
        simulated_ark=evidence["ark"].encode(),
    )
    assert verdicts(checks) == {
        **ALL_PASS,
        "certificate chain": "SKIP",
        "report_data": "PASS",
        "artifact measured": "SKIP",
    }, reasons(checks)
    assert list(platform.report_dir.iterdir()) == []  # the entry was removed


def test_without_the_hosts_certificates_the_evidence_has_none(tmp_path, start_gateway, fake):
    platform = fake_snp.FakeSnp(tmp_path / "snp", with_certificates=False)
    try:
        gateway = start_gateway(
            gateway_config(fake.url), UP_KEY=SECRET, TINYGW_EVENT_LOG=str(tmp_path / "no-log"), **platform.env()
        )
        answer = attest(gateway, bytes(32))
    finally:
        platform.stop()
    evidence = answer["evidence"]
    assert set(evidence) == {"provider", "platform", "outblob", "report"}
    assert (answer["platform"], answer["report"]) == ("sev-snp", evidence["report"])
    assert not {"vcek", "ask", "ark"} & set(answer)


# ---- attest/verify ---------------------------------------------------------------------------

DSTACK_CERTIFICATES = ("--vcek", SAMPLE / "dstack" / "sev_snp_vcek.pem", "--ask", SAMPLE / "dstack" / "sev_snp_ask.pem")
SAVED = (
    "snp report",
    "certificate chain",
    "report signature",
    "VCEK matches report",
    "guest not in debug mode",
    "no migration agent",
)


def test_verify_passes_the_dstack_report_with_its_measurement_pinned(tmp_path):
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"snp": {"measurement": [DSTACK_MEASUREMENT]}}))
    report = SAMPLE / "dstack" / "report.bin"
    code, found, output = verify("--snp-report", report, *DSTACK_CERTIFICATES, "--policy", policy)
    assert code == 0, output
    assert found == {**dict.fromkeys(SAVED, "PASS"), "snp.measurement": "PASS", "artifact measured": "PASS"}, output
    # without the pin: consistent, but the binary is not bound, and the verifier says so (exit 4)
    hex_report = tmp_path / "report.hex"
    hex_report.write_text(report.read_bytes().hex())
    code, found, output = verify("--snp-report", hex_report, *DSTACK_CERTIFICATES)
    assert code == 4, output
    assert found == {**dict.fromkeys(SAVED, "PASS"), "artifact measured": "SKIP"}, output
    assert "SKIP artifact measured: SEV-SNP has no runtime measurement register" in output


def test_verify_fails_each_broken_sample_naming_the_check(tmp_path):
    bad = tmp_path / "flipped.bin"
    bad.write_bytes(flipped(DSTACK_REPORT, 0x90))
    code, found, output = verify("--snp-report", bad, *DSTACK_CERTIFICATES)
    assert code == 1 and found["report signature"] == "FAIL", output
    code, found, output = verify(
        "--snp-report",
        SAMPLE / "dstack" / "report.bin",
        "--vcek",
        SAMPLE / "omne" / "kds_vcek.der",
        "--ask",
        SAMPLE / "dstack" / "sev_snp_ask.pem",
    )
    assert code == 1 and found["report signature"] == found["VCEK matches report"] == "FAIL", output
    code, found, output = verify(
        "--snp-report",
        SAMPLE / "dstack" / "report.bin",
        *DSTACK_CERTIFICATES,
        "--ark",
        ROOT / "attest" / "amd-ark" / "genoa.pem",
    )
    assert code == 1 and found["certificate chain"] == "FAIL", output
    assert "FAIL certificate chain: SEV-Milan is issued by ARK-Milan, not by ARK-Genoa" in output
    code, found, output = verify(
        "--snp-report",
        SAMPLE / "omne" / "attestation.bin",
        "--vcek",
        SAMPLE / "omne" / "kds_vcek.der",
        "--ask",
        SAMPLE / "omne" / "milan_ask.der",
        "--ark",
        SAMPLE / "omne" / "milan_ark.der",
    )
    assert code == 1 and found["guest not in debug mode"] == "FAIL", output
    assert [name for name, verdict in found.items() if verdict == "FAIL"] == ["guest not in debug mode"], output


def test_verify_refuses_a_malformed_snp_policy_or_missing_certificates(tmp_path):
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"snp": {"measurment": ["00" * 48]}}))
    code, _, output = verify("--snp-report", SAMPLE / "dstack" / "report.bin", *DSTACK_CERTIFICATES, "--policy", policy)
    assert code == 2 and "policy snp.measurment: unknown field" in output, output
    code, _, output = verify("--snp-report", SAMPLE / "dstack" / "report.bin")
    assert code == 2 and "--snp-report needs --vcek FILE and --ask FILE" in output, output
    assert "Traceback" not in output


@pytest.fixture
def snp_gateway(tmp_path, start_gateway, fake):
    """A real gateway on a simulated SEV-SNP guest (attested TLS), and the simulated platform."""
    platform = fake_snp.FakeSnp(tmp_path / "snp")
    (tmp_path / "simulated-ark.pem").write_bytes(platform.chain.pem("ark"))
    try:
        yield (
            start_gateway(
                gateway_config(fake.url),
                UP_KEY=SECRET,
                TINYGW_TLS="attested",
                TINYGW_EVENT_LOG=str(tmp_path / "no-log"),
                **platform.env(),
            ),
            platform,
        )
    finally:
        platform.stop()


def test_verify_reads_a_gateway_on_sev_snp(snp_gateway, tmp_path):
    gateway, platform = snp_gateway
    url = gateway.url.replace("http://", "https://")
    artifact = tmp_path / "tinygw"
    artifact.write_bytes(b"a stand-in: on SEV-SNP the binary is bound through the launch measurement")
    simulated = tmp_path / "simulated-ark.pem"
    code, found, output = verify("--artifact", artifact, "--url", url, simulated_ark=simulated)
    assert code == 4, output
    assert found == {
        "nonce echoed": "PASS",
        "tls channel": "PASS",
        "report_data": "PASS",
        **dict.fromkeys(SAVED, "PASS"),
        "certificate chain": "SKIP",
        "artifact measured": "SKIP",
    }, output
    assert "simulated ARK" in output and "RTMR3" not in output
    # Pinned, the simulated measurement PASSes; the simulated chain still never does.
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"snp": {"measurement": [platform.measurement.hex()], "vmpl": [0]}}))
    code, found, output = verify(
        "--artifact",
        artifact,
        "--url",
        url,
        "--policy",
        policy,
        "--accept-unverified",
        "--save-cert",
        tmp_path / "cert.pem",
        simulated_ark=simulated,
    )
    assert code == 4 and found["artifact measured"] == "PASS" and found["certificate chain"] == "SKIP", output
    assert not (tmp_path / "cert.pem").exists()
    # Without the simulated root, the chain is no AMD chain at all.
    code, found, output = verify("--artifact", artifact, "--url", url)
    assert code == 1 and found["certificate chain"] == "FAIL", output
    assert "none of AMD's pinned ARKs" in output


def test_verify_fails_a_debug_snp_guest(tmp_path, start_gateway, fake):
    platform = fake_snp.FakeSnp(tmp_path / "snp", policy=0xB0000)
    (tmp_path / "ark.pem").write_bytes(platform.chain.pem("ark"))
    try:
        gateway = start_gateway(
            gateway_config(fake.url), UP_KEY=SECRET, TINYGW_EVENT_LOG=str(tmp_path / "no-log"), **platform.env()
        )
        code, found, output = verify("--artifact", VERIFY, "--url", gateway.url, simulated_ark=tmp_path / "ark.pem")
    finally:
        platform.stop()
    assert code == 1 and found["guest not in debug mode"] == "FAIL", output


@pytest.fixture(scope="module")
def snp_answer(test_chain):
    """A consistent SEV-SNP answer for a fixed nonce, and the module of attest/verify that judges it."""
    nonce, config = bytes(range(32)), "ab" * 32
    data = hashlib.sha512(b"tinygw.attest.v1" + nonce + bytes.fromhex(config)).digest()
    tcb = fake_snp.tcb_version({"bootloader": 4, "tee": 0, "snp": 23, "microcode": 213})
    report = fake_snp.snp_report(test_chain.vcek_key, data, chip_id=bytes(range(64)), reported_tcb=tcb)
    answer = {
        "version": "0.1.0",
        "config_sha256": config,
        "nonce": nonce.hex(),
        "report_data": data.hex(),
        "event_log": [],
        "evidence": {
            "provider": "sev_guest",
            "platform": "sev-snp",
            "outblob": base64.b64encode(report).decode(),
            "report": base64.b64encode(report).decode(),
            "vcek": test_chain.pem("vcek").decode(),
            "ask": test_chain.pem("ask").decode(),
        },
    }
    return nonce, answer, report, verify_module("attest_verify_snp")


@given(st.data())
def test_any_snp_evidence_gets_a_verdict_per_check_never_an_exception(snp_answer, data):
    nonce, genuine, report, verify_module = snp_answer
    evidence = dict(genuine["evidence"])
    at = data.draw(st.integers(0, len(report) - 1))
    choices = {
        "report": st.one_of(
            st.just(base64.b64encode(flipped(report, at, data.draw(st.integers(0, 7)))).decode()),
            st.binary(max_size=1300).map(lambda b: base64.b64encode(b).decode()),
            st.text(max_size=30),
            st.integers(),
        ),
        "vcek": st.one_of(st.text(max_size=60), st.just(evidence["ask"]), st.none(), st.integers()),
        "ask": st.one_of(st.text(max_size=60), st.just(evidence["vcek"]), st.none()),
    }
    for key in data.draw(st.lists(st.sampled_from(sorted(choices)), unique=True)):
        evidence[key] = data.draw(choices[key])
    checks = verify_module.Checks(as_json=True)
    run = SimpleNamespace(allow_no_evidence=False, config_sha256=None, now=None)
    verify_module.check_answer(
        {**genuine, "evidence": evidence},
        None,
        nonce,
        "http://127.0.0.1:1",
        "00" * 48,
        verify_module.policies.Policy(),
        run,
        checks,
    )
    assert checks.results and all(r["result"] in ("PASS", "FAIL", "SKIP") for r in checks.results)
    assert checks.failed or checks.skipped  # a test-only chain: never all PASS
    json.dumps(checks.results)


def test_verify_learns_an_snp_policy_only_from_a_fully_passed_report(tmp_path):
    report = SAMPLE / "dstack" / "report.bin"
    learned = tmp_path / "learned.json"
    code, _, output = verify("--snp-report", report, *DSTACK_CERTIFICATES, "--learn-policy", learned)
    assert code == 4 and not learned.exists(), output  # artifact measured was a SKIP: nothing is written
    pinned = tmp_path / "pinned.json"
    pinned.write_text(json.dumps({"snp": {"measurement": [DSTACK_MEASUREMENT]}}))
    code, _, output = verify(
        "--snp-report", report, *DSTACK_CERTIFICATES, "--policy", pinned, "--learn-policy", learned
    )
    assert code == 0, output
    code, found, output = verify("--snp-report", report, *DSTACK_CERTIFICATES, "--policy", learned, "--json")
    assert code == 0, output
    document = json.loads(output)
    names = [check["name"] for check in document["checks"] if check["result"] == "PASS"]
    assert {"snp.measurement", "snp.host_data", "snp.vmpl", "snp.chip_ids", "snp.min_tcb"} <= set(names)
    garbage = tmp_path / "garbage.bin"
    garbage.write_bytes(os.urandom(1184))
    code, found, output = verify("--snp-report", garbage, *DSTACK_CERTIFICATES)
    assert code == 1 and "Traceback" not in output, output


# ---- revocation: AMD's CRL (--snp-crl) ---------------------------------------------------------


@pytest.fixture
def pinned_test_chain(test_chain, monkeypatch):
    """The test chain's ARK pinned as if it were AMD's Milan one (this test's copy of the pins
    only), so that its chain can PASS: a report it signed, and its certificates."""
    monkeypatch.setitem(snp.ARK_SHA256, "Milan", snp.fingerprint(test_chain.ark))
    tcb = fake_snp.tcb_version({"bootloader": 4, "tee": 0, "snp": 23, "microcode": 213})
    report = fake_snp.snp_report(test_chain.vcek_key, bytes(64), chip_id=bytes(range(64)), reported_tcb=tcb)
    return report, (test_chain.der("vcek"), test_chain.der("ask"), test_chain.der("ark"))


def chain_check(report, certificates, crl=None, **kwargs) -> snp.Check:
    checks = snp.verify_report(report, *certificates, crl=crl, **kwargs)
    return next(check for check in checks if check.name == "certificate chain")


def test_without_a_crl_the_chain_passes_saying_that_revocation_was_not_checked(pinned_test_chain):
    report, certificates = pinned_test_chain
    chain = chain_check(report, certificates)
    assert chain.result == "PASS" and chain.reason.startswith("revocation not checked: no --snp-crl"), chain


def test_a_clean_crl_of_the_pinned_ark_passes_der_or_pem(pinned_test_chain, test_chain):
    report, certificates = pinned_test_chain
    der = test_chain.crl()
    pem = snp.load_crl(der).public_bytes(snp_chain.serialization.Encoding.PEM)
    for crl in (der, pem):
        chain = chain_check(report, certificates, crl)
        assert (chain.result, chain.reason) == ("PASS", None), chain
        assert chain.values["crl_entries"] == 0


@pytest.mark.parametrize("revoked", ["vcek", "ask"])
def test_a_revoked_ask_or_vcek_fails_naming_it(pinned_test_chain, test_chain, revoked):
    report, certificates = pinned_test_chain
    chain = chain_check(report, certificates, test_chain.crl((revoked,)))
    assert chain.result == "FAIL", chain
    cert = getattr(test_chain, revoked)
    assert chain.reason.startswith(f"the {revoked.upper()} ({snp_chain._cn(cert)}, serial 0x{cert.serial_number:x}")
    assert "is revoked by AMD's CRL since" in chain.reason, chain
    # with the simulated root too: a revocation FAILs, it is not hidden behind the SKIP
    chain = chain_check(report, certificates[:2], test_chain.crl((revoked,)), simulated_ark=certificates[2])
    assert chain.result == "FAIL" and "is revoked by AMD's CRL" in chain.reason, chain


def test_a_crl_not_signed_by_the_pinned_ark_fails(pinned_test_chain, test_chain):
    report, certificates = pinned_test_chain
    other = fake_snp.rsa.generate_private_key(public_exponent=65537, key_size=2048)
    for crl in (test_chain.crl(signer=other), test_chain.crl(("vcek",), signer=other)):
        chain = chain_check(report, certificates, crl)
        assert chain.result == "FAIL", chain
        assert "is not signed by the chain's pinned ARK ARK-Milan" in chain.reason, chain


def test_a_crl_out_of_date_or_unreadable_fails(pinned_test_chain, test_chain):
    report, certificates = pinned_test_chain
    in_eight_days = datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=8)
    chain = chain_check(report, certificates, test_chain.crl(days=7), now=in_eight_days)
    assert chain.result == "FAIL" and "fetch AMD's current one" in chain.reason, chain
    chain = chain_check(report, certificates, b"not a CRL")
    assert chain.result == "FAIL" and chain.reason.startswith("cannot read the CRL (--snp-crl)"), chain


def test_verify_says_on_the_chains_pass_line_that_revocation_was_not_checked(tmp_path, test_chain):
    """AMD's real chain (the dstack sample): without --snp-crl, the PASS line says what it left out;
    a CRL that AMD's ARK did not sign (here the test chain's) FAILs the chain."""
    report = SAMPLE / "dstack" / "report.bin"
    code, found, output = verify("--snp-report", report, *DSTACK_CERTIFICATES)
    assert found["certificate chain"] == "PASS", output
    assert "\nPASS certificate chain: revocation not checked: no --snp-crl (AMD's CRL" in output, output
    code, _, output = verify("--snp-report", report, *DSTACK_CERTIFICATES, "--json")
    chain = next(check for check in json.loads(output)["checks"] if check["name"] == "certificate chain")
    assert chain["result"] == "PASS" and chain["reason"].startswith("revocation not checked"), chain  # its caveat
    forged = tmp_path / "crl.der"
    forged.write_bytes(test_chain.crl())
    code, found, output = verify("--snp-report", report, *DSTACK_CERTIFICATES, "--snp-crl", forged)
    assert code == 1 and found["certificate chain"] == "FAIL", output
    assert "is not signed by the chain's pinned ARK ARK-Milan" in output, output
    code, _, output = verify("--snp-report", report, *DSTACK_CERTIFICATES, "--snp-crl", tmp_path / "none.der")
    assert code == 2 and "cannot read --snp-crl" in output, output


def test_verify_fails_a_revoked_vcek_given_with_snp_crl(tmp_path, test_chain):
    """The whole command line, on the simulated chain: --snp-crl revoking the VCEK FAILs (exit 1),
    where the clean CRL leaves the simulated chain's SKIP (exit 4)."""
    tcb = fake_snp.tcb_version({"bootloader": 4, "tee": 0, "snp": 23, "microcode": 213})
    (tmp_path / "report.bin").write_bytes(
        fake_snp.snp_report(test_chain.vcek_key, bytes(64), chip_id=bytes(range(64)), reported_tcb=tcb)
    )
    for name in ("vcek", "ask", "ark"):
        (tmp_path / f"{name}.pem").write_bytes(test_chain.pem(name))
    (tmp_path / "revoked.der").write_bytes(test_chain.crl(("vcek",)))
    (tmp_path / "clean.der").write_bytes(test_chain.crl())
    saved = ("--snp-report", tmp_path / "report.bin", "--vcek", tmp_path / "vcek.pem", "--ask", tmp_path / "ask.pem")
    ark = tmp_path / "ark.pem"
    code, found, output = verify(*saved, "--snp-crl", tmp_path / "revoked.der", simulated_ark=ark)
    assert code == 1 and found["certificate chain"] == "FAIL" and "the VCEK (SEV-VCEK, serial 0x3" in output, output
    code, found, output = verify(*saved, "--snp-crl", tmp_path / "clean.der", simulated_ark=ark)
    assert code == 4 and found["certificate chain"] == "SKIP" and "simulated ARK" in output, output


def test_the_command_line_offers_no_root_but_amds():
    """--simulated-ark is gone: a simulated root reaches verify only through its Python entry point."""
    report, root = SAMPLE / "dstack" / "report.bin", DSTACK_CERTIFICATES[3]
    code, _, output = verify("--snp-report", report, *DSTACK_CERTIFICATES, "--simulated-ark", root)
    assert code == 2 and "unrecognized arguments: --simulated-ark" in output, output
    code, _, output = verify("--snp-report", report, *DSTACK_CERTIFICATES, "--simulated", root)
    assert code == 2 and "unrecognized arguments" in output, output  # nor any prefix of it
    code, _, output = verify("--help")
    assert code == 0 and "simulated" not in output.lower() and "--snp-crl" in output, output
