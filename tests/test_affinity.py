"""Black-box: conversation affinity (docs/configuration.md). A real gateway with two
workers, in front of fake providers: a conversation's turns reach one target of a
`round_robin` alias and present one key of a pool, a failed target's conversations
move and come back, two clients are spread independently, and the conversation's
header never reaches a provider."""

from __future__ import annotations

import collections
import json
import time

import pytest

from conftest import call, provider
from tinygw.fake.upstream import FakeUpstream, json_reply, well_behaved

KEYS = {"K1": "pool-key-one", "K2": "pool-key-two", "K3": "pool-key-three"}
CLIENTS = {"ALICE_KEYS": "alice-key", "BOB_KEYS": "bob-key"}
TURNS = 20


@pytest.fixture
def east():
    upstream = FakeUpstream(well_behaved("east")).start_in_thread()
    yield upstream
    upstream.stop_thread()


@pytest.fixture
def west():
    upstream = FakeUpstream(well_behaved("west")).start_in_thread()
    yield upstream
    upstream.stop_thread()


def config(east: FakeUpstream, west: FakeUpstream, model_affinity: bool = True, key_affinity: bool = True) -> dict:
    # `affinity` is on unless it is set: written only to turn it off
    pool = {"api_key_env": list(KEYS), **({} if key_affinity else {"affinity": False})}
    agent = {"targets": ["east:m-east", "west:m-west"], "strategy": "round_robin"}
    return {
        "providers": {"east": provider(east), "west": provider(west), "pool": provider(east, **pool)},
        "models": {
            "agent": agent if model_affinity else {**agent, "affinity": False},
            "pooled": {"targets": ["pool:m-pool"]},
        },
        "clients": {"alice": {"keys_env": "ALICE_KEYS"}, "bob": {"keys_env": "BOB_KEYS"}},
    }


def start(start_gateway, east, west, **options):
    env = {"TINYGW_WORKERS": "2", "PROVIDER_HEALTH_CHECK_SECONDS": "0", **KEYS, **CLIENTS}
    return start_gateway(config(east, west, **options.pop("affinity", {})), **env, **options)


def turn(gateway, model: str, number: int, conversation: dict, key: str = "alice-key", headers=None) -> str:
    """One turn of an agent's conversation (its prompt grown by the turns before): the
    upstream model that answered it."""
    messages = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "the task"}]
    for n in range(number):
        messages += [{"role": "assistant", "content": f"answer {n}"}, {"role": "user", "content": f"message {n}"}]
    body = {"model": model, "messages": messages, **conversation}
    status, _, answer = call(
        "POST",
        f"{gateway.url}/v1/chat/completions",
        body,
        {"Authorization": f"Bearer {key}", **(headers or {})},
    )
    assert status == 200, answer
    return json.loads(answer)["model"]


def conversation_targets(gateway, conversation: dict, **kw) -> set[str]:
    return {turn(gateway, "agent", n, conversation, **kw) for n in range(TURNS)}


def test_a_conversations_turns_reach_one_target_of_a_round_robin_alias(east, west, start_gateway):
    gateway = start(start_gateway, east, west)
    first_targets = collections.Counter()
    for i in range(12):
        named = {"prompt_cache_key": f"session-{i}"}
        targets = conversation_targets(gateway, named)
        assert len(targets) == 1, (named, targets)  # round robin alone: both, about half each
        first_targets.update(targets)
    assert set(first_targets) == {"m-east", "m-west"}  # and the conversations are spread over both
    assert len(conversation_targets(gateway, {"metadata": {"user_id": "claude-code-session"}})) == 1
    assert len(conversation_targets(gateway, {}, headers={"x-tinygw-conversation": "mine"})) == 1
    assert len(conversation_targets(gateway, {})) == 1  # by its opening alone


def test_the_conversation_header_never_reaches_a_provider(east, west, start_gateway):
    gateway = start(start_gateway, east, west)
    for n in range(4):
        turn(gateway, "agent", n, {}, headers={"x-tinygw-conversation": "secret-conversation-name"})
    requests = east.requests + west.requests
    assert len(requests) == 4
    for request in requests:
        assert "x-tinygw-conversation" not in request.headers
        assert b"secret-conversation-name" not in request.body


def test_without_affinity_round_robin_spreads_a_conversations_turns(east, west, start_gateway):
    gateway = start(start_gateway, east, west, affinity={"model_affinity": False, "key_affinity": False})
    assert conversation_targets(gateway, {"prompt_cache_key": "s"}) == {"m-east", "m-west"}
    east.requests.clear()
    for n in range(6):
        turn(gateway, "pooled", n, {"prompt_cache_key": "s"})
    assert len({r.headers["authorization"] for r in east.requests}) > 1


def pool_keys(gateway, east: FakeUpstream, conversation: dict) -> set[str]:
    east.requests.clear()
    for n in range(TURNS):
        turn(gateway, "pooled", n, conversation)
    return {r.headers["authorization"] for r in east.requests}


def test_a_conversation_presents_one_key_of_a_pool(east, west, start_gateway):
    gateway = start(start_gateway, east, west)
    used = set()
    for i in range(8):
        keys = pool_keys(gateway, east, {"prompt_cache_key": f"session-{i}"})
        assert len(keys) == 1, keys  # in turn: all three
        used |= keys
    assert len(used) > 1  # the conversations are spread over the keys


def test_two_clients_with_the_same_prompts_are_spread_independently(east, west, start_gateway):
    gateway = start(start_gateway, east, west)
    chosen = {}
    for client in ("alice-key", "bob-key"):
        chosen[client] = []
        for i in range(16):
            targets = {turn(gateway, "agent", n, {"prompt_cache_key": f"s{i}"}, key=client) for n in range(3)}
            assert len(targets) == 1
            chosen[client].append(targets.pop())
    assert chosen["alice-key"] != chosen["bob-key"]  # the same sixteen names, two other draws


def test_a_failed_targets_conversation_moves_and_comes_back_when_its_circuit_closes(east, west, start_gateway):
    gateway = start(
        start_gateway,
        east,
        west,
        PROVIDER_BREAKER_FAILURES="1",
        PROVIDER_BREAKER_OPEN_SECONDS="0.3",
        PROVIDER_BREAKER_MAX_OPEN_SECONDS="1",
    )
    upstreams = {"m-east": east, "m-west": west}
    # one conversation of each target
    home: dict[str, dict] = {}
    for i in range(40):
        named = {"prompt_cache_key": f"session-{i}"}
        home.setdefault(turn(gateway, "agent", 0, named), named)
        if len(home) == 2:
            break
    failing = upstreams["m-east"]
    failing.script = lambda request: json_reply(503, {"error": {"message": "down"}})
    for n in range(6):  # the east conversation moves to west; the west one stays
        assert turn(gateway, "agent", n, home["m-east"]) == "m-west"
        assert turn(gateway, "agent", n, home["m-west"]) == "m-west"
    failing.script = well_behaved("east")
    deadline, n, back = time.monotonic() + 15, 0, 0
    while back < 5:  # its probe, then every turn, until five in a row are back at east
        assert time.monotonic() < deadline, "the conversation did not come back to its target"
        back = back + 1 if turn(gateway, "agent", n, home["m-east"]) == "m-east" else 0
        n += 1
    assert turn(gateway, "agent", n, home["m-west"]) == "m-west"


def test_a_resting_keys_conversation_moves_to_another_key_and_comes_back(east, west, start_gateway):
    gateway = start(start_gateway, east, west)
    named = {"prompt_cache_key": "resting"}
    (own,) = pool_keys(gateway, east, named)
    other = {"prompt_cache_key": "other"}
    (others,) = pool_keys(gateway, east, other)
    busy = {"on": True}

    def script(request):
        if busy["on"] and request.headers.get("authorization") == own:
            return json_reply(429, {"error": {"message": "slow down"}}, [("retry-after", "1")])
        return well_behaved("east")(request)

    east.script = script
    east.requests.clear()
    for n in range(6):  # each worker tries its key once, rests it, and takes the conversation's next
        turn(gateway, "pooled", n, named)
    answered = [r.headers["authorization"] for r in east.requests if r.headers["authorization"] != own]
    assert len(set(answered)) == 1 and len(answered) == 6  # one other key, every turn answered
    if others != own:
        assert pool_keys(gateway, east, other) == {others}  # another conversation did not move
    busy["on"] = False
    deadline, n, back = time.monotonic() + 15, 0, 0
    while back < 5:  # its rest over, every turn presents its own key again
        assert time.monotonic() < deadline, "the conversation did not come back to its key"
        east.requests.clear()
        turn(gateway, "pooled", n, named)
        back = back + 1 if east.requests[-1].headers["authorization"] == own else 0
        n += 1
