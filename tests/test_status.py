"""Black-box: the status page, `/status` and `/status.json` (docs/design.md section 7).

A real gateway whose provider `down` answers 502 to everything, so that two failures
open its circuit for 300 s, and a healthy provider `up` whose circuit stays closed.
The last test loads `/status` in a real headless Chromium and keeps its screenshot
in `artifacts/status.png`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import time
from datetime import datetime
from pathlib import Path

import pytest

from conftest import ROOT, call, second_fake, wait_until
from tinygw import __version__
from tinygw.api.status import render_html
from tinygw.fake.upstream import json_reply, well_behaved

CHAT = "/v1/chat/completions"
PROVIDER_KEY = "sk-status-secret"
CHROMIUM = Path("/usr/bin/chromium")
INSTALL_SECONDS = 600  # apt-get update and install of chromium, at most
BROWSER_SECONDS = 60  # one headless chromium run, at most


healthy = second_fake("up")


def status_json(gateway) -> dict:
    status, headers, body = call("GET", f"{gateway.url}/status.json")
    assert status == 200 and headers["content-type"] == "application/json"
    return json.loads(body)


def provider_entry(data: dict, name: str) -> dict:
    [entry] = [p for p in data["providers"] if p["name"] == name]
    return entry


def outage_config(fake, healthy) -> dict:
    """`down` (the fake, which the outage fixtures make answer 502) and `up` (healthy, listed)."""
    return {
        "providers": {
            "down": {"base_url": f"{fake.url}/v1", "api": "openai", "listing": False, "api_key_env": "K1"},
            "up": {"base_url": f"{healthy.url}/v1", "api": "openai"},
        },
        "models": {"m": {"targets": ["down:Qwen3"]}, "n": {"targets": ["up:fake-model"]}},
    }


@pytest.fixture
def outage(fake, healthy, start_gateway):
    """A gateway with `down:Qwen3` open (two 502s) and `up:fake-model` closed, listed."""
    fake.script = lambda r: json_reply(502, {"error": {"message": "upstream down", "type": "server_error"}})
    gateway = start_gateway(
        outage_config(fake, healthy),
        K1=PROVIDER_KEY,
        TINYGW_API_KEYS="gw-key-status",  # the status pages ask for none
        PROVIDER_RETRY_FAST_FAILURES="false",
        PROVIDER_BREAKER_FAILURES="2",
        PROVIDER_BREAKER_OPEN_SECONDS="300",
        PROVIDER_HEALTH_CHECK_SECONDS="0",
    )
    key = {"Authorization": "Bearer gw-key-status"}
    for _ in range(2):
        assert call("POST", f"{gateway.url}{CHAT}", {"model": "m"}, headers=key)[0] == 502
    assert call("POST", f"{gateway.url}{CHAT}", {"model": "m"}, headers=key)[0] == 503
    wait_until(lambda: provider_entry(status_json(gateway), "up")["listing"]["up"], what="the listing of `up`")
    return gateway


@pytest.fixture
def outage_on_two_workers(fake, healthy, start_gateway):
    """Two workers sharing the gateway's circuits: `down:Qwen3` open (a 502 opens it), `up:fake-model` closed."""
    fake.script = lambda r: json_reply(502, {"error": {"message": "upstream down", "type": "server_error"}})
    gateway = start_gateway(
        outage_config(fake, healthy),
        K1=PROVIDER_KEY,
        TINYGW_WORKERS="2",
        PROVIDER_RETRY_FAST_FAILURES="false",
        PROVIDER_BREAKER_FAILURES="1",
        PROVIDER_BREAKER_OPEN_SECONDS="300",
        PROVIDER_HEALTH_CHECK_SECONDS="0",
    )

    assert call("POST", f"{gateway.url}{CHAT}", {"model": "m"})[0] == 502
    for _ in range(8):  # each call is a new connection, which the kernel gives to either worker: both skip it
        assert call("POST", f"{gateway.url}{CHAT}", {"model": "m"})[0] == 503
    wait_until(lambda: provider_entry(status_json(gateway), "up")["listing"]["up"], what="both listings of `up`")
    return gateway


def test_every_reload_shows_the_gateways_one_table_of_circuits(outage_on_two_workers):
    answered_by = set()
    deadline = time.monotonic() + 20
    while len(answered_by) < 2 and time.monotonic() < deadline:  # whichever worker answers, it shows the one table
        data = status_json(outage_on_two_workers)
        answered_by.add(data["worker"]["pid"])
        assert [w["slot"] for w in data["workers"]] == [1, 2]
        assert {w["pid"] for w in data["workers"]} >= {data["worker"]["pid"]}
        down = provider_entry(data, "down")["circuits"]
        assert [(c["provider_model"], c["state"], c["last_error"]) for c in down] == [("Qwen3", "Circuit Open", "502")]
        assert data["summary"]["open_circuits"] == 1
        up = provider_entry(data, "up")
        assert [c["state"] for c in up["circuits"]] == ["Circuit Closed"]
        assert up["listing"] == {"enabled": True, "up": True, "models": 1}
        page = call("GET", f"{outage_on_two_workers.url}/status")[2].decode()
        assert page.count("Circuit Open") == 1 and page.count("Circuit Closed") == 1
    assert len(answered_by) == 2, "both workers must have answered for this test to mean anything"


def test_status_json_shows_the_open_and_the_closed_circuit_and_the_worker(outage):
    data = status_json(outage)
    pid = data["worker"]["pid"]
    assert isinstance(pid, int) and pid != outage.process.pid  # a worker, not Granian's parent
    assert pid in {r["pid"] for r in outage.log_records() if r.get("msg") == "worker started"}
    generated = datetime.fromisoformat(data["generated_at"].replace("Z", "+00:00"))
    assert abs(generated.timestamp() - time.time()) < 60  # wall clock, not monotonic
    started = datetime.fromisoformat(data["started_at"].replace("Z", "+00:00"))
    assert started <= generated and 0 <= data["uptime_seconds"] < 120
    [logged] = [r for r in outage.log_records() if r.get("msg") == "worker started"]
    assert (data["version"], data["config_sha256"]) == (__version__, logged["config_sha256"])
    binary = os.environ.get("TINYGW_BINARY")  # the frozen build (make test-frozen) hashes itself
    expected = hashlib.sha256(Path(binary).read_bytes()).hexdigest() if binary else None
    assert data["artifact_sha256"] == expected
    assert data["workers"] == [{"slot": 1, "pid": pid, "started_at": data["workers"][0]["started_at"]}]
    assert data["models"] == [
        {"name": "m", "strategy": "failover", "targets": ["down:Qwen3"]},
        {"name": "n", "strategy": "failover", "targets": ["up:fake-model"]},
    ]

    down = provider_entry(data, "down")
    assert (down["api"], down["listing"]) == ("openai", {"enabled": False, "up": None, "models": None})
    [circuit] = down["circuits"]
    assert (circuit["provider_model"], circuit["state"], circuit["consecutive_failures"]) == (
        "Qwen3",
        "Circuit Open",
        2,
    )
    assert circuit["pause_seconds"] == 300
    assert 1 <= circuit["next_probe_seconds"] <= 300
    assert circuit["last_error"] == "502"
    next_probe = datetime.fromisoformat(circuit["next_probe_at"].replace("Z", "+00:00")).timestamp()
    assert time.time() < next_probe <= time.time() + 301
    opened = datetime.fromisoformat(circuit["opened_at"].replace("Z", "+00:00")).timestamp()
    assert time.time() - 60 < opened <= time.time() + 1

    up = provider_entry(data, "up")
    assert up["listing"] == {"enabled": True, "up": True, "models": 1}
    [circuit] = up["circuits"]
    assert circuit == {
        "provider_model": "fake-model",
        "state": "Circuit Closed",
        "consecutive_failures": 0,
        "pause_seconds": 300,
        "next_probe_seconds": None,
        "next_probe_at": None,
        "opened_at": None,
        "last_error": None,
    }


def test_status_html_shows_the_open_circuit_without_script_or_secrets(outage):
    status, headers, body = call("GET", f"{outage.url}/status")
    assert status == 200 and headers["content-type"] == "text/html; charset=utf-8"
    page = body.decode()
    assert '<meta http-equiv="refresh" content="5">' in page
    assert "<script" not in page.lower()
    assert "Circuit Open" in page and "Circuit Closed" in page
    assert re.search(r"next probe in \d+ s", page)
    pid = status_json(outage)["worker"]["pid"]
    assert f"Answered by worker PID {pid}" in page
    assert "Listing: up, 1 model" in page and "Listing: off" in page
    data = status_json(outage)
    for fact in (data["config_sha256"], __version__, "down:Qwen3", "up:fake-model", "Up since"):
        assert fact in page, fact
    json_body = call("GET", f"{outage.url}/status.json")[2].decode()
    for text in (page, json_body):
        assert PROVIDER_KEY not in text and "K1" not in text and "gw-key-status" not in text
        assert "127.0.0.1" not in text  # no base URL either


def test_status_pages_take_get_only(outage):
    assert call("POST", f"{outage.url}/status", b"")[0] == 405
    assert call("POST", f"{outage.url}/status.json", b"")[0] == 405


def test_every_value_of_the_html_is_escaped():
    hostile = "<img src=x onerror=alert(1)>"
    page = render_html(
        {
            "worker": {"pid": 7, "slot": 1},
            "version": hostile,
            "artifact_sha256": hostile,
            "config_sha256": hostile,
            "generated_at": hostile,
            "started_at": hostile,
            "uptime_seconds": 3.5,
            "workers": [{"slot": 1, "pid": 7, "started_at": hostile}],
            "models": [{"name": hostile, "strategy": "failover", "targets": [hostile]}],
            "summary": {
                "open_circuits": 0,
                "half_open_circuits": 1,
                "providers_listing_down": [hostile],
                "keys_resting": {hostile: 1},
            },
            "providers": [
                {
                    "name": hostile,
                    "api": "openai",
                    "listing": {"enabled": True, "up": False, "models": None},
                    "key_pool": {
                        "keys": 2,
                        "resting_keys": 1,
                        "resting": [{"key": 1, "worker": 1, "seconds_left": 3.5, "until": hostile}],
                    },
                    "circuits": [
                        {
                            "worker": 1,
                            "provider_model": hostile,
                            "state": "Circuit Half-Open",
                            "consecutive_failures": 0,
                            "pause_seconds": 60,
                            "next_probe_seconds": None,
                            "next_probe_at": None,
                            "opened_at": None,
                            "last_error": hostile,
                        }
                    ],
                }
            ],
        }
    )
    assert hostile not in page and "<img" not in page
    assert page.count("&lt;img src=x onerror=alert(1)&gt;") == 13
    assert "Circuit Half-Open" in page and "not up" in page


# ---- what on-call reads first: the summary, open circuits on top, the key pools -----------------

POOL_KEYS = {"K1": "sk-pool-first", "K2": "sk-pool-second"}


def _mixed_script():
    """`zz`'s fake: its listing fails, `zulu` answers 502, the first key gets a 429 with
    Retry-After 120 for `alpha`, everything else is healthy."""
    healthy = well_behaved("zz")

    def script(r):
        if r.method == "GET":
            return json_reply(502, {"error": {"message": "listing down", "type": "server_error"}})
        model = r.json().get("model")
        if model == "zulu":
            return json_reply(502, {"error": {"message": "upstream down", "type": "server_error"}})
        if model == "alpha" and r.headers.get("authorization") == f"Bearer {POOL_KEYS['K1']}":
            return json_reply(429, {"error": {"message": "slow down", "type": "rate_limit"}}, [("retry-after", "120")])
        return healthy(r)

    return script


@pytest.fixture
def mixed(fake, healthy, start_gateway):
    """Provider `aa` (first by name, healthy, one closed circuit) and `zz`: a key pool of two
    keys, the first resting 120 s; `zz:alpha` closed (configured first), `zz:zulu` open; its
    listing down."""
    fake.script = _mixed_script()
    config = {
        "providers": {
            "aa": {"base_url": f"{healthy.url}/v1", "api": "openai", "listing": False},
            "zz": {"base_url": f"{fake.url}/v1", "api": "openai", "api_key_env": ["K1", "K2"]},
        },
        "models": {
            "alpha": {"targets": ["zz:alpha"]},
            "zulu": {"targets": ["zz:zulu"]},
            "first": {"targets": ["aa:fake-model"]},
        },
    }
    gateway = start_gateway(
        config,
        **POOL_KEYS,
        PROVIDER_RETRY_FAST_FAILURES="false",
        PROVIDER_BREAKER_FAILURES="2",
        PROVIDER_BREAKER_OPEN_SECONDS="300",
        PROVIDER_HEALTH_CHECK_SECONDS="0",
    )
    chat = f"{gateway.url}{CHAT}"
    assert call("POST", chat, {"model": "first"})[0] == 200
    assert call("POST", chat, {"model": "alpha"})[0] == 200  # the first key's 429, then the second key
    for _ in range(2):
        assert call("POST", chat, {"model": "zulu"})[0] == 502
    wait_until(lambda: status_json(gateway)["summary"]["open_circuits"] == 1, what="zz:zulu open")
    return gateway


def test_status_json_sums_up_what_is_down_and_puts_it_first(mixed):
    data = status_json(mixed)
    assert list(data)[:4] == ["version", "artifact_sha256", "config_sha256", "summary"]
    assert data["summary"] == {
        "open_circuits": 1,
        "half_open_circuits": 0,
        "providers_listing_down": ["zz"],
        "keys_resting": {"zz": 1},
    }
    assert [p["name"] for p in data["providers"]] == ["zz", "aa"]  # the provider with an open circuit first
    zz = data["providers"][0]
    assert [(c["provider_model"], c["state"]) for c in zz["circuits"]] == [
        ("zulu", "Circuit Open"),
        ("alpha", "Circuit Closed"),
    ]


def test_status_json_shows_each_key_pool_and_never_a_key(mixed):
    data = status_json(mixed)
    pool = provider_entry(data, "zz")["key_pool"]
    assert (pool["keys"], pool["resting_keys"]) == (2, 1)
    [rest] = pool["resting"]
    assert (rest["key"], rest["worker"]) == (1, 1)  # the first key of api_key_env, by its place
    assert 60 < rest["seconds_left"] <= 120
    until = datetime.fromisoformat(rest["until"].replace("Z", "+00:00")).timestamp()
    assert time.time() + 60 < until <= time.time() + 121
    assert provider_entry(data, "aa")["key_pool"] == {"keys": 0, "resting_keys": 0, "resting": []}
    for path in ("/status", "/status.json"):
        text = call("GET", f"{mixed.url}{path}")[2].decode()
        for secret in (*POOL_KEYS.values(), *POOL_KEYS):
            assert secret not in text, (path, secret)


def test_status_html_has_the_summary_on_top_and_open_circuits_first(mixed):
    page = call("GET", f"{mixed.url}/status")[2].decode()
    summary = re.search(r'<p class="summary">(.*?)</p>', page)
    assert summary, page[:2000]
    text = re.sub(r"<[^>]+>", "", summary.group(1))
    assert text == "1 circuit open · 0 half-open · listing down: zz · keys resting: zz 1"
    assert page.index('class="summary"') < page.index('class="facts"') < page.index("<section>")
    assert page.index("Circuit Open") < page.index("Circuit Closed")
    assert page.index("<h2>zz ") < page.index("<h2>aa ")
    assert re.search(r"Key pool: 2 keys, 1 resting: key 1 on worker 1 until \S+Z \(\d+ s\)", page)


# ---- a real browser --------------------------------------------------------------------


@pytest.fixture(scope="session")
def chromium() -> Path:
    """/usr/bin/chromium, installed from the distribution's packages when missing."""
    if CHROMIUM.exists():
        return CHROMIUM
    started = time.monotonic()
    try:
        done = subprocess.run(
            ["bash", "-c", "apt-get update -qq && apt-get install -y -qq chromium"],
            env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "DEBIAN_FRONTEND": "noninteractive"},
            capture_output=True,
            text=True,
            timeout=INSTALL_SECONDS,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"chromium is not installed and installing it failed: {type(e).__name__}: {e}")
    took = time.monotonic() - started
    if done.returncode != 0 or not CHROMIUM.exists():
        pytest.skip(
            f"chromium is not installed and `apt-get install chromium` failed "
            f"(exit {done.returncode}) after {took:.0f} s: {done.stderr[-500:]}"
        )
    print(f"\ninstalled chromium in {took:.0f} s")
    return CHROMIUM


def headless(chromium: Path, profile: Path, *args: str) -> subprocess.CompletedProcess:
    command = [
        str(chromium),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-quic",
        f"--user-data-dir={profile}",
        *args,
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=BROWSER_SECONDS)


def test_chromium_renders_the_open_circuit_and_the_seconds_to_its_probe(outage_on_two_workers, chromium, tmp_path):
    outage = outage_on_two_workers
    url = f"{outage.url}/status"
    before = max(c["next_probe_seconds"] for c in provider_entry(status_json(outage), "down")["circuits"])
    dom = headless(chromium, tmp_path / "profile-dom", "--dump-dom", url)
    after = min(c["next_probe_seconds"] for c in provider_entry(status_json(outage), "down")["circuits"])
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert dom.stdout.count("Circuit Open") == 1 and dom.stdout.count("Circuit Closed") == 1  # the one table
    assert status_json(outage)["config_sha256"] in dom.stdout
    shown = re.search(r"next probe in (\d+) s", dom.stdout)
    assert shown, dom.stdout[-2000:]
    assert math.ceil(after) <= int(shown.group(1)) <= math.ceil(before)

    assert "1 circuit open" in dom.stdout
    assert dom.stdout.index('class="summary"') < dom.stdout.index("Circuit Open") < dom.stdout.index("Circuit Closed")

    screenshot = tmp_path / "status.png"
    shot = headless(chromium, tmp_path / "profile-shot", "--window-size=1200,900", f"--screenshot={screenshot}", url)
    assert shot.returncode == 0, shot.stderr[-2000:]
    assert screenshot.exists() and screenshot.stat().st_size > 5 * 1024
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    artifacts = ROOT / "artifacts"
    artifacts.mkdir(exist_ok=True)
    shutil.copyfile(screenshot, artifacts / "status.png")
