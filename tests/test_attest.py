"""attest/launch, GET /attestation and attest/verify, against fake sysfs and configfs-tsm trees.

No root and no TDX hardware: `FakeTdx` stands in for both kernel interfaces, and is
honest about what matters, that RTMR3 moves only by what is written into it, never by
the event log. Its register file is a FIFO that a thread reads, extending the register
by each 48-byte write as the kernel's sysfs file does (a regular file would keep only
the last write). Its report directory is a plain one: for each new entry with a 64-byte
`inblob` a second thread writes `generation`, `provider` and, last, an `outblob` laid
out as a TDX quote v4, with the register's RTMR3 at offset 520 and the inblob as
REPORTDATA at offset 568. It signs nothing: the quote signature is the platform
verifier's business, and attest/verify says it skipped it.

The artifact is a small shell script that execs the gateway from source (or, with
TINYGW_BINARY set, the frozen binary itself), so no PyInstaller build is needed here.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import http.server
import importlib.machinery
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

import conftest
from conftest import ROOT, call, wait_until
from tinygw.worker.gateway import Gateway

sys.path.insert(0, str(ROOT / "attest"))
from fake_snp import verify_with_simulated_ark  # noqa: E402 (attest/ is not a package)
from fake_tdx import FakeTdx  # noqa: E402

from tinygw import __version__
from tinygw.api.attestation import attestation_page
from tinygw.config import environment
from tinygw.fake.upstream import FakeUpstream
from tinygw.trust import attestation

LAUNCH = ROOT / "attest" / "launch"
VERIFY = ROOT / "attest" / "verify"
# attest/verify --platform-verifier: the simulated platform's SIMULATED signature check
SIMULATED_SIGNATURE = f"{sys.executable} {ROOT / 'attest' / 'fake_tdx.py'}"
SECRET = "sk-attest-never-shown"


# ---- artifacts, releases, processes -----------------------------------------------------


def make_artifact(directory: Path) -> Path:
    """The gateway as one executable file: the frozen build when there is one."""
    if os.environ.get("TINYGW_BINARY"):
        return Path(os.environ["TINYGW_BINARY"]).resolve()
    return script_artifact(directory)


def script_artifact(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    artifact = directory / "tinygw"
    artifact.write_text(f'#!/bin/sh\n# a stand-in for build/dist/tinygw\nexec "{sys.executable}" -m tinygw "$@"\n')
    artifact.chmod(0o755)
    return artifact


def one_byte_changed(artifact: Path, directory: Path) -> Path:
    copy = directory / "tinygw-modified"
    shutil.copyfile(artifact, copy)
    data = bytearray(copy.read_bytes())
    at = data.find(b"stand-in")  # a letter of the script's comment, so that it still runs
    data[at if at >= 0 else -1] ^= 0x20  # or the frozen binary's last byte
    copy.write_bytes(bytes(data))
    copy.chmod(0o755)
    return copy


def sha384(path: Path) -> str:
    return hashlib.sha384(path.read_bytes()).hexdigest()


def write_release(artifact: Path, path: Path) -> dict:
    """release.json as build/release.py writes it, for this test's artifact."""
    data = artifact.read_bytes()
    digest = hashlib.sha384(data).hexdigest()
    release = {
        "version": __version__,
        "source_commit": "0" * 40,
        "source_date_epoch": 0,
        "python_version": platform.python_version(),
        "pyinstaller_version": "none (a test's stand-in artifact)",
        "lock_sha256": "0" * 64,
        "artifact": {"name": "tinygw", "size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "sha384": digest},
        "measurement": {
            "register": "rtmr3",
            "event": {"type": "tinygw.artifact", "digest_sha384": digest},
            "expected_rtmr3": hashlib.sha384(bytes(48) + bytes.fromhex(digest)).hexdigest(),
        },
    }
    path.write_text(json.dumps(release, indent=2))
    return release


def gateway_config(upstream_url: str) -> dict:
    return {
        "providers": {
            "up": {"base_url": f"{upstream_url}/v1", "api": "openai", "api_key_env": "UP_KEY", "listing": False}
        },
        "models": {"m": {"targets": ["up:m"]}},
    }


def launched_gateway(
    artifact: Path, upstream_url: str, env: dict[str, str], log_path: Path, **config: object
) -> conftest.Gateway:
    """conftest's real gateway process, started as `attest/launch ARTIFACT serve`; `config`:
    more fields of its configuration."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(conftest, "gateway_command", lambda: [str(LAUNCH), str(artifact)])
        return conftest.Gateway({**gateway_config(upstream_url), **config}, {"UP_KEY": SECRET, **env}, log_path)


@contextlib.contextmanager
def two_workers_on_fake_tdx(root: Path, env: dict[str, str], **config: object):
    """(gateway, its release.json's content, the fake provider): a gateway of 2 workers launched
    by attest/launch on the fake TDX platform under `root`, with `env` and `config` added, and
    every one of them stopped at the end."""
    tdx = FakeTdx(root / "tdx")
    upstream = FakeUpstream().start_in_thread()
    artifact = make_artifact(root / "dist")
    release = write_release(artifact, root / "release.json")
    gateway = None
    try:
        gateway = launched_gateway(
            artifact,
            upstream.url,
            {**tdx.env(), "TINYGW_EVENT_LOG": str(root / "run" / "event-log.jsonl"), "TINYGW_WORKERS": "2", **env},
            root / "gateway.log",
            **config,
        )
        wait_until(lambda: tdx.rtmr3.hex() == release["measurement"]["expected_rtmr3"], what="the measurement")
        wait_until(lambda: gateway.logs().count('"msg":"worker started"') == 2, seconds=20, what="both workers")
        yield gateway, release, upstream
    finally:
        if gateway is not None:
            gateway.stop()
        upstream.stop_thread()
        tdx.stop()


def launch(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [str(LAUNCH), *args],
        env={"PATH": os.environ["PATH"], **env},
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def verify(*args: str | Path, simulated_ark: Path | None = None) -> tuple[int, dict[str, str], str]:
    """attest/verify's exit status, {check: PASS | FAIL | SKIP}, and its output. `simulated_ark`: a
    file holding the simulated SEV-SNP root, given to verify's entry point (its command line has no
    option for it) by attest/fake_snp.py's verify_with_simulated_ark."""
    # with the test's interpreter, which has the verifier's packages (requirements/verify.lock)
    command = [sys.executable, str(VERIFY)] if simulated_ark is None else verify_with_simulated_ark(simulated_ark)
    done = subprocess.run(
        [*command, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": os.environ["PATH"]},
    )
    verdicts = {}
    for line in done.stdout.splitlines():
        verdict, _, rest = line.partition(" ")
        if verdict in ("PASS", "FAIL", "SKIP"):
            verdicts[rest.partition(":")[0]] = verdict
    return done.returncode, verdicts, done.stdout + done.stderr


def verify_module(name: str = "attest_verify"):
    """attest/verify (a script, no .py) loaded as a module, to call its functions directly."""
    loader = importlib.machinery.SourceFileLoader(name, str(VERIFY))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader))
    loader.exec_module(module)
    return module


def run_verify(*args: str) -> subprocess.CompletedProcess:
    """attest/verify as a program that reads it sees it: its stdout and stderr apart."""
    return subprocess.run([sys.executable, str(VERIFY), *args], capture_output=True, text=True, timeout=60, check=False)


def nonce_hex() -> str:
    return os.urandom(32).hex()


def events_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ---- attest/launch ------------------------------------------------------------------------


@pytest.fixture
def tiny_artifact(tmp_path) -> Path:
    """An artifact that says it ran, with its pid and arguments, in a path with a space."""
    artifact = tmp_path / "my tools" / "gw"
    artifact.parent.mkdir()
    artifact.write_text('#!/bin/sh\necho "ran $$ $*"\n')
    artifact.chmod(0o755)
    return artifact


def test_launch_runs_the_copy_it_measured_not_the_path_it_was_given(tmp_path):
    tdx = FakeTdx(tmp_path / "tdx")
    try:
        artifact = tmp_path / "disk" / "gw"
        artifact.parent.mkdir()
        artifact.write_text('#!/bin/sh\necho "$0 $TMPDIR"\n')
        artifact.chmod(0o755)
        env = {**tdx.env(), "TINYGW_EVENT_LOG": str(tmp_path / "events")}
        out, _ = launch([str(artifact)], env, tmp_path).communicate(timeout=10)
        ran, tmpdir = out.split()
        assert Path(ran).parent == Path(tmpdir) and Path(ran).parent.parent == tdx.launch_dir
        assert sha384(Path(ran)) == sha384(artifact) == events_of(tmp_path / "events")[0]["digest_sha384"]
    finally:
        tdx.stop()


def test_launch_refuses_to_run_unmeasured_unless_told(tmp_path, tiny_artifact):
    env = {"TINYGW_RTMR_PATH": str(tmp_path / "no-register"), "TINYGW_EVENT_LOG": str(tmp_path / "log" / "events")}
    refused = launch([str(tiny_artifact), "serve"], env, tmp_path)
    out, err = refused.communicate(timeout=10)
    assert refused.returncode == 3 and out == ""
    assert "refusing to run unmeasured" in err and "TINYGW_ALLOW_UNMEASURED=1" in err

    allowed = launch([str(tiny_artifact), "serve"], {**env, "TINYGW_ALLOW_UNMEASURED": "1"}, tmp_path)
    out, err = allowed.communicate(timeout=10)
    assert allowed.returncode == 0 and out == f"ran {allowed.pid} serve\n"
    assert "unmeasured" in err
    assert not (tmp_path / "log").exists()  # nothing was measured, so there is no event


def test_launch_extends_rtmr3_logs_the_event_and_execs(tmp_path, tiny_artifact):
    tdx = FakeTdx(tmp_path / "tdx")
    try:
        log = tmp_path / "run" / "tinygw" / "event-log.jsonl"
        env = {**tdx.env(), "TINYGW_EVENT_LOG": str(log)}
        digest = sha384(tiny_artifact)
        # A relative path: the launcher hashes, logs and execs the same absolute one.
        process = launch(["my tools/gw", "serve", "--x"], env, tmp_path)
        out, err = process.communicate(timeout=10)
        assert process.returncode == 0
        assert out == f"ran {process.pid} serve --x\n"  # the same process: exec, not a child
        event = {
            "register": "rtmr3",
            "type": "tinygw.artifact",
            "digest_sha384": digest,
            "artifact": str(tiny_artifact),
        }
        assert events_of(log) == [event]
        assert "extended rtmr3" in err and digest in err

        expected = write_release(tiny_artifact, tmp_path / "release.json")["measurement"]["expected_rtmr3"]
        wait_until(lambda: tdx.rtmr3.hex() == expected, what="RTMR3 to hold the release's expected value")
        assert tdx.writes == [bytes.fromhex(digest)]  # 48 raw bytes

        again = launch([str(tiny_artifact)], env, tmp_path)
        assert again.wait(10) == 0
        assert events_of(log) == [event, event]
        twice = hashlib.sha384(bytes.fromhex(expected) + bytes.fromhex(digest)).hexdigest()
        wait_until(lambda: tdx.rtmr3.hex() == twice, what="RTMR3 to be extended a second time")
    finally:
        tdx.stop()


# ---- GET /attestation ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """A gateway started by attest/launch on the fake TDX platform, and its release.json."""
    root = tmp_path_factory.mktemp("measured")
    tdx = FakeTdx(root / "tdx")
    upstream = FakeUpstream().start_in_thread()
    artifact = make_artifact(root / "dist")
    release = write_release(artifact, root / "release.json")
    event_log = root / "run" / "event-log.jsonl"
    gateway = None
    try:
        gateway = launched_gateway(
            artifact, upstream.url, {**tdx.env(), "TINYGW_EVENT_LOG": str(event_log)}, root / "gateway.log"
        )
        wait_until(lambda: tdx.rtmr3.hex() == release["measurement"]["expected_rtmr3"], what="the launch's measurement")
        yield SimpleNamespace(
            root=root,
            tdx=tdx,
            artifact=artifact,
            release=release,
            release_path=root / "release.json",
            event_log=event_log,
            gateway=gateway,
            config_sha256=environment.from_environ(gateway.env).config_sha256(),
        )
    finally:
        if gateway is not None:
            gateway.stop()
        upstream.stop_thread()
        tdx.stop()


def test_attestation_answers_with_the_quote_and_the_event_log(measured):
    nonce = nonce_hex()
    status, headers, body = call("GET", f"{measured.gateway.url}/attestation?nonce={nonce.upper()}")
    assert status == 200, body
    assert headers["cache-control"] == "no-store"
    answer = json.loads(body)
    frozen = bool(os.environ.get("TINYGW_BINARY"))
    assert answer["version"] == __version__
    assert answer["artifact_sha384"] == (measured.release["artifact"]["sha384"] if frozen else None)
    assert answer["artifact_sha256"] == (measured.release["artifact"]["sha256"] if frozen else None)
    assert answer["config_sha256"] == measured.config_sha256
    assert answer["nonce"] == nonce
    expected = hashlib.sha512(b"tinygw.attest.v1" + bytes.fromhex(nonce) + bytes.fromhex(measured.config_sha256))
    assert answer["report_data"] == expected.hexdigest()
    assert answer["event_log"] == events_of(measured.event_log) and len(answer["event_log"]) == 1
    assert answer["evidence"]["provider"] == "tdx_guest"
    quote = base64.b64decode(answer["evidence"]["outblob"])
    assert quote[568:632] == expected.digest() and quote[520:568] == measured.tdx.rtmr3
    assert list(measured.tdx.report_dir.iterdir()) == []  # the entry was removed
    assert SECRET.encode() not in body

    # The measured gateway is the gateway: it proxies.
    status, _, body = call(
        "POST",
        f"{measured.gateway.url}/v1/chat/completions",
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert status == 200, body


@pytest.mark.parametrize(
    "query",
    [
        "",
        "nonce=",
        f"nonce={'ab' * 31}",  # 31 bytes
        f"nonce={'ab' * 65}",  # 65 bytes
        f"nonce={'ab' * 32}a",  # odd length
        f"nonce={'zz' * 32}",
        f"nonce={'ab' * 16}%20{'ab' * 16}",  # bytes.fromhex would allow the space
        f"nonce={'ab' * 32}&nonce={'cd' * 32}",
    ],
)
def test_attestation_rejects_a_bad_nonce(measured, query):
    status, _, body = call("GET", f"{measured.gateway.url}/attestation?{query}")
    assert status == 400
    error = json.loads(body)["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_nonce")
    assert "nonce" in error["message"]


def test_attestation_without_hardware_says_so(tmp_path, start_gateway, fake):
    """Not launched, no TSM interface: evidence "none" and an empty log, and verify fails
    it (or, with --allow-no-evidence, skips the quote checks but still finds no measurement)."""
    gateway = start_gateway(
        gateway_config(fake.url),
        UP_KEY=SECRET,
        TINYGW_TSM_REPORT_DIR=str(tmp_path / "no-tsm"),
        TINYGW_EVENT_LOG=str(tmp_path / "no-log"),
    )
    for nonce in ("ab" * 32, "cd" * 64):
        status, _, body = call("GET", f"{gateway.url}/attestation?nonce={nonce}")
        assert status == 200, body
        answer = json.loads(body)
        assert answer["nonce"] == nonce and answer["evidence"] == {"provider": "none"} and answer["event_log"] == []
        assert SECRET.encode() not in body

    artifact = make_artifact(tmp_path / "dist")
    code, verdicts, output = verify("--artifact", str(artifact), "--url", gateway.url)
    assert code == 1, output
    assert verdicts == {
        "nonce echoed": "PASS",
        "report_data": "FAIL",
        "event log replays to RTMR3": "FAIL",
        "artifact measured": "FAIL",
        "quote signature": "FAIL",
    }, output
    assert "no hardware evidence" in output
    code, verdicts, output = verify("--artifact", str(artifact), "--url", gateway.url, "--allow-no-evidence")
    assert code == 1, output
    assert verdicts == {
        "nonce echoed": "PASS",
        "report_data": "SKIP",
        "event log replays to RTMR3": "SKIP",
        "artifact measured": "FAIL",
        "quote signature": "SKIP",
    }, output


def in_process_attestation(report_dir: Path, nonce: bytes) -> tuple[int, dict]:
    settings = environment.from_environ(
        {
            "TINYGW_CONFIG": "{}",
            "TINYGW_TSM_REPORT_DIR": str(report_dir),
            "TINYGW_EVENT_LOG": str(report_dir / "no-log"),
        }
    )
    sent = []

    async def send(message):
        sent.append(message)

    scope = {"query_string": b"nonce=" + nonce.hex().encode()}
    asyncio.run(attestation_page(Gateway(settings), scope, send))
    return sent[0]["status"], json.loads(sent[1]["body"])


def test_a_changed_generation_is_a_race(tmp_path, monkeypatch):
    tdx = FakeTdx(tmp_path / "tdx")
    generations = []
    read = attestation._read

    def read_with_a_rival(path, limit, what):
        content = read(path, limit, what)
        if what == "generation":
            generations.append(content)
            if len(generations) == 2:  # someone else wrote the inblob in between
                return b"2\n"
        return content

    monkeypatch.setattr(attestation, "_read", read_with_a_rival)
    try:
        status, answer = in_process_attestation(tdx.report_dir, os.urandom(32))
    finally:
        tdx.stop()
    assert status == 503
    assert answer["error"]["message"] == "attestation raced; retry"
    assert answer["error"]["code"] == "attestation_raced"
    assert list(tdx.report_dir.iterdir()) == []


def test_a_silent_tsm_provider_is_a_bounded_503(tmp_path, monkeypatch):
    monkeypatch.setattr(attestation, "EVIDENCE_SECONDS", 0.2)
    report_dir = tmp_path / "report"
    report_dir.mkdir()  # a report interface that never answers
    status, answer = in_process_attestation(report_dir, os.urandom(64))
    assert status == 503
    assert answer["error"]["code"] == "evidence_unavailable"
    assert "gave no generation within 0.2 s" in answer["error"]["message"]
    assert list(report_dir.iterdir()) == []


# ---- attest/verify ---------------------------------------------------------------------------

ALL_CHECKS = [
    "nonce echoed",
    "report_data",
    "event log replays to RTMR3",
    "artifact measured",
    "config",
    "TD not in debug mode",
    "quote signature",
]
UNVERIFIED = 4  # attest/verify's exit status when nothing FAILed but a check was SKIPped


def test_verify_passes_the_genuine_gateway(measured, tmp_path):
    code, verdicts, output = verify(
        "--release",
        str(measured.release_path),
        "--url",
        measured.gateway.url,
        "--config-sha256",
        measured.config_sha256,
    )
    assert code == UNVERIFIED, output  # consistent, but nothing checked the quote's signature
    assert list(verdicts) == ALL_CHECKS, output
    assert set(verdicts.values()) == {"PASS", "SKIP"} and verdicts["quote signature"] == "SKIP", output
    assert "signature chain is not checked" in output
    assert output.splitlines()[-1].startswith("verdict: UNVERIFIED: ") and output.endswith("; exit 4\n"), output

    code, verdicts, output = verify(
        "--artifact",
        str(measured.artifact),
        "--url",
        measured.gateway.url,
        "--accept-unverified",
        "--expect-mrtd",
        "00" * 48,
    )
    assert code == 0 and "config" not in verdicts and verdicts["MRTD"] == "PASS", output
    assert output.splitlines()[-1].startswith("verdict: UNVERIFIED: "), output
    assert "accepted with --accept-unverified" in output.splitlines()[-1] and output.endswith("; exit 0\n"), output

    # A platform verifier gets the quote's path as its last argument; its exit status decides.
    checker = tmp_path / "check-quote"
    checker.write_text(f"#!{sys.executable}\nimport sys\nsys.exit(open(sys.argv[-1], 'rb').read(2) != b'\\x04\\x00')\n")
    checker.chmod(0o755)
    code, verdicts, output = verify(
        "--release",
        str(measured.release_path),
        "--url",
        measured.gateway.url,
        "--platform-verifier",
        f"{checker} --strict",
    )
    assert code == 0 and verdicts["quote signature"] == "PASS", output
    code, verdicts, output = verify(
        "--release", str(measured.release_path), "--url", measured.gateway.url, "--platform-verifier", "false"
    )
    assert code == 1 and verdicts["quote signature"] == "FAIL", output


def test_verify_fails_a_one_byte_change_in_the_artifact(measured, tmp_path):
    modified = one_byte_changed(measured.artifact, tmp_path)
    code, verdicts, output = verify("--artifact", str(modified), "--url", measured.gateway.url)
    assert code == 1, output
    assert verdicts["artifact measured"] == "FAIL", output
    assert [name for name, verdict in verdicts.items() if verdict == "FAIL"] == ["artifact measured"], output


@contextlib.contextmanager
def always_answering(answer):
    """A server that answers every GET with `answer`: bytes (a gateway that replays an
    old answer), or a function of the request's path that makes the bytes, or
    (status, headers, bytes)."""

    class Replay(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = answer(self.path) if callable(answer) else answer
            status, headers, body = body if isinstance(body, tuple) else (200, {}, body)
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Replay)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_verify_fails_a_replayed_answer(measured):
    status, _, captured = call("GET", f"{measured.gateway.url}/attestation?nonce={nonce_hex()}")
    assert status == 200
    with always_answering(captured) as url:
        code, verdicts, output = verify("--release", str(measured.release_path), "--url", url)
    assert code == 1, output
    assert verdicts["nonce echoed"] == "FAIL" and verdicts["report_data"] == "FAIL", output
    # Everything else in the old answer is genuine; only freshness gives it away.
    assert verdicts["event log replays to RTMR3"] == "PASS" and verdicts["artifact measured"] == "PASS", output


def test_verify_reads_freshness_from_the_quote_not_only_the_json(measured):
    """An old quote under a JSON answer rewritten for each new nonce: only the quote's
    REPORTDATA can tell, and it must."""
    status, _, captured = call("GET", f"{measured.gateway.url}/attestation?nonce={nonce_hex()}")
    old = json.loads(captured)

    def rewritten(path: str) -> bytes:
        nonce = bytes.fromhex(path.split("nonce=")[1])
        data = hashlib.sha512(b"tinygw.attest.v1" + nonce + bytes.fromhex(old["config_sha256"])).hexdigest()
        return json.dumps({**old, "nonce": nonce.hex(), "report_data": data}).encode()

    with always_answering(rewritten) as url:
        code, verdicts, output = verify("--release", str(measured.release_path), "--url", url)
    assert code == 1 and verdicts["nonce echoed"] == "PASS" and verdicts["report_data"] == "FAIL", output
    assert "quote's REPORTDATA" in output


def test_verify_fails_a_debug_td_and_another_image(measured):
    status, _, captured = call("GET", f"{measured.gateway.url}/attestation?nonce={nonce_hex()}")
    answer = json.loads(captured)
    quote = bytearray(base64.b64decode(answer["evidence"]["outblob"]))
    quote[48 + 120] |= 1  # TDATTRIBUTES.DEBUG
    answer["evidence"]["outblob"] = base64.b64encode(bytes(quote)).decode()
    with always_answering(json.dumps(answer).encode()) as url:
        code, verdicts, output = verify("--release", str(measured.release_path), "--url", url)
    assert code == 1 and verdicts["TD not in debug mode"] == "FAIL", output
    code, verdicts, output = verify(
        "--release", str(measured.release_path), "--url", measured.gateway.url, "--expect-mrtd", "11" * 48
    )
    assert code == 1 and verdicts["MRTD"] == "FAIL", output


def test_verify_counts_every_rtmr3_event_and_only_those(measured):
    """The genuine digest filed under another register proves nothing, and a second
    binary measured into RTMR3 under another label still ran there."""
    status, _, body = call("GET", f"{measured.gateway.url}/attestation?nonce={nonce_hex()}")
    answer = json.loads(body)
    genuine = measured.release["artifact"]["sha384"]
    answer["event_log"] = [{"register": "rtmr2", "type": "tinygw.artifact", "digest_sha384": genuine}]
    with always_answering(json.dumps(answer).encode()) as url:
        code, verdicts, output = verify("--release", str(measured.release_path), "--url", url)
    assert code == 1 and verdicts["artifact measured"] == "FAIL" and "no rtmr3 event" in output, output
    answer["event_log"] = [
        {"register": "rtmr3", "type": "tinygw.artifact", "digest_sha384": genuine},
        {"register": "rtmr3", "type": "config", "digest_sha384": "0" * 96},
    ]
    with always_answering(json.dumps(answer).encode()) as url:
        code, verdicts, output = verify("--release", str(measured.release_path), "--url", url)
    assert code == 1 and verdicts["artifact measured"] == "FAIL" and "also measures 'config'" in output, output


def test_verify_fails_a_changed_configuration(measured):
    other = gateway_config("http://127.0.0.1:1")
    other["routing"] = {"max_attempts": 3}
    other_sha256 = environment.from_environ(
        {**measured.gateway.env, "TINYGW_CONFIG": json.dumps(other)}
    ).config_sha256()
    assert other_sha256 != measured.config_sha256
    code, verdicts, output = verify(
        "--release", str(measured.release_path), "--url", measured.gateway.url, "--config-sha256", other_sha256
    )
    assert code == 1, output
    assert [name for name, verdict in verdicts.items() if verdict == "FAIL"] == ["config"], output


def test_verify_fails_an_event_log_that_does_not_replay(tmp_path, fake):
    """A modified artifact was launched (so RTMR3 holds its digest); then its event log
    is rewritten to claim the genuine one. The log now names the right artifact, but
    does not replay to the register."""
    tdx = FakeTdx(tmp_path / "tdx")
    genuine = script_artifact(tmp_path / "dist")  # the copy must run
    write_release(genuine, tmp_path / "release.json")
    modified = one_byte_changed(genuine, tmp_path)
    log = tmp_path / "event-log.jsonl"
    gateway = launched_gateway(modified, fake.url, {**tdx.env(), "TINYGW_EVENT_LOG": str(log)}, tmp_path / "gw.log")
    try:
        wait_until(lambda: len(tdx.writes) == 1, what="the launch's measurement")
        assert tdx.writes == [bytes.fromhex(sha384(modified))]
        log.write_text(log.read_text().replace(sha384(modified), sha384(genuine)))

        code, verdicts, output = verify("--release", str(tmp_path / "release.json"), "--url", gateway.url)
    finally:
        gateway.stop()
        tdx.stop()
    assert code == 1, output
    assert verdicts["artifact measured"] == "PASS", output
    assert [name for name, verdict in verdicts.items() if verdict == "FAIL"] == ["event log replays to RTMR3"], output


# ---- the quote's signature: Intel DCAP with dcap-qvl -------------------------------------------

# A real Intel-signed TDX quote and its collateral (dcap-qvl's sample files, MIT: see the
# LICENSE beside them). Collateral expires: it verifies at a fixed time, never the wall clock.
DCAP_SAMPLE = Path(__file__).parent / "data" / "dcap-sample"
SAMPLE_TIME = "1751328000"  # 2025-07-01T00:00:00Z
COLLATERAL = str(DCAP_SAMPLE / "tdx_quote_collateral.json")


def verify_sample(*flags: str, now: str = SAMPLE_TIME) -> tuple[int, dict[str, str], str]:
    """attest/verify on Intel's signed sample quote with its collateral, at `now`."""
    return verify("--quote", str(DCAP_SAMPLE / "tdx_quote"), "--collateral", COLLATERAL, "--now", now, *flags)


def verify_signed(release: Path, url: str, *flags: str) -> tuple[int, dict[str, str], str]:
    """attest/verify of the gateway at `url` against `release`, the simulated quote's
    signature standing in for a genuine one (attest/fake_tdx.py as the platform verifier)."""
    return verify("--release", str(release), "--url", url, "--platform-verifier", SIMULATED_SIGNATURE, *flags)


def test_a_real_intel_quote_verifies_at_its_time():
    code, verdicts, output = verify_sample()
    assert code == 0 and verdicts == {"quote signature": "PASS"}, output
    assert "TCB status UpToDate, advisories: none" in output


def test_a_real_intel_quote_with_one_bit_flipped_fails(tmp_path):
    quote = bytearray((DCAP_SAMPLE / "tdx_quote").read_bytes())
    quote[568] ^= 1  # a bit of REPORTDATA, inside what the quote's signature covers
    flipped = tmp_path / "flipped"
    flipped.write_bytes(bytes(quote))
    code, verdicts, output = verify(
        "--quote", str(flipped), "--collateral", str(DCAP_SAMPLE / "tdx_quote_collateral.json"), "--now", SAMPLE_TIME
    )
    assert code == 1 and verdicts == {"quote signature": "FAIL"}, output
    assert "signature is invalid" in output


def test_expired_collateral_fails_today():
    code, verdicts, output = verify(
        "--quote", str(DCAP_SAMPLE / "tdx_quote"), "--collateral", str(DCAP_SAMPLE / "tdx_quote_collateral.json")
    )
    assert code == 1 and verdicts == {"quote signature": "FAIL"}, output


def test_a_quote_not_signed_by_intel_fails_the_signature_check(measured):
    code, verdicts, output = verify(
        "--release",
        str(measured.release_path),
        "--url",
        measured.gateway.url,
        "--collateral",
        str(DCAP_SAMPLE / "tdx_quote_collateral.json"),
        "--now",
        SAMPLE_TIME,
        "--accept-unverified",
    )
    assert code == 1 and verdicts["quote signature"] == "FAIL", output
    assert verdicts["report_data"] == "PASS" and verdicts["event log replays to RTMR3"] == "PASS", output
