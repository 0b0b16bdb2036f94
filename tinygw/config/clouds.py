"""Claude on the clouds: a bedrock or vertex provider's own fields, checked, and its
credentials read (AWS keys; a Google service account), for tinygw.config.environment
(docs/design.md section 18)."""

from __future__ import annotations

import re
from collections.abc import Mapping

import msgspec

from tinygw.config.documents import ProviderDoc
from tinygw.config.settings import CLOUDS, AwsCredentials, ServiceAccount, default_base_url
from tinygw.config.urls import not_plaintext, parse_base_url
from tinygw.config.variables import read, secret, variable_name
from tinygw.errors import ConfigError
from tinygw.secret import Secret

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


def cloud_fields(env: Mapping[str, str], path: str, doc: ProviderDoc) -> tuple[ProviderDoc, dict]:
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
        if field.endswith("_env") and getattr(doc, field) is not None:
            variable_name(f"{path}.{field}", getattr(doc, field))
    region: str = doc.region  # type: ignore[assignment]  # required above
    if doc.base_url is None:
        doc = msgspec.structs.replace(doc, base_url=default_base_url(doc.api, region))
    if doc.api == "bedrock":
        session = doc.aws_session_token_env
        aws = AwsCredentials(
            secret(env, doc.aws_access_key_id_env),  # type: ignore[arg-type]  # required above
            secret(env, doc.aws_secret_access_key_env),  # type: ignore[arg-type]
            secret(env, session) if session is not None else None,
        )
        return doc, {"aws": aws}
    google = _service_account(env, f"{path}.credentials_env", doc.credentials_env)  # type: ignore[arg-type]
    token_origin = parse_base_url(f"{doc.credentials_env} token_uri", google.token_uri)
    not_plaintext(f"{doc.credentials_env} token_uri", token_origin, doc.plaintext)
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
    value = read(env, name)
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
