"""A file of the run's directory that every worker of the gateway maps as floats, and the
exclusive flock its changes take (docs/design.md section 4, "One circuit for the
gateway").

Its first two floats are its layout (a number every worker computes from the same
configuration) and a marker written last, once it is ready: the first worker to map it
for a layout zeroes it and prepares it under the lock, and the others (and a worker
started again after a crash) map it as it is. Without a run directory (a Gateway built
in a test) the map is this process's alone.
"""

from __future__ import annotations

import fcntl
import mmap
import os
from collections.abc import Callable
from typing import Any

LAYOUT, READY = 0, 1  # the header's floats
_READY_MARK = 7.0e15 + 3.0  # a marker no zeroed or half-written file holds


class Mapped:
    def __init__(
        self,
        directory: str | None,
        names: tuple[str, str],
        size: int,
        layout: float,
        prepare: Callable[[Any], None] = lambda values: None,
    ) -> None:
        """`names`: the file's and its lock's, in `directory`; `size` in bytes; `prepare`
        writes a new file's first values (after the header) while it is made."""
        self._lock_fd = self._fd = -1
        if not directory:
            self.map = mmap.mmap(-1, size)
            self._ready(layout, prepare)
            return
        file, lock = names
        self._lock_fd = os.open(os.path.join(directory, lock), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self._fd = os.open(os.path.join(directory, file), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self.lock()
        try:
            if os.fstat(self._fd).st_size != size:
                os.ftruncate(self._fd, 0)
                os.ftruncate(self._fd, size)
            self.map = mmap.mmap(self._fd, size)
            self._ready(layout, prepare)
        finally:
            self.unlock()

    def _ready(self, layout: float, prepare: Callable[[Any], None]) -> None:
        self.values = values = memoryview(self.map).cast("d")
        if values[LAYOUT] == layout and values[READY] == _READY_MARK:
            return  # made by another worker of this run: kept as it is
        values[READY] = 0.0
        self.map[:] = bytes(len(self.map))
        values[LAYOUT] = layout
        prepare(values)
        values[READY] = _READY_MARK

    def lock(self) -> None:
        if self._lock_fd >= 0:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)

    def unlock(self) -> None:
        if self._lock_fd >= 0:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def close(self) -> None:
        self.values.release()
        self.map.close()
        for fd in (self._fd, self._lock_fd):
            if fd >= 0:
                os.close(fd)
        self._fd = self._lock_fd = -1
