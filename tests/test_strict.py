"""Configuration that cannot be misread (docs/design.md section 13), run as an operator
would: a misspelled variable, a duplicate key, a plaintext upstream, a credential in a
provider's headers or query. Each start that must not happen exits 2 with one line."""

from __future__ import annotations

import json

import pytest

from conftest import call, check_in_process, free_port, run_command, run_tinygw
from tinygw.config.clients import clients, taken_variables
from tinygw.config.documents import ClientDoc, ProviderDoc
from tinygw.config.environment import from_environ
from tinygw.errors import ConfigError

PROVIDER = {"base_url": "https://api.example.com/v1", "api": "openai", "api_key_env": "A_KEY"}
GOOD = {"providers": {"a": PROVIDER}, "models": {"m": {"targets": ["a:up"]}}}


def env(doc=GOOD, **extra: str) -> dict[str, str]:
    return {"TINYGW_CONFIG": doc if isinstance(doc, str) else json.dumps(doc), "A_KEY": "secret-a", **extra}


def refused(done, where: str) -> str:
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"tinygw: configuration error: {where}"), done.stderr
    return lines[0]


# ---- every TINYGW_* and PROVIDER_* variable is one the gateway reads --------------------


@pytest.mark.parametrize(
    "typo,meant",
    [
        ("TINYGW_API_KEY", "TINYGW_API_KEYS"),
        ("TINYGW_TLS_NAME", "TINYGW_TLS_NAMES"),
        ("TINYGW_WORKER", "TINYGW_WORKERS"),
        ("PROVIDER_BREAKER_FAILURE", "PROVIDER_BREAKER_FAILURES"),
    ],
)
@pytest.mark.parametrize("command", ["check", "serve"])
def test_a_variable_the_gateway_does_not_read_exits_2_naming_the_closest(typo, meant, command):
    done = run_command(command, env(**{typo: "gw-key-typo", "TINYGW_PORT": str(free_port())}))
    line = refused(done, f"{typo}: ")
    assert f"did you mean {meant}?" in line and "gw-key-typo" not in line


def test_key_variables_the_configuration_names_are_read(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("secret-p\n")
    doc = {
        "providers": {
            "a": {**PROVIDER, "api_key_env": "PROVIDER_A_KEY", "headers": {"x-team": {"env": "TINYGW_TEAM_TOKEN"}}}
        },
        "models": GOOD["models"],
    }
    done = run_tinygw(
        ["check"],
        {"TINYGW_CONFIG": json.dumps(doc), "PROVIDER_A_KEY_FILE": str(key_file), "TINYGW_TEAM_TOKEN": "team-secret"},
    )
    assert done.returncode == 0, done.stderr
    # ... and only those: a variable named nowhere is refused.
    done = run_tinygw(
        ["check"],
        {
            "TINYGW_CONFIG": json.dumps(doc),
            "PROVIDER_A_KEY_FILE": str(key_file),
            "TINYGW_TEAM_TOKEN": "team-secret",
            "PROVIDER_B_KEY": "x",
        },
    )
    assert "did you mean PROVIDER_A_KEY?" in refused(done, "PROVIDER_B_KEY: ")


@pytest.mark.parametrize("host", ["localhost", "not_a_host", "256.1.1.1", "[::1]", "192.0.2.77"])
@pytest.mark.parametrize("command", ["check", "serve"])
def test_a_listen_address_that_cannot_be_bound_exits_2_naming_it(host, command):
    # Granian binds an IP address of this machine; anything else was a traceback (exit 1).
    done = run_command(command, env(TINYGW_HOST=host, TINYGW_API_KEYS="gw-k", TINYGW_PORT=str(free_port())))
    refused(done, "TINYGW_HOST: ")


# ---- no JSON object names a key twice -------------------------------------------------------

OTHER = json.dumps({**PROVIDER, "base_url": "https://other.example.com/v1"})
DUPLICATES = [
    (
        '{"providers": {"a": %s, "a": %s}, "models": {"m": {"targets": ["a:up"]}}}' % (json.dumps(PROVIDER), OTHER),  # noqa: UP031 -- JSON's braces, not doubled
        "$.providers.a",
    ),
    (
        '{"providers": {"a": %s}, "models": {"m": {"targets": ["a:up"], "targets": ["a:other"]}}}'  # noqa: UP031 -- as above
        % json.dumps(PROVIDER),
        "$.models.m.targets",
    ),
    (
        '{"providers": {"a": {"base_url": "https://api.example.com/v1", "api": "openai", "api_key_env": "A_KEY",'
        ' "headers": {"x-a": "1", "x-a": "2"}}}, "models": {}}',
        "$.providers.a.headers.x-a",
    ),
    ('{"routing": {"debug": false}, "routing": {"debug": true}}', "$.routing"),
]


@pytest.mark.parametrize("document,path", DUPLICATES)
def test_a_duplicate_key_exits_2_naming_its_path(document, path, tmp_path):
    refused(check_in_process(env(document)), f"TINYGW_CONFIG {path}: ")
    (tmp_path / "config.json").write_text(document)
    done = run_tinygw(
        ["serve"],
        {"TINYGW_CONFIG_FILE": str(tmp_path / "config.json"), "A_KEY": "secret-a", "TINYGW_PORT": str(free_port())},
    )
    refused(done, f"TINYGW_CONFIG_FILE {path}: ")


# ---- careless configuration is refused, never a crash ---------------------------------------------


@pytest.mark.parametrize("command", ["check", "serve"])
def test_a_document_nested_1000_deep_exits_2_naming_the_bound_of_64(command, tmp_path):
    """Before: a RecursionError traceback from msgspec, exit 1."""
    deep = "[" * 1000 + "]" * 1000
    document = '{"providers": {"a": {"base_url": "https://x.example", "api": "openai", "headers": {"x": %s}}}}' % deep  # noqa: UP031 -- JSON's braces
    line = refused(
        run_command(command, {"TINYGW_CONFIG": document, "TINYGW_PORT": str(free_port())}), "TINYGW_CONFIG: "
    )
    assert "64" in line
    (tmp_path / "config.json").write_text(document)
    done = run_command(command, {"TINYGW_CONFIG_FILE": str(tmp_path / "config.json"), "TINYGW_PORT": str(free_port())})
    assert "64" in refused(done, "TINYGW_CONFIG_FILE: ")


@pytest.mark.parametrize("command", ["check", "serve"])
@pytest.mark.parametrize(
    "extra,where",
    [
        ({"TINYGW_PORT": "\uff18\uff10\uff18\uff10"}, "TINYGW_PORT: "),
        ({"TINYGW_API_KEYS": "gw-key with-space"}, "TINYGW_API_KEYS: "),
        ({"TINYGW_API_KEYS": "gw-key\x1b[2J"}, "TINYGW_API_KEYS: "),
    ],
)
def test_a_number_in_other_digits_or_a_gateway_key_with_a_space_exits_2_naming_the_variable(extra, where, command):
    line = refused(run_command(command, env(**{"TINYGW_PORT": str(free_port()), **extra})), where)
    assert "gw-key" not in line


# ---- a client's keys are its own variables' ---------------------------------------------------

BEDROCK = {
    "api": "bedrock",
    "region": "us-east-1",
    "aws_access_key_id_env": "AWS_ID",
    "aws_secret_access_key_env": "AWS_SECRET",
}


def _with_team(keys_env, providers: dict | None = None) -> dict:
    doc = {**GOOD, "clients": {"team": {"keys_env": keys_env}}}
    return {**doc, "providers": {**GOOD["providers"], **(providers or {})}}


@pytest.mark.parametrize("command", ["check", "serve"])
@pytest.mark.parametrize(
    "doc,extra,variable",
    [
        # the gateway's own: the word `on` (a setting, shown at /attestation) would be a key
        (_with_team("TINYGW_EHBP"), {"TINYGW_EHBP": "on"}, "TINYGW_EHBP"),
        (
            _with_team(["TEAM_KEYS", "PROVIDER_RETRY_FAST_FAILURES"]),
            {"PROVIDER_RETRY_FAST_FAILURES": "true"},
            "PROVIDER_RETRY_FAST_FAILURES",
        ),
        # a provider's key: the upstream key would open the gateway
        (_with_team("A_KEY"), {}, "A_KEY"),
        (_with_team("A_KEY"), {"A_KEY": None, "A_KEY_FILE": "KEY_FILE"}, "A_KEY"),
        (
            _with_team("B_KEY", {"b": {**PROVIDER, "api_key_env": ["OTHER_KEY", "B_KEY"]}}),
            {"OTHER_KEY": "o", "B_KEY": "secret-b"},
            "B_KEY",
        ),
        (_with_team("T", {"b": {**PROVIDER, "headers": {"x-team": {"env": "T"}}}}), {"T": "secret-t"}, "T"),
        (
            _with_team("AWS_SECRET", {"bed": BEDROCK}),
            {"AWS_ID": "AKIDEXAMPLE", "AWS_SECRET": "secret-aws"},
            "AWS_SECRET",
        ),
    ],
)
def test_a_client_whose_keys_env_is_the_gateways_or_a_providers_variable_exits_2_naming_both(
    doc, extra, variable, command, tmp_path
):
    """Before: exit 0, and the variable's value (`on`, the upstream key) was a gateway key."""
    key_file = tmp_path / "key"
    key_file.write_text("secret-a\n")
    environment = env(doc, TEAM_KEYS="sk-team-own", TINYGW_PORT=str(free_port()))
    for name, value in extra.items():
        environment.pop(name, None)
        if value is not None:
            environment[name] = str(key_file) if value == "KEY_FILE" else value
    line = refused(run_command(command, environment), "TINYGW_CONFIG $.clients.team.keys_env: ")
    assert "'team'" in line and variable in line
    assert "secret-" not in line


def test_the_variables_no_client_may_read_its_keys_from():
    providers = {
        "a": ProviderDoc(api="openai", base_url="https://a.example", api_key_env=["A_KEY", "A_KEY_2"]),
        "v": ProviderDoc(api="vertex", project="p", region="global", credentials_env="SA_JSON"),
    }
    taken = taken_variables(providers)
    for name in ("A_KEY", "A_KEY_2_FILE", "SA_JSON", "SA_JSON_FILE", "TINYGW_API_KEYS", "TINYGW_LAUNCH_DIR"):
        assert name in taken
    assert "provider 'v'" in taken["SA_JSON"] and "for itself" in taken["TINYGW_EHBP"]
    docs = {"team": ClientDoc(keys_env="OWN")}
    env_ = {"OWN": "sk-own", "TINYGW_API_KEYS": "sk-d"}
    assert set(clients(env_, "here", docs, (), "TINYGW_API_KEYS", taken)) == {"team"}
    # a client reads NAME and NAME_FILE: either may be taken
    for keys_env, clash in [
        ("TINYGW_TLS_KEY", "TINYGW_TLS_KEY_FILE"),
        ("A_KEY_FILE", "A_KEY_FILE"),
        ("A_KEY", "A_KEY"),
    ]:
        with pytest.raises(ConfigError) as e:
            clients(env_, "here", {"team": ClientDoc(keys_env=["OWN", keys_env])}, (), "TINYGW_API_KEYS", taken)
        assert e.value.where == "here $.clients.team.keys_env" and clash in e.value.reason


# ---- plaintext only to loopback, unless said -----------------------------------------------


@pytest.mark.parametrize("url", ["http://10.1.2.3/v1", "http://api.example.com/v1", "http://[2001:db8::1]:8000/v1"])
def test_plaintext_to_a_non_loopback_address_must_be_asked_for(url):
    doc = {"providers": {"a": {**PROVIDER, "base_url": url}}, "models": GOOD["models"]}
    assert "plaintext" in refused(check_in_process(env(doc)), "TINYGW_CONFIG $.providers.a.base_url: ")
    asked = {"providers": {"a": {**PROVIDER, "base_url": url, "plaintext": True}}, "models": GOOD["models"]}
    done = check_in_process(env(asked))
    assert done.returncode == 0, done.stderr
    assert '"plaintext": true' in done.stdout  # in the hash: a verifier sees it


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:8000/v1",
        "http://127.8.9.10/v1",
        "http://[::1]:8000/v1",
        "http://localhost:8000/v1",
        "https://10.1.2.3/v1",
    ],
)
def test_loopback_and_https_need_no_plaintext(url):
    doc = {"providers": {"a": {**PROVIDER, "base_url": url}}, "models": GOOD["models"]}
    assert check_in_process(env(doc)).returncode == 0


def test_the_header_policy_is_the_wires():
    # proxy-authenticate is hop-by-hop: never forwarded from a client, so never configurable either.
    doc = {"providers": {"a": {**PROVIDER, "headers": {"Proxy-Authenticate": "x"}}}, "models": GOOD["models"]}
    refused(check_in_process(env(doc)), "TINYGW_CONFIG $.providers.a.headers.Proxy-Authenticate: ")


# ---- credentials in headers and query: {"env": NAME} ------------------------------------------

TEAM_TOKEN = "team-token-5d1c"
QUERY_KEY = "query-key-c0ffee"


def credentials_config(url: str) -> dict:
    return {
        "providers": {
            "p": {
                "base_url": url,
                "api": "openai",
                "listing": False,
                "headers": {"x-team-token": {"env": "TEAM_TOKEN"}, "x-plain": "visible"},
                "query": {"key": {"env": "QUERY_KEY"}, "api-version": "1"},
            }
        },
        "models": {"m": {"targets": ["p:x"]}},
    }


def test_credentials_in_headers_and_query_are_sent_and_shown_as_their_names(fake, start_gateway, tmp_path):
    (tmp_path / "query-key").write_text(QUERY_KEY + "\n")
    gateway = start_gateway(
        credentials_config(f"{fake.url}/v1"), TEAM_TOKEN=TEAM_TOKEN, QUERY_KEY_FILE=str(tmp_path / "query-key")
    )
    assert call("POST", f"{gateway.url}/v1/chat/completions", {"model": "m"})[0] == 200
    sent = fake.requests[-1]
    assert sent.headers["x-team-token"] == TEAM_TOKEN and sent.headers["x-plain"] == "visible"
    assert sent.path == f"/v1/chat/completions?key={QUERY_KEY}&api-version=1"
    for page in ("/metrics", "/status", "/status.json"):
        text = call("GET", f"{gateway.url}{page}")[2].decode()
        assert TEAM_TOKEN not in text and QUERY_KEY not in text
    assert TEAM_TOKEN not in gateway.logs() and QUERY_KEY not in gateway.logs()

    done = run_tinygw(
        ["check"],
        {
            "TINYGW_CONFIG": json.dumps(credentials_config("https://x.example/v1")),
            "TEAM_TOKEN": TEAM_TOKEN,
            "QUERY_KEY": QUERY_KEY,
        },
    )
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout[: done.stdout.rindex("}") + 1])["providers"]["p"]
    assert shown["headers"] == {"x-team-token": {"env": "TEAM_TOKEN"}, "x-plain": "visible"}
    assert shown["query"] == {"key": {"env": "QUERY_KEY"}, "api-version": "1"}
    assert TEAM_TOKEN not in done.stdout + done.stderr and QUERY_KEY not in done.stdout + done.stderr


def test_an_unset_credential_variable_exits_2_naming_it():
    done = run_tinygw(
        ["check"], {"TINYGW_CONFIG": json.dumps(credentials_config("https://x.example/v1")), "QUERY_KEY": QUERY_KEY}
    )
    refused(done, "TEAM_TOKEN: ")


# ---- no object's repr or str shows a key ------------------------------------------------------

GATEWAY_KEY = "gw-inbound-key-31f4"
PROVIDER_KEY = "sk-provider-key-8e2a"


def reachable(root: object):
    """Every object reachable from `root` through attributes, slots, Struct fields and
    containers (modules, classes and functions excluded)."""
    import msgspec

    seen, stack = set(), [root]
    while stack:
        value = stack.pop()
        if id(value) in seen or isinstance(value, (type, type(json), type(reachable), str, bytes, int, float)):
            continue
        seen.add(id(value))
        yield value
        if isinstance(value, dict):
            stack += [*value.keys(), *value.values()]
        elif isinstance(value, (list, tuple, set, frozenset)):
            stack += list(value)
        if isinstance(value, msgspec.Struct):
            stack += [getattr(value, f) for f in value.__struct_fields__]
        stack += list(getattr(value, "__dict__", {}).values())
        for name in getattr(type(value), "__slots__", ()):
            if hasattr(value, name):
                stack.append(getattr(value, name))


def test_no_object_of_a_running_gateway_shows_a_key_in_its_repr_or_str(tmp_path):
    import asyncio

    from tinygw.worker.gateway import Gateway

    doc = credentials_config("https://x.example/v1")
    doc["providers"]["p"]["api_key_env"] = ["K1", "K2"]
    doc["providers"]["an"] = {"base_url": "https://an.example", "api": "anthropic", "api_key_env": "K3"}
    doc["providers"]["az"] = {
        "base_url": "https://az.example/v1",
        "api": "openai",
        "api_key_env": "K4",
        "api_key_header": "api-key",
    }
    keys = {
        "K1": PROVIDER_KEY + "1",
        "K2": PROVIDER_KEY + "2",
        "K3": PROVIDER_KEY + "3",
        "K4": PROVIDER_KEY + "4",
        "TEAM_TOKEN": TEAM_TOKEN,
        "QUERY_KEY": QUERY_KEY,
    }
    settings = from_environ({"TINYGW_CONFIG": json.dumps(doc), "TINYGW_API_KEYS": GATEWAY_KEY, **keys})

    async def build() -> Gateway:
        return Gateway(settings)

    gateway = asyncio.run(build())
    secrets = [GATEWAY_KEY, *keys.values()]
    checked = 0
    for value in reachable(gateway):
        if type(value).__module__.startswith("tinygw"):
            shown = repr(value) + str(value)
            assert not [s for s in secrets if s in shown], f"{type(value).__name__} shows a key: {shown[:200]}"
            checked += 1
    assert checked > 10


@pytest.mark.parametrize(
    "given,typo,meant",
    [
        ({}, "TINYGW_CONFIG_FIEL", "TINYGW_CONFIG_FILE"),  # no configuration at all: the typo is why
        ({"TINYGW_CONFIG": "{not json"}, "TINYGW_CONFG", "TINYGW_CONFIG"),
    ],
)
def test_a_misspelled_variable_is_named_when_the_configuration_cannot_be_read(tmp_path, given, typo, meant):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(GOOD))
    done = check_in_process({**given, typo: str(config)})
    assert f"did you mean {meant}?" in refused(done, f"{typo}: ")


@pytest.mark.parametrize("key_variable", ["PROVIDER_A_KEY", "TINYGW_OPENAI_KEY", "TINYGW_TLS_KEY", "TINYGW_CONFIG_KEY"])
def test_a_broken_configuration_is_still_named_before_variables_it_may_name_for_keys(key_variable):
    # The configuration, which cannot be read, may name these for its keys: its own error
    # is the one said, and no other variable is offered for them (TINYGW_API_KEYS would
    # be a provider key given as the gateway's).
    done = check_in_process({"TINYGW_CONFIG": "{not json", key_variable: "secret-a"})
    line = refused(done, "TINYGW_CONFIG")
    assert key_variable not in line and "secret-a" not in line


def test_a_requests_inbound_shows_neither_the_gateway_key_nor_the_prompt():
    from tinygw.protocol.routing import api_endpoint
    from tinygw.worker.proxy import Inbound

    route = api_endpoint("/v1/chat/completions", "openai", "/chat/completions")[1].route
    inbound = Inbound(
        route=route,
        model="m",
        stream=False,
        body=b'{"model":"m","messages":[{"role":"user","content":"the-prompt"}]}',
        headers=[(b"authorization", f"Bearer {GATEWAY_KEY}".encode())],
        query=b"key=" + QUERY_KEY.encode(),
        request_id=b"r-1",
    )
    shown = repr(inbound) + str(inbound)
    assert "r-1" in shown and "/v1/chat/completions" in shown
    assert GATEWAY_KEY not in shown and QUERY_KEY not in shown and "the-prompt" not in shown
