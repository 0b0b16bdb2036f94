"""The frozen executable, build/dist/tinygw: what a deployment runs (docs/design.md section 8).

`make test-frozen` builds it, runs these tests, then runs the black-box suites against
it too (TINYGW_BINARY). Plain `make test` leaves this file out: a binary left from an
earlier build need not match the sources under test. These tests cover what only the
frozen build has: its self-hash, the contents of its archive, that it runs no code from
outside it, and a real `serve` with two spawned workers.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import certifi
import openai
import pytest

from conftest import ROOT, call, wait_until
from tinygw import __version__

BINARY = ROOT / "build" / "dist" / "tinygw"
pytestmark = pytest.mark.skipif(
    not BINARY.exists(), reason="build/dist/tinygw is not built; `make test-frozen` builds it and runs these tests"
)

RUNTIME_PACKAGES = {"tinygw", "granian", "msgspec", "h11", "certifi"}  # always inside
# Besides those, only what requirements/runtime.lock pins may be inside (cryptography, say).
RUNTIME_LOCKED = {
    re.sub(r"[-.]", "_", name.lower())
    for name in re.findall(
        r"^([A-Za-z0-9][A-Za-z0-9._-]*)==", (ROOT / "requirements" / "runtime.lock").read_text(), re.MULTILINE
    )
}
TEST_PACKAGES = {"openai", "anthropic", "pytest", "_pytest", "prometheus_client"}
GATEWAY_KEY = "gw-frozen-4e1b"
PROVIDER_KEY = "sk-prov-frozen-77d2"
CONFIG = {
    "providers": {"oa": {"base_url": "FAKE/v1", "api": "openai", "api_key_env": "OA_KEY", "listing": False}},
    "models": {"gpt-x": {"targets": ["oa:upstream-gpt"]}},
}


def run_binary(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BINARY), *args],
        cwd=cwd,
        env={"PATH": os.environ.get("PATH", ""), **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def archive():
    from PyInstaller.archive.readers import CArchiveReader

    return CArchiveReader(str(BINARY))


def test_version_prints_the_sha256_of_the_executable(tmp_path):
    done = run_binary(["version"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"tinygw {__version__} sha256:{hashlib.sha256(BINARY.read_bytes()).hexdigest()}\n"


def test_runs_no_code_from_outside_the_executable(tmp_path):
    # What was measured is what runs: neither PYTHONPATH nor the working directory can
    # put a module in front of the bundled ones, and no sitecustomize is imported.
    planted = tmp_path / "tinygw"
    planted.mkdir()
    (planted / "__init__.py").write_text('__version__ = "planted"\n')
    (tmp_path / "sitecustomize.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    done = run_binary(["version"], tmp_path, PYTHONPATH=str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"tinygw {__version__} sha256:")
    assert not (tmp_path / "ran").exists()


def test_check_prints_what_the_source_prints(tmp_path):
    env = {
        "TINYGW_CONFIG": json.dumps(CONFIG).replace("FAKE", "http://127.0.0.1:9"),
        "OA_KEY": PROVIDER_KEY,
        "TINYGW_API_KEYS": GATEWAY_KEY,
        "PROVIDER_BREAKER_FAILURES": "3",
    }
    frozen = run_binary(["check"], tmp_path, **env)
    source = subprocess.run(
        [sys.executable, "-m", "tinygw", "check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(ROOT), **env},
        timeout=60,
    )
    assert frozen.returncode == source.returncode == 0, frozen.stderr + source.stderr
    assert "config_sha256: " in frozen.stdout and PROVIDER_KEY not in frozen.stdout
    assert frozen.stdout == source.stdout  # the same effective configuration, the same hash


def test_serves_plain_and_streamed_chat_with_two_workers(fake, start_gateway, monkeypatch):
    monkeypatch.setenv("TINYGW_BINARY", str(BINARY))
    config = json.loads(json.dumps(CONFIG).replace("FAKE", fake.url))
    gateway = start_gateway(config, OA_KEY=PROVIDER_KEY, TINYGW_API_KEYS=GATEWAY_KEY, TINYGW_WORKERS="2")
    assert gateway.process.args[0] == str(BINARY)
    workers = set()

    def both_workers_answered() -> bool:  # each call is a new connection, spread over the workers
        workers.add(json.loads(call("GET", f"{gateway.url}/status.json")[2])["worker"]["pid"])
        return len(workers) == 2

    wait_until(both_workers_answered, seconds=20, what="both spawned workers to answer")
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=GATEWAY_KEY, max_retries=0, timeout=10)
    messages = [{"role": "user", "content": "hi"}]
    for _ in range(3):
        answer = client.chat.completions.create(model="gpt-x", messages=messages)
        assert answer.choices[0].message.content == "Hello from fake."
        stream = client.chat.completions.create(model="gpt-x", messages=messages, stream=True)
        assert "".join(chunk.choices[0].delta.content or "" for chunk in stream) == "Hello from fake."
    assert len(fake.requests) == 6
    for request in fake.requests:
        assert request.path == "/v1/chat/completions"
        assert request.json()["model"] == "upstream-gpt"
        assert request.headers["authorization"] == f"Bearer {PROVIDER_KEY}"
    assert [r.json().get("stream", False) for r in fake.requests] == [False, True] * 3


def test_holds_the_runtime_packages_and_no_test_dependency():
    pkg = archive()
    pyz = pkg.open_embedded_archive("PYZ.pyz")
    packages = {name.split(".")[0] for name in pyz.toc}
    assert not packages & TEST_PACKAGES
    bundled = packages - set(sys.stdlib_module_names)
    assert RUNTIME_PACKAGES <= bundled <= RUNTIME_PACKAGES | RUNTIME_LOCKED
    # Files outside the PYZ (extension modules, data, a package's metadata) belong to the
    # same packages or to Python.
    folders = {name.split("/")[0].split("-")[0] for name in pkg.toc if "/" in name}
    assert folders <= bundled | {f"python{sys.version_info.major}.{sys.version_info.minor}"}


def test_bundles_the_locked_trust_roots():
    # tinygw/upstream/pool.py loads certifi.where(), which in the frozen build is this member.
    assert archive().extract("certifi/cacert.pem") == Path(certifi.where()).read_bytes()


def test_release_names_the_debian_root_it_was_built_in():
    # Built inside a Debian build root, not on the host: release.json lists every package of
    # the root with its .deb's sha256, and the bundled Python is the root's python3.11.
    release = json.loads((BINARY.parent / "release.json").read_text())
    assert release["artifact"]["sha256"] == hashlib.sha256(BINARY.read_bytes()).hexdigest()
    root = release["build_root"]
    assert root["release"] == "bookworm" and root["package_lists"]["fetched"]
    packages = {package["name"]: package for package in root["packages"]}
    assert set(root["include"]) <= packages.keys()
    assert all(re.fullmatch(r"[0-9a-f]{64}", package["sha256"]) for package in packages.values())
    assert packages["libpython3.11"]["version"].startswith(release["python_version"] + "-")  # 3.11.2-6+deb12u9
