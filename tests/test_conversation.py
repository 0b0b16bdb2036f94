"""A request's conversation key (tinygw.protocol.conversation): what names it, in order,
and what of the opening it hashes."""

from __future__ import annotations

import json

import pytest

from tinygw.protocol.conversation import conversation_key
from tinygw.protocol.request import read_head

HEADER = [(b"x-tinygw-conversation", b"header-id")]


def key(body: dict | bytes, headers=(), client: str = "default") -> bytes:
    """The key of a request with `body` (a model added to it), as the gateway reads it."""
    raw = body if isinstance(body, bytes) else json.dumps({"model": "m", **body}).encode()
    return conversation_key(read_head(raw), list(headers), client)


def turns(first: dict, *later: dict) -> list[bytes]:
    return [key(first), *(key(b) for b in later)]


def test_prompt_cache_key_then_metadata_user_id_then_the_header_then_the_opening():
    both = {"model": "m", "prompt_cache_key": "pck", "metadata": {"user_id": "session"}, "messages": []}
    assert key(both, HEADER) == key({"prompt_cache_key": "pck"})
    assert key({**both, "prompt_cache_key": None}, HEADER) == key({"metadata": {"user_id": "session"}})
    assert key({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, HEADER) == key({}, HEADER)
    # the names are read, not the opening: a later turn with another opening keeps its key
    assert key({"prompt_cache_key": "pck", "messages": [{"role": "user", "content": "a"}]}) == key(
        {"prompt_cache_key": "pck", "messages": [{"role": "user", "content": "b"}]}
    )
    assert len(key(both)) == 32


def test_the_client_is_always_part_of_the_key():
    body = {"prompt_cache_key": "same"}
    assert key(body, client="alice") != key(body, client="bob")
    opening = {"messages": [{"role": "user", "content": "hi"}]}
    assert key(opening, client="alice") != key(opening, client="bob")
    assert key({}, HEADER, client="alice") != key({}, HEADER, client="bob")


def test_an_anthropic_conversation_keeps_its_opening_as_it_grows():
    system = [{"type": "text", "text": "You are helpful.", "cache_control": {"type": "ephemeral"}}]
    first = {"model": "claude", "system": system, "messages": [{"role": "user", "content": "task one"}]}
    second = {
        **first,
        "system": [{"type": "text", "text": "You are helpful."}],  # its breakpoint moved
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "task one"}]},
            {"role": "assistant", "content": "done"},
            {"role": "user", "content": [{"type": "text", "text": "next", "cache_control": {"type": "ephemeral"}}]},
        ],
    }
    # A string content and a one-block content are two spellings: not the same opening.
    assert key(first) != key(second)
    second["messages"][0] = {
        "role": "user",
        "content": [{"type": "text", "text": "task one", "cache_control": {"type": "ephemeral"}}],
    }
    third = {**second, "messages": [{"role": "user", "content": [{"type": "text", "text": "task one"}]}]}
    assert key(second) == key(third)
    assert key(second) != key({**third, "system": "You are someone else."})


def test_an_openai_conversation_opens_with_its_system_and_developer_messages():
    opening = [
        {"role": "system", "content": "sys"},
        {"role": "developer", "content": "dev"},
        {"role": "user", "content": "task"},
    ]
    later = [*opening, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    assert key({"messages": opening}) == key({"messages": later})
    assert key({"messages": opening}) != key({"messages": [opening[0], opening[2]]})
    assert key({"messages": opening}) != key({"messages": [*opening[:2], {"role": "user", "content": "other"}]})


def test_a_responses_conversation_opens_with_its_instructions_and_first_input():
    first = {"instructions": "be brief", "input": "task"}
    assert key(first) == key({**first, "tools": [], "previous_response_id": None})
    assert key(first) != key({**first, "instructions": "be other"})
    assert key(first) != key({**first, "input": "another task"})
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "task"}]}]
    grown = [*items, {"type": "function_call_output", "call_id": "c", "output": "x"}]
    assert key({"instructions": "be brief", "input": items}) == key({"instructions": "be brief", "input": grown})
    assert key({"instructions": "be brief", "input": items}) != key({"instructions": "other", "input": items})


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "m", "messages": "not a list"}',
        b'{"model": "m", "messages": [1, 2]}',
        b'{"model": "m", "prompt_cache_key": 5, "messages": []}',
        b'{"model": "m", "metadata": [], "system": {"x": 1}}',
        b'{"model": "m", "input": 5}',
        b'{"model": "m", "messages": [{"role": "user", "content": [1]}]}',
        b'{"model": "m", "a": "\\ud83d"}',  # read by the standard library: no spans, the empty opening
    ],
)
def test_an_odd_body_still_has_a_key(body):
    assert len(key(body)) == 32
    assert key(body) == key(body)
