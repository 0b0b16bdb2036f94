"""What makes a configuration impossible to misread (docs/design.md section 13): every
`TINYGW_*` and `PROVIDER_*` variable is one the gateway reads, and no JSON object of
the configuration names a key twice.

A misspelled variable is not a default silently kept: `TINYGW_API_KEY` (singular) would
otherwise start a gateway without inbound auth. A duplicate key would serve the last
value while a reviewer reads the first.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Mapping
from itertools import accumulate

from tinygw.config.settings import (
    CONFIDENTIAL_KEYS_VARIABLE,
    METRICS_DIR_VARIABLE,
    SERVED_CERT_VARIABLE,
    SERVED_NOT_AFTER_VARIABLE,
    SERVED_SPKI_VARIABLE,
)
from tinygw.errors import ConfigError

PREFIXES = ("TINYGW_", "PROVIDER_")

# Every variable of ours that an operator may set (docs/configuration.md lists each).
OPERATOR_VARIABLES = frozenset(
    """
    TINYGW_CONFIG TINYGW_CONFIG_FILE TINYGW_HOST TINYGW_PORT TINYGW_WORKERS TINYGW_LOG_LEVEL TINYGW_DRAIN_SECONDS
    TINYGW_CLIENT_TIMEOUT_SECONDS TINYGW_MAX_BODY_BYTES TINYGW_API_KEYS TINYGW_API_KEYS_FILE
    TINYGW_TLS TINYGW_TLS_NAMES TINYGW_TLS_CERT_FILE TINYGW_TLS_KEY_FILE
    TINYGW_EHBP TINYGW_RECEIPTS TINYGW_KEY_SEED_FILE
    TINYGW_RTMR_PATH TINYGW_TSM_REPORT_DIR TINYGW_EVENT_LOG TINYGW_LAUNCH_DIR TINYGW_ALLOW_UNMEASURED
    PROVIDER_BREAKER_FAILURES PROVIDER_BREAKER_OPEN_SECONDS PROVIDER_BREAKER_MAX_OPEN_SECONDS
    PROVIDER_BREAKER_HALF_OPEN_PROBES PROVIDER_RETRY_FAST_FAILURES PROVIDER_HEALTH_CHECK_SECONDS
    PROVIDER_LISTING_SECONDS
    """.split()
)
# Set by `serve` for its own workers (and dropped when inherited from outside): read, but
# never suggested to an operator.
SET_BY_SERVE = frozenset(
    {
        METRICS_DIR_VARIABLE,
        SERVED_CERT_VARIABLE,
        SERVED_SPKI_VARIABLE,
        SERVED_NOT_AFTER_VARIABLE,
        CONFIDENTIAL_KEYS_VARIABLE,
    }
)


def refuse_unknown_variables(env: Mapping[str, str], key_variables: set[str]) -> None:
    """ConfigError for the first variable with our prefixes that the gateway does not
    read; the variables the configuration names for its keys (and their `_FILE`) are read."""
    named = key_variables | {f"{name}_FILE" for name in key_variables}
    for name in _unread(env, named):
        closest = difflib.get_close_matches(name, sorted(OPERATOR_VARIABLES | named), n=1, cutoff=0)
        raise ConfigError(name, _not_read(closest))


# The variables that say where the configuration is: a near miss of one of them is why a
# configuration cannot be found.
CONFIGURATION_VARIABLES = ("TINYGW_CONFIG", "TINYGW_CONFIG_FILE")
# How like one of them an unread variable must be to be called its misspelling (difflib's
# ratio: TINYGW_CONFIG_FIEL is 0.94 like TINYGW_CONFIG_FILE; a key variable
# TINYGW_CONFIG_KEY, 0.87, is not one).
MISSPELLING_RATIO = 0.9


def refuse_misspelled_variables(env: Mapping[str, str]) -> None:
    """For a configuration that cannot be read: ConfigError for an unread variable with
    our prefixes that is a near miss of TINYGW_CONFIG or TINYGW_CONFIG_FILE
    (`TINYGW_CONFIG_FIEL`), the likelier cause. Others wait: the configuration may name
    them for its keys, and no other name is offered for them meanwhile."""
    for name in _unread(env, set()):
        if closest := difflib.get_close_matches(name, CONFIGURATION_VARIABLES, n=1, cutoff=MISSPELLING_RATIO):
            raise ConfigError(name, _not_read(closest))


def _unread(env: Mapping[str, str], named: set[str]) -> list[str]:
    """The variables with our prefixes, in order, that the gateway does not read."""
    return [n for n in sorted(env) if n.startswith(PREFIXES) and n not in OPERATOR_VARIABLES | SET_BY_SERVE | named]


def _not_read(closest: list[str]) -> str:
    return "not a variable tinygw reads" + (f"; did you mean {closest[0]}?" if closest else "")


# How deeply the configuration's objects and arrays may nest (docs/design.md section 13): the
# document's real shape is 4 levels deep; deeper is a mistake or a test of the parser, and
# a parser's recursion (msgspec's, json's) must never be what stops it.
MAX_DEPTH = 64
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')  # a JSON string: the brackets in it are text
_NOT_BRACKET = bytes(sorted(set(range(256)) - set(b"[]{}")))
_LEVEL = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


def refuse_deep_nesting(where: str, raw: bytes) -> None:
    """ConfigError when the document nests objects and arrays more than MAX_DEPTH deep;
    read before any parser sees it (and without recursion)."""
    brackets = _STRING.sub(b"", raw).translate(None, _NOT_BRACKET)
    if len(brackets) > MAX_DEPTH and max(accumulate(map(_LEVEL.__getitem__, brackets))) > MAX_DEPTH:
        raise ConfigError(where, f"nested deeper than {MAX_DEPTH} levels")


class _Pairs(list):
    """A JSON object as its (key, value) pairs, in order, duplicates kept."""


def refuse_duplicate_keys(where: str, raw: bytes) -> None:
    """ConfigError naming the JSON path of the first key that an object repeats. The
    document was decoded once already (msgspec has said it is well-formed)."""
    try:
        _walk(where, "$", json.loads(raw, object_pairs_hook=_Pairs))
    except (ValueError, RecursionError):
        raise ConfigError(where, "malformed or too deeply nested JSON") from None


def _walk(where: str, path: str, value: object) -> None:
    if isinstance(value, _Pairs):
        seen: set[str] = set()
        for key, item in value:
            if key in seen:
                raise ConfigError(f"{where} {path}.{key}", "a duplicate key (each key may appear once in an object)")
            seen.add(key)
            _walk(where, f"{path}.{key}", item)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _walk(where, f"{path}[{i}]", item)
