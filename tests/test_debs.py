"""Any release rebuilds, any day (docs/design.md section 8): the build root's .debs fetched by
exact version and sha256 from the mirror, else the snapshot archive, else DEBS_DIR
(build/debs.py, against a fake archive served on loopback); `make release-check`'s comparison;
and `make reproduce REFERENCE=` refusing a release whose commit this clone lacks. No build and
no Debian mirror: `make reproduce REFERENCE=release/release.json` builds for real."""

from __future__ import annotations

import hashlib
import http.server
import json
import lzma
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from conftest import ROOT, closed_port

DEBS = ROOT / "build" / "debs.py"
FIXTURE = ROOT / "tests" / "data" / "release-b2c6bbe.json"  # release/release.json as it was for b2c6bbe

# Two packages as a release pins them: zlib1g's version has since left bookworm-security (an update
# replaced it), as Debian's security archive does.
OLD_ZLIB = b"zlib1g 1:1.2.13.dfsg-1, not a real .deb"
NEW_ZLIB = b"zlib1g 1:1.2.13.dfsg-1+deb12u1, not a real .deb"
BASE_FILES = b"base-files 12.4+deb12u15, not a real .deb"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def manifest(tmp_path: Path, *packages: tuple[str, str, bytes]) -> Path:
    path = tmp_path / "build-root.txt"
    lines = ["release bookworm", "include python3"]
    lines += [f"package {name} {version} amd64 {sha256(data)}" for name, version, data in packages]
    path.write_text("\n".join(lines) + "\n")
    return path


def publish(base: Path, suite: str, debs: list[tuple[str, str, bytes]], listed_sha256: str | None = None) -> None:
    """A suite of a fake archive at `base`: its Packages.xz and the .debs in its pool."""
    paragraphs = []
    for name, version, data in debs:
        filename = f"pool/main/{name[0]}/{name}/{name}_{version.split(':')[-1]}_amd64.deb"
        (base / filename).parent.mkdir(parents=True, exist_ok=True)
        (base / filename).write_bytes(data)
        paragraphs.append(
            f"Package: {name}\nVersion: {version}\nArchitecture: amd64\nDescription: x\n more\n"
            f"Filename: {filename}\nSize: {len(data)}\nSHA256: {listed_sha256 or sha256(data)}\n"
        )
    index = base / "dists" / suite / "main" / "binary-amd64" / "Packages.xz"
    index.parent.mkdir(parents=True, exist_ok=True)
    index.write_bytes(lzma.compress("\n".join(paragraphs).encode()))


@pytest.fixture
def archive(tmp_path):
    """A directory served over HTTP on loopback: (its path, its URL)."""
    served = tmp_path / "served"
    served.mkdir()

    class Files(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args):
            super().__init__(*args, directory=str(served))

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Files)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield served, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def mirror_of_today(served: Path) -> None:
    """The mirror as it is after the update: bookworm has base-files, security the new zlib1g."""
    publish(served / "debian", "bookworm", [("base-files", "12.4+deb12u15", BASE_FILES)])
    publish(served / "debian", "bookworm-updates", [])
    publish(served / "debian-security", "bookworm-security", [("zlib1g", "1:1.2.13.dfsg-1+deb12u1", NEW_ZLIB)])


def fetch(m: Path, cache: Path, url: str, *extra: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, str(DEBS), "fetch", str(m), str(cache)]
    command += ["--mirror", f"{url}/debian/", "--security-mirror", f"{url}/debian-security", *extra]
    env = {"PATH": "/usr/bin:/bin"}  # neither DEBIAN_SNAPSHOT nor DEBS_DIR unless given
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=60, check=False)


def test_each_deb_comes_from_the_mirror_by_version_and_sha256(tmp_path, archive):
    served, url = archive
    mirror_of_today(served)
    publish(served / "debian-security", "bookworm-security", [("zlib1g", "1:1.2.13.dfsg-1", OLD_ZLIB)])
    m = manifest(tmp_path, ("base-files", "12.4+deb12u15", BASE_FILES), ("zlib1g", "1:1.2.13.dfsg-1", OLD_ZLIB))
    done = fetch(m, tmp_path / "cache", url)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "cache" / f"{sha256(OLD_ZLIB)}.deb").read_bytes() == OLD_ZLIB
    assert (tmp_path / "cache" / f"{sha256(BASE_FILES)}.deb").read_bytes() == BASE_FILES
    # Cached: a second fetch needs no archive at all.
    again = fetch(m, tmp_path / "cache", f"http://127.0.0.1:{closed_port()}")
    assert again.returncode == 0, again.stderr


def test_a_version_gone_from_the_mirror_comes_from_debs_dir_by_sha256(tmp_path, archive):
    served, url = archive
    mirror_of_today(served)
    debs_dir = tmp_path / "auditor's debs" / "nested"
    debs_dir.mkdir(parents=True)
    (debs_dir / "any-name.deb").write_bytes(OLD_ZLIB)
    (debs_dir / "other.deb").write_bytes(NEW_ZLIB)
    m = manifest(tmp_path, ("base-files", "12.4+deb12u15", BASE_FILES), ("zlib1g", "1:1.2.13.dfsg-1", OLD_ZLIB))
    done = fetch(m, tmp_path / "cache", url, "--debs-dir", str(tmp_path / "auditor's debs"))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "cache" / f"{sha256(OLD_ZLIB)}.deb").read_bytes() == OLD_ZLIB


def test_a_deb_whose_bytes_are_not_the_pinned_ones_is_refused_and_the_next_place_tried(tmp_path, archive):
    served, url = archive
    mirror_of_today(served)
    # The mirror lists the pinned sha256 but serves other bytes.
    publish(served / "debian", "bookworm", [("zlib1g", "1:1.2.13.dfsg-1", NEW_ZLIB)], listed_sha256=sha256(OLD_ZLIB))
    (tmp_path / "debs").mkdir()
    (tmp_path / "debs" / "zlib1g.deb").write_bytes(OLD_ZLIB)
    m = manifest(tmp_path, ("zlib1g", "1:1.2.13.dfsg-1", OLD_ZLIB))
    done = fetch(m, tmp_path / "cache", url, "--debs-dir", str(tmp_path / "debs"))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "cache" / f"{sha256(OLD_ZLIB)}.deb").read_bytes() == OLD_ZLIB


def test_the_snapshot_archive_is_tried_when_debian_snapshot_is_set(tmp_path, archive):
    served, url = archive
    mirror_of_today(served)
    then = served / "archive" / "debian-security" / "20261201T084548Z"
    publish(then, "bookworm-security", [("zlib1g", "1:1.2.13.dfsg-1", OLD_ZLIB)])
    publish(served / "archive" / "debian" / "20261201T084548Z", "bookworm", [])
    publish(served / "archive" / "debian" / "20261201T084548Z", "bookworm-updates", [])
    m = manifest(tmp_path, ("zlib1g", "1:1.2.13.dfsg-1", OLD_ZLIB))
    snapshot = ["--snapshot", "20261201T084548Z", "--snapshot-archive", f"{url}/archive"]
    done = fetch(m, tmp_path / "cache", url, *snapshot)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "cache" / f"{sha256(OLD_ZLIB)}.deb").read_bytes() == OLD_ZLIB


def test_a_package_found_nowhere_is_named_with_the_three_places_tried(tmp_path, archive):
    served, url = archive
    mirror_of_today(served)
    (tmp_path / "debs").mkdir()
    (tmp_path / "debs" / "zlib1g.deb").write_bytes(NEW_ZLIB)
    m = manifest(tmp_path, ("base-files", "12.4+deb12u15", BASE_FILES), ("zlib1g", "1:1.2.13.dfsg-1", OLD_ZLIB))
    done = fetch(m, tmp_path / "cache", url, "--debs-dir", str(tmp_path / "debs"))
    assert done.returncode == 1
    [line] = done.stderr.splitlines()
    assert line.startswith(f"debs.py: zlib1g 1:1.2.13.dfsg-1 (amd64, sha256 {sha256(OLD_ZLIB)}) found nowhere: ")
    mirror, snapshot, debs_dir = line.split(" found nowhere: ")[1].split("; ")
    assert mirror == (
        f"the mirror ({url}/debian bookworm, bookworm-updates and {url}/debian-security bookworm-security): "
        "no such version"
    )
    assert snapshot == "the snapshot archive: DEBIAN_SNAPSHOT is not set"
    assert debs_dir == f"DEBS_DIR={tmp_path / 'debs'}: no .deb with that sha256"
    # Without a reachable mirror nor DEBS_DIR, each place still says why.
    done = fetch(m, tmp_path / "cache", f"http://127.0.0.1:{closed_port()}")
    assert done.returncode == 1
    reasons = done.stderr.split(" found nowhere: ")[1].strip().split("; ")
    assert "unreachable" in reasons[0] and reasons[1:] == [
        "the snapshot archive: DEBIAN_SNAPSHOT is not set",
        "DEBS_DIR: not set",
    ]


def test_the_root_is_made_from_a_repository_of_exactly_the_fetched_debs(tmp_path):
    package = tmp_path / "pkg"
    (package / "DEBIAN").mkdir(parents=True)
    (package / "DEBIAN" / "control").write_text(
        "Package: tinygw-probe\nVersion: 1:1.0-1\nArchitecture: all\nMaintainer: x <x@example.org>\n"
        "Description: a probe\n two lines\n"
    )
    subprocess.run(["dpkg-deb", "--root-owner-group", "--build", str(package), str(tmp_path / "p.deb")], check=True)
    data = (tmp_path / "p.deb").read_bytes()
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / f"{sha256(data)}.deb").write_bytes(data)
    m = tmp_path / "build-root.txt"
    m.write_text(f"release bookworm\npackage tinygw-probe 1:1.0-1 all {sha256(data)}\n")
    subprocess.run(
        [sys.executable, str(DEBS), "repo", str(m), str(tmp_path / "cache"), str(tmp_path / "repo")], check=True
    )
    assert (tmp_path / "repo" / "tinygw-probe_1%3a1.0-1_all.deb").read_bytes() == data
    index = (tmp_path / "repo" / "Packages").read_text()
    assert "Package: tinygw-probe\n" in index and "Description: a probe\n two lines\n" in index
    assert f"Filename: ./tinygw-probe_1%3a1.0-1_all.deb\nSize: {len(data)}\nSHA256: {sha256(data)}\n" in index


def test_a_releases_manifest_is_its_build_root(tmp_path):
    subprocess.run([sys.executable, str(DEBS), "manifest", str(FIXTURE), str(tmp_path / "m")], check=True)
    lines = (tmp_path / "m").read_text().splitlines()
    root = json.loads(FIXTURE.read_text())["build_root"]
    assert [line.split(" ")[1:] for line in lines if line.startswith("package ")] == [
        [p["name"], p["version"], p["architecture"], p["sha256"]] for p in root["packages"]
    ]
    assert (
        "package zlib1g 1:1.2.13.dfsg-1 amd64 " + next(p["sha256"] for p in root["packages"] if p["name"] == "zlib1g")
        in lines
    )
    assert [line.split(" ")[2] for line in lines if line.startswith("source ")] == [
        "bookworm",
        "bookworm-updates",
        "bookworm-security",
    ]
    assert 'aptopt Acquire::Check-Valid-Until "false";' in lines
    assert not [line for line in lines if line.split(" ")[0] in ("mmdebstrap", "recipe", "tar")]


def test_release_check_names_each_package_with_a_newer_version(tmp_path):
    record = json.loads(FIXTURE.read_text())
    now = tmp_path / "now.txt"
    lines = [
        f"package {p['name']} {p['version']} {p['architecture']} {p['sha256']}"
        for p in record["build_root"]["packages"]
        if p["name"] != "zlib1g"
    ]
    now.write_text("\n".join([*lines, f"package zlib1g 1:1.2.13.dfsg-1+deb12u1 amd64 {'e' * 64}"]) + "\n")
    command = [sys.executable, str(DEBS), "stale", str(FIXTURE), str(now)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    assert done.returncode == 1
    assert done.stdout.splitlines()[0] == (
        "release-check: zlib1g: 1:1.2.13.dfsg-1 in the release, 1:1.2.13.dfsg-1+deb12u1 on the mirror now (newer)"
    )
    assert "STALE" in done.stdout.splitlines()[1] and len(done.stdout.splitlines()) == 2
    now.write_text("\n".join([*lines, f"package zlib1g 1:1.2.13.dfsg-1 amd64 {'e' * 64}"]) + "\n")
    now.write_text(now.read_text().replace(f"zlib1g 1:1.2.13.dfsg-1 amd64 {'e' * 64}", _zlib_line(record)))
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    assert done.returncode == 0 and "current" in done.stdout


def _zlib_line(record: dict) -> str:
    zlib = next(p for p in record["build_root"]["packages"] if p["name"] == "zlib1g")
    return f"zlib1g {zlib['version']} amd64 {zlib['sha256']}"


def test_reproduce_refuses_a_release_whose_commit_is_not_in_the_history(tmp_path):
    record = json.loads(FIXTURE.read_text())
    record["source_commit"] = "f" * 40
    (tmp_path / "release.json").write_text(json.dumps(record))
    command = [sys.executable, str(ROOT / "build" / "reproduce.py"), "--reference", str(tmp_path / "release.json")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2
    assert f"the release's source commit {'f' * 40} is not in the git history" in done.stderr
    assert "building" not in done.stdout
