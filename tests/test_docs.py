"""The docs cannot drift from the code: docs/configuration.md names every JSON field
(with its default) and every variable that config/ reads, and nothing else;
docs/api.md names every route and error code; README and docs link only inside the
repository; the configurations and commands docs/clients.md gives start as written."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request

import msgspec
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from conftest import ROOT, START_SECONDS, call, check_in_process, free_port, provider, wait_until
from tinygw.api import app
from tinygw.config import environment
from tinygw.config.documents import ClientDoc, ConfigDoc, ModelDoc, ProviderDoc, RoutingDoc

CONFIGURATION = (ROOT / "docs" / "configuration.md").read_text()
API = (ROOT / "docs" / "api.md").read_text()
CLIENTS = (ROOT / "docs" / "clients.md").read_text()
CONFIDENTIAL = (ROOT / "docs" / "confidential.md").read_text()
VARIABLE = re.compile(r"\b(?:TINYGW|PROVIDER)_[A-Z0-9_]+\b")


def _section_rows(heading: str) -> dict[str, str]:
    """`name` -> default cell of the first table under the heading that starts with `heading`."""
    section = CONFIGURATION[CONFIGURATION.index(heading) :]
    rows = {}
    for line in section.splitlines()[1:]:
        if line.startswith("#"):
            break
        match = re.match(r"\| `([a-z_]+)` \| ([^|]+) \|", line)
        if match:
            rows[match.group(1)] = match.group(2).strip()
    return rows


def _documented_default(cell: str):
    if cell.startswith("required"):
        return msgspec.NODEFAULT
    return json.loads(cell.strip("`"))


@pytest.mark.parametrize(
    "struct,heading",
    [
        (ConfigDoc, "Top level"),
        (ProviderDoc, "### Provider fields"),
        (ModelDoc, "### Model fields"),
        (RoutingDoc, "### Routing fields"),
        (ClientDoc, "### Client fields"),
    ],
)
def test_every_json_field_is_documented_with_its_default(struct, heading):
    rows = _section_rows(heading)
    fields = {f.name: f for f in msgspec.structs.fields(struct)}
    assert set(rows) == set(fields)
    for name, field in fields.items():
        default = field.default if field.default_factory is msgspec.NODEFAULT else field.default_factory()
        documented = _documented_default(rows[name])
        if isinstance(default, msgspec.Struct):  # routing: documented as the JSON it decodes from
            documented = msgspec.convert(documented, type(default))
        assert documented == default, name


def _variables_read_by_the_code() -> set[str]:
    code = "".join(path.read_text() for path in (ROOT / "tinygw" / "config").glob("*.py"))
    return set(re.findall(r'"((?:TINYGW|PROVIDER)_[A-Z0-9_]+)"', code))


def test_the_strict_environment_knows_every_variable_the_code_reads_and_the_docs_name():
    from tinygw.config import strict

    known = strict.OPERATOR_VARIABLES | strict.SET_BY_SERVE
    assert _variables_read_by_the_code() <= known
    assert known <= set(VARIABLE.findall(CONFIGURATION))


def test_every_variable_the_code_reads_is_documented():
    documented = set(VARIABLE.findall(CONFIGURATION))
    missing = _variables_read_by_the_code() - documented
    assert not missing


def test_every_documented_variable_exists():
    code = "".join(p.read_text() for p in (ROOT / "tinygw").rglob("*.py"))
    code += (ROOT / "attest" / "launch").read_text()
    invented = {name for name in VARIABLE.findall(CONFIGURATION + API) if name not in code}
    assert not invented


def test_documented_variable_defaults_are_the_codes():
    settings = environment.from_environ({"TINYGW_CONFIG": "{}"})
    effective = {
        "TINYGW_HOST": settings.host,
        "TINYGW_PORT": settings.port,
        "TINYGW_WORKERS": "auto" if settings.workers_from != "TINYGW_WORKERS" else settings.workers,
        "TINYGW_LOG_LEVEL": settings.log_level,
        "TINYGW_DRAIN_SECONDS": settings.drain_seconds,
        "TINYGW_CLIENT_TIMEOUT_SECONDS": settings.client_timeout_seconds,
        "TINYGW_MAX_BODY_BYTES": settings.max_body_bytes,
        "PROVIDER_BREAKER_FAILURES": settings.breaker.failures,
        "PROVIDER_BREAKER_OPEN_SECONDS": settings.breaker.open_seconds,
        "PROVIDER_BREAKER_MAX_OPEN_SECONDS": settings.breaker.max_open_seconds,
        "PROVIDER_BREAKER_HALF_OPEN_PROBES": settings.breaker.half_open_probes,
        "PROVIDER_RETRY_FAST_FAILURES": settings.retry_fast_failures,
        "PROVIDER_HEALTH_CHECK_SECONDS": settings.health_check_seconds,
        "PROVIDER_LISTING_SECONDS": settings.listing_seconds,
        "TINYGW_TLS": settings.tls_mode,
        "TINYGW_TLS_NAMES": ",".join(settings.tls_names),
        "TINYGW_RTMR_PATH": settings.rtmr_path,
        "TINYGW_EVENT_LOG": settings.event_log,
        "TINYGW_TSM_REPORT_DIR": settings.tsm_report_dir,
    }
    for name, value in effective.items():
        match = re.search(rf"^\| `{name}` \| `([^`]*)` \|", CONFIGURATION, re.MULTILINE)
        assert match, name
        documented = match.group(1)
        if isinstance(value, bool):
            assert documented == str(value).lower(), name
        elif isinstance(value, (int, float)):
            assert float(documented) == value, name
        else:
            assert documented == value, name


def test_api_doc_names_every_route_and_error_code():
    for route in app.ROUTE_LIST.split(", "):
        assert f"`{route}`" in API, route
    code = "".join(
        (ROOT / "tinygw" / name).read_text() for name in ("api/app.py", "worker/proxy.py", "api/attestation.py")
    )
    codes = set(re.findall(r'"(?:invalid_request_error|authentication_error|internal_error)",\s*"([a-z_]+)"', code))
    codes |= {"circuit_open", "connect_error", "timeout", "protocol_error", "attestation_raced", "evidence_unavailable"}
    for name in sorted(codes):
        assert f"`{name}`" in API, name
    for header in (
        "x-request-id",
        "x-upstream-request-id",
        "x-tinygw-provider",
        "x-tinygw-provider-model",
        "x-tinygw-attempts",
        "x-tinygw-circuit",
    ):
        assert f"`{header}`" in API, header


@pytest.mark.parametrize(
    "path",
    [
        "README.md",
        "docs/configuration.md",
        "docs/api.md",
        "docs/deploy.md",
        "docs/design.md",
        "docs/performance.md",
        "docs/testing.md",
        "docs/clients.md",
        "docs/confidential.md",
        "docs/verify.md",
    ],
)
def test_links_stay_inside_the_repository(path):
    text = (ROOT / path).read_text()
    for target in re.findall(r"\]\(([^)#\s]+)[^)]*\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        resolved = (ROOT / path).parent / target
        assert ROOT in resolved.resolve().parents or resolved.resolve() == ROOT, target
        assert resolved.exists(), target


def _blocks(text: str, heading: str, language: str) -> list[str]:
    """The fenced `language` blocks of the section under `heading`, to the next heading."""
    section = text[text.index(heading) + len(heading) :]
    section = re.split(r"\n#{2,3} ", section)[0]
    return re.findall(rf"```{language}\n(.*?)```", section, re.DOTALL)


def _service_account(token_uri: str) -> str:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    return json.dumps(
        {"client_email": "gw@example.iam.gserviceaccount.com", "private_key": pem.decode(), "token_uri": token_uri}
    )


def test_the_cloud_configuration_of_clients_md_passes_check():
    (config,) = _blocks(CLIENTS, "## Use it with Claude Code on Bedrock or Vertex", "json")
    done = check_in_process(
        {
            "TINYGW_API_KEYS": "my-gateway-key",
            "TINYGW_CONFIG": config,
            "AWS_ACCESS_KEY_ID": "an-id",
            "AWS_SECRET_ACCESS_KEY": "a-secret",
            "GOOGLE_SERVICE_ACCOUNT": _service_account("https://oauth2.googleapis.com/token"),
        }
    )
    assert done.returncode == 0, done.stderr


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as answer:
            return answer.status == 200
    except OSError:
        return False


def test_the_cloud_modes_of_clients_md_run_on_tinygw_fake(tmp_path):
    """The section's shell blocks as a newcomer runs them (tinygw and python on PATH, as
    after `. .venv/bin/activate`), on free ports instead of 9000 and 8080."""
    start, by_hand = _blocks(CLIENTS, "### The cloud modes on `tinygw fake`", "sh")
    fake, port = free_port(), free_port()
    environ = {
        "PATH": f"{os.path.dirname(sys.executable)}:/usr/bin:/bin",
        "PYTHONPATH": str(ROOT),
        "TINYGW_PORT": str(port),
        "TINYGW_WORKERS": "1",
    }
    shell = subprocess.Popen(
        ["bash", "-c", start.replace("9000", str(fake)) + "wait\n"],
        cwd=tmp_path,
        env=environ,
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "stderr", "wb"),
        start_new_session=True,  # its group: the shell, the fake and the gateway
    )
    try:
        wait_until(lambda: _healthy(f"http://127.0.0.1:{port}/healthz"), START_SECONDS, "the gateway")
        done = subprocess.run(
            ["bash", "-c", by_hand.replace("8080", str(port))], capture_output=True, text=True, timeout=30
        )
        assert done.stdout.count('"text": "Hello from fake."') == 2, done.stdout + done.stderr
    finally:
        os.killpg(shell.pid, signal.SIGTERM)
        shell.wait(10)
        print((tmp_path / "stderr").read_text())


@pytest.mark.parametrize(
    "field,documented",
    [
        ({"weight": 0}, r"`(tinygw: configuration error: TINYGW_CONFIG \$\.providers\.deepseek\.weight: [^\n]*?)`\."),
        ({"api": "bedrok"}, r"\(`(TINYGW_CONFIG \$\.providers\.p\.api: Invalid enum value [^\n]*?)`\)"),
    ],
)
def test_the_errors_configuration_md_shows_are_the_codes(field, documented):
    (shown,) = re.findall(documented, CONFIGURATION)
    name = "deepseek" if "weight" in field else "p"
    config = {"providers": {name: {"base_url": "http://127.0.0.1:9", "api": "openai", **field}}}
    done = check_in_process({"TINYGW_API_KEYS": "a-gateway-key", "TINYGW_CONFIG": json.dumps(config)})
    assert done.returncode == 2
    assert shown in done.stderr, done.stderr


def test_the_client_of_confidential_md_keeps_the_bodies_its_receipt_is_for(tmp_path, fake, start_gateway):
    """The snippet as written, against a gateway here (its key taken from the page the doc
    says never to trust, its evidence from provider none): the hashes PASS, the key is
    vouched for by nothing (UNVERIFIED)."""
    (snippet,) = _blocks(CONFIDENTIAL, "### Keeping the bodies a receipt is for", "python")
    config = {"providers": {"f": provider(fake)}, "models": {"gpt-demo": {"targets": ["f:up"]}}}
    gateway = start_gateway(config, TINYGW_EHBP="on", TINYGW_RECEIPTS="on", TINYGW_API_KEYS="GATEWAY_KEY")
    (tmp_path / "gateway.hpke").write_bytes(call("GET", f"{gateway.url}/.well-known/hpke-keys")[2])
    (tmp_path / "evidence.json").write_bytes(call("GET", f"{gateway.url}/attestation?nonce={'ab' * 32}")[2])
    (tmp_path / "client.py").write_text(snippet.replace("https://gateway.example", gateway.url))
    ran = subprocess.run([sys.executable, "client.py"], cwd=tmp_path, capture_output=True, text=True, timeout=30)
    assert ran.returncode == 0, ran.stderr
    files = [str(tmp_path / name) for name in ("receipt.json", "evidence.json", "request.json", "answer.txt")]
    verify = [sys.executable, str(ROOT / "attest" / "verify"), "receipt", files[0], "--attestation", files[1]]
    done = subprocess.run([*verify, "--request", files[2], "--response", files[3]], capture_output=True, text=True)
    assert done.returncode == 4, done.stdout + done.stderr  # UNVERIFIED: no quote vouches for the key
    for check in ("receipt fields", "request hash", "response hash"):
        assert f"PASS {check}" in done.stdout, done.stdout
