"""A gateway's processes die together, and a dead gateway leaves nothing serving or
lying around (docs/design.md section 13): real `tinygw serve` processes, killed."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, call, wait_until

CONFIG = {
    "providers": {"p": {"base_url": "http://127.0.0.1:9/v1", "api": "openai", "listing": False}},
    "models": {"m": {"targets": ["p:x"]}},
}


def descendants(pid: int) -> set[int]:
    """Every live (not zombie) process under `pid`."""
    parents: dict[int, int] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rpartition(b")")[2].split()
        except (OSError, ValueError):
            continue
        if fields[0] != b"Z":
            parents[int(entry)] = int(fields[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def at_least(count: int, pids: set[int]) -> set[int] | None:
    return pids if len(pids) >= count else None


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] != b"Z"
    except OSError:
        return False


def assert_all_die_within_a_second(pids: set[int]) -> None:
    wait_until(lambda: not any(alive(pid) for pid in pids), 1.0, f"all of {sorted(pids)} to die")


def private_shm_or_skip(directory: Path) -> list[str]:
    """A prefix that runs a gateway with `directory` as its /dev/shm, in a mount namespace of
    its own: a gateway that another test suite on the host starts meanwhile removes what
    a dead gateway left in the host's /dev/shm, before the one under test could."""
    shm = ["unshare", "--mount", "--propagation", "private", "sh", "-c", 'mount --bind "$0" /dev/shm && exec "$@"']
    probe = subprocess.run([*shm, str(directory), "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot give a gateway a /dev/shm of its own here: {probe.stderr.strip()[:200]}")
    return [*shm, str(directory)]


def test_workers_die_with_a_killed_gateway_and_the_port_serves_again(start_gateway, tmp_path):
    """...and the next start, at once, removes the killed one's directories: its own are
    locked before they bear their names, so no wait tells they are dead (docs/design.md
    section 13)."""
    temporary, shm = tmp_path / "tmp", tmp_path / "shm"
    temporary.mkdir()
    shm.mkdir()
    prefix = private_shm_or_skip(shm)
    gateway = start_gateway(CONFIG, prefix=prefix, TINYGW_WORKERS="2", TMPDIR=str(temporary))
    workers = wait_until(lambda: at_least(2, descendants(gateway.process.pid)), 10, "both workers")
    (its_own,) = shm.glob("tinygw-metrics-*")  # made where its /dev/shm is
    unpacked = list(temporary.glob("_MEI*"))  # frozen: the bootloader's (none from source)
    assert len(unpacked) == (1 if os.environ.get("TINYGW_BINARY") else 0)
    gateway.process.kill()
    gateway.process.wait()
    assert_all_die_within_a_second(workers)
    for path in unpacked:  # the bootloader's takes no lock: a young one is left alone (GRACE_SECONDS)
        old = time.time() - 3600
        os.utime(path, (old, old))
    again = start_gateway(CONFIG, prefix=prefix, port=gateway.port, TINYGW_WORKERS="2", TMPDIR=str(temporary))
    assert call("GET", f"{again.url}/healthz")[0] == 200
    assert not its_own.exists() and not [p for p in unpacked if p.exists()]
    removed = [r["path"] for r in again.log_records() if r.get("msg") == "removed what a dead gateway left"]
    assert f"/dev/shm/{its_own.name}" in removed and all(str(p) in removed for p in unpacked)


# Stands in for the frozen binary's bootloader: a parent that runs the Python process
# (build/entry.py, the frozen entry point) and waits for it.
BOOTLOADER = "import subprocess, sys; sys.exit(subprocess.call(sys.argv[1:sys.argv.index('#')]))"


def test_the_gateway_dies_with_its_bootloader(start_gateway):
    if os.environ.get("TINYGW_BINARY"):  # the real bootloader
        gateway = start_gateway(CONFIG, TINYGW_WORKERS="2")
    else:
        prefix = [sys.executable, "-c", BOOTLOADER, sys.executable, str(ROOT / "build" / "entry.py"), "serve", "#"]
        gateway = start_gateway(CONFIG, prefix=prefix, TINYGW_WORKERS="2")
    assert "entry.py" in " ".join(gateway.process.args) or os.environ.get("TINYGW_BINARY")
    below = wait_until(lambda: at_least(3, descendants(gateway.process.pid)), 10, "the gateway and both workers")
    gateway.process.kill()
    gateway.process.wait()
    assert_all_die_within_a_second(below)


def test_leftovers_of_dead_gateways_are_removed_at_start(start_gateway, tmp_path):
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    old = time.time() - 3600
    made = {}
    for name in (
        "tinygw-tls-dead",
        "tinygw-tls-alive",
        "tinygw-metrics-dead",
        "_MEIdead",
        "_MEIunpacking",
        "_MEIsomeone-else",
        "unrelated",
    ):
        made[name] = temporary / name
        made[name].mkdir()
        (made[name] / "key.pem").write_text("x")
    (made["_MEIdead"] / "granian").mkdir()
    (made["_MEIunpacking"] / "granian").mkdir()
    for path in made.values():
        os.utime(path, (old, old))
    # A live gateway holds a lock on its directory, and a bootloader that unpacks has a
    # file open in its own (here, this test does both).
    held = os.open(made["tinygw-tls-alive"], os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(held, fcntl.LOCK_EX)
    unpacking = open(made["_MEIunpacking"] / "granian" / "lib.so", "wb")  # noqa: SIM115 -- open across the start
    try:
        gateway = start_gateway(CONFIG, TMPDIR=str(temporary))
    finally:
        os.close(held)
        unpacking.close()
    left = {path.name for path in temporary.iterdir()}
    if os.environ.get("TINYGW_BINARY"):  # the frozen gateway unpacks itself into its TMPDIR: that one lives
        (own,) = {name for name in left - set(made) if name.startswith("_MEI")}
        left.discard(own)
    assert left == {"tinygw-tls-alive", "_MEIunpacking", "_MEIsomeone-else", "unrelated"}
    removed = {r["path"] for r in gateway.log_records() if r.get("msg") == "removed what a dead gateway left"}
    assert {str(made[n]) for n in ("tinygw-tls-dead", "tinygw-metrics-dead", "_MEIdead")} <= removed


def test_a_borrowed_directory_is_left_alone_while_it_is_young_and_its_own_never_is(tmp_path):
    from tinygw import lifecycle

    # A staging directory (make_held's, left by a gateway killed between its making and its
    # lock) is unlocked at birth, as a borrowed one is.
    for name in ("_MEIyoung", "tinygw-metrics-young", ".staging-tinygw-tls-young"):
        (tmp_path / name / "granian").mkdir(parents=True)
    now = time.time()
    for name in ("_MEIyoung", ".staging-tinygw-tls-young"):
        os.utime(tmp_path / name, (now, now))
    removed = lifecycle.remove_leftovers([str(tmp_path)], keep="/nonexistent", now=now + lifecycle.GRACE_SECONDS / 2)
    assert removed == [str(tmp_path / "tinygw-metrics-young")]  # unlocked: dead, however young
    removed = lifecycle.remove_leftovers([str(tmp_path)], keep="/nonexistent", now=now + lifecycle.GRACE_SECONDS + 1)
    assert sorted(removed) == [str(tmp_path / ".staging-tinygw-tls-young"), str(tmp_path / "_MEIyoung")]


def test_a_measured_gateway_removes_dead_launch_directories_beside_its_own(start_gateway, tmp_path):
    # attest/launch points TMPDIR at its own directory (tinygw-launch.*), which holds the
    # measured copy of the artifact; dead runs' copies lie beside it.
    old = time.time() - 3600
    tmp_path = tmp_path / "run"
    tmp_path.mkdir()
    own, dead, foreign = (tmp_path / name for name in ("tinygw-launch.own", "tinygw-launch.dead", "tinygw-launch.x"))
    for path in (own, dead, foreign):
        path.mkdir()
        os.utime(path, (old, old))
    (own / "tinygw").write_text("the running copy")
    (dead / "tinygw").write_text("a dead run's copy")
    os.utime(own, (old, old))
    os.utime(dead, (old, old))
    start_gateway(CONFIG, TMPDIR=str(own))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tinygw-launch.own", "tinygw-launch.x"]


def test_a_directory_s_name_cannot_be_taken_before_it_is_given(tmp_path, monkeypatch):
    """Another user can read the staging directory's name in /dev/shm or /tmp, and make the
    name it would become: the name given is drawn apart from it, and again when taken."""
    import tempfile

    from tinygw import lifecycle

    mkdtemp = tempfile.mkdtemp

    def watched(prefix: str, dir: str) -> str:  # noqa: A002 -- mkdtemp's own parameter name
        staging = mkdtemp(prefix=prefix, dir=dir)
        squatted = os.path.join(dir, os.path.basename(staging).removeprefix(lifecycle.STAGING_PREFIX))
        os.mkdir(squatted)  # the squatter, as soon as it sees the staging name
        return staging

    monkeypatch.setattr(tempfile, "mkdtemp", watched)
    drawn = iter(["taken", "free"])
    (tmp_path / "tinygw-metrics-taken").mkdir()
    monkeypatch.setattr(lifecycle.secrets, "token_hex", lambda n: next(drawn))
    path, lock = lifecycle.make_held(str(tmp_path), "tinygw-metrics-")
    assert path == str(tmp_path / "tinygw-metrics-free")
    assert lifecycle._held(path)  # locked by this process, as it was before it bore the name
    lifecycle.release(lock)
    assert not lifecycle._held(path)
