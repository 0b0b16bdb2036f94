"""release.json: what a client (or its auditor) needs to check that a gateway runs this build.

docs/design.md section 8. Run inside the build root by build/in-root.sh:

    release.py requirements
        print what the build installs, with the locks' hashes: all of runtime.lock, and of
        dev.lock PyInstaller and what the lock says it needs (its "# via" lines)
    release.py check-locks
        exit 1, naming each package, unless the venv holds exactly those pins
    release.py write ARTIFACT OUTPUT --source-commit SHA --source-date-epoch N --build-root MANIFEST
        write OUTPUT (release.json) for the executable ARTIFACT, built in the root MANIFEST
        describes (written by build/buildroot.sh)

The measurement is the one attest/launch makes before it execs the artifact: one event,
the artifact's sha384, extended into a zeroed RTMR3.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import platform
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOCKS = (ROOT / "requirements" / "runtime.lock", ROOT / "requirements" / "dev.lock")  # hashed in this order

# A TDX RTMR holds one SHA-384 value: 48 bytes, all zero at boot.
RTMR_BYTES = 48
EVENT_TYPE = "tinygw.artifact"

RUNTIME_LOCK, DEV_LOCK = LOCKS
BUILD_TOOL = "pyinstaller"  # of dev.lock, only this and what it needs is installed for the build

_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s\\;]+)", re.MULTILINE)
_VIA = re.compile(r"^\s*#\s+(?:via\s+)?([A-Za-z0-9][A-Za-z0-9._-]*)\s*$", re.MULTILINE)


def expected_rtmr3(digest_hex: str) -> str:
    """RTMR3 after one extend of a zeroed register with `digest_hex` (a sha384, hex).

    TDX extends a runtime measurement register as new = SHA384(old ‖ digest), and the
    register starts as 48 zero bytes, so a register that holds only the artifact's event
    reads SHA384(0x00 * 48 ‖ sha384(artifact)). Returns lowercase hex."""
    digest = bytes.fromhex(digest_hex)
    if len(digest) != RTMR_BYTES:
        raise ValueError(f"an RTMR event digest is {RTMR_BYTES} bytes (sha384), got {len(digest)}")
    return hashlib.sha384(bytes(RTMR_BYTES) + digest).hexdigest()


def lock_sha256() -> str:
    """sha256 of runtime.lock's bytes followed by dev.lock's bytes."""
    return hashlib.sha256(b"".join(lock.read_bytes() for lock in LOCKS)).hexdigest()


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_entries(lock: Path) -> dict[str, tuple[str, str, set[str]]]:
    """A uv-compiled lock's packages: name -> (version, its lines with the hashes, the packages that need it)."""
    entries = {}
    for block in re.split(r"\n(?=[A-Za-z0-9])", lock.read_text()):
        if pin := _PIN.match(block):
            needed_by = {_canonical(name) for name in _VIA.findall(block)}
            entries[_canonical(pin[1])] = (pin[2], block.strip() + "\n", needed_by)
    return entries


def build_pins() -> list[tuple[str, str, str, Path]]:
    """(name, version, lines, lock) of what the build installs: runtime.lock, then the build
    tool's closure in dev.lock."""
    runtime, dev = lock_entries(RUNTIME_LOCK), lock_entries(DEV_LOCK)
    tools = {BUILD_TOOL}
    while grown := {name for name, (_, _, needed_by) in dev.items() if needed_by & tools} - tools:
        tools |= grown
    pins = [(name, version, lines, RUNTIME_LOCK) for name, (version, lines, _) in runtime.items()]
    return pins + [(name, dev[name][0], dev[name][1], DEV_LOCK) for name in sorted(tools - runtime.keys())]


def lock_mismatches() -> list[str]:
    """Each package of the build whose installed version differs from its pin (empty when in sync)."""
    problems = []
    for name, pinned, _, lock in build_pins():
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            installed = None
        if installed != pinned:
            problems.append(f"{name}: {lock.name} pins {pinned}, the venv has {installed or 'nothing'}")
    return problems


def build_root(manifest: Path) -> dict:
    """release.json's `build_root`, from the manifest build/buildroot.sh wrote: the Debian packages
    the build ran on, each with the sha256 of its .deb, and where and when their lists were fetched."""
    record: dict = {
        "distribution": "debian",
        "release": None,
        "include": [],
        "packages": [],
        "package_lists": {"fetched": None, "sources": []},
        "mmdebstrap": None,
        "apt_options": [],
        "recipe_sha256": None,
        "tar_sha256": None,
    }
    for line in manifest.read_text().splitlines():
        kind, _, value = line.partition(" ")
        if kind == "package":
            name, version, architecture, sha256 = value.split(" ")
            record["packages"].append(
                {"name": name, "version": version, "architecture": architecture, "sha256": sha256}
            )
        elif kind == "source":
            uri, suite, date = value.split(" ", 2)
            record["package_lists"]["sources"].append({"uri": uri, "suite": suite, "date": date})
        elif kind == "fetched":
            record["package_lists"]["fetched"] = value
        elif kind == "include":
            record["include"] = value.split()
        elif kind == "aptopt":
            record["apt_options"].append(value)
        elif kind in ("release", "mmdebstrap"):
            record[kind] = value
        elif kind in ("recipe", "tar"):
            record[f"{kind}_sha256"] = value
        else:
            raise ValueError(f"{manifest}: unknown line {line!r}")
    return record


def _digests(path: Path) -> tuple[int, str, str]:
    sha256, sha384 = hashlib.sha256(), hashlib.sha384()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            sha256.update(block)
            sha384.update(block)
    return path.stat().st_size, sha256.hexdigest(), sha384.hexdigest()


def release(
    artifact: Path,
    source_commit: str,
    source_date_epoch: int,
    source_tree_clean: bool | None = None,
    root_manifest: Path | None = None,
) -> dict:
    """The release record of `artifact`, in the schema attest/verify reads."""
    import PyInstaller

    sys.path.insert(0, str(ROOT))
    import tinygw

    size, sha256, sha384 = _digests(artifact)
    return {
        "version": tinygw.__version__,
        "source_commit": source_commit,
        # false: built from uncommitted changes on top of source_commit; null: not known
        "source_tree_clean": source_tree_clean,
        "source_date_epoch": source_date_epoch,
        "python_version": platform.python_version(),
        "pyinstaller_version": PyInstaller.__version__,
        "lock_sha256": lock_sha256(),
        "artifact": {"name": artifact.name, "size": size, "sha256": sha256, "sha384": sha384},
        "measurement": {
            "register": "rtmr3",
            "event": {"type": EVENT_TYPE, "digest_sha384": sha384},
            "expected_rtmr3": expected_rtmr3(sha384),
        },
        "build_root": build_root(root_manifest) if root_manifest else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="release.py", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("requirements")
    commands.add_parser("check-locks")
    write = commands.add_parser("write")
    write.add_argument("artifact", type=Path)
    write.add_argument("output", type=Path)
    write.add_argument("--source-commit", required=True)
    write.add_argument("--source-date-epoch", type=int, required=True)
    write.add_argument("--source-tree-clean", choices=("true", "false", "unknown"), default="unknown")
    write.add_argument("--build-root", type=Path, help="the build root's manifest (build/buildroot.sh)")
    args = parser.parse_args(argv)

    if args.command == "requirements":
        print("".join(lines for _, _, lines, _ in build_pins()), end="")
        return 0
    if args.command == "check-locks":
        problems = lock_mismatches()
        for problem in problems:
            print(f"release.py: {problem}", file=sys.stderr)
        return 1 if problems else 0
    clean = {"true": True, "false": False}.get(args.source_tree_clean)
    record = release(args.artifact, args.source_commit, args.source_date_epoch, clean, args.build_root)
    args.output.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
