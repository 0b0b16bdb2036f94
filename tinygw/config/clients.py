"""Who a request is: the named clients of the configuration and the keys they hold
(docs/design.md section 16), read from the environment for tinygw.config.environment.
`default` holds the keys of TINYGW_API_KEYS."""

from __future__ import annotations

import re
from collections.abc import Mapping

from tinygw.config import strict
from tinygw.config.documents import ClientDoc, ProviderDoc
from tinygw.config.files import read_file
from tinygw.config.settings import DEFAULT_CLIENT, Client
from tinygw.config.variables import ASCII_SPACE, gateway_key, secret, variable_name
from tinygw.errors import ConfigError
from tinygw.secret import Secret

# A client's name: a metric label, a log field and a row of the status page.
_CLIENT_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


def inbound_keys(env: Mapping[str, str]) -> tuple[tuple[Secret, ...], str]:
    """The keys of the client `default`, and the variable they came from."""
    inline, file_path = env.get("TINYGW_API_KEYS"), env.get("TINYGW_API_KEYS_FILE")
    if inline is not None and file_path is not None:
        raise ConfigError("TINYGW_API_KEYS", "both TINYGW_API_KEYS and TINYGW_API_KEYS_FILE are set; set one")
    if file_path is not None:
        name, words = "TINYGW_API_KEYS_FILE", read_file("TINYGW_API_KEYS_FILE", file_path).split("\n")
    elif inline is not None:
        name, words = "TINYGW_API_KEYS", inline.split(",")
    else:
        return (), "TINYGW_API_KEYS"
    keys = tuple(gateway_key(name, w) for w in words if w.strip(ASCII_SPACE))
    if not keys:
        raise ConfigError(name, "set but holds no key")
    return keys, name


def taken_variables(providers: Mapping[str, ProviderDoc]) -> dict[str, str]:
    """The variables no client may read its keys from, each with whose it is: the gateway's
    own (it reads them for itself: `TINYGW_EHBP` would make the word `on` a key) and every
    provider's credentials, with their `_FILE` (an upstream key would become a gateway key)."""
    taken = dict.fromkeys(strict.OPERATOR_VARIABLES | strict.SET_BY_SERVE, "a variable the gateway reads for itself")
    for provider, doc in sorted(providers.items()):
        for name in doc.key_variables():
            for read in (name, f"{name}_FILE"):
                taken.setdefault(read, f"a credential variable of the provider {provider!r}")
    return taken


def _refuse_taken(where: str, client: str, name: str, taken: Mapping[str, str]) -> None:
    """ConfigError when the keys of `client`, read from `name` or `NAME_FILE`, would be read
    from a variable of `taken`."""
    for read in (name, f"{name}_FILE"):
        if read in taken:
            raise ConfigError(where, f"the client {client!r} reads its keys from {name}, but {read} is {taken[read]}")


def _client_keys(env: Mapping[str, str], name: str) -> tuple[Secret, ...]:
    """The keys of a client's variable `name` (or `NAME_FILE`): a comma list."""
    words = secret(env, name).reveal().split(",")
    keys = tuple(gateway_key(name, w) for w in words if w.strip(ASCII_SPACE))
    if not keys:
        raise ConfigError(name, "holds no key")
    return keys


def clients(
    env: Mapping[str, str],
    where: str,
    docs: dict[str, ClientDoc],
    default_keys: tuple[Secret, ...],
    default_env: str,
    taken: Mapping[str, str],
) -> dict[str, Client]:
    """Every client a request may be (docs/design.md section 16). `default` has the keys of
    TINYGW_API_KEYS (`default_keys`, from `default_env`); it exists when it has keys or no
    other client has (then every request is it), with the limits `clients` gives it. No
    client reads its keys from a variable of `taken` (taken_variables)."""
    owners: dict[str, str] = {key.reveal(): DEFAULT_CLIENT for key in default_keys}  # key -> its client
    clients: dict[str, Client] = {}
    for name, doc in docs.items():
        path = f"{where} $.clients.{name}"
        if not _CLIENT_NAME.fullmatch(name):
            raise ConfigError(path, "a client name is 1 to 64 letters, digits, '.', '_' or '-'")
        if name == DEFAULT_CLIENT:
            if doc.keys_env is not None:
                raise ConfigError(f"{path}.keys_env", "the keys of the client default are TINYGW_API_KEYS'")
            continue
        names = [doc.keys_env] if isinstance(doc.keys_env, str) else list(doc.keys_env or [])
        if not names:
            raise ConfigError(path, f"the client {name!r} has no keys: name the variables that hold them in keys_env")
        for key_name in names:
            variable_name(f"{path}.keys_env", key_name)
            _refuse_taken(f"{path}.keys_env", name, key_name, taken)
        keys = tuple(key for key_name in names for key in _client_keys(env, key_name))
        for key in keys:
            owner = owners.setdefault(key.reveal(), name)
            if owner != name:  # the key itself is never said
                raise ConfigError(path, f"a key of the client {name!r} is also a key of the client {owner!r}")
        clients[name] = _client(name, doc, keys, tuple(names))
    default = docs.get(DEFAULT_CLIENT, ClientDoc())
    if default_keys or not clients:
        clients[DEFAULT_CLIENT] = _client(DEFAULT_CLIENT, default, default_keys, (default_env,) if default_keys else ())
    elif DEFAULT_CLIENT in docs:
        raise ConfigError(
            f"{where} $.clients.{DEFAULT_CLIENT}",
            "the client default has no keys: TINYGW_API_KEYS is unset, and other clients have keys",
        )
    return clients


def _client(name: str, doc: ClientDoc, keys: tuple[Secret, ...], key_env: tuple[str, ...]) -> Client:
    return Client(
        name=name,
        keys=keys,
        key_env=key_env,
        max_concurrent=doc.max_concurrent,
        requests_per_minute=doc.requests_per_minute,
        tokens_per_minute=doc.tokens_per_minute,
    )
