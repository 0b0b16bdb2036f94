"""Where metric values live, so that a scrape of any worker counts every worker.

Granian runs `TINYGW_WORKERS` processes and a scrape reaches one of them. Each worker
keeps its values in a file of its own, mapped into memory, in a directory that
`tinygw serve` creates for the run (prometheus_client's multiprocess mode, in ~100
lines): an increment is a write of 8 bytes into the map, no system call; a scrape
reads every worker's file. A worker that died keeps its file, so its counts stay.
A file is named by its worker's pid, start time (a reused pid never reopens an old
file) and slot, and a live worker holds a lock on it: a scrape tells live workers from
dead ones by trying that lock, not by the pid, which the system may have given to
another.

A worker's slot (1..N, the `worker` label of per-process gauges, docs/design.md section 7) is the
first of the directory's `slot-N.lock` files that it can lock: a worker that replaces
one that died takes the slot it freed, so the label stays across restarts. Granian
numbers its workers too, but tells the app nothing of it.

File layout: 4 bytes of used length (little-endian), 4 of padding, then entries of
[4-byte key length][key: JSON, padded to 8][8-byte float value]. The used length is
written after the entry, so a reader never sees half an entry.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import sys
import time

import msgspec

Key = tuple  # (family name, label values, part): all strings, hashable, JSON-encodable

_USED = struct.Struct("<I")
_LENGTH = struct.Struct("<I")
_VALUE = struct.Struct("<d")
_HEADER_BYTES = 8
_NATIVE_LITTLE = sys.byteorder == "little" and struct.calcsize("d") == 8
_INITIAL_BYTES = 64 * 1024
_FILE_PREFIX = "worker-"
_FILE_SUFFIX = ".db"
# Slots tried at most: Granian runs at most 256 workers (TINYGW_WORKERS), and a
# replacement may start while the worker it replaces is still stopping.
MAX_SLOTS = 1024


def _as_key(value) -> Key:
    return tuple(_as_key(v) if isinstance(v, list) else v for v in value)


class MemoryStore:
    """One process's values, in a list: for a worker without a directory, and tests."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.slot = 1
        self.values: list[float] = []  # by index, as FileStore's
        self._indexes: dict[Key, int] = {}

    def owns(self, pid: int) -> bool:
        return pid == self.pid

    def index(self, key: Key) -> int:
        """Where `key`'s value is in `values`: found once per series, then added to there."""
        index = self._indexes.get(key)
        if index is None:
            index = self._indexes[key] = len(self.values)
            self.values.append(0.0)
        return index

    def add(self, key: Key, amount: float = 1.0) -> None:
        index = self.index(key)
        self.values[index] += amount

    def set(self, key: Key, value: float) -> None:
        index = self.index(key)
        self.values[index] = value

    def snapshot(self) -> list[tuple[int, int, bool, dict[Key, float]]]:
        """(pid, slot, alive, values) of every worker."""
        return [(self.pid, self.slot, True, {key: self.values[i] for key, i in self._indexes.items()})]


class FileStore:
    """This worker's values in `directory/worker-PID.db`; `snapshot()` reads all workers'."""

    def __init__(self, directory: str) -> None:
        self.pid = os.getpid()
        self.directory = directory
        self.slot, self._slot_file = _take_slot(directory)
        self.path = os.path.join(directory, f"{_FILE_PREFIX}{self.pid}-{time.time_ns()}-{self.slot}{_FILE_SUFFIX}")
        self._file = open(self.path, "x+b")  # noqa: SIM115 (open for the worker's life)
        fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # held while alive
        self._file.truncate(_INITIAL_BYTES)
        self._map = mmap.mmap(self._file.fileno(), _INITIAL_BYTES)
        # The map as doubles (values are 8-aligned): an increment is an index, not two
        # struct calls. Replaced when the map grows: read it at each use, never keep it.
        self.values = _doubles(self._map)
        self._size = _INITIAL_BYTES
        self._used = _HEADER_BYTES
        _USED.pack_into(self._map, 0, self._used)
        self._indexes: dict[Key, int] = {}  # key -> its value's offset / 8

    def index(self, key: Key) -> int:
        """Where `key`'s value is in `values` (its offset / 8): found once per series
        (tinygw.observe.metrics keeps it), then added to there."""
        index = self._indexes.get(key)
        return self._append(key) if index is None else index

    def add(self, key: Key, amount: float = 1.0) -> None:
        index = self.index(key)  # first: it may replace the view
        self.values[index] += amount

    def set(self, key: Key, value: float) -> None:
        index = self.index(key)
        self.values[index] = value

    def _append(self, key: Key) -> int:
        raw = msgspec.json.encode(key)
        raw += b" " * (-(_LENGTH.size + len(raw)) % 8)
        entry = _LENGTH.pack(len(raw)) + raw + _VALUE.pack(0.0)
        while self._used + len(entry) > self._size:
            self._size *= 2
            self._file.truncate(self._size)
            self.values.release()  # a map with a view on it cannot be resized
            self._map.resize(self._size)
            self.values = _doubles(self._map)
        start = self._used
        self._map[start : start + len(entry)] = entry
        self._used += len(entry)
        _USED.pack_into(self._map, 0, self._used)
        index = (start + _LENGTH.size + len(raw)) // 8
        self._indexes[key] = index
        return index

    def owns(self, pid: int) -> bool:
        return pid == self.pid

    def snapshot(self) -> list[tuple[int, int, bool, dict[Key, float]]]:
        """(pid, slot, alive, values) of every worker whose file can be read; a file that
        cannot be read or parsed is left out, not allowed to fail the scrape."""
        try:
            names = sorted(os.listdir(self.directory))
        except OSError:
            names = []
        workers = []
        for name in names:
            if not (name.startswith(_FILE_PREFIX) and name.endswith(_FILE_SUFFIX)):
                continue
            path = os.path.join(self.directory, name)
            try:
                pid, _, slot = (int(part) for part in name[len(_FILE_PREFIX) : -len(_FILE_SUFFIX)].split("-"))
                with open(path, "rb") as f:
                    alive = path == self.path or held(f.fileno())
                    values = parse(f.read())
            except (ValueError, OSError, struct.error, msgspec.MsgspecError):
                continue
            workers.append((pid, slot, alive, values))
        return workers

    def close(self) -> None:
        self.values.release()
        self._map.close()
        self._file.close()
        self._slot_file.close()


class _StructDoubles:
    """The map's values as little-endian doubles where memoryview's native ones are not."""

    def __init__(self, buffer: mmap.mmap) -> None:
        self._buffer = buffer

    def __getitem__(self, index: int) -> float:
        value: float = _VALUE.unpack_from(self._buffer, index * 8)[0]
        return value

    def __setitem__(self, index: int, value: float) -> None:
        _VALUE.pack_into(self._buffer, index * 8, value)

    def release(self) -> None:
        pass


def _doubles(buffer: mmap.mmap):
    return memoryview(buffer).cast("d") if _NATIVE_LITTLE else _StructDoubles(buffer)


def _take_slot(directory: str):
    """The first free slot of the directory, and its lock file, held while alive."""
    for slot in range(1, MAX_SLOTS + 1):
        f = open(os.path.join(directory, f"slot-{slot}.lock"), "a+b")  # noqa: SIM115 (held for the worker's life)
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            continue
        return slot, f
    raise OSError("no free metrics slot")


def slot_alive(directory: str, slot: int) -> bool:
    """Does a live worker hold slot `slot`'s lock file in `directory`?"""
    try:
        fd = os.open(os.path.join(directory, f"slot-{slot}.lock"), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        return held(fd)
    finally:
        os.close(fd)


def held(fd: int) -> bool:
    """Does a live worker hold the lock of the file `fd` is open on (its slot's, held while alive)?"""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def parse(data: bytes) -> dict[Key, float]:
    """The entries of one worker's file."""
    values: dict[Key, float] = {}
    if len(data) < _HEADER_BYTES:
        return values
    (used,) = _USED.unpack_from(data, 0)
    position = _HEADER_BYTES
    while position + _LENGTH.size <= min(used, len(data)):
        (length,) = _LENGTH.unpack_from(data, position)
        key_end = position + _LENGTH.size + length
        if key_end + _VALUE.size > len(data):
            break
        key = _as_key(msgspec.json.decode(data[position + _LENGTH.size : key_end]))
        (values[key],) = _VALUE.unpack_from(data, key_end)
        position = key_end + _VALUE.size
    return values
