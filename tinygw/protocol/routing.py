"""Routes, and from a request's route and model to the targets that may serve it.

A route table's rows are `Endpoint`s (the table itself is in tinygw.api.app, beside
the handlers); a proxied API route is a `Route`.

A path is a row's path exactly, or else the first row whose path is a template that it
matches (`Paths`, the one matcher): `{name}` stands for one path segment, and `{model}`
and `{id}` for one or more (a model's name may hold `/`). The cloud shapes of Claude take their model
from the path.

A model is a configured alias (its targets, in the alias's order), a
provider-qualified `provider/upstream_model` (that provider alone), or a name that a
pattern alias matches (`"claude-*"`: the longest matching pattern; an exact alias
always comes first). A target's upstream model `*` is the requested name as sent. A
target is usable only on a route that reaches its provider's API: OpenAI routes go to
`api: openai` providers, `/v1/messages` to `api: anthropic`, `bedrock` and `vertex` ones,
`/v1/messages/count_tokens` to `anthropic` ones, and the Bedrock and Vertex shapes of
Claude to `bedrock` and `vertex` providers (docs/design.md section 18).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Container, Iterable
from typing import NamedTuple

import msgspec
from msgspec import Struct

from tinygw.config.settings import Model, Settings, Target

# The end of a pattern alias's name, and a target's upstream model meaning "as sent".
WILDCARD = "*"


class Route(Struct, frozen=True):
    """A proxied API route."""

    path: str  # the gateway's path (a template for the cloud shapes), also the metrics label
    api: str  # the shape of its requests and answers: "openai" | "anthropic" | "bedrock" | "vertex"
    upstream_path: str  # appended to an openai or anthropic provider's base_url path
    reaches: frozenset[str] = frozenset()  # the provider APIs that may serve it (by default its own)
    # A cloud shape's: streamed or not, by its path (else the body's `stream` says); and its
    # path's pattern, whose group `model` is the requested model.
    stream: bool | None = None
    pattern: re.Pattern[str] | None = None

    def __post_init__(self) -> None:
        if not self.reaches:
            msgspec.structs.force_setattr(self, "reaches", frozenset({self.api}))

    def model_in(self, path: str) -> str | None:
        """The model a cloud shape's `path` names (None for a route whose body names it)."""
        if self.pattern is None:
            return None
        match = self.pattern.fullmatch(path)
        return match["model"] if match else None


class Endpoint(NamedTuple):
    """One row of the gateway's route table (in tinygw.api.app): what answers a path, to
    which methods, and whether the gateway key is asked for. The key is checked at
    dispatch, before any handler runs: a new route cannot forget it."""

    methods: tuple[str, ...]
    auth: bool
    page: Callable | None = None  # async (gateway, scope, send)
    route: Route | None = None  # a proxied API route
    # A page in both APIs' shapes (the model list): Anthropic's, errors included, when
    # the request carries `anthropic-version`, as Anthropic's SDKs send it.
    both_shapes: bool = False

    def anthropic_shaped(self, first: dict[bytes, bytes]) -> bool:
        """Whether a request's errors take Anthropic's shape (else OpenAI's); `first` is
        its headers by name (each one's first value)."""
        if self.route is not None:
            return self.route.api != "openai"  # Claude's, on any cloud
        return self.both_shapes and b"anthropic-version" in first


def api_endpoint(path: str, api: str, upstream_path: str, reaches: Iterable[str] = ()) -> tuple[str, Endpoint]:
    return path, Endpoint(("POST",), True, route=Route(path, api, upstream_path, frozenset(reaches)))


def cloud_endpoint(path: str, api: str, stream: bool) -> tuple[str, Endpoint]:
    """A cloud's shape of Claude's Messages API: its model in `path` (a template), the body as the cloud takes it."""
    return path, Endpoint(("POST",), True, route=Route(path, api, "", stream=stream, pattern=template(path)))


_PARAMETER = re.compile(r"\{([a-z_]+)\}")
# The parameters that name a model, which may hold `/` (`provider/model`, an ARN).
_MODEL_NAMES = ("model", "id")


def template(path: str) -> re.Pattern[str]:
    """A path template as a pattern: `{name}` one segment, `{model}` and `{id}` one or more."""
    parts, last = [], 0
    for match in _PARAMETER.finditer(path):
        parts.append(re.escape(path[last : match.start()]))
        parts.append(f"(?P<{match[1]}>{'.+' if match[1] in _MODEL_NAMES else '[^/]+'})")
        last = match.end()
    return re.compile("".join([*parts, re.escape(path[last:])]))


class Paths:
    """The one matcher of a route table: a path's row, exactly, or else the first row
    whose template it matches."""

    __slots__ = ("_exact", "_templates")

    def __init__(self, rows: dict[str, Endpoint]) -> None:
        self._exact = rows
        self._templates = [(template(path), endpoint) for path, endpoint in rows.items() if "{" in path]

    def match(self, path: str) -> Endpoint | None:
        endpoint = self._exact.get(path)
        if endpoint is not None:  # every API route but the cloud shapes
            return endpoint
        for pattern, candidate in self._templates:
            if pattern.fullmatch(path):
                return candidate
        return None


def page_endpoint(path: str, page: Callable, auth: bool = False, both_shapes: bool = False) -> tuple[str, Endpoint]:
    return path, Endpoint(("GET", "HEAD"), auth, page=page, both_shapes=both_shapes)


class Resolution(Struct, frozen=True):
    # The model as the gateway names it in metrics and logs: the alias, the pattern
    # that matched, or `provider/*` for a provider-qualified request (a client's
    # free-form name would otherwise let it mint new metric series without bound).
    model: str
    targets: tuple[Target, ...]  # in the model's configured order, usable on this route
    # The configured model, whose strategy orders the targets per request; None when their
    # order is fixed (one target, or `failover`: the configured order, as `targets` are).
    alias: Model | None = None
    # Whether a request's conversation chooses its target or key (tinygw.protocol.conversation.conversation_key):
    # worked out here, once per configured name, so that a plain request computes no conversation key.
    affinity: bool = False
    # Where the request goes on, in order, when a target answers that its prompt is too long
    # for the model's context (the alias's context_fallback, usable on this route).
    context_fallback: tuple[Target, ...] = ()


def resolve(settings: Settings, route: Route, model: str) -> Resolution | None:
    """The targets for `model` on `route`, or None when the gateway does not serve it."""
    alias = settings.models.get(model)
    if alias is None:
        provider, slash, upstream_model = model.partition("/")
        if slash and upstream_model and provider in settings.providers:
            if settings.providers[provider].doc.api in route.reaches:
                target = Target(provider, upstream_model)
                return Resolution(f"{provider}/*", (target,), affinity=_keys_by_conversation(settings, (target,)))
            return None
        alias = matching_pattern(settings.models, model)
        if alias is None:
            return None
    if any(t.upstream_model == WILDCARD for t in alias.targets):
        alias = msgspec.structs.replace(alias, targets=tuple(as_sent(t, model) for t in alias.targets))
    targets = tuple(t for t in alias.targets if settings.providers[t.provider].doc.api in route.reaches)
    if not targets:
        return None
    affinity = (alias.spreads_by_conversation() and len(targets) > 1) or _keys_by_conversation(settings, targets)
    longer = tuple(t for t in alias.context_fallback if settings.providers[t.provider].doc.api in route.reaches)
    return Resolution(alias.name, targets, None if alias.order_is_fixed() else alias, affinity, longer)


def _keys_by_conversation(settings: Settings, targets: tuple[Target, ...]) -> bool:
    """Whether one of `targets` is a provider whose conversation chooses its key (a pool, `affinity` on)."""
    providers = settings.providers
    return any(len(providers[t.provider].keys) > 1 and providers[t.provider].doc.affinity for t in targets)


def concealed(resolution: Resolution, configured: Container[Target], conceal: Callable[[str], str]) -> Resolution:
    """`resolution` for a request whose body was sealed (docs/confidential.md): each target
    whose upstream model the body named (a provider-qualified model, a pattern's `*`) carries
    `conceal(upstream model)`, shown in its place wherever others may read it. A target in
    `configured` is the operator's name, not the client's: shown as it is."""
    if all(t in configured for t in resolution.targets):  # an alias's own targets: the usual request
        return resolution

    def hidden(target: Target) -> Target:
        if target in configured:
            return target
        return Target(target.provider, target.upstream_model, concealed=conceal(target.upstream_model))

    alias = resolution.alias  # a pattern's targets, ordered by its strategy: the same targets, concealed
    if alias is not None:
        alias = msgspec.structs.replace(alias, targets=tuple(map(hidden, alias.targets)))
    return msgspec.structs.replace(resolution, targets=tuple(map(hidden, resolution.targets)), alias=alias)


class Resolver:
    """resolve() for one configuration, each configured name's answer on each API worked
    out once (at its first request) and kept: the common request names an alias. Other
    names (a pattern's match, `provider/model`) are resolved each time, and not kept: a
    client's free-form names must not grow memory."""

    __slots__ = ("_settings", "_known")

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._known: dict[tuple[str, str], Resolution | None] = {}  # (route's path, model) ->

    def resolve(self, route: Route, model: str) -> Resolution | None:
        try:
            return self._known[(route.path, model)]
        except KeyError:  # not worked out yet, or a name that is not kept
            pass
        resolution = resolve(self._settings, route, model)
        if model in self._settings.models:
            self._known[(route.path, model)] = resolution
        return resolution


def matching_pattern(models: dict[str, Model], model: str) -> Model | None:
    """The longest pattern alias (a name ending in `*`) that `model` starts with."""
    best = None
    for name, alias in models.items():
        if name.endswith(WILDCARD) and model.startswith(name[:-1]) and (best is None or len(name) > len(best.name)):
            best = alias
    return best


def as_sent(target: Target, model: str) -> Target:
    """`target`, with an upstream model of `*` replaced by the requested name."""
    return Target(target.provider, model) if target.upstream_model == WILDCARD else target
