"""The docs cannot drift from the code: docs/configuration.md names every JSON field
(with its default) and every variable that config/ reads, and nothing else;
docs/api.md names every route and error code; README and docs link only inside the
repository."""

from __future__ import annotations

import json
import re

import msgspec
import pytest

from conftest import ROOT
from tinygw.api import app
from tinygw.config import environment
from tinygw.config.documents import ClientDoc, ConfigDoc, ModelDoc, ProviderDoc, RoutingDoc

CONFIGURATION = (ROOT / "docs" / "configuration.md").read_text()
API = (ROOT / "docs" / "api.md").read_text()
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
