"""The gateway's processes live and die together, and a dead one leaves nothing behind
(docs/design.md section 13).

Every process under `tinygw serve` asks the kernel for SIGKILL when its parent dies
(prctl's PR_SET_PDEATHSIG): the Granian workers (their parent is serve's process) and,
frozen, serve's own process (its parent is the PyInstaller bootloader). A worker left
running by a dead parent would keep serving the old key and configuration, and keep
the port from the next gateway.

A gateway killed without a chance to clean up leaves directories behind: its attested
key's (`tinygw-tls-*`), its metrics' (`tinygw-metrics-*`), frozen, the bootloader's
unpack directory (`_MEI*`) and, measured, attest/launch's (`tinygw-launch.*`: the copy
of the artifact, and TMPDIR). `serve` removes those of dead gateways at start. Who is
dead: serve holds a lock (flock) on each directory it makes for its whole life (its
forked workers share it; spawned ones die with it all the same); the unpack directory is the
bootloader's and the launch directory the launcher's, which take no lock, but every
process of the gateway maps its Python library from the one and its executable from the
other, and workers map their metrics files. So a directory that no live
process holds a lock on, maps a file from or has a file open in belongs to nobody
alive. The gateway's own directories are locked before they bear their names
(`make_held`), so one found unlocked is dead however young; a borrowed one modified
within the last `GRACE_SECONDS` is left alone: a starting gateway may be between two
of its files.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import secrets
import shutil
import signal
import stat
import sys
import tempfile
import time

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36

# A borrowed directory (an unpack or launch one) modified more recently than this may
# belong to a gateway that is starting right now, between two of its files or before it
# maps any (an unpack writes 51 MB in about 0.3 s, each file held open as it is written).
GRACE_SECONDS = 2.0
# A directory of the gateway's own is made under this name, locked, then renamed.
STAGING_PREFIX = ".staging-"

UNPACK_PREFIX = "_MEI"
LAUNCH_PREFIX = "tinygw-launch."  # attest/launch's directory: the artifact's measured copy, and TMPDIR
OWN_PREFIXES = ("tinygw-tls-", "tinygw-metrics-", "tinygw-keys-")
# A killed gateway may leave a staging directory (empty: it is renamed as soon as locked).
STAGING_PREFIXES = tuple(STAGING_PREFIX + p for p in OWN_PREFIXES)
PREFIXES = (*OWN_PREFIXES, UNPACK_PREFIX, LAUNCH_PREFIX, *STAGING_PREFIXES)
# What a directory of each borrowed kind holds when it is ours: the unpacked Granian, the copy.
_MARKS = {UNPACK_PREFIX: "granian", LAUNCH_PREFIX: "tinygw"}


def _prctl(option: int, value: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))


def die_with_parent(parent_pid: int | None = None) -> None:
    """SIGKILL this process when its parent dies. With `parent_pid` (the parent it was
    started by), exit at once when the parent died before the request was made."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)


def die_with_bootloader() -> None:
    """Frozen: the Python process dies with the bootloader that unpacked and started it
    (an executable of the same file: when the parent runs another, the bootloader died
    before the request was made, and this process was handed to another parent)."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if getattr(sys, "frozen", False) and _exe(os.getppid()) != _exe(os.getpid()):
        os._exit(1)


def adopt_orphans() -> None:
    """Become the parent of this process's orphaned descendants (PR_SET_CHILD_SUBREAPER):
    the test suite's way to find what it left behind."""
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def _exe(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return None


def make_held(parent: str, prefix: str) -> tuple[str, int]:
    """A new private (0700) directory `prefix` + 16 random hex digits in `parent`, locked
    by this process before it bears that name: a gateway starting beside this one never
    sees it unlocked. Its name is drawn apart from the staging one, which others can
    read in `parent`, and drawn again when taken (as mkdtemp does). Its path, and the
    file descriptor that holds its lock. Raises OSError."""
    staging = tempfile.mkdtemp(prefix=STAGING_PREFIX + prefix, dir=parent)
    fd = None
    try:
        fd = os.open(staging, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        for _ in range(100):
            path = os.path.join(parent, prefix + secrets.token_hex(8))
            if not os.path.lexists(path):  # 64 random bits: nobody can make it between this look and the rename
                os.rename(staging, path)
                return path, fd
        raise FileExistsError(errno.EEXIST, f"no free name for a new {prefix}* directory", parent)
    except BaseException:
        release(fd)
        shutil.rmtree(staging, ignore_errors=True)
        raise


def release(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)


def remove_leftovers(parents: list[str], keep: str, now: float | None = None) -> list[str]:
    """Remove the directories of dead gateways owned by this user in `parents`, never
    `keep` (this process's own TMPDIR) or one that holds it; the paths removed."""
    now = time.time() if now is None else now  # compared with file times, which are wall clock
    candidates = []
    for parent in dict.fromkeys(p for p in parents if p):
        try:
            names = os.listdir(parent)
        except OSError:
            continue
        candidates += [os.path.join(parent, n) for n in names if n.startswith(PREFIXES)]
    keep = os.path.realpath(keep)
    candidates = [
        path
        for path in candidates
        if _ours_and_settled(path, now) and not (keep + "/").startswith(os.path.realpath(path) + "/")
    ]
    if not candidates:
        return []
    mapped = _mapped_directories()
    removed = []
    for path in candidates:
        mark = next((m for prefix, m in _MARKS.items() if os.path.basename(path).startswith(prefix)), None)
        if mark and not os.path.exists(os.path.join(path, mark)):
            continue  # another program's
        if os.path.realpath(path) in mapped or _held(path):
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.lexists(path):
            removed.append(path)
    return removed


def _ours_and_settled(path: str, now: float) -> bool:
    try:
        info = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        return False
    # not made locked: borrowed, or a staging directory between its making and its lock
    unlocked_at_birth = os.path.basename(path).startswith((*_MARKS, *STAGING_PREFIXES))
    return not unlocked_at_birth or now - info.st_mtime > GRACE_SECONDS


def _held(path: str) -> bool:
    """Does a live process hold the lock of the gateway that made `path`?"""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return True  # cannot tell: leave it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


def _mapped_directories() -> set[str]:
    """The directories of ours (by their prefixes) that live processes map files from,
    or have a file open in (a bootloader that unpacks, a launcher that copies)."""
    directories: set[str] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
                paths = {line.partition("/")[2].rstrip("\n") for line in f if "/" in line}
        except OSError:
            continue  # gone, or another user's
        paths.update(_open_files(pid))
        for path in paths:
            parts = path.split("/")
            directories.update(
                "/" + "/".join(parts[: i + 1]) for i, part in enumerate(parts) if part.startswith(PREFIXES)
            )
    return directories


def _open_files(pid: str) -> set[str]:
    """The paths (without the leading /) of the files process `pid` has open (none when
    it is gone meanwhile)."""
    paths: set[str] = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return paths
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("/"):
            paths.add(target[1:])
    return paths
