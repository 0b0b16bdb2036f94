"""Configuration: read from the environment once, at start, into frozen Structs.

This is the only module that reads `os.environ` (through `from_environ`, which takes
the mapping as an argument so that tests pass their own). Every bad value raises
`ConfigError` naming the variable or JSON path and the reason; the caller turns that
into exit code 2. The types it fills are in `tinygw.config.settings`; secrets are held in
`tinygw.secret.Secret`.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
from collections.abc import Mapping
from types import UnionType
from typing import Annotated, Literal, TypeVar, Union, get_args, get_origin, get_type_hints
from urllib.parse import urlsplit

import msgspec

from tinygw.config import sealing, strict, tlsmode
from tinygw.config.files import MAX_SECRET_FILE_BYTES, read_file
from tinygw.config.settings import (
    CLOUDS,
    CONFIDENTIAL_KEYS_VARIABLE,
    DEFAULT_CLIENT,
    DEFAULT_EVENT_LOG,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_RTMR_PATH,
    DEFAULT_TSM_REPORT_DIR,
    METRICS_DIR_VARIABLE,
    SERVED_CERT_VARIABLE,
    SERVED_NOT_AFTER_VARIABLE,
    SERVED_SPKI_VARIABLE,
    AwsCredentials,
    Breaker,
    Client,
    ClientDoc,
    ConfigDoc,
    EnvRef,
    Model,
    ModelDoc,
    Origin,
    Provider,
    ProviderDoc,
    ServiceAccount,
    Settings,
    Target,
    default_base_url,
    plain,
)
from tinygw.errors import ConfigError
from tinygw.headers import CREDENTIALS, GATEWAY_HEADERS
from tinygw.secret import Secret

_CONFIG_DECODER = msgspec.json.Decoder(ConfigDoc)
_PROVIDER_DECODER = msgspec.json.Decoder(ProviderDoc)
_MODEL_DECODER = msgspec.json.Decoder(ModelDoc)
_CLIENT_DECODER = msgspec.json.Decoder(ClientDoc)
_Doc = TypeVar("_Doc")

# ---- reading the environment -------------------------------------------------------

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_LOG_LEVELS = ("debug", "info", "warning", "error")
# A provider's static `headers` may not set the gateway's own (tinygw.headers: credentials,
# framing, hop-by-hop); the header that carries its key may be any other token.
_KEY_HEADER_REFUSED = GATEWAY_HEADERS - CREDENTIALS | {"content-type", "cookie"}
_QUERY_SAFE = re.compile(r"[\x20-\x7e]*")  # printable ASCII; percent-encoded when sent
_HEADER_SAFE = re.compile(r"[\x21-\x7e](?:[\x20-\x7e]*[\x21-\x7e])?")  # a header value, trimmed
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # an HTTP header name (RFC 9110)
_GATEWAY_KEY = re.compile(r"[\x21-\x7e]+")  # visible ASCII, no space
# A client's name: a metric label, a log field and a row of the status page.
_CLIENT_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


# Numbers in variables are written in ASCII digits (docs/configuration.md): int() and
# float() also take other scripts' digits ('８０８０'), '_' between digits, 'inf' and 'nan'.
_INTEGER = re.compile(r"[+-]?[0-9]+")
_DECIMAL = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_ASCII_SPACE = " \t\r\n"


def _number(env: Mapping[str, str], name: str, default, *, kind=float, low=None, high=None):
    raw = env.get(name)
    text = None if raw is None else raw.strip(_ASCII_SPACE)
    if not text:
        return default
    if not (_INTEGER if kind is int else _DECIMAL).fullmatch(text):
        what = "an integer" if kind is int else "a number"
        raise ConfigError(name, f"not {what} in ASCII digits: {raw!r}")
    value = kind(text)
    if value in (float("inf"), float("-inf")):  # 1e999
        raise ConfigError(name, f"not a finite number: {raw!r}")
    if low is not None and value < low:
        raise ConfigError(name, f"must be at least {low}, got {text}")
    if high is not None and value > high:
        raise ConfigError(name, f"must be at most {high}, got {text}")
    return value


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    word = raw.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise ConfigError(name, f"not a boolean (true/false): {raw!r}")


def _path(env: Mapping[str, str], name: str, default: str) -> str:
    raw = env.get(name)
    return default if raw is None or raw.strip() == "" else raw


def _secret(env: Mapping[str, str], name: str) -> Secret:
    """A key held in `NAME`, or in the file that `NAME_FILE` names (docs/design.md section 2)."""
    value, file_path = env.get(name), env.get(f"{name}_FILE")
    if value is not None and file_path is not None:
        raise ConfigError(name, f"both {name} and {name}_FILE are set; set one")
    if file_path is not None:
        value = read_file(f"{name}_FILE", file_path, MAX_SECRET_FILE_BYTES)
        if value.endswith("\n"):
            value = value[:-1]
            if value.endswith("\r"):
                value = value[:-1]
    if value is None:
        raise ConfigError(name, f"unset (neither {name} nor {name}_FILE is set)")
    if value.strip() == "":
        raise ConfigError(name, "empty")
    if not _HEADER_SAFE.fullmatch(value):
        # Said without the value: a key must never reach a message.
        raise ConfigError(name, "holds whitespace at an end or a character outside printable ASCII")
    return Secret(value)


def _gateway_key(name: str, word: str) -> Secret:
    """One of the gateway's own keys (TINYGW_API_KEYS', a client's: a line or a comma-separated
    entry of the variable `name`), the ASCII spaces around it dropped: visible ASCII with no
    space, so that a client sends it in a header as it is written (docs/design.md section
    16). The one rule for every gateway key."""
    key = word.strip(_ASCII_SPACE)
    if not _GATEWAY_KEY.fullmatch(key):
        # Said without the value: a key must never reach a message.
        raise ConfigError(name, "holds a key that is not visible ASCII without spaces")
    return Secret(key)


def _inbound_keys(env: Mapping[str, str]) -> tuple[tuple[Secret, ...], str]:
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
    keys = tuple(_gateway_key(name, w) for w in words if w.strip(_ASCII_SPACE))
    if not keys:
        raise ConfigError(name, "set but holds no key")
    return keys, name


def _client_keys(env: Mapping[str, str], name: str) -> tuple[Secret, ...]:
    """The keys of a client's variable `name` (or `NAME_FILE`): a comma list."""
    words = _secret(env, name).reveal().split(",")
    keys = tuple(_gateway_key(name, w) for w in words if w.strip(_ASCII_SPACE))
    if not keys:
        raise ConfigError(name, "holds no key")
    return keys


def _clients(
    env: Mapping[str, str], where: str, docs: dict[str, ClientDoc], default_keys: tuple[Secret, ...], default_env: str
) -> dict[str, Client]:
    """Every client a request may be (docs/design.md section 16). `default` has the keys of
    TINYGW_API_KEYS (`default_keys`, from `default_env`); it exists when it has keys or no
    other client has (then every request is it), with the limits `clients` gives it."""
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
            if not key_name or not key_name.replace("_", "a").isalnum():
                raise ConfigError(f"{path}.keys_env", f"not an environment variable name: {key_name!r}")
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


def _config_document(env: Mapping[str, str]) -> tuple[str, bytes]:
    inline, file_path = env.get("TINYGW_CONFIG"), env.get("TINYGW_CONFIG_FILE")
    if inline is not None and file_path is not None:
        raise ConfigError("TINYGW_CONFIG", "both TINYGW_CONFIG and TINYGW_CONFIG_FILE are set; set one")
    if file_path is not None:
        return "TINYGW_CONFIG_FILE", read_file("TINYGW_CONFIG_FILE", file_path).encode()
    if inline is not None:
        return "TINYGW_CONFIG", inline.encode()
    raise ConfigError(
        "TINYGW_CONFIG", "unset: give the JSON configuration in TINYGW_CONFIG or a path in TINYGW_CONFIG_FILE"
    )


def _decode(where: str, raw: bytes, decoder: msgspec.json.Decoder[_Doc], prefix: str = "$") -> _Doc:
    try:
        return decoder.decode(raw)
    except msgspec.ValidationError as e:
        message, _, path = str(e).partition(" - at `")
        path = path.rstrip("`")
        allowed = _allowed_values(decoder.type, path)
        if allowed:
            message += f" (allowed: {', '.join(msgspec.json.encode(v).decode() for v in allowed)})"
        raise ConfigError(f"{where} {prefix}{path.removeprefix('$')}", message) from None
    except msgspec.DecodeError as e:
        raise ConfigError(where, f"malformed JSON: {e}") from None


# A step of msgspec's error path: `.field`, `[index]` of a list, `[...]` for a dict's value.
_PATH_STEP = re.compile(r"\.([^.\[]+)|\[([0-9]+|\.\.\.)\]")


def _allowed_values(doc_type: object, path: str) -> tuple:
    """The values a `Literal` field at `path` (`$.api`, `$.routing.debug`) of the document
    type `doc_type` allows, read from the type itself (so a value added to a Literal is named
    at once); () when the field is not a Literal, or the path leads nowhere."""
    field: object = doc_type
    for name, index in _PATH_STEP.findall(path.removeprefix("$")):
        field = _step(field, name, index)
        if field is None:
            return ()
    return tuple(v for member in _members(field) if get_origin(member) is Literal for v in get_args(member))


def _members(field: object) -> list:
    """A type's alternatives, Annotated's metadata dropped: `Literal[...] | None` is two."""
    while get_origin(field) is Annotated:
        field = get_args(field)[0]
    if get_origin(field) in (Union, UnionType):
        return [m for member in get_args(field) for m in _members(member)]
    return [field]


def _step(field: object, name: str, index: str) -> object:
    """The type one step (a field `name`, a list's `index`, a dict's `...`) into `field`, or None."""
    for member in _members(field):
        if name and isinstance(member, type) and issubclass(member, msgspec.Struct):
            hints = get_type_hints(member, include_extras=True)
            if name in hints:
                return hints[name]
        elif index == "..." and get_origin(member) is dict:
            return get_args(member)[1]
        elif index.isdigit() and get_origin(member) is list:
            return get_args(member)[0]
    return None


# A host name as DNS and the URL standard allow it (letters, digits, '-', '.', '_'),
# or an IP address; anything else (a space, a line break, '%') is refused.
_HOST_NAME = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_.])?")


def parse_base_url(where: str, url: str) -> Origin:
    # Visible ASCII only: a space or a line break would end up in the request line.
    if not url or any(not "\x21" <= c <= "\x7e" for c in url):
        raise ConfigError(where, "must be visible ASCII without spaces or control characters")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ConfigError(where, f"must start with http:// or https://, got {url!r}")
    if not parts.hostname:
        raise ConfigError(where, f"has no host: {url!r}")
    if parts.query or parts.fragment or parts.username or parts.password or "?" in url or "#" in url:
        raise ConfigError(where, "must not carry a query, fragment or credentials")
    host = parts.hostname
    if not (
        _HOST_NAME.fullmatch(host)
        and len(host) <= 253
        and all(0 < len(label) <= 63 for label in host.rstrip(".").split("."))
    ):
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise ConfigError(where, f"has a bad host: {url!r}") from None
    try:
        port = parts.port
    except ValueError:
        raise ConfigError(where, f"has a bad port: {url!r}") from None
    if port is None:
        if parts.netloc.endswith(":"):
            raise ConfigError(where, f"has an empty port: {url!r}")
        port = 443 if parts.scheme == "https" else 80
    if not 1 <= port <= 65535:
        raise ConfigError(where, f"has a bad port: {url!r}")
    scheme: Literal["http", "https"] = "https" if parts.scheme == "https" else "http"  # the two allowed above
    return Origin(scheme, host, port, parts.path.rstrip("/"))


def _not_plaintext(where: str, origin: Origin, plaintext: bool) -> None:
    if origin.scheme == "http" and not _is_loopback(origin.host) and not plaintext:
        raise ConfigError(
            where,
            "http:// to an address that is not loopback: the network (inside a "
            "confidential VM, its host) reads every byte; use https, or say "
            '"plaintext": true',
        )


def _provider(env: Mapping[str, str], where: str, name: str, doc: ProviderDoc) -> Provider:
    path = f"{where} $.providers.{name}"
    if not name or "/" in name or ":" in name:
        raise ConfigError(path, "a provider name must be non-empty and hold no '/' or ':'")
    doc, cloud = _cloud_fields(env, path, doc)
    if doc.base_url is None:
        raise ConfigError(f"{path}.base_url", "required (the provider's URL)")
    origin = parse_base_url(f"{path}.base_url", doc.base_url)
    if doc.api in CLOUDS and origin.path:
        raise ConfigError(
            f"{path}.base_url", f"a scheme and host only for {doc.api}: the gateway writes the whole path"
        )
    _not_plaintext(f"{path}.base_url", origin, doc.plaintext)
    names = [doc.api_key_env] if isinstance(doc.api_key_env, str) else list(doc.api_key_env or [])
    for key_name in names:
        if not key_name or not key_name.replace("_", "a").isalnum():
            raise ConfigError(f"{path}.api_key_env", f"not an environment variable name: {key_name!r}")
    keys = tuple(_secret(env, key_name) for key_name in names)
    headers = _values(env, f"{path}.headers", doc.headers)
    for header, value in headers.items():
        if not _TOKEN.fullmatch(header) or not (isinstance(value, Secret) or _HEADER_SAFE.fullmatch(value)):
            raise ConfigError(f"{path}.headers.{header}", "not a valid header name or value")
        if header.lower() in GATEWAY_HEADERS:
            raise ConfigError(f"{path}.headers.{header}", "set by the gateway (keys belong in api_key_env)")
    key_header = doc.api_key_header
    if key_header is not None:
        if not _TOKEN.fullmatch(key_header):
            raise ConfigError(f"{path}.api_key_header", "not a valid header name")
        if key_header.lower() in _KEY_HEADER_REFUSED:
            raise ConfigError(f"{path}.api_key_header", f"{key_header!r} is a header the gateway sets or drops")
        if key_header.lower() in {h.lower() for h in doc.headers}:
            raise ConfigError(f"{path}.api_key_header", f"{key_header!r} is also in headers")
    query = _values(env, f"{path}.query", doc.query)
    for name, value in query.items():
        if not name or not _QUERY_SAFE.fullmatch(name) or not _QUERY_SAFE.fullmatch(plain(value)):
            raise ConfigError(f"{path}.query.{name}", "a name must be non-empty, name and value printable ASCII")
    if doc.health_path is not None and not doc.health_path.startswith("/"):
        raise ConfigError(f"{path}.health_path", "must start with '/'")
    return Provider(
        name=name, doc=doc, origin=origin, keys=keys, key_env=tuple(names), headers=headers, query=query, **cloud
    )


# A cloud provider's own fields, by its api; each is refused on a provider of another api.
_CLOUD_FIELDS = {
    "bedrock": ("region", "aws_access_key_id_env", "aws_secret_access_key_env", "aws_session_token_env"),
    "vertex": ("region", "project", "credentials_env"),
}
_REQUIRED = {
    "bedrock": ("region", "aws_access_key_id_env", "aws_secret_access_key_env"),
    "vertex": ("project", "region", "credentials_env"),
}
# A region or project as the clouds name them: a path segment and a host name's label.
_CLOUD_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")


def _cloud_fields(env: Mapping[str, str], path: str, doc: ProviderDoc) -> tuple[ProviderDoc, dict]:
    """A bedrock or vertex provider's fields, checked, and its credentials read (docs/design.md
    section 18): (the doc with its base_url filled in, the Provider's `aws`, `google`,
    `token_origin`). Another provider may set none of them."""
    own = _CLOUD_FIELDS.get(doc.api, ())
    for field in sorted({f for fields in _CLOUD_FIELDS.values() for f in fields} - set(own)):
        if getattr(doc, field) is not None:
            raise ConfigError(f"{path}.{field}", f"not a field of an {doc.api} provider")
    if doc.api not in CLOUDS:
        return doc, {}
    for field in _REQUIRED[doc.api]:
        if getattr(doc, field) is None:
            raise ConfigError(f"{path}.{field}", f"required for an {doc.api} provider")
    for field in ("region", "project"):
        value = getattr(doc, field)
        if value is not None and not _CLOUD_NAME.fullmatch(value):
            raise ConfigError(f"{path}.{field}", f"not a {field} name (lower-case letters, digits, '-'): {value!r}")
    if doc.api_key_env is not None or doc.api_key_header is not None:
        field = "api_key_env" if doc.api_key_env is not None else "api_key_header"
        raise ConfigError(f"{path}.{field}", f"an {doc.api} provider's credentials have fields of their own")
    for field in own:
        variable = getattr(doc, field)
        if field.endswith("_env") and variable is not None and not variable.replace("_", "a").isalnum():
            raise ConfigError(f"{path}.{field}", f"not an environment variable name: {variable!r}")
    region: str = doc.region  # type: ignore[assignment]  # required above
    if doc.base_url is None:
        doc = msgspec.structs.replace(doc, base_url=default_base_url(doc.api, region))
    if doc.api == "bedrock":
        session = doc.aws_session_token_env
        aws = AwsCredentials(
            _secret(env, doc.aws_access_key_id_env),  # type: ignore[arg-type]  # required above
            _secret(env, doc.aws_secret_access_key_env),  # type: ignore[arg-type]
            _secret(env, session) if session is not None else None,
        )
        return doc, {"aws": aws}
    google = _service_account(env, f"{path}.credentials_env", doc.credentials_env)  # type: ignore[arg-type]
    token_origin = parse_base_url(f"{doc.credentials_env} token_uri", google.token_uri)
    _not_plaintext(f"{doc.credentials_env} token_uri", token_origin, doc.plaintext)
    return doc, {"google": google, "token_origin": token_origin}


class _ServiceAccountKey(msgspec.Struct):
    """The fields of a Google service-account key file that the gateway reads."""

    client_email: str
    private_key: str
    token_uri: str = "https://oauth2.googleapis.com/token"  # noqa: S105 -- an address, not a secret
    private_key_id: str | None = None
    type: str = "service_account"


_decode_service_account = msgspec.json.Decoder(_ServiceAccountKey)


def _service_account(env: Mapping[str, str], where: str, name: str) -> ServiceAccount:
    """The service-account key (JSON) held in `name`, or in the file `NAME_FILE` names;
    its RSA key checked as the TLS keys are (at least 2048 bits). Never quoted in a message."""
    value, file_path = env.get(name), env.get(f"{name}_FILE")
    if value is not None and file_path is not None:
        raise ConfigError(name, f"both {name} and {name}_FILE are set; set one")
    if file_path is not None:
        value = read_file(f"{name}_FILE", file_path, MAX_SECRET_FILE_BYTES)
    if value is None or not value.strip():
        raise ConfigError(name, f"unset or empty (neither {name} nor {name}_FILE holds a service-account key)")
    try:
        key = _decode_service_account.decode(value)
    except msgspec.MsgspecError:
        raise ConfigError(name, "not a service-account key (JSON with client_email, private_key, token_uri)") from None
    if key.type != "service_account":
        raise ConfigError(name, f"a key of type {key.type!r}, not a service account's")
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    try:
        private_key = load_pem_private_key(key.private_key.encode(), password=None)
    except (ValueError, TypeError):
        raise ConfigError(name, "its private_key is not a PEM private key without a password") from None
    if not isinstance(private_key, rsa.RSAPrivateKey) or private_key.key_size < 2048:
        raise ConfigError(name, "its private_key is not an RSA key of at least 2048 bits")
    return ServiceAccount(key.client_email, Secret(key.private_key), key.token_uri, key.private_key_id)


def _values(env: Mapping[str, str], path: str, values: dict[str, str | EnvRef]) -> dict[str, str | Secret]:
    """A provider's headers or query, each `{"env": NAME}` read from the environment."""
    resolved: dict[str, str | Secret] = {}
    for name, value in values.items():
        if isinstance(value, EnvRef):
            if not value.env or not value.env.replace("_", "a").isalnum():
                raise ConfigError(f"{path}.{name}.env", f"not an environment variable name: {value.env!r}")
            resolved[name] = _secret(env, value.env)
        else:
            resolved[name] = value
    return resolved


def _model(where: str, name: str, doc: ModelDoc, providers: Mapping[str, Provider]) -> Model:
    path = f"{where} $.models.{name}"
    if not name:
        raise ConfigError(path, "a model name must be non-empty")
    if "*" in name[:-1]:
        raise ConfigError(path, "a pattern's '*' must be its last character, and its only one")
    targets = []
    for i, entry in enumerate(doc.targets):
        provider, sep, upstream = entry.partition(":")
        if not sep or not provider or not upstream:
            raise ConfigError(f"{path}.targets[{i}]", f"must be provider:upstream_model, got {entry!r}")
        if provider not in providers:
            raise ConfigError(f"{path}.targets[{i}]", f"unknown provider {provider!r}")
        if "*" in upstream and upstream != "*":
            raise ConfigError(f"{path}.targets[{i}]", f"the upstream model is a name or '*', got {upstream!r}")
        targets.append(Target(provider, upstream))
    timeouts = (doc.timeout_s, doc.first_byte_timeout_s, doc.stall_timeout_s)
    return Model(name=name, targets=tuple(targets), strategy=doc.strategy, timeouts=timeouts)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def from_environ(env: Mapping[str, str] | None = None) -> Settings:
    """Build the effective Settings from an environment, or raise ConfigError."""
    env = os.environ if env is None else env
    try:
        where, raw = _config_document(env)
        strict.refuse_deep_nesting(where, raw)
        doc = _decode(where, raw, _CONFIG_DECODER)
    except ConfigError:
        strict.refuse_misspelled_variables(env)  # TINYGW_CONFIG_FIEL is why, not "TINYGW_CONFIG: unset"
        raise
    strict.refuse_duplicate_keys(where, raw)
    provider_docs = {
        name: _decode(where, p, _PROVIDER_DECODER, f"$.providers.{name}") for name, p in doc.providers.items()
    }
    client_docs = {name: _decode(where, c, _CLIENT_DECODER, f"$.clients.{name}") for name, c in doc.clients.items()}
    key_variables = {n for d in provider_docs.values() for n in d.key_variables()}
    key_variables |= {n for c in client_docs.values() for n in c.key_variables()}
    strict.refuse_unknown_variables(env, key_variables)
    providers = {name: _provider(env, where, name, d) for name, d in provider_docs.items()}
    models = {
        name: _model(where, name, _decode(where, m, _MODEL_DECODER, f"$.models.{name}"), providers)
        for name, m in doc.models.items()
    }
    api_keys, api_keys_env = _inbound_keys(env)
    clients = _clients(env, where, client_docs, api_keys, api_keys_env)
    return Settings(
        **_listening(env, authenticated=any(c.keys for c in clients.values())),
        api_keys=api_keys,
        clients=clients,
        drain_seconds=_number(env, "TINYGW_DRAIN_SECONDS", 30.0, low=0, high=3600),
        client_timeout_seconds=_number(env, "TINYGW_CLIENT_TIMEOUT_SECONDS", 30.0, low=0.1, high=3600),
        max_body_bytes=_number(env, "TINYGW_MAX_BODY_BYTES", DEFAULT_MAX_BODY_BYTES, kind=int, low=1, high=2**31),
        providers=providers,
        models=models,
        routing=doc.routing,
        breaker=_breaker(env),
        retry_fast_failures=_flag(env, "PROVIDER_RETRY_FAST_FAILURES", True),
        health_check_seconds=_number(env, "PROVIDER_HEALTH_CHECK_SECONDS", 10.0, low=0, high=86400),
        listing_seconds=_number(env, "PROVIDER_LISTING_SECONDS", 60.0, low=0, high=86400),
        metrics_dir=env.get(METRICS_DIR_VARIABLE) or None,
        **tlsmode.tls_fields(env),
        **sealing.sealing_fields(env),
        rtmr_path=_path(env, "TINYGW_RTMR_PATH", DEFAULT_RTMR_PATH),
        tsm_report_dir=_path(env, "TINYGW_TSM_REPORT_DIR", DEFAULT_TSM_REPORT_DIR),
        event_log=_path(env, "TINYGW_EVENT_LOG", DEFAULT_EVENT_LOG),
    )


# What a configuration that starts but can serve no request is told (docs/design.md section 2):
# `serve` logs it as a warning, `tinygw check` prints it.
NOTHING_SERVED = "nothing can be served: the configuration has no providers and no models"


def start_warnings(settings: Settings) -> list[str]:
    """What is valid but almost surely not meant: said at start, never refused. A model
    needs a provider, so no provider is no model, and every request would be a 404."""
    return [NOTHING_SERVED] if not settings.providers else []


def _breaker(env: Mapping[str, str]) -> Breaker:
    breaker = Breaker(
        failures=_number(env, "PROVIDER_BREAKER_FAILURES", 5, kind=int, low=0, high=1_000_000),
        open_seconds=_number(env, "PROVIDER_BREAKER_OPEN_SECONDS", 30.0, low=0.001, high=86400 * 7),
        max_open_seconds=_number(env, "PROVIDER_BREAKER_MAX_OPEN_SECONDS", 300.0, low=0.001, high=86400 * 7),
        half_open_probes=_number(env, "PROVIDER_BREAKER_HALF_OPEN_PROBES", 1, kind=int, low=1, high=1000),
    )
    if breaker.max_open_seconds < breaker.open_seconds:
        raise ConfigError(
            "PROVIDER_BREAKER_MAX_OPEN_SECONDS",
            f"must be at least PROVIDER_BREAKER_OPEN_SECONDS ({breaker.open_seconds:g})",
        )
    return breaker


def _listen_address(host: str) -> str:
    """TINYGW_HOST: an IP address (Granian binds an address, not a name) of this machine."""
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:
        raise ConfigError("TINYGW_HOST", f"not an IP address (a name is not resolved): {host!r}") from None
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, 0))
        except OSError as e:
            raise ConfigError("TINYGW_HOST", f"cannot listen on {host}: {e.strerror}") from None
    return host


def _listening(env: Mapping[str, str], authenticated: bool) -> dict:
    """Where and how the gateway listens, as Settings fields; `authenticated`: whether any
    gateway key is configured (else it listens on loopback only)."""
    host = _listen_address(env.get("TINYGW_HOST", "127.0.0.1").strip() or "127.0.0.1")
    log_level = env.get("TINYGW_LOG_LEVEL", "info").strip().lower() or "info"
    if log_level not in _LOG_LEVELS:
        raise ConfigError("TINYGW_LOG_LEVEL", f"must be one of {', '.join(_LOG_LEVELS)}, got {log_level!r}")
    if not authenticated and not _is_loopback(host):
        raise ConfigError(
            "TINYGW_API_KEYS",
            f"no inbound keys are configured, so the gateway serves only on a loopback address, not {host!r}",
        )
    return {
        "host": host,
        "port": _number(env, "TINYGW_PORT", 8080, kind=int, low=0, high=65535),
        "workers": _number(env, "TINYGW_WORKERS", 1, kind=int, low=1, high=256),
        "log_level": log_level,
    }


def forget_inherited() -> None:
    """Drop the variables that `serve` sets for its own workers, should they come from
    outside: they are the gateway's, never an operator's (or a host's)."""
    for name in strict.SET_BY_SERVE:
        os.environ.pop(name, None)


def share_metrics_dir(path: str) -> None:
    """Hand the run's metrics directory to the workers that Granian is about to start."""
    os.environ[METRICS_DIR_VARIABLE] = path


def share_served_cert(path: str, spki_sha256: str, not_after: float) -> None:
    """Tell the workers which certificate they serve, its key's digest (for
    /attestation) and when it expires (a metric), so that they need not parse
    certificates themselves."""
    os.environ[SERVED_CERT_VARIABLE] = path
    os.environ[SERVED_SPKI_VARIABLE] = spki_sha256
    os.environ[SERVED_NOT_AFTER_VARIABLE] = repr(not_after)


def share_confidential_keys(directory: str) -> None:
    """Tell the workers where serve put the EHBP and receipt keys (docs/confidential.md)."""
    os.environ[CONFIDENTIAL_KEYS_VARIABLE] = directory
