"""Configuration: unit tests of `from_environ`, and black-box runs of the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Annotated, Literal, get_args, get_type_hints

import msgspec
import pytest

from conftest import ROOT, Gateway, free_port, run_tinygw
from tinygw.config import cpus, environment
from tinygw.config.documents import ModelDoc, ProviderDoc
from tinygw.config.environment import from_environ
from tinygw.errors import ConfigError
from tinygw.secret import Secret

PROVIDERS = {"a": {"base_url": "https://api.example.com/v1", "api": "openai", "api_key_env": "A_KEY"}}
GOOD = {"providers": PROVIDERS, "models": {"m": {"targets": ["a:up"]}}}


def env(doc=GOOD, **extra) -> dict[str, str]:
    return {"TINYGW_CONFIG": json.dumps(doc), "A_KEY": "secret-a", **extra}


def error_of(environ: dict[str, str]) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        from_environ(environ)
    return info.value


def test_defaults():
    settings = from_environ(env())
    assert (settings.host, settings.port, settings.log_level) == ("127.0.0.1", 8080, "info")
    assert settings.workers == cpus.usable().count  # TINYGW_WORKERS=auto (tests/test_workers.py)
    assert settings.drain_seconds == 30 and settings.max_body_bytes == 10 * 1024 * 1024
    b = settings.breaker
    assert (b.failures, b.open_seconds, b.max_open_seconds, b.half_open_probes) == (5, 30, 300, 1)
    assert settings.retry_fast_failures is True
    assert (settings.health_check_seconds, settings.listing_seconds) == (10, 60)
    provider = settings.providers["a"]
    assert (provider.doc.weight, provider.doc.connect_timeout_s, provider.doc.first_byte_timeout_s) == (1, 10, 120)
    assert (provider.doc.timeout_s, provider.doc.max_connections, provider.doc.listing) == (600, None, True)
    assert (provider.origin.host, provider.origin.port, provider.origin.path) == ("api.example.com", 443, "/v1")
    assert settings.models["m"].strategy == "failover"
    assert settings.routing.max_attempts == 2 and settings.routing.debug is False


def test_a_stream_s_head_waits_30_s_by_default_and_a_model_may_set_its_own():
    from tinygw.worker.upstreams import model_timeouts

    models = {"m": {"targets": ["a:up"]}, "n": {"targets": ["a:up"], "head_timeout_s": 2}}
    timeouts = model_timeouts(from_environ(env({"providers": PROVIDERS, "models": models})))
    assert (timeouts[("m", "a")].head_seconds, timeouts[("n", "a")].head_seconds) == (30.0, 2.0)
    assert timeouts[("m", "a")].first_byte_seconds == 120.0


def test_a_provider_s_request_targets_are_worked_out_when_it_is_built_and_never_written():
    from tinygw.worker.upstreams import make_upstream

    providers = {"a": {**PROVIDERS["a"], "query": {"api-version": "2025-01-01"}}}
    provider = from_environ(env({"providers": providers, "models": {}})).providers["a"]
    upstream = make_upstream(provider, None, None, 4, lambda *_: None, lambda _: None, lambda *_: None)
    assert (upstream.base_path, upstream.query_suffix) == (b"/v1", b"?api-version=2025-01-01")
    assert upstream.path("/chat/completions") == b"/v1/chat/completions?api-version=2025-01-01"
    assert upstream.path("/chat/completions", b"api-version=x&a=\xc3\xa9") == (
        b"/v1/chat/completions?api-version=2025-01-01&a=%C3%A9"
    )
    assert not any(isinstance(value, dict) for value in msgspec.structs.asdict(upstream).values())  # nothing cached
    plain = make_upstream(
        from_environ(env()).providers["a"], None, None, 4, lambda *_: None, lambda _: None, lambda *_: None
    )
    assert plain.path("/embeddings") == b"/v1/embeddings"


@pytest.mark.parametrize(
    "extra,where",
    [
        ({"TINYGW_PORT": "http"}, "TINYGW_PORT"),
        ({"TINYGW_PORT": "70000"}, "TINYGW_PORT"),
        ({"TINYGW_WORKERS": "0"}, "TINYGW_WORKERS"),
        ({"TINYGW_LOG_LEVEL": "loud"}, "TINYGW_LOG_LEVEL"),
        ({"TINYGW_DRAIN_SECONDS": "-1"}, "TINYGW_DRAIN_SECONDS"),
        ({"TINYGW_MAX_BODY_BYTES": "1e3"}, "TINYGW_MAX_BODY_BYTES"),
        ({"PROVIDER_BREAKER_FAILURES": "five"}, "PROVIDER_BREAKER_FAILURES"),
        ({"PROVIDER_BREAKER_FAILURES": "-1"}, "PROVIDER_BREAKER_FAILURES"),
        ({"PROVIDER_BREAKER_OPEN_SECONDS": "nan"}, "PROVIDER_BREAKER_OPEN_SECONDS"),
        (
            {"PROVIDER_BREAKER_OPEN_SECONDS": "60", "PROVIDER_BREAKER_MAX_OPEN_SECONDS": "30"},
            "PROVIDER_BREAKER_MAX_OPEN_SECONDS",
        ),
        ({"PROVIDER_BREAKER_HALF_OPEN_PROBES": "0"}, "PROVIDER_BREAKER_HALF_OPEN_PROBES"),
        ({"PROVIDER_RETRY_FAST_FAILURES": "maybe"}, "PROVIDER_RETRY_FAST_FAILURES"),
        ({"PROVIDER_HEALTH_CHECK_SECONDS": "-5"}, "PROVIDER_HEALTH_CHECK_SECONDS"),
        ({"PROVIDER_LISTING_SECONDS": "x"}, "PROVIDER_LISTING_SECONDS"),
        ({"TINYGW_HOST": "0.0.0.0"}, "TINYGW_API_KEYS"),
        ({"TINYGW_API_KEYS": " , "}, "TINYGW_API_KEYS"),
        ({"TINYGW_CONFIG_FILE": "/nonexistent/tinygw.json"}, "TINYGW_CONFIG"),
        ({"A_KEY": ""}, "A_KEY"),
        ({"A_KEY": "sk-secret-value "}, "A_KEY"),
        ({"A_KEY": "sk-secret\u00e9"}, "A_KEY"),
        # Numbers are ASCII digits: int() and float() read these too.
        ({"TINYGW_PORT": "\uff18\uff10\uff18\uff10"}, "TINYGW_PORT"),  # full-width 8080
        ({"TINYGW_WORKERS": "\u0663"}, "TINYGW_WORKERS"),  # Arabic-Indic 3
        ({"TINYGW_MAX_BODY_BYTES": "1_000_000"}, "TINYGW_MAX_BODY_BYTES"),
        ({"PROVIDER_BREAKER_OPEN_SECONDS": "\uff13\uff10"}, "PROVIDER_BREAKER_OPEN_SECONDS"),
        ({"PROVIDER_BREAKER_OPEN_SECONDS": "3_0.5"}, "PROVIDER_BREAKER_OPEN_SECONDS"),
        ({"PROVIDER_BREAKER_OPEN_SECONDS": "infinity"}, "PROVIDER_BREAKER_OPEN_SECONDS"),
        ({"PROVIDER_BREAKER_OPEN_SECONDS": "1e999"}, "PROVIDER_BREAKER_OPEN_SECONDS"),
        ({"TINYGW_DRAIN_SECONDS": "\u30005"}, "TINYGW_DRAIN_SECONDS"),  # an ideographic space before it
        # The gateway's own keys are visible ASCII without spaces.
        ({"TINYGW_API_KEYS": "sk-secret one"}, "TINYGW_API_KEYS"),
        ({"TINYGW_API_KEYS": "ok-key,sk-secret\x07"}, "TINYGW_API_KEYS"),
        ({"TINYGW_API_KEYS": "sk-secret\u00e9"}, "TINYGW_API_KEYS"),
        ({"TINYGW_API_KEYS": "sk-secret\u00a0"}, "TINYGW_API_KEYS"),  # a no-break space at its end
        ({"TINYGW_API_KEYS": "sk-secret\x85x"}, "TINYGW_API_KEYS"),
    ],
)
def test_bad_environment_values_name_the_variable(extra, where):
    error = error_of(env(**extra))
    assert error.where == where
    assert "sk-secret" not in str(error)  # a bad key is named, never shown


@pytest.mark.parametrize(
    "doc,where",
    [
        ("{", "TINYGW_CONFIG"),
        ({"providers": PROVIDERS, "extra": 1}, "TINYGW_CONFIG $"),
        ({"providers": {"a": {**PROVIDERS["a"], "weight": 0}}}, "TINYGW_CONFIG $.providers.a.weight"),
        ({"providers": {"a": {**PROVIDERS["a"], "timeout_s": "long"}}}, "TINYGW_CONFIG $.providers.a.timeout_s"),
        ({"providers": {"a": {**PROVIDERS["a"], "api": "grpc"}}}, "TINYGW_CONFIG $.providers.a.api"),
        ({"providers": {"a": {**PROVIDERS["a"], "base_url": "ftp://x"}}}, "TINYGW_CONFIG $.providers.a.base_url"),
        ({"providers": {"a": {**PROVIDERS["a"], "colour": "red"}}}, "TINYGW_CONFIG $.providers.a"),
        ({"providers": {"a": {"api": "openai"}}}, "TINYGW_CONFIG $.providers.a.base_url"),
        (
            {"providers": {"a": {**PROVIDERS["a"], "headers": {"Authorization": "x"}}}},
            "TINYGW_CONFIG $.providers.a.headers.Authorization",
        ),
        (
            {"providers": {"a": {**PROVIDERS["a"], "headers": {"Transfer-Encoding": "chunked"}}}},
            "TINYGW_CONFIG $.providers.a.headers.Transfer-Encoding",
        ),
        ({"providers": PROVIDERS, "models": {"m": {"targets": ["b:up"]}}}, "TINYGW_CONFIG $.models.m.targets[0]"),
        ({"providers": PROVIDERS, "models": {"m": {"targets": ["a"]}}}, "TINYGW_CONFIG $.models.m.targets[0]"),
        ({"providers": PROVIDERS, "models": {"m": {"targets": []}}}, "TINYGW_CONFIG $.models.m.targets"),
        (
            {"providers": PROVIDERS, "models": {"m": {"targets": ["a:x"], "strategy": "best"}}},
            "TINYGW_CONFIG $.models.m.strategy",
        ),
        ({"providers": PROVIDERS, "routing": {"max_attempts": 0}}, "TINYGW_CONFIG $.routing.max_attempts"),
    ],
)
def test_bad_documents_name_the_json_path(doc, where):
    environ = env() | {"TINYGW_CONFIG": doc if isinstance(doc, str) else json.dumps(doc)}
    assert error_of(environ).where == where


def test_numbers_in_ascii_digits_are_read_with_their_sign_point_and_exponent():
    settings = from_environ(
        env(
            TINYGW_PORT=" 8081 ",
            TINYGW_WORKERS="+2",
            PROVIDER_BREAKER_OPEN_SECONDS="1.5e1",
            PROVIDER_BREAKER_MAX_OPEN_SECONDS=".5e3",
            TINYGW_DRAIN_SECONDS="0.",
        )
    )
    assert (settings.port, settings.workers, settings.drain_seconds) == (8081, 2, 0.0)
    assert (settings.breaker.open_seconds, settings.breaker.max_open_seconds) == (15.0, 500.0)


def test_the_gateway_s_keys_file_holds_visible_ascii_keys_one_a_line(tmp_path):
    keys_file = tmp_path / "keys"
    keys_file.write_bytes(b"k1\r\n  k2\t\n\n")
    settings = from_environ(env(TINYGW_API_KEYS_FILE=str(keys_file)))
    assert [k.reveal() for k in settings.api_keys] == ["k1", "k2"]
    keys_file.write_bytes("k1\nsk-secret\u2028two\n".encode())  # a line separator splitlines() would cut at
    error = error_of(env(TINYGW_API_KEYS_FILE=str(keys_file)))
    assert error.where == "TINYGW_API_KEYS_FILE" and "sk-secret" not in str(error)


def _nested(levels: int) -> str:
    return "[" * levels + "]" * levels


@pytest.mark.parametrize(
    "doc",
    [
        '{"providers": {"a": {"base_url": "https://x.example", "api": "openai", "headers": {"x": %s}}}}',
        '{"providers": {"a": %s}}',
        '{"models": {"m": {"targets": %s}}}',
        '{"routing": %s}',
        '{"unknown": %s}',
    ],
)
def test_json_nested_deeper_than_64_levels_is_refused_naming_the_bound(doc):
    """Before: msgspec's RecursionError, a traceback and exit 1, at 1,000 levels."""
    error = error_of({"TINYGW_CONFIG": doc % _nested(1000)})
    assert error.where == "TINYGW_CONFIG" and "64" in str(error)
    assert "64" in str(error_of({"TINYGW_CONFIG": doc % _nested(65 - doc.count("{"))}))
    assert "64" not in str(error_of({"TINYGW_CONFIG": doc % _nested(64 - doc.count("{"))}))  # the type is wrong


def test_brackets_inside_strings_are_text_not_nesting():
    doc = {**GOOD, "providers": {"a": {**PROVIDERS["a"], "headers": {"x-deep": "[{" * 100 + '\\"'}}}}
    assert from_environ(env(doc)).providers["a"].headers["x-deep"] == "[{" * 100 + '\\"'


def test_unset_key_and_both_sources_are_errors(tmp_path):
    environ = env()
    del environ["A_KEY"]
    assert error_of(environ).where == "A_KEY"
    key_file = tmp_path / "key"
    key_file.write_text("k")
    assert error_of(env(A_KEY_FILE=str(key_file))).where == "A_KEY"
    assert error_of({"TINYGW_CONFIG": "{}", "TINYGW_CONFIG_FILE": "x"}).where == "TINYGW_CONFIG"
    assert error_of({}).where == "TINYGW_CONFIG"


def test_keys_from_files_drop_one_trailing_newline(tmp_path):
    key_file = tmp_path / "a_key"
    key_file.write_text("from-file\n")
    keys_file = tmp_path / "gateway_keys"
    keys_file.write_text("k1\n\nk2\n")
    config_file = tmp_path / "config.json"
    config_file.write_text(json.dumps(GOOD))
    settings = from_environ(
        {"TINYGW_CONFIG_FILE": str(config_file), "A_KEY_FILE": str(key_file), "TINYGW_API_KEYS_FILE": str(keys_file)}
    )
    assert settings.providers["a"].keys[0].reveal() == "from-file"
    assert [k.reveal() for k in settings.api_keys] == ["k1", "k2"]


def test_key_pool_and_inbound_keys_allow_any_host():
    doc = {"providers": {"a": {**PROVIDERS["a"], "api_key_env": ["K1", "K2"]}}}
    settings = from_environ(
        {"TINYGW_CONFIG": json.dumps(doc), "K1": "one", "K2": "two", "TINYGW_API_KEYS": "x,y", "TINYGW_HOST": "0.0.0.0"}
    )
    assert [k.reveal() for k in settings.providers["a"].keys] == ["one", "two"]
    assert settings.host == "0.0.0.0"


def test_secrets_never_show_in_repr_or_effective_config():
    settings = from_environ(env(TINYGW_API_KEYS="inbound-secret"))
    assert repr(Secret("x")) == "***" and str(Secret("x")) == "***"
    text = repr(settings) + json.dumps(settings.effective())
    assert "secret-a" not in text and "inbound-secret" not in text
    assert settings.effective()["providers"]["a"]["api_key_env"] == ["A_KEY"]


def test_config_hash_is_canonical_and_covers_breaker_settings():
    reordered = {"models": GOOD["models"], "providers": PROVIDERS}
    one = from_environ(env()).config_sha256()
    assert one == from_environ(env(reordered)).config_sha256()
    assert one == from_environ(env(A_KEY="another-key")).config_sha256()  # secrets are not configuration
    assert one != from_environ(env(PROVIDER_BREAKER_FAILURES="3")).config_sha256()


# ---- the command line, black-box -------------------------------------------------------------


run_cli = run_tinygw


def test_check_prints_the_redacted_configuration_and_its_hash():
    done = run_cli(["check"], env())
    assert done.returncode == 0, done.stderr
    assert "secret-a" not in done.stdout
    assert f"config_sha256: {from_environ(env()).config_sha256()}" in done.stdout


def test_check_exits_2_with_one_line_naming_the_path():
    done = run_cli(["check"], env(GOOD | {"routing": {"max_attempts": "two"}}))
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "$.routing.max_attempts" in lines[0]


def allowed(struct, field: str) -> str:
    """The values a Literal field allows, as the message names them: read from its type."""
    return ", ".join(json.dumps(v) for v in get_args(get_type_hints(struct)[field]))


@pytest.mark.parametrize(
    "doc,where,values",
    [
        ({"providers": {"a": {**PROVIDERS["a"], "api": "bedrok"}}}, "$.providers.a.api", allowed(ProviderDoc, "api")),
        ({"providers": {"a": {**PROVIDERS["a"], "api": 1}}}, "$.providers.a.api", allowed(ProviderDoc, "api")),
        (
            {"providers": PROVIDERS, "models": {"m": {"targets": ["a:x"], "strategy": "random"}}},
            "$.models.m.strategy",
            allowed(ModelDoc, "strategy"),
        ),
    ],
)
def test_check_names_the_values_a_literal_allows(doc, where, values):
    done = run_cli(["check"], env(doc))
    assert done.returncode == 2
    [line] = done.stderr.strip().splitlines()
    assert line.startswith(f"tinygw: configuration error: TINYGW_CONFIG {where}: ")
    assert line.endswith(f" (allowed: {values})")
    assert '"openai"' in allowed(ProviderDoc, "api") and '"round_robin"' in allowed(ModelDoc, "strategy")


class Inner(msgspec.Struct, forbid_unknown_fields=True):
    mode: Literal["a", "b"] | None = None


class Outer(msgspec.Struct, forbid_unknown_fields=True):
    kind: Annotated[Literal["x", "y"], msgspec.Meta(title="kind")] = "x"
    by_name: dict[str, Inner] = {}
    items: list[Inner] = []
    count: int = 0


@pytest.mark.parametrize(
    "raw,where,named",
    [
        (b'{"kind": "z"}', "W $.kind", ' (allowed: "x", "y")'),
        (b'{"by_name": {"n": {"mode": "c"}}}', "W $.by_name[...].mode", ' (allowed: "a", "b")'),
        (b'{"items": [{}, {"mode": 3}]}', "W $.items[1].mode", ' (allowed: "a", "b")'),
        (b'{"count": "many"}', "W $.count", None),  # not a Literal: msgspec's message alone
    ],
)
def test_every_literal_field_names_its_values_wherever_it_is(raw, where, named):
    with pytest.raises(ConfigError) as info:
        environment._decode("W", raw, msgspec.json.Decoder(Outer))
    assert info.value.where == where
    assert info.value.reason.endswith(named) if named else "allowed" not in info.value.reason


def test_a_configuration_that_serves_nothing_is_said_at_check_and_at_serve(tmp_path):
    warning = "nothing can be served: the configuration has no providers and no models"
    done = run_cli(["check"], {"TINYGW_CONFIG": "{}"})
    assert done.returncode == 0 and done.stderr == f"tinygw: warning: {warning}\n"
    assert "warning" not in run_cli(["check"], env()).stderr
    gateway = Gateway({}, {}, tmp_path / "gateway.log")
    try:
        records = gateway.log_records()
        assert [r["level"] for r in records if r.get("msg") == warning] == ["warning"]
    finally:
        gateway.stop()
    served = Gateway(GOOD, {"A_KEY": "secret-a"}, tmp_path / "served.log")
    try:
        assert not [r for r in served.log_records() if r.get("msg") == warning]
    finally:
        served.stop()


@pytest.mark.parametrize("workers", ["1", "2"])
def test_serve_with_a_bad_value_exits_2_naming_the_variable(workers):
    done = run_cli(
        ["serve"], env(TINYGW_WORKERS=workers, PROVIDER_BREAKER_OPEN_SECONDS="soon", TINYGW_PORT=str(free_port()))
    )
    assert done.returncode == 2
    assert "PROVIDER_BREAKER_OPEN_SECONDS" in done.stderr
    assert "secret-a" not in done.stderr


def test_a_worker_whose_startup_fails_stops_the_server():
    """Granian alone on the app, with a bad environment: the lifespan fails in the
    worker, and the whole server must stop rather than serve without a gateway."""
    if os.environ.get("TINYGW_BINARY"):
        pytest.skip("runs Granian from the source tree")
    port = free_port()
    full = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(ROOT), **env(A_KEY="")}
    started = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "granian",
            "--interface",
            "asgi",
            "--port",
            str(port),
            "--workers",
            "2",
            "tinygw.api.app:app",
        ],
        env=full,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode != 0
    assert "A_KEY" in done.stderr
    assert time.monotonic() - started < 30


def test_version():
    done = run_cli(["version"], {})
    assert done.returncode == 0 and done.stdout.startswith("tinygw ")


# ---- docs/design.md section 10: what a careless operator may set -------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "http://api example.com/v1",
        "http://api.example.com/v1\r\nX-Injected: 1",
        "http://api.example.com:0/v1",
        "http://api.example.com:/v1",
        "http://api.exa%20mple.com/v1",
        "https://api.example.com/v1?key=1",
        "http://a..b/v1",
        f"http://{'x' * 64}.example.com/v1",
    ],
)
def test_check_refuses_a_base_url_that_cannot_be_a_request_target(url):
    doc = {"providers": {"a": {**PROVIDERS["a"], "base_url": url}}, "models": GOOD["models"]}
    done = run_cli(["check"], env(doc))
    assert done.returncode == 2
    assert "TINYGW_CONFIG $.providers.a.base_url" in done.stderr and "X-Injected" not in done.stderr


@pytest.mark.parametrize("variable", ["A_KEY_FILE", "TINYGW_CONFIG_FILE", "TINYGW_API_KEYS_FILE"])
@pytest.mark.parametrize("kind", ["/dev/zero", "fifo", "huge"])
def test_a_file_that_never_ends_stops_the_start_naming_its_variable(tmp_path, variable, kind):
    if kind == "fifo":
        path = tmp_path / "fifo"
        os.mkfifo(path)  # no writer: opening it for reading would wait forever
    elif kind == "huge":
        path = tmp_path / "huge"
        path.write_bytes(b"k" * (2 * 1024 * 1024))
    else:
        path = kind
    environ = env(**{variable: str(path)})
    if variable == "A_KEY_FILE":
        del environ["A_KEY"]
    if variable == "TINYGW_CONFIG_FILE":
        del environ["TINYGW_CONFIG"]
    done = run_cli(["check"], environ, seconds=20)
    assert done.returncode == 2
    assert done.stderr.startswith(f"tinygw: configuration error: {variable}: ")


def test_affinity_is_on_by_default_hashed_only_when_off_and_checked():
    one = from_environ(env())
    assert one.models["m"].affinity and one.providers["a"].doc.affinity
    assert "affinity" not in json.dumps(one.effective())  # a configuration that does not set it keeps its hash
    on = {
        "providers": {"a": {**PROVIDERS["a"], "affinity": True}},
        "models": {"m": {"targets": ["a:up"], "affinity": True}},
    }
    assert from_environ(env(on)).config_sha256() == one.config_sha256()
    for off in (
        {**GOOD, "models": {"m": {"targets": ["a:up"], "affinity": False}}},
        {**GOOD, "providers": {"a": {**PROVIDERS["a"], "affinity": False}}},
    ):
        assert from_environ(env(off)).config_sha256() != one.config_sha256()
    bad = {**GOOD, "models": {"m": {"targets": ["a:up"], "affinity": "yes"}}}
    assert "$.models.m.affinity" in str(error_of(env(bad)))
    header = {"providers": {"a": {**PROVIDERS["a"], "headers": {"X-Tinygw-Conversation": "x"}}}}
    assert "headers.X-Tinygw-Conversation" in str(error_of(env(header)))


def test_a_context_fallback_names_aliases_or_targets_and_an_alias_stands_for_its_targets():
    providers = {**PROVIDERS, "b": {"base_url": "https://b.example.com/v1", "api": "openai", "api_key_env": "A_KEY"}}
    models = {
        "m": {"targets": ["a:small"], "context_fallback": ["big", "b:huge", "a:small"]},
        "big": {"targets": ["b:large", "a:large"]},
    }
    settings = from_environ(env({"providers": providers, "models": models}))
    assert [str(t) for t in settings.models["m"].context_fallback] == ["b:large", "a:large", "b:huge", "a:small"]
    assert settings.models["big"].context_fallback == ()


@pytest.mark.parametrize(
    "entry,reason",
    [("nowhere", "neither a configured model"), ("zz:x", "unknown provider"), ("a:*", "not '*'")],
)
def test_a_context_fallback_that_names_nothing_it_can_send_to_names_its_path(entry, reason):
    models = {"m": {"targets": ["a:small"], "context_fallback": [entry]}}
    error = error_of(env({"providers": PROVIDERS, "models": models}))
    assert error.where.endswith("$.models.m.context_fallback[0]") and reason in error.reason
