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

import msgspec

from tinygw.config import clients as clients_of
from tinygw.config import clouds, cpus, sealing, strict, tlsmode
from tinygw.config import models as models_of
from tinygw.config.documents import ClientDoc, ConfigDoc, EnvRef, ModelDoc, ProviderDoc
from tinygw.config.files import read_file
from tinygw.config.settings import (
    CLOUDS,
    CONFIDENTIAL_KEYS_VARIABLE,
    DEFAULT_EVENT_LOG,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_RTMR_PATH,
    DEFAULT_TSM_REPORT_DIR,
    METRICS_DIR_VARIABLE,
    SERVED_CERT_VARIABLE,
    SERVED_NOT_AFTER_VARIABLE,
    SERVED_SPKI_VARIABLE,
    Breaker,
    Provider,
    Settings,
    plain,
)
from tinygw.config.urls import is_loopback, not_plaintext, parse_base_url
from tinygw.config.variables import ASCII_SPACE, HEADER_SAFE, secret, variable_name
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
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # an HTTP header name (RFC 9110)


# Numbers in variables are written in ASCII digits (docs/configuration.md): int() and
# float() also take other scripts' digits ('８０８０'), '_' between digits, 'inf' and 'nan'.
_INTEGER = re.compile(r"[+-]?[0-9]+")
_DECIMAL = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


def _number(env: Mapping[str, str], name: str, default, *, kind=float, low=None, high=None):
    raw = env.get(name)
    text = None if raw is None else raw.strip(ASCII_SPACE)
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


def _provider(env: Mapping[str, str], where: str, name: str, doc: ProviderDoc) -> Provider:
    path = f"{where} $.providers.{name}"
    if not name or "/" in name or ":" in name:
        raise ConfigError(path, "a provider name must be non-empty and hold no '/' or ':'")
    doc, cloud = clouds.cloud_fields(env, path, doc)
    if doc.base_url is None:
        raise ConfigError(f"{path}.base_url", "required (the provider's URL)")
    origin = parse_base_url(f"{path}.base_url", doc.base_url)
    if doc.api in CLOUDS and origin.path:
        raise ConfigError(
            f"{path}.base_url", f"a scheme and host only for {doc.api}: the gateway writes the whole path"
        )
    not_plaintext(f"{path}.base_url", origin, doc.plaintext)
    names = [doc.api_key_env] if isinstance(doc.api_key_env, str) else list(doc.api_key_env or [])
    for key_name in names:
        variable_name(f"{path}.api_key_env", key_name)
    keys = tuple(secret(env, key_name) for key_name in names)
    headers = _values(env, f"{path}.headers", doc.headers)
    for header, value in headers.items():
        if not _TOKEN.fullmatch(header) or not (isinstance(value, Secret) or HEADER_SAFE.fullmatch(value)):
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


def _values(env: Mapping[str, str], path: str, values: dict[str, str | EnvRef]) -> dict[str, str | Secret]:
    """A provider's headers or query, each `{"env": NAME}` read from the environment."""
    resolved: dict[str, str | Secret] = {}
    for name, value in values.items():
        if isinstance(value, EnvRef):
            resolved[name] = secret(env, variable_name(f"{path}.{name}.env", value.env))
        else:
            resolved[name] = value
    return resolved


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
    model_docs = {name: _decode(where, m, _MODEL_DECODER, f"$.models.{name}") for name, m in doc.models.items()}
    models = {name: models_of.model(where, name, m, providers) for name, m in model_docs.items()}
    models = {
        name: models_of.with_context_fallback(where, m, model_docs[name], models, providers)
        for name, m in models.items()
    }
    api_keys, api_keys_env = clients_of.inbound_keys(env)
    taken = clients_of.taken_variables(provider_docs)
    clients = clients_of.clients(env, where, client_docs, api_keys, api_keys_env, taken)
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
    if not authenticated and not is_loopback(host):
        raise ConfigError(
            "TINYGW_API_KEYS",
            f"no inbound keys are configured, so the gateway serves only on a loopback address, not {host!r}",
        )
    return {
        "host": host,
        "port": _number(env, "TINYGW_PORT", 8080, kind=int, low=0, high=65535),
        **_workers(env),
        "log_level": log_level,
    }


def _workers(env: Mapping[str, str]) -> dict:
    """TINYGW_WORKERS: a number, or `auto` (the default): the CPUs this process may run on."""
    raw = env.get("TINYGW_WORKERS", "").strip(ASCII_SPACE)
    if raw.lower() in ("", "auto"):
        usable = cpus.usable()
        return {"workers": usable.count, "workers_from": usable.source}
    count = _number(env, "TINYGW_WORKERS", 1, kind=int, low=1, high=cpus.MAX_WORKERS)
    return {"workers": count, "workers_from": cpus.FROM_VARIABLE}


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


def share_workers(count: int) -> None:
    """Tell the workers the count serve resolved (`auto`), so that each sizes its share of
    what the workers split (receipts) by the same number."""
    os.environ["TINYGW_WORKERS"] = str(count)


def share_confidential_keys(directory: str) -> None:
    """Tell the workers where serve put the EHBP and receipt keys (docs/confidential.md)."""
    os.environ[CONFIDENTIAL_KEYS_VARIABLE] = directory
