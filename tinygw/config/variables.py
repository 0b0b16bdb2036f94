"""A variable that holds a secret: `NAME`, or the file `NAME_FILE` names (docs/design.md
section 2), and the rules for what a key may hold. Read by tinygw.config.environment and
the modules it reads providers and clients with; never shown in a message."""

from __future__ import annotations

import re
from collections.abc import Mapping

from tinygw.config.files import MAX_SECRET_FILE_BYTES, read_file
from tinygw.errors import ConfigError
from tinygw.secret import Secret

ASCII_SPACE = " \t\r\n"
# A header value, trimmed: what a provider's key (or a credential in its headers) may hold.
HEADER_SAFE = re.compile(r"[\x21-\x7e](?:[\x20-\x7e]*[\x21-\x7e])?")
_GATEWAY_KEY = re.compile(r"[\x21-\x7e]+")  # visible ASCII, no space
_VARIABLE_NAME = re.compile(r"[A-Za-z0-9_]+")


def variable_name(where: str, name: str | None) -> str:
    """`name`, which the configuration at `where` gives as an environment variable's name."""
    if not name or not _VARIABLE_NAME.fullmatch(name):
        raise ConfigError(where, f"not an environment variable name: {name!r}")
    return name


def read(env: Mapping[str, str], name: str) -> str | None:
    """What `NAME` holds, or the file `NAME_FILE` names (less one line end at its end); None
    when neither is set."""
    value, file_path = env.get(name), env.get(f"{name}_FILE")
    if value is not None and file_path is not None:
        raise ConfigError(name, f"both {name} and {name}_FILE are set; set one")
    if file_path is not None:
        value = read_file(f"{name}_FILE", file_path, MAX_SECRET_FILE_BYTES)
        if value.endswith("\n"):
            value = value[:-1]
            if value.endswith("\r"):
                value = value[:-1]
    return value


def secret(env: Mapping[str, str], name: str) -> Secret:
    """A key held in `NAME`, or in the file that `NAME_FILE` names (docs/design.md section 2)."""
    value = read(env, name)
    if value is None:
        raise ConfigError(name, f"unset (neither {name} nor {name}_FILE is set)")
    if value.strip() == "":
        raise ConfigError(name, "empty")
    if not HEADER_SAFE.fullmatch(value):
        # Said without the value: a key must never reach a message.
        raise ConfigError(name, "holds whitespace at an end or a character outside printable ASCII")
    return Secret(value)


def gateway_key(name: str, word: str) -> Secret:
    """One of the gateway's own keys (TINYGW_API_KEYS', a client's: a line or a comma-separated
    entry of the variable `name`), the ASCII spaces around it dropped: visible ASCII with no
    space, so that a client sends it in a header as it is written (docs/design.md section
    16). The one rule for every gateway key."""
    key = word.strip(ASCII_SPACE)
    if not _GATEWAY_KEY.fullmatch(key):
        # Said without the value: a key must never reach a message.
        raise ConfigError(name, "holds a key that is not visible ASCII without spaces")
    return Secret(key)
