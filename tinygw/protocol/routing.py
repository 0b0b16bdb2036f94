"""From a request's route and model to the targets that may serve it.

A model is a configured alias (its targets, in the alias's order) or a
provider-qualified `provider/upstream_model` (that provider alone). A target is
usable only on a route of its provider's API: OpenAI routes go to `api: openai`
providers, `/v1/messages` and `/v1/messages/count_tokens` to `api: anthropic` ones.
"""

from __future__ import annotations

from msgspec import Struct

from tinygw.config.settings import Model, Settings, Target


class Route(Struct, frozen=True):
    path: str  # the gateway's path, also the metrics label
    api: str  # "openai" | "anthropic"
    upstream_path: str  # appended to the provider's base_url path


ROUTES = {
    r.path: r
    for r in (
        Route("/v1/chat/completions", "openai", "/chat/completions"),
        Route("/v1/completions", "openai", "/completions"),
        Route("/v1/embeddings", "openai", "/embeddings"),
        Route("/v1/responses", "openai", "/responses"),
        Route("/v1/messages", "anthropic", "/v1/messages"),
        Route("/v1/messages/count_tokens", "anthropic", "/v1/messages/count_tokens"),
    )
}


class Resolution(Struct, frozen=True):
    # The model as the gateway names it in metrics and logs: the alias, or
    # `provider/*` for a provider-qualified request (whose free-form name would
    # otherwise let clients mint new metric series without bound).
    model: str
    targets: tuple[Target, ...]  # in the model's configured order, usable on this route
    alias: Model | None = None  # the configured model, whose strategy orders the targets


def resolve(settings: Settings, route: Route, model: str) -> Resolution | None:
    """The targets for `model` on `route`, or None when the gateway does not serve it."""
    alias = settings.models.get(model)
    if alias is not None:
        targets = tuple(t for t in alias.targets if settings.providers[t.provider].doc.api == route.api)
        return Resolution(model, targets, alias) if targets else None
    provider, slash, upstream_model = model.partition("/")
    if slash and upstream_model and provider in settings.providers:
        if settings.providers[provider].doc.api == route.api:
            return Resolution(f"{provider}/*", (Target(provider, upstream_model),))
    return None
