"""The model list (docs/design.md sections 3 and 6): GET /v1/models and /v1/models/{id}.

The list: every configured alias but the patterns, the listed models that a pattern
serves by their own names, then `provider/upstream_model` for each model of each
provider whose last listing succeeded; one model: any name a request may use (routed as
a request is). Each with its `availability` from the circuits of its targets; in
OpenAI's shape, or Anthropic's (paged) when the request carries `anthropic-version`.
"""

from __future__ import annotations

from urllib.parse import parse_qs

from tinygw.config.settings import Settings
from tinygw.protocol.routing import WILDCARD, Route, resolve
from tinygw.protocol.wire import header, send_error, send_json
from tinygw.worker import discovery
from tinygw.worker.gateway import Gateway

MODEL_PREFIX = "/v1/models/"


def _entry(model_id: str, owner: str, targets: list[tuple[str, str]], circuits: dict) -> dict:
    """One model object: its `availability` is true if any of its targets' circuits admits an
    attempt now (a circuit no attempt has made yet is closed), else `retry_after`, whole
    seconds until the soonest probe."""
    known = [circuits[t] for t in targets if t in circuits]
    available = len(known) < len(targets) or any(c.available() for c in known)
    retry_after = None if available else min(c.retry_after_header() for c in known)
    return {
        "id": model_id,
        "object": "model",
        "created": 0,
        "owned_by": owner,
        "availability": {"available": available, "retry_after": retry_after},
    }


def _circuits(gateway: Gateway) -> dict:
    # Circuits are looked up, not made: reading the list must not add circuits (and metric
    # series) for every listed model.
    return {(c.provider, c.provider_model): c for c in gateway.breakers.all()}


def _served(settings: Settings, model_id: str) -> tuple[str, list[tuple[str, str]]] | None:
    """(owner, targets) of `model_id` as a request naming it is routed (tinygw.protocol.routing:
    an alias, `provider/upstream_model`, or a pattern's match), on any of the providers'
    APIs; None when no route serves it."""
    targets: list[tuple[str, str]] = []
    model = None
    for api in sorted({p.doc.api for p in settings.providers.values()}):
        resolution = resolve(settings, Route(MODEL_PREFIX, api, ""), model_id)
        if resolution is not None:
            model = resolution.model
            targets += [(t.provider, t.upstream_model) for t in resolution.targets]
    if model is None:
        return None
    provider, slash, _ = model_id.partition("/")
    qualified = slash and model_id not in settings.models and provider in settings.providers
    return (provider if qualified else "tinygw"), targets


def _model_entries(gateway: Gateway) -> list[dict]:
    """docs/design.md section 6: every model alias but the patterns (a client would send
    `claude-*` as a model's name); then each model of a provider's last successful listing
    that a pattern sends to that provider as it came (`claude-sonnet-5-5` by `"claude-*":
    ["an:*"]`), by its own name; then `provider/upstream_model` for each model of each
    provider whose last listing succeeded. Each with its `availability`."""
    settings = gateway.settings
    models = settings.models
    listings = discovery.synced(gateway)  # the gateway's last listings, whichever worker ran them
    entries = [
        (name, "tinygw", [(t.provider, t.upstream_model) for t in models[name].targets])
        for name in sorted(models)
        if not name.endswith(WILDCARD)
    ]
    by_pattern = set()
    for name, alias in models.items():
        if name.endswith(WILDCARD):
            for target in alias.targets:
                if target.upstream_model == WILDCARD:
                    by_pattern |= {m for m in listings.get(target.provider, ()) if m.startswith(name[:-1])}
    for model_id in sorted(by_pattern - models.keys()):
        served = _served(settings, model_id)
        if served is not None and served[0] == "tinygw":  # else a pattern does not serve it: a longer one, say
            entries.append((model_id, *served))
    for provider in sorted(listings):
        for upstream_model in listings[provider]:
            if f"{provider}/{upstream_model}" not in models:  # else the alias is what a request gets
                entries.append((f"{provider}/{upstream_model}", provider, [(provider, upstream_model)]))
    circuits = _circuits(gateway)
    return [_entry(model_id, owner, targets, circuits) for model_id, owner, targets in entries]


# The models' creation time is not known to the gateway: 0 in OpenAI's shape, the
# same instant in Anthropic's.
_EPOCH = "1970-01-01T00:00:00Z"
# Anthropic's page size: 20 unless the request's `limit` (1 to 1000) says otherwise.
ANTHROPIC_PAGE = 20
ANTHROPIC_MAX_PAGE = 1000


def _anthropic_entry(entry: dict) -> dict:
    """A model in the shape of Anthropic's Models API, with tinygw's `availability`."""
    return {
        "type": "model",
        "id": entry["id"],
        "display_name": entry["id"],
        "created_at": _EPOCH,
        "availability": entry["availability"],
    }


def _anthropic_page(data: list[dict], query: bytes) -> dict | str:
    """One page of the list as Anthropic's API pages it (`limit`, `after_id`,
    `before_id`), or the reason the query is refused. An id not in the list gives an
    empty page."""
    params = {k: v[-1] for k, v in parse_qs(query.decode("latin-1")).items()}
    raw_limit = params.get("limit", str(ANTHROPIC_PAGE))
    if not raw_limit.isdigit() or not 1 <= int(raw_limit) <= ANTHROPIC_MAX_PAGE:
        return f"limit must be an integer from 1 to {ANTHROPIC_MAX_PAGE}"
    limit = int(raw_limit)
    ids = [e["id"] for e in data]
    if "before_id" in params:
        end = ids.index(params["before_id"]) if params["before_id"] in ids else 0
        page, has_more = data[max(0, end - limit) : end], end - limit > 0
    else:
        after = params.get("after_id")
        start = 0 if after is None else ids.index(after) + 1 if after in ids else len(ids)
        page, has_more = data[start : start + limit], start + limit < len(ids)
    return {
        "data": page,
        "has_more": has_more,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
    }


async def model_list(gateway: Gateway, scope, send) -> None:
    """GET /v1/models: OpenAI's list, or Anthropic's pages when the request carries
    `anthropic-version` (as Anthropic's SDKs send it)."""
    data = _model_entries(gateway)
    if header(scope["headers"], b"anthropic-version") is None:
        await send_json(send, {"object": "list", "data": data})
        return
    page = _anthropic_page([_anthropic_entry(e) for e in data], scope.get("query_string", b""))
    if isinstance(page, str):
        await send_error(send, 400, page, "invalid_request_error", "invalid_query")
        return
    await send_json(send, page)


async def one_model(gateway: Gateway, scope, send) -> None:
    """GET /v1/models/{id} (the id may hold '/'): any model a request may name, whether the
    list shows it or not (a pattern's match, a provider's model that no listing gave), with
    its availability; else 404."""
    model_id = scope["path"][len(MODEL_PREFIX) :]
    served = _served(gateway.settings, model_id)
    if served is not None:
        entry = _entry(model_id, *served, _circuits(gateway))
        anthropic = header(scope["headers"], b"anthropic-version") is not None
        await send_json(send, _anthropic_entry(entry) if anthropic else entry)
        return
    await send_error(send, 404, f"the model {model_id!r} does not exist", "invalid_request_error", "model_not_found")
