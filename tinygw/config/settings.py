"""What the configuration is: the effective Settings (the JSON document's types are
tinygw.config.documents).

Frozen msgspec Structs, keyword-only, unknown fields forbidden, limits in the types
(so a bad value names its path). `tinygw.config.environment` reads them from the environment;
everything else receives them. `Settings.config_sha256()` is the hash that
`tinygw check` prints and `/attestation` reports.
"""

from __future__ import annotations

import hashlib
from typing import Literal

import msgspec
from msgspec import Struct

from tinygw.config.documents import ProviderDoc, RoutingDoc
from tinygw.secret import Secret

# A request body above this many bytes is refused with 413 (docs/design.md section 3).
DEFAULT_MAX_BODY_BYTES = 10 * 1024 * 1024

METRICS_DIR_VARIABLE = "TINYGW_METRICS_DIR"
# The certificate that `serve` hands its workers to report in /attestation (docs/design.md section 9).
SERVED_CERT_VARIABLE = "TINYGW_TLS_SERVED_CERT"
SERVED_SPKI_VARIABLE = "TINYGW_TLS_SERVED_SPKI"
# When the served certificate expires (its notAfter, Unix time): a metric of the workers.
SERVED_NOT_AFTER_VARIABLE = "TINYGW_TLS_SERVED_NOT_AFTER"
# Where serve put the EHBP and receipt keys for its workers (docs/confidential.md).
CONFIDENTIAL_KEYS_VARIABLE = "TINYGW_CONFIDENTIAL_KEYS"

# Where attestation measures and reports (docs/design.md section 8). attest/launch reads the same
# variables with the same defaults; tests point them at fake trees.
DEFAULT_RTMR_PATH = "/sys/devices/virtual/misc/tdx_guest/measurements/rtmr3:sha384"
DEFAULT_TSM_REPORT_DIR = "/sys/kernel/config/tsm/report"
DEFAULT_EVENT_LOG = "/run/tinygw/event-log.jsonl"


class Origin(Struct, frozen=True):
    """Where a provider lives: what the upstream pool connects to."""

    scheme: Literal["http", "https"]
    host: str
    port: int
    path: str  # the base_url's path, without a trailing slash ("" or "/v1")


class Target(Struct, frozen=True):
    """One `provider:upstream_model` entry of a model's targets."""

    provider: str
    upstream_model: str
    # `provider:upstream_model`, as the access log writes it per request: spelled once,
    # when the target is made (whatever is passed here is replaced). With `concealed`,
    # `provider:*#h`.
    name: str = ""
    # `*#h` when the upstream model is a name a sealed body carried (docs/confidential.md),
    # else "": shown in the model's place wherever others may read it.
    concealed: str = ""
    # The upstream model as metrics, logs and the status page show it: `concealed`, else
    # itself (spelled once, as `name`; whatever is passed here is replaced).
    shown_model: str = ""

    def __post_init__(self) -> None:
        shown = self.concealed or self.upstream_model
        msgspec.structs.force_setattr(self, "shown_model", shown)
        msgspec.structs.force_setattr(self, "name", f"{self.provider}:{shown}")

    def __str__(self) -> str:
        return self.name


# The provider APIs of Claude on the clouds (docs/design.md section 18).
CLOUDS = ("bedrock", "vertex")


def default_base_url(api: str, region: str) -> str:
    """A cloud provider's `base_url` when it sets none: the region's endpoint (Vertex's
    `global` region has no prefix)."""
    if api == "bedrock":
        return f"https://bedrock-runtime.{region}.amazonaws.com"
    return "https://aiplatform.googleapis.com" if region == "global" else f"https://{region}-aiplatform.googleapis.com"


class AwsCredentials(Struct, frozen=True):
    """A bedrock provider's AWS credentials (tinygw.upstream.signing signs with them)."""

    access_key_id: Secret
    secret_access_key: Secret
    session_token: Secret | None = None


class ServiceAccount(Struct, frozen=True):
    """What a Google service-account key holds that the JWT bearer grant needs."""

    client_email: str
    private_key: Secret  # PEM
    token_uri: str
    private_key_id: str | None = None


class Provider(Struct, frozen=True, kw_only=True):
    name: str
    doc: ProviderDoc
    origin: Origin
    keys: tuple[Secret, ...]
    key_env: tuple[str, ...]
    # The doc's headers and query with each `{"env": NAME}` read into a Secret.
    headers: dict[str, str | Secret] = {}
    query: dict[str, str | Secret] = {}
    # A bedrock provider's credentials; a vertex provider's service account, and where
    # its token endpoint (the account's `token_uri`) is.
    aws: AwsCredentials | None = None
    google: ServiceAccount | None = None
    token_origin: Origin | None = None

    @property
    def cloud(self) -> bool:
        """Claude on Bedrock or Vertex: the gateway writes the whole path and signs."""
        return self.doc.api in CLOUDS


def plain(value: str | Secret) -> str:
    """A header or query value as sent."""
    return value.reveal() if isinstance(value, Secret) else value


# The timeouts a model may set over its providers', in Model.timeouts' order.
MODEL_TIMEOUTS = ("timeout_s", "first_byte_timeout_s", "stall_timeout_s", "head_timeout_s")


class Model(Struct, frozen=True, kw_only=True):
    name: str
    targets: tuple[Target, ...]
    strategy: str
    # The alias's timeouts over its providers' (ModelDoc), in MODEL_TIMEOUTS' order, each
    # None when the provider's hold.
    timeouts: tuple[float | None, ...] = (None, None, None, None)
    affinity: bool = True  # the doc's: a conversation keeps its target (tinygw.resilience.strategy)
    # The targets a prompt too long for a target's context goes on to, in order (ModelDoc's
    # context_fallback, its aliases' targets in their place).
    context_fallback: tuple[Target, ...] = ()

    def order_is_fixed(self) -> bool:
        """Whether every request tries the targets in their configured order (one target,
        or `failover`); else the strategy orders them per request (tinygw.resilience.strategy)."""
        return len(self.targets) < 2 or self.strategy == "failover"

    def spreads_by_conversation(self) -> bool:
        """Whether a request's conversation chooses its first target (a spreading strategy
        with `affinity` on), rather than the strategy's turn."""
        return self.affinity and not self.order_is_fixed()


# The client whose keys are TINYGW_API_KEYS', and every request's when no key is configured.
DEFAULT_CLIENT = "default"
# A client's limits, by the names that `x-tinygw-limit` and the metrics give them, in the
# order they are checked.
LIMITS = ("max_concurrent", "requests_per_minute", "tokens_per_minute")


class Client(Struct, frozen=True, kw_only=True):
    """A named client: its gateway keys, the variables they came from, its limits."""

    name: str
    keys: tuple[Secret, ...] = ()
    key_env: tuple[str, ...] = ()
    max_concurrent: int | None = None
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None

    @property
    def limited(self) -> bool:
        return (self.max_concurrent, self.requests_per_minute, self.tokens_per_minute) != (None, None, None)

    def limits(self) -> dict[str, int | None]:
        """Each limit by its name (None: no limit)."""
        return {name: getattr(self, name) for name in LIMITS}


class Breaker(Struct, frozen=True, kw_only=True):
    failures: int = 5  # 0 turns breakers off
    open_seconds: float = 30.0
    max_open_seconds: float = 300.0
    half_open_probes: int = 1


class Settings(Struct, frozen=True, kw_only=True):
    host: str = "127.0.0.1"
    port: int = 8080
    workers: int = 1
    # Where `workers` came from: "affinity" or "cgroup" (TINYGW_WORKERS=auto), or "TINYGW_WORKERS".
    workers_from: str = "TINYGW_WORKERS"
    log_level: str = "info"
    drain_seconds: float = 30.0
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # How long a request's head may take to arrive, and the longest pause between
    # bytes of its body (docs/design.md section 10).
    client_timeout_seconds: float = 30.0
    api_keys: tuple[Secret, ...] = ()  # the keys of the client `default`
    # Every client a request may be, by name: `default` among them when it has keys or no
    # client has (then every request is `default`), as tinygw.config.environment reads them.
    clients: dict[str, Client] = {}
    providers: dict[str, Provider] = {}
    models: dict[str, Model] = {}
    routing: RoutingDoc = RoutingDoc()
    breaker: Breaker = Breaker()
    retry_fast_failures: bool = True
    health_check_seconds: float = 10.0
    listing_seconds: float = 60.0
    # TLS (docs/design.md section 9): "off" | "attested" | "files"; the names of an attested
    # certificate; the files of `files`; where an attested key may be written (memory
    # file systems only, tinygw.trust.tls); and the certificate being served, set by serve for
    # its workers (not configuration: not in the hash, nor is the key's place).
    tls_mode: str = "off"
    tls_names: tuple[str, ...] = ("localhost", "127.0.0.1")
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_key_dirs: tuple[str, ...] = ()
    served_cert: str | None = None
    served_spki_sha256: str | None = None
    served_not_after: float | None = None
    # EHBP ("off" | "on" | "required") and signed receipts (docs/confidential.md); where serve
    # put their keys for its workers (not configuration: not in the hash).
    ehbp: str = "off"
    receipts: bool = False
    confidential_keys: str | None = None
    # The file of the seed that the EHBP and receipt keys are made from (TINYGW_KEY_SEED_FILE),
    # read by serve alone: not configuration, not in the hash (replicas share it).
    key_seed_file: str | None = None
    # Where the workers of one `tinygw serve` keep their metrics (tinygw.observe.metricstore);
    # set by serve itself for its workers, not configuration, so not in the hash.
    metrics_dir: str | None = None
    # Paths of the measurement register, the configfs-tsm report interface and the
    # launcher's event log: where the machine keeps them, not configuration, so not in
    # the hash.
    rtmr_path: str = DEFAULT_RTMR_PATH
    tsm_report_dir: str = DEFAULT_TSM_REPORT_DIR
    event_log: str = DEFAULT_EVENT_LOG

    def effective(self) -> dict:
        """The non-secret configuration, as `tinygw check` prints and hashes it."""
        return {
            "providers": {
                name: {
                    **_without_default_affinity(msgspec.to_builtins(p.doc)),
                    "api_key_env": list(p.key_env),
                }
                for name, p in sorted(self.providers.items())
            },
            "models": {
                name: {
                    "targets": [str(t) for t in m.targets],
                    "strategy": m.strategy,
                    **({} if m.affinity else {"affinity": False}),
                    **({"context_fallback": [str(t) for t in m.context_fallback]} if m.context_fallback else {}),
                    **{
                        field: seconds
                        for field, seconds in zip(MODEL_TIMEOUTS, m.timeouts, strict=True)
                        if seconds is not None
                    },
                }
                for name, m in sorted(self.models.items())
            },
            "routing": msgspec.to_builtins(self.routing),
            "clients": {name: {"keys_env": list(c.key_env), **c.limits()} for name, c in sorted(self.clients.items())},
            "breaker": msgspec.to_builtins(self.breaker),
            "retry_fast_failures": self.retry_fast_failures,
            "health_check_seconds": self.health_check_seconds,
            "listing_seconds": self.listing_seconds,
            "gateway": {
                "max_body_bytes": self.max_body_bytes,
                "drain_seconds": self.drain_seconds,
                "client_timeout_seconds": self.client_timeout_seconds,
                "tls": self.tls_mode,
                "inbound_auth": any(c.keys for c in self.clients.values()) or bool(self.api_keys),
                # only when on: with both off the hash is what it was before they existed
                **({"ehbp": self.ehbp} if self.ehbp != "off" else {}),
                **({"receipts": True} if self.receipts else {}),
            },
        }

    def config_sha256(self) -> str:
        """sha256 of the canonical JSON (sorted keys, no spaces) of `effective()`."""
        return hashlib.sha256(canonical_json(self.effective())).hexdigest()


def _without_default_affinity(doc: dict) -> dict:
    """A provider's fields as hashed: `affinity` only when off, so that the hash of a
    configuration that does not set it is what it was before the field existed."""
    if doc.get("affinity") is True:
        del doc["affinity"]
    return doc


def canonical_json(value: object) -> bytes:
    return msgspec.json.encode(value, order="sorted")
