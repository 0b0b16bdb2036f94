"""The JSON document's types (TINYGW_CONFIG, docs/configuration.md): what an operator
may write. Frozen msgspec Structs, keyword-only, unknown fields forbidden, limits in the
types (so a bad value names its path); tinygw.config.environment turns them into
tinygw.config.settings' effective values."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta, Struct

Seconds = Annotated[float, Meta(gt=0)]


class EnvRef(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A credential in a provider's `headers` or `query`: `{"env": "NAME"}`, the
    variable (or `NAME_FILE`) that holds it. Shown as the name, never the value."""

    env: str


# A provider's header or query value: a plain (non-secret) string, or a credential.
Value = str | EnvRef


class ProviderDoc(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    # Required for openai and anthropic; bedrock and vertex default to the region's
    # endpoint, and take a scheme and host only (the gateway writes the whole path).
    base_url: str | None = None
    api: Literal["openai", "anthropic", "bedrock", "vertex"]
    api_key_env: str | list[str] | None = None
    # Claude on the clouds (docs/design.md section 18). bedrock: its region and the
    # variables of its AWS credentials; vertex: its project, region, and the variable
    # that holds a service-account key (JSON).
    region: str | None = None
    project: str | None = None
    aws_access_key_id_env: str | None = None
    aws_secret_access_key_env: str | None = None
    aws_session_token_env: str | None = None
    credentials_env: str | None = None
    # The header that carries the key: None is by `api` (`Authorization: Bearer KEY`
    # for openai, `x-api-key: KEY` for anthropic); a name (Azure's `api-key`) gets the
    # raw key as its value.
    api_key_header: str | None = None
    headers: dict[str, Value] = {}
    # Query parameters appended to every upstream request (Azure's `api-version`);
    # tinygw.config.environment checks them, tinygw.worker.gateway encodes them once.
    query: dict[str, Value] = {}
    weight: Annotated[int, Meta(ge=1)] = 1
    connect_timeout_s: Seconds = 10.0
    # A streamed answer's head: every provider sends it at once (the tokens come later).
    head_timeout_s: Seconds = 30.0
    # From a streamed answer's head to the first byte of its body.
    first_byte_timeout_s: Seconds = 120.0
    timeout_s: Seconds = 600.0
    # The longest pause between two reads of a streamed answer once it began.
    stall_timeout_s: Seconds = 120.0
    # None: derived from the open-file limit at start (tinygw.upstream.pool.default_max_connections).
    max_connections: Annotated[int, Meta(ge=1, le=65536)] | None = None
    # How long a request waits for one of those connections before the target counts as busy.
    pool_timeout_s: Seconds = 10.0
    listing: bool = True
    health_path: str | None = None
    # http:// to an address that is not loopback: the host of a confidential VM reads
    # every byte of it, so it must be asked for (docs/design.md section 13).
    plaintext: bool = False
    # A client's own OpenAI-Organization and OpenAI-Project headers are forwarded (else
    # dropped): the operator lets clients pick the account their key acts for, and a
    # 401/403 to a request that carried one is then the client's (docs/design.md section 16).
    client_account_headers: bool = False
    # A conversation keeps its key of the pool (docs/configuration.md, conversation affinity);
    # false: the keys are used in turn.
    affinity: bool = True

    def key_variables(self) -> set[str]:
        """Every variable this provider reads a credential from."""
        names = [self.api_key_env] if isinstance(self.api_key_env, str) else list(self.api_key_env or [])
        refs = [v.env for v in (*self.headers.values(), *self.query.values()) if isinstance(v, EnvRef)]
        clouds = (self.aws_access_key_id_env, self.aws_secret_access_key_env, self.aws_session_token_env)
        return {*names, *refs, *(name for name in (*clouds, self.credentials_env) if name)}


class ModelDoc(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    targets: Annotated[list[str], Meta(min_length=1)]
    strategy: Literal["failover", "round_robin", "weighted", "shuffle"] = "failover"
    # The model's own timeouts, over its providers' for this alias (None: the provider's).
    timeout_s: Seconds | None = None
    first_byte_timeout_s: Seconds | None = None
    stall_timeout_s: Seconds | None = None
    head_timeout_s: Seconds | None = None
    # Where a request goes on when a target answers that its prompt is too long for the
    # model's context: aliases (their targets, in order) or provider:upstream_model targets.
    context_fallback: list[str] = []
    # A spreading strategy sends a conversation to the same target at every turn (docs/configuration.md).
    affinity: bool = True


class RoutingDoc(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    debug: bool = False
    max_attempts: Annotated[int, Meta(ge=1, le=16)] = 2


# A client's limit: a positive integer, exact in the doubles that the workers share it in.
Limit = Annotated[int, Meta(ge=1, le=2**40)]


class ClientDoc(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A named client (docs/design.md section 16): the variables that hold its gateway
    keys, and its limits (None: no limit)."""

    keys_env: str | list[str] | None = None
    max_concurrent: Limit | None = None
    requests_per_minute: Limit | None = None
    tokens_per_minute: Limit | None = None

    def key_variables(self) -> set[str]:
        """Every variable this client reads its keys from."""
        return {self.keys_env} if isinstance(self.keys_env, str) else set(self.keys_env or [])


class ConfigDoc(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    # Entries are decoded one by one, so that an error's path names the entry.
    providers: dict[str, msgspec.Raw] = {}
    models: dict[str, msgspec.Raw] = {}
    routing: RoutingDoc = RoutingDoc()
    clients: dict[str, msgspec.Raw] = {}


# ---- the effective configuration ---------------------------------------------------
