"""From a request's route and model to its targets: the Resolver that keeps each
configured name's answer gives the answers resolve() gives, and keeps nothing else."""

from __future__ import annotations

import json

from tinygw.config.environment import from_environ
from tinygw.protocol.routing import Resolver, Route, resolve

OPENAI = Route("/v1/chat/completions", "openai", "/chat/completions")
ANTHROPIC = Route("/v1/messages", "anthropic", "/v1/messages")


def settings():
    doc = {
        "providers": {
            "o": {"base_url": "https://o.test", "api": "openai"},
            "a": {"base_url": "https://a.test", "api": "anthropic"},
        },
        "models": {
            "both": {"targets": ["o:up-o", "a:up-a"]},
            "only-o": {"targets": ["o:up-o"]},
            "as-sent": {"targets": ["o:*"]},
            "gpt-*": {"targets": ["o:*"]},
        },
    }
    return from_environ({"TINYGW_CONFIG": json.dumps(doc)})


NAMES = ["both", "only-o", "as-sent", "gpt-*", "gpt-4o", "o/anything", "a/anything", "x/y", "nothing", ""]


def test_the_resolver_answers_as_resolve_does_every_time():
    s = settings()
    resolver = Resolver(s)
    for _ in range(2):  # worked out, then kept
        for route in (OPENAI, ANTHROPIC):
            for name in NAMES:
                assert resolver.resolve(route, name) == resolve(s, route, name), (route.api, name)


def test_the_resolver_keeps_configured_names_only():
    s = settings()
    resolver = Resolver(s)
    for name in NAMES:
        resolver.resolve(OPENAI, name)
    assert sorted(name for _, name in resolver._known) == ["as-sent", "both", "gpt-*", "only-o"]
    assert resolver.resolve(ANTHROPIC, "only-o") is None
    assert resolver.resolve(OPENAI, "both").targets == resolve(s, OPENAI, "both").targets
