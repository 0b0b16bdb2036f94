"""Reading the files that the environment names (`*_FILE`, TLS files), at start.

Each is read whole, up to a size, and must be a regular file: a path to /dev/zero, a
FIFO or a directory stops the start with a message naming the variable, never hangs
or crashes it.
"""

from __future__ import annotations

import os
import stat

from tinygw.errors import ConfigError

MAX_SECRET_FILE_BYTES = 64 * 1024
MAX_CONFIG_FILE_BYTES = 1024 * 1024


def read_file(name: str, path: str, limit: int = MAX_CONFIG_FILE_BYTES) -> str:
    data = read_bytes(name, path, limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(name, f"{path!r} is not UTF-8 text") from None


def read_bytes(name: str, path: str, limit: int) -> bytes:
    """The file's bytes, as they are (a key seed is not text)."""
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise ConfigError(name, f"cannot read {path!r}: {e.strerror}") from None
    try:
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
    except OSError as e:
        os.close(fd)
        raise ConfigError(name, f"cannot read {path!r}: {e.strerror}") from None
    if not regular:  # before fdopen, which raises on a directory
        os.close(fd)
        raise ConfigError(name, f"{path!r} is not a regular file")
    with os.fdopen(fd, "rb") as f:
        try:
            data = f.read(limit + 1)
        except OSError as e:
            raise ConfigError(name, f"cannot read {path!r}: {e.strerror}") from None
    if len(data) > limit:
        raise ConfigError(name, f"{path!r} is over {limit} bytes")
    return data
