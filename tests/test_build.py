"""The build's bookkeeping, without building: what goes into the build root's venv, how
release.json records the root, and what `make reproduce REFERENCE=` says when a release
differs (docs/design.md section 8). `make reproduce` and `make test-frozen` build for real."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "build"))
import release  # noqa: E402 -- build/ is on sys.path only from here
import reproduce  # noqa: E402 -- as above

MANIFEST = """\
release bookworm
include python3 python3-venv libpython3.11 binutils usr-is-merged
mmdebstrap 1.3.5
recipe 1111111111111111111111111111111111111111111111111111111111111111
aptopt Acquire::Check-Valid-Until "false";
fetched 2026-11-30T09:18:00Z
source http://deb.debian.org/debian/ bookworm Sat, 11 Jul 2026 10:16:37 UTC
source http://deb.debian.org/debian-security/ bookworm-security Sat, 28 Nov 2026 02:53:00 UTC
package libpython3.11 3.11.2-6+deb12u9 amd64 5737023cb469c012203bc6f4e6f522459d7561be499a69139df278785ec62129
package python3-pip-whl 23.0.1+dfsg-1 all 2222222222222222222222222222222222222222222222222222222222222222
tar 3333333333333333333333333333333333333333333333333333333333333333
"""


def test_the_root_gets_the_runtime_lock_and_pyinstallers_pins_only():
    pins = {name: lock.name for name, _, _, lock in release.build_pins()}
    runtime = set(release.lock_entries(release.RUNTIME_LOCK))
    assert {name for name, lock in pins.items() if lock == "runtime.lock"} == runtime
    # PyInstaller and what dev.lock says it needs, found through the lock's "# via" lines.
    assert {name for name, lock in pins.items() if lock == "dev.lock"} >= {
        "pyinstaller",
        "altgraph",
        "pyinstaller-hooks-contrib",
    }
    assert not pins.keys() & {"pytest", "openai", "anthropic", "hypothesis", "prometheus-client"}


def test_the_requirements_carry_the_locks_hashes():
    printed = subprocess.run(
        [sys.executable, str(ROOT / "build" / "release.py"), "requirements"], check=True, capture_output=True, text=True
    ).stdout
    blocks = re.split(r"\n(?=\S)", printed.strip())  # a pin, then its hashes and comments
    assert sorted(block.split("==")[0] for block in blocks) == sorted(name for name, *_ in release.build_pins())
    assert all("\n    --hash=sha256:" in block for block in blocks)


def test_release_json_records_the_build_root_from_its_manifest(tmp_path):
    (tmp_path / "manifest").write_text(MANIFEST)
    root = release.build_root(tmp_path / "manifest")
    assert root["release"] == "bookworm" and root["mmdebstrap"] == "1.3.5"
    assert root["include"] == ["python3", "python3-venv", "libpython3.11", "binutils", "usr-is-merged"]
    assert root["packages"][1] == {
        "name": "python3-pip-whl",
        "version": "23.0.1+dfsg-1",
        "architecture": "all",
        "sha256": "2" * 64,
    }
    assert root["package_lists"] == {
        "fetched": "2026-11-30T09:18:00Z",
        "sources": [
            {"uri": "http://deb.debian.org/debian/", "suite": "bookworm", "date": "Sat, 11 Jul 2026 10:16:37 UTC"},
            {
                "uri": "http://deb.debian.org/debian-security/",
                "suite": "bookworm-security",
                "date": "Sat, 28 Nov 2026 02:53:00 UTC",
            },
        ],
    }
    assert root["apt_options"] == ['Acquire::Check-Valid-Until "false";']
    assert (root["recipe_sha256"], root["tar_sha256"]) == ("1" * 64, "3" * 64)
    (tmp_path / "manifest").write_text(MANIFEST + "surprise line\n")
    with pytest.raises(ValueError, match="surprise line"):
        release.build_root(tmp_path / "manifest")


def _release(tmp_path, name: str, sha256: str, packages: list[tuple[str, str]], commit: str = "c" * 40):
    folder = tmp_path / name
    folder.mkdir()
    record = {
        "version": "0.1.0",
        "source_commit": commit,
        "lock_sha256": "l" * 64,
        "artifact": {"name": "tinygw", "sha256": sha256},
        "build_root": {
            "release": "bookworm",
            "package_lists": {"fetched": "2026-11-30T09:18:00Z"},
            "packages": [{"name": n, "version": v, "architecture": "amd64", "sha256": v * 4} for n, v in packages],
        },
    }
    (folder / "release.json").write_text(json.dumps(record))
    return folder


def test_reproduce_against_a_release_names_moved_packages_first(tmp_path, capsys):
    built = _release(tmp_path, "built", "b" * 64, [("libc6", "2.36-9+deb12u14"), ("python3.11", "3.11.2-6+deb12u9")])
    reference = _release(
        tmp_path,
        "ref",
        "a" * 64,
        [("libc6", "2.36-9+deb12u14"), ("python3.11", "3.11.2-6+deb12u8"), ("perl", "5.36.0-7")],
        commit="d" * 40,
    )
    assert reproduce.compare_with_reference(reference / "release.json", built / "tinygw") == 1
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith(f"reproduce: DIFFERENT from the release in {reference / 'release.json'}")
    assert lines[1:3] == [
        "reproduce:   build root: perl: 5.36.0-7 (amd64) in the reference's root; not in this one",
        "reproduce:   build root: python3.11: 3.11.2-6+deb12u8 (amd64) in the reference's root, "
        "3.11.2-6+deb12u9 (amd64) in this one",
    ]
    assert lines[3] == f"reproduce:   input source_commit: {'d' * 40!r} in the reference, {'c' * 40!r} here"
    assert "to name the first differing archive member" in lines[4]


def test_reproduce_against_the_same_release_says_identical(tmp_path, capsys):
    built = _release(tmp_path, "built", "b" * 64, [("libc6", "2.36-9+deb12u14")])
    assert reproduce.compare_with_reference(built / "release.json", built / "tinygw") == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"reproduce: this build  sha256 {'b' * 64}  {built / 'tinygw'}"
    assert out[1] == f"reproduce: the release sha256 {'b' * 64}  {built / 'release.json'}"
    assert out[2] == f"reproduce: identical to the release in {built / 'release.json'}"


def test_two_builds_may_differ_only_in_when_their_lists_were_fetched():
    first = {"artifact": {"sha256": "a"}, "build_root": {"tar_sha256": "t", "package_lists": {"fetched": "09:18"}}}
    later = json.loads(json.dumps(first))
    later["build_root"]["package_lists"]["fetched"] = "09:31"
    assert (
        reproduce.differing_fields(
            reproduce._without(first, reproduce.FETCH_FIELDS), reproduce._without(later, reproduce.FETCH_FIELDS)
        )
        == []
    )
    later["build_root"]["tar_sha256"] = "u"
    assert reproduce.differing_fields(first, later) == ["build_root.package_lists.fetched", "build_root.tar_sha256"]
