"""`make reproduce`: build this tree twice, from two fresh build roots, and compare.

    reproduce.py                      build twice and compare (what `make reproduce` runs)
    reproduce.py --reference RELEASE  build that release (its commit, its packages) and compare
    reproduce.py ARTIFACT ARTIFACT    compare two executables built anywhere

docs/design.md section 8: two builds of one commit from two fresh build roots of the same package
versions, started from hosts with different Pythons, give byte-identical artifacts. Each
build is `make build` in its own copy of the tree (two directories of different depth
and length), with BUILDROOT_FRESH=1 (so each makes its build root anew from Debian's
mirror) and with a different host Python first on PATH and as make's PYTHON: the one
behind .venv (pyenv's on this project's machines) and Debian's /usr/bin/python3. Neither
may matter, as the build runs the root's own python3. Exit 0, printing both sha256s, when
they are identical; else exit 1, naming the first member of the onefile archive that
differs (and, inside the PYZ or base_library.zip, the first entry that differs), and
keep the copies. Their release.json files must match too, but for when and from where
the package lists were fetched.

Given a release (`make reproduce REFERENCE=release/release.json`), it builds that release
instead, once: the release's `source_commit`, taken from this clone's git history (`git
archive`; exit 2 when the commit is not there), in a root of the release's own packages
(`build_root.packages`: each .deb fetched by its exact version and checked by its sha256,
build/debs.py), not of today's package lists, with this tree's build/build.sh. Exit 0,
printing both sha256s, when the artifact is the release's; else exit 1 naming what
differs: the build root's packages, the other inputs that moved (mmdebstrap, the recipe,
the locks, ...), and the first differing archive member when the release's artifact lies
beside its release.json.

What is copied is what `make build` builds: the working tree's files that git tracks
or would track (`git ls-files --cached --others --exclude-standard`), so uncommitted
edits are checked too and ignored files (.venv, build/dist, caches) are not. In CI's
fresh clone that is exactly the commit. Both builds use the source commit and its time
of this checkout (the copies have no .git).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import debs
from PyInstaller.archive.readers import CArchiveReader

ROOT = Path(__file__).resolve().parent.parent
IGNORED_WITHOUT_GIT = shutil.ignore_patterns(
    ".git", ".venv", "__pycache__", ".pytest_cache", "dist", "work", "artifacts"
)
DEBIAN_PYTHON = Path("/usr/bin/python3")
# Fields of release.json that differ between two builds of the same inputs: when, and from
# which mirror, the build root's package lists were fetched.
FETCH_FIELDS = ("build_root.package_lists",)


def copy_tree(destination: Path) -> None:
    """Copy the files a build reads (see the module docstring) into `destination`."""
    if not (ROOT / ".git").exists():
        shutil.copytree(ROOT, destination, ignore=IGNORED_WITHOUT_GIT, symlinks=True)
        return
    listed = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        check=True,
        capture_output=True,
    ).stdout
    for name in filter(None, listed.decode().split("\0")):
        source = ROOT / name
        if source.is_file():  # a tracked file deleted in the work tree is not part of it
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / name)


def source_identity() -> dict[str, str]:
    """SOURCE_COMMIT and SOURCE_DATE_EPOCH of this checkout, for builds of its copies."""
    if not (ROOT / ".git").exists():
        return {}
    git = ["git", "-C", str(ROOT)]
    return {
        "SOURCE_COMMIT": subprocess.run(
            [*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True
        ).stdout.strip(),
        "SOURCE_DATE_EPOCH": os.environ.get("SOURCE_DATE_EPOCH")
        or subprocess.run(
            [*git, "log", "-1", "--format=%ct"], check=True, capture_output=True, text=True
        ).stdout.strip(),
        "SOURCE_TREE_CLEAN": "false"
        if subprocess.run([*git, "status", "--porcelain"], check=True, capture_output=True, text=True).stdout.strip()
        else "true",
    }


def host_pythons() -> tuple[Path, Path]:
    """The Python behind .venv (pyenv's here) and Debian's, installed with apt-get when missing."""
    if not DEBIAN_PYTHON.exists():
        print(f"reproduce: {DEBIAN_PYTHON} is missing; installing Debian's python3 with apt-get")
        subprocess.run(["apt-get", "update", "-qq"], check=True, stdout=subprocess.DEVNULL)
        subprocess.run(["apt-get", "install", "-y", "-qq", "python3"], check=True, stdout=subprocess.DEVNULL)
    first = Path(sys.base_prefix) / "bin" / "python3"
    if first.resolve() == DEBIAN_PYTHON.resolve():
        print(f"reproduce: warning: .venv is Debian's Python too; both builds have {first} first on PATH")
    return first, DEBIAN_PYTHON


def build(source: Path, identity: dict[str, str], python: Path) -> Path:
    """`make build` in the copy at `source`, from a fresh build root, with `python` first on PATH."""
    env = {key: value for key, value in os.environ.items() if key not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    env.update(identity, PATH=f"{python.parent}{os.pathsep}{env.get('PATH', '')}", BUILDROOT_FRESH="1")
    version = subprocess.run(
        [python, "-c", "import platform; print(platform.python_version())"], check=True, capture_output=True, text=True
    ).stdout.strip()
    print(f"reproduce: building in {source} with {python} (Python {version}) first on PATH", flush=True)
    started = time.monotonic()
    subprocess.run(
        ["make", "--no-print-directory", "-C", str(source), "build", f"PYTHON={python}"], check=True, env=env
    )
    print(f"reproduce: built in {source} in {time.monotonic() - started:.1f} s", flush=True)
    return source / "build" / "dist" / "tinygw"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def first_difference(a: Path, b: Path) -> str:
    """Where two onefile executables first differ, as a sentence."""
    archive_a, archive_b = CArchiveReader(str(a)), CArchiveReader(str(b))
    names_a, names_b = list(archive_a.toc), list(archive_b.toc)
    for name in names_a:
        if name not in archive_b.toc:
            return f"archive member {name!r} is only in the first build"
        data_a, data_b = archive_a.extract(name), archive_b.extract(name)
        if data_a != data_b:
            where = f"archive member {name!r} differs (sha256 {sha256(data_a)} vs {sha256(data_b)})"
            if archive_a.toc[name][-1] == "z":
                where += _first_pyz_difference(archive_a, archive_b, name)
            elif name == "base_library.zip":
                where += _first_zip_difference(data_a, data_b)
            return where
    if extra := [name for name in names_b if name not in archive_a.toc]:
        return f"archive member {extra[0]!r} is only in the second build"
    if names_a != names_b:
        return "the archives hold the same members in a different order"
    if archive_a.options != archive_b.options:
        return f"the archives' runtime options differ: {archive_a.options} vs {archive_b.options}"
    bytes_a, bytes_b = a.read_bytes(), b.read_bytes()
    offset = next(
        (i for i, (x, y) in enumerate(zip(bytes_a, bytes_b, strict=False)) if x != y), min(len(bytes_a), len(bytes_b))
    )
    return (
        f"every archive member is identical; the files first differ at byte {offset} "
        f"(sizes {len(bytes_a)} and {len(bytes_b)}): the bootloader, ELF sections or archive layout"
    )


def _first_pyz_difference(archive_a: CArchiveReader, archive_b: CArchiveReader, name: str) -> str:
    pyz_a, pyz_b = archive_a.open_embedded_archive(name), archive_b.open_embedded_archive(name)
    for entry in pyz_a.toc:
        if entry not in pyz_b.toc:
            return f"; its entry {entry!r} is only in the first build"
        if pyz_a.extract(entry, raw=True) != pyz_b.extract(entry, raw=True):
            return f"; its first differing entry is {entry!r}"
    if extra := [entry for entry in pyz_b.toc if entry not in pyz_a.toc]:
        return f"; its entry {extra[0]!r} is only in the second build"
    return "; its entries are identical, their order or the table of contents is not"


def _first_zip_difference(data_a: bytes, data_b: bytes) -> str:
    with zipfile.ZipFile(io.BytesIO(data_a)) as zip_a, zipfile.ZipFile(io.BytesIO(data_b)) as zip_b:
        infos_a, infos_b = zip_a.infolist(), zip_b.infolist()
        names_a, names_b = [info.filename for info in infos_a], [info.filename for info in infos_b]
        if names_a != names_b:
            i = next(
                (i for i, (x, y) in enumerate(zip(names_a, names_b, strict=False)) if x != y),
                min(len(names_a), len(names_b)),
            )
            first = names_a[i] if i < len(names_a) else names_b[i]
            return f"; its member list differs in name or order from position {i} ({first!r})"
        for info_a, info_b in zip(infos_a, infos_b, strict=True):  # same names, checked above
            if zip_a.read(info_a) != zip_b.read(info_b):
                return f"; its first differing entry is {info_a.filename!r}"
            if info_a.date_time != info_b.date_time:
                return f"; entry {info_a.filename!r} has different timestamps"
    return "; its entries are identical, their metadata is not"


def compare(first: Path, second: Path) -> int:
    """`reproduce.py A B`: compare two artifacts built elsewhere (an auditor's and a release's)."""
    if first.read_bytes() == second.read_bytes():
        print(f"reproduce: identical, sha256 {sha256(first.read_bytes())}")
        return 0
    print(f"reproduce: they differ: {first_difference(first, second)}", file=sys.stderr)
    return 1


def differing_fields(a, b, path: str = "") -> list[str]:
    """The dotted paths at which two release records differ (a list counts as one value)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [
            field
            for key in sorted(a.keys() | b.keys())
            for field in differing_fields(a.get(key), b.get(key), f"{path}.{key}" if path else key)
        ]
    return [] if a == b else [path]


def _without(record: dict, fields: tuple[str, ...]) -> dict:
    record = json.loads(json.dumps(record))
    for field in fields:
        *parents, last = field.split(".")
        holder = record
        for parent in parents:
            holder = holder.get(parent) or {}
        holder.pop(last, None)
    return record


def package_differences(reference: list[dict], built: list[dict]) -> list[str]:
    """The build root's packages that moved between a reference release and this build, one line each."""
    ours, theirs = {p["name"]: p for p in built}, {p["name"]: p for p in reference}
    lines = []
    for name in sorted(ours.keys() | theirs.keys()):
        mine, ref = ours.get(name), theirs.get(name)
        if ref is None:
            lines.append(f"{name}: not in the reference's root; {mine['version']} ({mine['architecture']}) in this one")
        elif mine is None:
            lines.append(f"{name}: {ref['version']} ({ref['architecture']}) in the reference's root; not in this one")
        elif (ref["version"], ref["architecture"]) != (mine["version"], mine["architecture"]):
            lines.append(
                f"{name}: {ref['version']} ({ref['architecture']}) in the reference's root, "
                f"{mine['version']} ({mine['architecture']}) in this one"
            )
        elif ref["sha256"] != mine["sha256"]:
            lines.append(
                f"{name} {mine['version']}: the same version from another .deb "
                f"(sha256 {ref['sha256']} vs {mine['sha256']})"
            )
    return lines


def compare_with_reference(reference_path: Path, artifact: Path) -> int:
    """Compare a build with a release: the artifact's sha256, and on a difference what moved."""
    reference = json.loads(reference_path.read_text())
    built = json.loads((artifact.parent / "release.json").read_text())
    wanted, got = reference["artifact"]["sha256"], built["artifact"]["sha256"]
    print(f"reproduce: this build  sha256 {got}  {artifact}")
    print(f"reproduce: the release sha256 {wanted}  {reference_path}")
    if wanted == got:
        print(f"reproduce: identical to the release in {reference_path}")
        return 0
    print(
        f"reproduce: DIFFERENT from the release in {reference_path}: its sha256 is {wanted}, this build's {got}",
        file=sys.stderr,
    )
    packages = package_differences(
        (reference.get("build_root") or {}).get("packages", []), (built.get("build_root") or {}).get("packages", [])
    )
    for line in packages:
        print(f"reproduce:   build root: {line}", file=sys.stderr)
    ignored = ("artifact", "measurement", "build_root.packages", *FETCH_FIELDS)
    for field in differing_fields(_without(reference, ignored), _without(built, ignored)):
        print(
            f"reproduce:   input {field}: {_get(reference, field)!r} in the reference, {_get(built, field)!r} here",
            file=sys.stderr,
        )
    theirs = reference_path.parent / reference["artifact"]["name"]
    if theirs.is_file() and sha256(theirs.read_bytes()) == wanted:
        print(f"reproduce:   {first_difference(theirs, artifact)}", file=sys.stderr)
    else:
        print(
            f"reproduce:   (put the release's artifact at {theirs} to name the first differing archive member)",
            file=sys.stderr,
        )
    return 1


def _get(record: dict, field: str):
    for key in field.split("."):
        record = record.get(key) if isinstance(record, dict) else None
    return record


def git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=False, capture_output=True, text=True)


def reproduce_release(reference_path: Path) -> int:
    """Build a release's source commit in a root of the release's own packages, and compare."""
    reference = json.loads(reference_path.read_text())
    commit = str(reference.get("source_commit") or "")
    if not re.fullmatch(r"[0-9a-f]{40}", commit) or git("cat-file", "-e", f"{commit}^{{commit}}").returncode:
        print(
            f"reproduce: the release's source commit {commit or '(none)'} is not in the git history of {ROOT}: "
            f"fetch it (git fetch origin {commit}) or clone the repository it was built from",
            file=sys.stderr,
        )
        return 2
    try:
        manifest = debs.manifest_from_release(reference)
    except (KeyError, TypeError, ValueError) as error:
        print(f"reproduce: {reference_path}: cannot build its root: {error}", file=sys.stderr)
        return 2
    if reference.get("source_tree_clean") is not True:
        print(
            f"reproduce: warning: the release says source_tree_clean={reference.get('source_tree_clean')}: "
            "it may have been built from changes that are not in the commit",
            file=sys.stderr,
        )
    work = Path(tempfile.mkdtemp(prefix="tinygw-reproduce-"))
    source = work / "source"
    source.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(source)], input=archive, check=True)
    (work / "build-root.txt").write_text(manifest)
    env = {key: value for key, value in os.environ.items() if key not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    env.update(
        SOURCE_COMMIT=commit,
        SOURCE_DATE_EPOCH=git("log", "-1", "--format=%ct", commit).stdout.strip(),
        SOURCE_TREE_CLEAN="true",
    )
    print(f"reproduce: building {commit} in {source} from the release's {manifest.count('package ')} packages")
    started = time.monotonic()
    built = subprocess.run(
        [
            "sh",
            str(ROOT / "build" / "build.sh"),
            "--source",
            str(source),
            "--root-manifest",
            str(work / "build-root.txt"),
            str(source / "build" / "dist"),
        ],
        check=False,
        env=env,
    )
    if built.returncode:
        print(f"reproduce: the build failed (exit {built.returncode}); kept in {work}", file=sys.stderr)
        return 1
    print(f"reproduce: built in {time.monotonic() - started:.1f} s", flush=True)
    status = compare_with_reference(reference_path, source / "build" / "dist" / "tinygw")
    if status:
        print(f"reproduce: the build is kept in {work}", file=sys.stderr)
    else:
        shutil.rmtree(work)
    return status


def reproduce() -> int:
    """Build twice from two copies of this tree, two fresh roots and two host Pythons, and compare."""
    pythons = host_pythons()
    work = Path(tempfile.mkdtemp(prefix="tinygw-reproduce-"))
    # Two different directories, of different depth and length, so no path can hide. The
    # second is copied from the first, so that an edit made meanwhile cannot tell them apart.
    sources = work / "a", work / "b" / "second-copy"
    identity = source_identity()
    copy_tree(sources[0])
    shutil.copytree(sources[0], sources[1], symlinks=True)
    first = build(sources[0], identity, pythons[0])
    second = build(sources[1], identity, pythons[1])
    sums = sha256(first.read_bytes()), sha256(second.read_bytes())
    print(f"reproduce: first  build {sums[0]}  {first}")
    print(f"reproduce: second build {sums[1]}  {second}")
    if first.read_bytes() != second.read_bytes():
        print(f"reproduce: NOT reproducible: {first_difference(first, second)}", file=sys.stderr)
        print(f"reproduce: both builds are kept in {work}", file=sys.stderr)
        return 1
    releases = [json.loads((path.parent / "release.json").read_text()) for path in (first, second)]
    if moved := differing_fields(_without(releases[0], FETCH_FIELDS), _without(releases[1], FETCH_FIELDS)):
        print(
            f"reproduce: the artifacts match but their release.json files differ in {', '.join(moved)}; kept in {work}",
            file=sys.stderr,
        )
        return 1
    print("reproduce: identical")
    shutil.rmtree(work)
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="reproduce.py", description=__doc__.splitlines()[0])
    parser.add_argument("--reference", type=Path, help="a release.json to rebuild and compare with")
    parser.add_argument("artifacts", type=Path, nargs="*", help="two executables to compare instead of building")
    args = parser.parse_args(argv)
    if args.artifacts:
        if len(args.artifacts) != 2 or args.reference:
            parser.error("give two artifacts, or none")
        return compare(*args.artifacts)
    return reproduce_release(args.reference) if args.reference else reproduce()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
