"""The build root's .deb files: each fetched by its exact version and checked by its sha256.

docs/design.md section 8 ("Any release rebuilds, any day"). The Python standard library only,
run by build/buildroot.sh with the host's python3 (what it fetches is pinned by sha256, so
nothing of the host decides the root's bytes) and imported by build/reproduce.py:

    debs.py fetch MANIFEST CACHE --mirror URI --security-mirror URI [--snapshot T] [--debs-dir DIR]
        put every package of MANIFEST (build/buildroot.sh's format) into CACHE as SHA256.deb,
        from the first place that has that version with that sha256: CACHE itself, the mirror
        (bookworm and bookworm-updates from --mirror, bookworm-security from --security-mirror,
        through their Packages indexes), the snapshot archive as of T (DEBIAN_SNAPSHOT), a
        folder of .debs (DEBS_DIR, matched by sha256 whatever the file names). A package found
        nowhere is named with the three places tried, and the exit is 1.
    debs.py repo MANIFEST CACHE REPO
        REPO: a flat apt repository of exactly MANIFEST's .debs (a Packages index of their
        own control fields), for mmdebstrap to make the root from
    debs.py manifest RELEASE_JSON OUTPUT
        OUTPUT: the manifest of a release's build root, from its release.json `build_root`
        (what `make reproduce REFERENCE=` builds from instead of today's package lists)
    debs.py stale RELEASE_JSON MANIFEST
        the release's build root against MANIFEST (today's resolution, `make release-check`):
        each package with a newer version now, or added or gone; exit 1 when any

The indexes are read without their signatures: they only say where a .deb is, and every .deb
is checked against the sha256 the manifest pins (from apt's signed lists, when resolved).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import lzma
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

ARCH = "amd64"
RELEASE = "bookworm"
SNAPSHOT_ARCHIVE = "http://snapshot.debian.org/archive"
# One index or .deb; Debian's largest Packages.xz is ~10 MB.
TIMEOUT_SECONDS = 120
# The order in which release.json lists the suites and the root's sources.list names them.
SUITES = (RELEASE, f"{RELEASE}-updates", f"{RELEASE}-security")


@dataclass(frozen=True)
class Package:
    name: str
    version: str
    architecture: str
    sha256: str

    def __str__(self) -> str:
        return f"{self.name} {self.version} ({self.architecture}, sha256 {self.sha256})"


def read_manifest(path: Path) -> list[Package]:
    """The `package NAME VERSION ARCH SHA256` lines of a build root's manifest."""
    return [Package(*line.split(" ")[1:5]) for line in path.read_text().splitlines() if line.startswith("package ")]


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def stanzas(index: str, names: set[str]) -> Iterable[dict[str, str]]:
    """The paragraphs of a Packages index for the packages in `names` (single-line fields only)."""
    for paragraph in index.split("\n\n"):
        first, _, rest = paragraph.lstrip("\n").partition("\n")
        if not first.startswith("Package: ") or first[9:] not in names:
            continue
        fields = {"Package": first[9:]}
        for line in rest.split("\n"):
            key, sep, value = line.partition(": ")
            if sep and not key.startswith(" "):
                fields[key] = value
        yield fields


# A place returns the path of a .deb it put into the cache, or the reason it has none.
Place = Callable[[Package, Path], "Path | str"]


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=TIMEOUT_SECONDS) as answer:  # noqa: S310 -- http(s) URLs only
        return answer.read()


def _index(base: str, suite: str) -> str:
    """A suite's Packages index for ARCH, in whichever compression the archive has."""
    url = f"{base.rstrip('/')}/dists/{suite}/main/binary-{ARCH}/Packages"
    for suffix, decompress in ((".xz", lzma.decompress), (".gz", gzip.decompress), ("", bytes)):
        try:
            return decompress(_get(url + suffix)).decode()
        except urllib.error.HTTPError as error:
            if error.code != 404:
                raise
    raise urllib.error.URLError(f"{url}.xz, .gz or plain: 404 Not Found")


class Archive:
    """A Debian archive's suites (a mirror, or the snapshot archive at one time), read lazily."""

    def __init__(self, label: str, suites: list[tuple[str, str]], names: set[str]):
        self.label, self.suites, self.names = label, suites, names
        self._where: dict[tuple[str, str, str], tuple[str, str]] | str | None = None

    def _load(self) -> dict[tuple[str, str, str], tuple[str, str]] | str:
        """(name, version, architecture) -> (URL, sha256) of every listed .deb, or why there is none."""
        where = {}
        for base, suite in self.suites:
            try:
                text = _index(base, suite)
            except (OSError, urllib.error.URLError, lzma.LZMAError, EOFError) as error:
                return f"{base} {suite}: {getattr(error, 'reason', error)}"
            for fields in stanzas(text, self.names):
                key = fields["Package"], fields.get("Version", ""), fields.get("Architecture", "")
                where[key] = f"{base.rstrip('/')}/{fields.get('Filename', '')}", fields.get("SHA256", "")
        return where

    def __call__(self, package: Package, cache: Path) -> Path | str:
        if self._where is None:
            self._where = self._load()
        if isinstance(self._where, str):
            return f"{self.label}: unreachable ({self._where})"
        found = self._where.get((package.name, package.version, package.architecture))
        if found is None:
            return f"{self.label}: no such version"
        url, listed = found
        if listed != package.sha256:
            return f"{self.label}: its .deb of that version has sha256 {listed}"
        try:
            data = _get(url)
        except (OSError, urllib.error.URLError) as error:
            return f"{self.label}: {url}: {getattr(error, 'reason', error)}"
        if hashlib.sha256(data).hexdigest() != package.sha256:
            return f"{self.label}: {url} has sha256 {hashlib.sha256(data).hexdigest()}"
        return _store(data, package, cache)


def _store(data: bytes, package: Package, cache: Path) -> Path:
    target = cache / f"{package.sha256}.deb"
    partial = target.with_suffix(".partial")
    partial.write_bytes(data)
    partial.replace(target)
    return target


def mirror(main: str, security: str, names: set[str]) -> Place:
    suites = [(main, RELEASE), (main, f"{RELEASE}-updates"), (security, f"{RELEASE}-security")]
    label = (
        f"the mirror ({main.rstrip('/')} {RELEASE}, {RELEASE}-updates and {security.rstrip('/')} {RELEASE}-security)"
    )
    return Archive(label, suites, names)


def snapshot(when: str | None, names: set[str], archive: str = SNAPSHOT_ARCHIVE) -> Place:
    if not when:
        return lambda package, cache: "the snapshot archive: DEBIAN_SNAPSHOT is not set"
    main, security = f"{archive.rstrip('/')}/debian/{when}", f"{archive.rstrip('/')}/debian-security/{when}"
    suites = [(main, RELEASE), (main, f"{RELEASE}-updates"), (security, f"{RELEASE}-security")]
    return Archive(f"the snapshot archive at {when} ({archive})", suites, names)


def folder(path: str | None) -> Place:
    if not path:
        return lambda package, cache: "DEBS_DIR: not set"
    by_sha256: dict[str, Path] = {}

    def find(package: Package, cache: Path) -> Path | str:
        if not by_sha256:
            for deb in sorted(Path(path).rglob("*.deb")):
                if deb.is_file():
                    by_sha256.setdefault(sha256_file(deb), deb)
        if (deb := by_sha256.get(package.sha256)) is None:
            return f"DEBS_DIR={path}: no .deb with that sha256"
        return _store(deb.read_bytes(), package, cache)

    return find


def cached(package: Package, cache: Path) -> Path | None:
    path = cache / f"{package.sha256}.deb"
    if not path.is_file() or sha256_file(path) != package.sha256:
        return None
    path.touch()  # in use: kept by build/buildroot.sh's pruning
    return path


def fetch(packages: list[Package], cache: Path, places: list[Place]) -> list[str]:
    """Put each package into `cache`, trying `places` in order; one line per package found nowhere."""
    cache.mkdir(parents=True, exist_ok=True)
    missing = []
    for package in packages:
        if cached(package, cache):
            continue
        reasons = []
        for place in places:
            got = place(package, cache)
            if isinstance(got, Path):
                break
            reasons.append(got)
        else:
            missing.append(f"{package} found nowhere: {'; '.join(reasons)}")
    return missing


def control(deb: Path) -> str:
    """A .deb's control fields, as dpkg-deb prints them (multi-line fields kept)."""
    return subprocess.run(["dpkg-deb", "-f", str(deb)], check=True, capture_output=True, text=True).stdout


def make_repo(packages: list[Package], cache: Path, repo: Path) -> None:
    """A flat apt repository (`deb [trusted=yes] file:REPO ./`) of exactly these .debs."""
    repo.mkdir(parents=True, exist_ok=True)
    paragraphs = []
    for package in packages:
        source = cache / f"{package.sha256}.deb"
        name = f"{package.name}_{package.version.replace(':', '%3a')}_{package.architecture}.deb"
        shutil.copyfile(source, repo / name)
        fields = control(repo / name).rstrip("\n")
        paragraphs.append(f"{fields}\nFilename: ./{name}\nSize: {source.stat().st_size}\nSHA256: {package.sha256}\n")
    (repo / "Packages").write_text("\n".join(paragraphs))


def manifest_from_release(record: dict) -> str:
    """The manifest (build/buildroot.sh's format) of a release's build root, from its release.json.

    mmdebstrap's version and the recipe's sha256 are not carried over: build/buildroot.sh adds
    those of the tools that make the root now."""
    root = record.get("build_root") or {}
    if not root.get("packages"):
        raise ValueError("the release's release.json has no build_root.packages to build from")
    lists = root.get("package_lists") or {}
    lines = [f"release {root['release']}", f"include {' '.join(root['include'])}"]
    lines += [f"aptopt {option}" for option in root.get("apt_options", [])]
    if lists.get("fetched"):
        lines.append(f"fetched {lists['fetched']}")
    lines += [f"source {s['uri']} {s['suite']} {s['date']}" for s in lists.get("sources", [])]
    lines += [f"package {p['name']} {p['version']} {p['architecture']} {p['sha256']}" for p in root["packages"]]
    return "\n".join(lines) + "\n"


def dpkg_newer(a: str, b: str) -> bool:
    """Whether Debian version `a` is newer than `b` (dpkg's own comparison)."""
    return subprocess.run(["dpkg", "--compare-versions", a, "gt", b], check=False).returncode == 0


def stale(release: list[Package], now: list[Package], newer: Callable[[str, str], bool] = dpkg_newer) -> list[str]:
    """What a build root resolved now would change in a release's: one line a package."""
    theirs, ours = {p.name: p for p in release}, {p.name: p for p in now}
    lines = []
    for name in sorted(theirs.keys() | ours.keys()):
        old, new = theirs.get(name), ours.get(name)
        if new is None:
            lines.append(f"{name}: {old.version} in the release, not in a root resolved now")  # type: ignore[union-attr]
        elif old is None:
            lines.append(f"{name}: not in the release, {new.version} in a root resolved now")
        elif old.version != new.version:
            which = "newer" if newer(new.version, old.version) else "older"
            lines.append(f"{name}: {old.version} in the release, {new.version} on the mirror now ({which})")
        elif old.sha256 != new.sha256:
            lines.append(f"{name} {old.version}: another .deb on the mirror now (sha256 {new.sha256})")
    return lines


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="debs.py", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    get = commands.add_parser("fetch")
    get.add_argument("manifest", type=Path)
    get.add_argument("cache", type=Path)
    get.add_argument("--mirror", required=True)
    get.add_argument("--security-mirror", required=True)
    get.add_argument("--snapshot", default=os.environ.get("DEBIAN_SNAPSHOT") or None)
    get.add_argument("--snapshot-archive", default=SNAPSHOT_ARCHIVE)
    get.add_argument("--debs-dir", default=os.environ.get("DEBS_DIR") or None)
    repo = commands.add_parser("repo")
    repo.add_argument("manifest", type=Path)
    repo.add_argument("cache", type=Path)
    repo.add_argument("repo", type=Path)
    write = commands.add_parser("manifest")
    write.add_argument("release", type=Path)
    write.add_argument("output", type=Path)
    check = commands.add_parser("stale")
    check.add_argument("release", type=Path)
    check.add_argument("manifest", type=Path)
    args = parser.parse_args(argv)

    if args.command == "fetch":
        packages = read_manifest(args.manifest)
        names = {p.name for p in packages}
        places = [
            mirror(args.mirror, args.security_mirror, names),
            snapshot(args.snapshot, names, args.snapshot_archive),
            folder(args.debs_dir),
        ]
        missing = fetch(packages, args.cache, places)
        for line in missing:
            print(f"debs.py: {line}", file=sys.stderr)
        return 1 if missing else 0
    if args.command == "repo":
        make_repo(read_manifest(args.manifest), args.cache, args.repo)
        return 0
    if args.command == "manifest":
        args.output.write_text(manifest_from_release(json.loads(args.release.read_text())))
        return 0
    record = json.loads(args.release.read_text())
    release = [
        Package(p["name"], p["version"], p["architecture"], p["sha256"]) for p in record["build_root"]["packages"]
    ]
    lines = stale(release, read_manifest(args.manifest))
    commit = record.get("source_commit", "?")[:12]
    for line in lines:
        print(f"release-check: {line}")
    if lines:
        print(
            f"release-check: STALE: the release of {commit} lacks {len(lines)} package change(s) the mirror has now; "
            "cut a new release (docs/deploy.md)"
        )
        return 1
    print(f"release-check: current: the release of {commit} has the mirror's newest packages")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
