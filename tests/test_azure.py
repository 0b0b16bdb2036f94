"""Azure-style providers (issue 12): the key in a header of the provider's choosing
(`api_key_header`), and non-secret query parameters on every upstream request
(`query`). Unit tests of their validation; black-box against a fake provider that
records what it was sent; and the key nowhere but in that header."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from conftest import ROOT, call, gateway_command, wait_until
from tinygw.config.environment import from_environ
from tinygw.errors import ConfigError

CHAT = "/v1/chat/completions"
AZURE_KEY = "azure-key-7f3e91"


def azure(url: str, **extra) -> dict:
    return {
        "base_url": url,
        "api": "openai",
        "api_key_env": "AZ_KEY",
        "api_key_header": "api-key",
        "query": {"api-version": "2024-10-21"},
        **extra,
    }


def environ(provider: dict) -> dict[str, str]:
    return {
        "TINYGW_CONFIG": json.dumps({"providers": {"az": provider}, "models": {"m": {"targets": ["az:gpt"]}}}),
        "AZ_KEY": AZURE_KEY,
    }


@pytest.mark.parametrize(
    "field,value",
    [
        ("api_key_header", "api key"),
        ("api_key_header", ""),
        ("api_key_header", "Content-Length"),
        ("api_key_header", "transfer-encoding"),
        ("api_key_header", "connection"),
        ("api_key_header", "host"),
        ("api_key_header", "x-request-id"),
        ("query", {"api-version": "2024\r\nX: 1"}),
        ("query", {"": "v"}),
        ("query", {"v": "é"}),
        ("query", {"v": 1}),
    ],
)
def test_a_bad_key_header_or_query_names_its_path(field, value):
    with pytest.raises(ConfigError) as info:
        from_environ(environ(azure("https://x.openai.azure.com/openai/v1", **{field: value})))
    assert f"$.providers.az.{field}" in str(info.value)
    assert AZURE_KEY not in str(info.value)


def test_the_key_header_may_not_also_be_a_static_header():
    with pytest.raises(ConfigError) as info:
        from_environ(environ(azure("https://x.example/v1", headers={"Api-Key": "x"})))
    assert "$.providers.az.api_key_header" in str(info.value)


def test_check_shows_the_options_hashes_them_and_never_the_key():
    env = {
        "PATH": os.environ.get("PATH", ""),
        "PYTHONPATH": str(ROOT),
        **environ(azure("https://x.openai.azure.com/openai/v1")),
    }
    done = subprocess.run([*gateway_command(), "check"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert '"api_key_header": "api-key"' in done.stdout and '"api-version": "2024-10-21"' in done.stdout
    assert AZURE_KEY not in done.stdout + done.stderr
    base = from_environ(environ(azure("https://x.openai.azure.com/openai/v1"))).config_sha256()
    other = from_environ(
        environ(azure("https://x.openai.azure.com/openai/v1", query={"api-version": "2025-01-01"}))
    ).config_sha256()
    same_but_key = from_environ({**environ(azure("https://x.openai.azure.com/openai/v1")), "AZ_KEY": "other"})
    assert base != other and same_but_key.config_sha256() == base


def test_the_key_goes_raw_in_its_header_and_the_query_on_every_request(fake, start_gateway):
    gateway = start_gateway(
        {"providers": {"az": azure(f"{fake.url}/openai/v1", listing=True)}, "models": {"m": {"targets": ["az:gpt"]}}},
        AZ_KEY=AZURE_KEY,
        PROVIDER_LISTING_SECONDS="0.2",
        TINYGW_API_KEYS="gw-k",
    )
    auth = {"Authorization": "Bearer gw-k"}
    # the client's own query: kept, but it cannot change the operator's api-version
    status, _, body = call(
        "POST",
        f"{gateway.url}{CHAT}?api-version=1999&user=a%20b",
        {"model": "m"},
        headers={**auth, "api-key": "client-sent"},
    )
    assert status == 200, body
    assert call("POST", f"{gateway.url}{CHAT}", {"model": "m", "stream": True}, headers=auth)[0] == 200
    assert call("POST", f"{gateway.url}/v1/embeddings", {"model": "m", "input": "x"}, headers=auth)[0] == 200
    wait_until(lambda: any(r.method == "GET" for r in fake.requests), what="a listing")
    posts = [r for r in fake.requests if r.method == "POST"]
    assert [r.path for r in posts] == [
        "/openai/v1/chat/completions?api-version=2024-10-21&user=a%20b",
        "/openai/v1/chat/completions?api-version=2024-10-21",
        "/openai/v1/embeddings?api-version=2024-10-21",
    ]
    [listing, *_] = [r for r in fake.requests if r.method == "GET"]
    assert listing.path == "/openai/v1/models?api-version=2024-10-21"
    for request in fake.requests:
        assert request.headers["api-key"] == AZURE_KEY  # raw, no "Bearer", never the client's
        assert "authorization" not in request.headers and "x-api-key" not in request.headers
    for page in ("/metrics", "/status", "/status.json"):
        assert AZURE_KEY.encode() not in call("GET", f"{gateway.url}{page}")[2]
    assert AZURE_KEY not in gateway.logs()


def test_query_values_are_percent_encoded(fake, start_gateway):
    gateway = start_gateway(
        {
            "providers": {"az": azure(f"{fake.url}/v1", listing=False, query={"a b": "c&d=e", "f": ""})},
            "models": {"m": {"targets": ["az:gpt"]}},
        },
        AZ_KEY=AZURE_KEY,
    )
    assert call("POST", f"{gateway.url}{CHAT}", {"model": "m"})[0] == 200
    assert fake.requests[-1].path == "/v1/chat/completions?a%20b=c%26d%3De&f="
