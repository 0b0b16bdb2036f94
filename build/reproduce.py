"""`make reproduce`: build this tree twice, from two temporary copies, and compare.

    reproduce.py                    build twice and compare (what `make reproduce` runs)
    reproduce.py ARTIFACT ARTIFACT  compare two executables built anywhere

SPEC section 8: two builds of one commit with the same toolchain, from two different
directories, give byte-identical artifacts. Exit 0, printing both sha256s, when they
do; else exit 1, naming the first member of the onefile archive that differs (and,
inside the PYZ or base_library.zip, the first entry that differs), and keep the copies.

What is copied is what `make build` builds: the working tree's files that git tracks
or would track (`git ls-files --cached --others --exclude-standard`), so uncommitted
edits are checked too and ignored files (.venv, build/dist, build/work, caches) are
not, which would let one build's leftovers into the other. In CI's fresh clone that is
exactly the commit. Both builds use this venv's Python and PyInstaller, and the source
commit and its time of this checkout (the copies have no .git).
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from PyInstaller.archive.readers import CArchiveReader

ROOT = Path(__file__).resolve().parent.parent
IGNORED_WITHOUT_GIT = shutil.ignore_patterns(".git", ".venv", "__pycache__", ".pytest_cache", "dist", "work",
                                             "artifacts")


def copy_tree(destination: Path) -> None:
    """Copy the files a build reads (see the module docstring) into `destination`."""
    if not (ROOT / ".git").exists():
        shutil.copytree(ROOT, destination, ignore=IGNORED_WITHOUT_GIT, symlinks=True)
        return
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            check=True, capture_output=True).stdout
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
        "SOURCE_COMMIT": subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True,
                                        text=True).stdout.strip(),
        "SOURCE_DATE_EPOCH": os.environ.get("SOURCE_DATE_EPOCH") or subprocess.run(
            [*git, "log", "-1", "--format=%ct"], check=True, capture_output=True, text=True).stdout.strip(),
        "SOURCE_TREE_CLEAN": "false" if subprocess.run([*git, "status", "--porcelain"], check=True,
                                                       capture_output=True, text=True).stdout.strip() else "true",
    }


def build(source: Path, out: Path) -> Path:
    copy_tree(source)
    env = {**os.environ, **source_identity(), "PYTHON": sys.executable}
    started = time.monotonic()
    subprocess.run(["sh", str(source / "build" / "build.sh"), str(out)], check=True, env=env)
    print(f"reproduce: built in {source} in {time.monotonic() - started:.1f} s")
    return out / "tinygw"


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
    offset = next((i for i, (x, y) in enumerate(zip(bytes_a, bytes_b)) if x != y), min(len(bytes_a), len(bytes_b)))
    return (f"every archive member is identical; the files first differ at byte {offset} "
            f"(sizes {len(bytes_a)} and {len(bytes_b)}): the bootloader, ELF sections or archive layout")


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
            i = next((i for i, (x, y) in enumerate(zip(names_a, names_b)) if x != y), min(len(names_a), len(names_b)))
            first = names_a[i] if i < len(names_a) else names_b[i]
            return f"; its member list differs in name or order from position {i} ({first!r})"
        for info_a, info_b in zip(infos_a, infos_b):
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


def reproduce() -> int:
    """Build twice from two copies of this tree and compare."""
    work = Path(tempfile.mkdtemp(prefix="tinygw-reproduce-"))
    # Two different directories, of different depth and length, so no path can hide.
    first = build(work / "a", work / "dist-a")
    second = build(work / "b" / "second-copy", work / "dist-b")
    sums = sha256(first.read_bytes()), sha256(second.read_bytes())
    print(f"reproduce: first  build {sums[0]}  {first}")
    print(f"reproduce: second build {sums[1]}  {second}")
    if first.read_bytes() != second.read_bytes():
        print(f"reproduce: NOT reproducible: {first_difference(first, second)}", file=sys.stderr)
        print(f"reproduce: both builds are kept in {work}", file=sys.stderr)
        return 1
    releases = [(path.parent / "release.json").read_bytes() for path in (first, second)]
    if releases[0] != releases[1]:
        print(f"reproduce: the artifacts match but their release.json files differ; kept in {work}", file=sys.stderr)
        return 1
    shutil.rmtree(work)
    print("reproduce: identical")
    return 0


def main(argv: list[str]) -> int:
    if len(argv) == 2:
        return compare(Path(argv[0]), Path(argv[1]))
    if argv:
        print("usage: reproduce.py [ARTIFACT ARTIFACT]", file=sys.stderr)
        return 2
    return reproduce()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
