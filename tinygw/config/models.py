"""A model of the configuration (`models.NAME`): its targets, and the targets its
`context_fallback` names (docs/configuration.md, Model fields)."""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from tinygw.config.documents import ModelDoc
from tinygw.config.settings import MODEL_TIMEOUTS, Model, Provider, Target
from tinygw.errors import ConfigError


def model(where: str, name: str, doc: ModelDoc, providers: Mapping[str, Provider]) -> Model:
    path = f"{where} $.models.{name}"
    if not name:
        raise ConfigError(path, "a model name must be non-empty")
    if "*" in name[:-1]:
        raise ConfigError(path, "a pattern's '*' must be its last character, and its only one")
    targets = [target(f"{path}.targets[{i}]", entry, providers) for i, entry in enumerate(doc.targets)]
    timeouts = tuple(getattr(doc, field) for field in MODEL_TIMEOUTS)
    return Model(name=name, targets=tuple(targets), strategy=doc.strategy, timeouts=timeouts, affinity=doc.affinity)


def target(path: str, entry: str, providers: Mapping[str, Provider]) -> Target:
    provider, sep, upstream = entry.partition(":")
    if not sep or not provider or not upstream:
        raise ConfigError(path, f"must be provider:upstream_model, got {entry!r}")
    if provider not in providers:
        raise ConfigError(path, f"unknown provider {provider!r}")
    if "*" in upstream and upstream != "*":
        raise ConfigError(path, f"the upstream model is a name or '*', got {upstream!r}")
    return Target(provider, upstream)


def with_context_fallback(
    where: str, model: Model, doc: ModelDoc, models: Mapping[str, Model], providers: Mapping[str, Provider]
) -> Model:
    """`model` with the targets its `context_fallback` names: an alias's targets in its
    place (a configured name, not a pattern), else a provider:upstream_model target (not `*`:
    it has no name of its own to send)."""
    targets: list[Target] = []
    for i, entry in enumerate(doc.context_fallback):
        path = f"{where} $.models.{model.name}.context_fallback[{i}]"
        alias = models.get(entry)
        if alias is not None and not entry.endswith("*"):
            targets += [t for t in alias.targets if t.upstream_model != "*"]
            continue
        if ":" not in entry:
            raise ConfigError(path, f"{entry!r} is neither a configured model nor provider:upstream_model")
        named = target(path, entry, providers)
        if named.upstream_model == "*":
            raise ConfigError(path, "a context fallback names its upstream model, not '*'")
        targets.append(named)
    if not targets:
        return model
    return msgspec.structs.replace(model, context_fallback=tuple(dict.fromkeys(targets)))
