"""Black-box: the fake provider (`tinygw fake`) through a real gateway, read by the
official SDKs' own stream parsers, as real clients read it: every route streams, query
strings are honoured, a tool is called once and a text answer follows its result."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from conftest import Gateway, module_fake, provider, sdk_clients
from tinygw.fake.cache import LIFE_SECONDS, PromptCache, prompt_blocks, tokens
from tinygw.fake.upstream import FakeRequest, well_behaved

GATEWAY_KEY = "gw-key-fake"
TEXT = "Hello from fake."
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"],
}

fake, fresh_fake = module_fake()
openai_client, anthropic_client = sdk_clients(GATEWAY_KEY)


@pytest.fixture(scope="module")
def gateway(fake, tmp_path_factory):
    config = {
        "providers": {
            "oa": provider(fake),
            "an": {"base_url": fake.url, "api": "anthropic", "listing": False},
        },
    }
    gw = Gateway(config, {"TINYGW_API_KEYS": GATEWAY_KEY}, tmp_path_factory.mktemp("gw") / "gateway.log")
    yield gw
    gw.stop()


@pytest.fixture
def oai(gateway) -> openai.OpenAI:
    return openai_client(gateway)


@pytest.fixture
def ant(gateway) -> anthropic.Anthropic:
    return anthropic_client(gateway)


# ---- OpenAI --------------------------------------------------------------------------------


def test_completions_stream(oai):
    chunks = list(
        oai.completions.create(
            model="oa/gpt-3.5-turbo-instruct", prompt="hi", stream=True, stream_options={"include_usage": True}
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == TEXT
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == 4


def test_chat_stream_calls_the_tool_once_then_answers(oai):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    messages = [{"role": "user", "content": "weather?"}]
    with oai.chat.completions.stream(model="oa/gpt-4o", messages=messages, tools=tools) as stream:
        first = stream.get_final_completion()
    call = first.choices[0].message.tool_calls[0]
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "fake", "days": 1})
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    with oai.chat.completions.stream(model="oa/gpt-4o", messages=messages, tools=tools) as stream:
        second = stream.get_final_completion()
    assert second.choices[0].message.content == TEXT and not second.choices[0].message.tool_calls


def test_responses_stream_text(oai):
    with oai.responses.stream(model="oa/gpt-5", input="hi") as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert final.output_text == TEXT
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]


def test_responses_stream_calls_the_tool_once_then_answers(oai):
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": False}]
    with oai.responses.stream(model="oa/gpt-5", input="weather?", tools=tools) as stream:
        kinds = [event.type for event in stream]
        first = stream.get_final_response()
    call = first.output[0]
    assert (call.type, call.name, json.loads(call.arguments)) == (
        "function_call",
        "get_weather",
        {"city": "fake", "days": 1},
    )
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
    items = [
        {"role": "user", "content": "weather?"},
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
    ]
    with oai.responses.stream(model="oa/gpt-5", input=items, tools=tools) as stream:
        assert stream.get_final_response().output_text == TEXT


# ---- Anthropic ---------------------------------------------------------------------------------


def test_messages_with_a_query_string_are_anthropic_answers(ant, fake):
    """Claude Code posts to /v1/messages?beta=true."""
    answer = ant.messages.create(
        model="an/claude-test-1",
        max_tokens=16,
        messages=[{"role": "user", "content": "hi"}],
        extra_query={"beta": "true"},
    )
    assert answer.content[0].text == TEXT
    assert fake.requests[-1].path == "/v1/messages?beta=true"


def test_messages_stream_calls_the_tool_once_then_answers(ant):
    tools = [{"name": "get_weather", "description": "the weather", "input_schema": WEATHER}]
    messages = [{"role": "user", "content": "weather?"}]
    with ant.messages.stream(model="an/claude-opus-4-8", max_tokens=64, messages=messages, tools=tools) as stream:
        kinds = [event.type for event in stream]
        first = stream.get_final_message()
    block = first.content[0]
    assert (block.type, block.name, block.input) == ("tool_use", "get_weather", {"city": "fake", "days": 1})
    assert first.stop_reason == "tool_use" and "input_json" in kinds
    messages += [
        {"role": "assistant", "content": [block.model_dump()]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "sunny"}]},
    ]
    with ant.messages.stream(model="an/claude-opus-4-8", max_tokens=64, messages=messages, tools=tools) as stream:
        second = stream.get_final_message()
    assert [b.type for b in second.content] == ["text"] and second.content[0].text == TEXT


def test_beta_messages_stream_with_a_query_string(ant):
    with ant.beta.messages.stream(
        model="an/claude-test-2",
        max_tokens=16,
        messages=[{"role": "user", "content": "hi"}],
        extra_query={"beta": "true"},
    ) as stream:
        assert stream.get_final_text() == TEXT


@pytest.mark.parametrize("folder", ["any", "the repository's"])
def test_the_demo_tells_its_story_from_any_folder(tmp_path, folder):
    """`tinygw demo` starts its gateway with the package on PYTHONPATH, wherever it is run
    from (`make demo` runs it from the repository), and ends without a traceback."""
    import os
    import subprocess

    from conftest import ROOT, gateway_command

    done = subprocess.run(
        [*gateway_command(), "demo"],
        cwd=tmp_path if folder == "any" else ROOT,
        capture_output=True,
        text=True,
        env={"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT)},
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "every step happened" in done.stdout
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr


def test_a_fake_stopped_in_its_thread_closes_its_loop():
    """Left to the collector at exit, an unclosed loop's self-pipe may be closed before it:
    `make demo` then ended with an 'Exception ignored' traceback."""
    from tinygw.fake.upstream import FakeUpstream, well_behaved

    fake = FakeUpstream(well_behaved("f")).start_in_thread()
    loop = fake._loop
    fake.stop_thread()
    assert loop is not None and loop.is_closed()


# ---- the prompt cache (tinygw.fake.cache), on an injected clock -------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def grown(turns: int) -> dict:
    messages = [{"role": "user", "content": "the task " * 20}]
    for n in range(turns):
        messages += [{"role": "assistant", "content": f"answer {n} " * 20}, {"role": "user", "content": f"next {n}"}]
    return {"model": "m", "system": "You are an agent. " * 50, "messages": messages}


def test_the_prompt_cache_reads_the_longest_prefix_kept_per_key_and_model():
    clock = Clock()
    cache = PromptCache(clock)
    first, second = prompt_blocks(grown(0)), prompt_blocks(grown(1))
    total, cached = cache.read("k1", "m", first)
    assert cached == 0 and total == sum(tokens(b) for b in first)
    total, cached = cache.read("k1", "m", second)
    assert cached == sum(tokens(b) for b in first) and total == sum(tokens(b) for b in second)
    assert cache.read("k2", "m", second)[1] == 0  # another account
    assert cache.read("k1", "other", second)[1] == 0  # another model
    clock.now += LIFE_SECONDS - 1
    assert cache.read("k1", "m", second)[1] == total  # read again: kept another five minutes
    clock.now += LIFE_SECONDS + 1
    assert cache.read("k1", "m", second)[1] == 0  # expired


def test_the_prompt_cache_is_bounded():
    cache = PromptCache(Clock(), limit=10)
    for i in range(20):
        cache.read(f"k{i}", "m", prompt_blocks(grown(2)))
    assert cache.read("k19", "m", prompt_blocks(grown(2)))[1] > 0
    assert cache.read("k0", "m", prompt_blocks(grown(2)))[1] == 0  # the oldest was forgotten


def test_the_fake_reports_what_it_read_from_its_cache_in_both_apis():
    script = well_behaved(cache=PromptCache(Clock()))

    def ask(path: str, body: dict, headers: dict) -> dict:
        reply = script(FakeRequest("POST", path, headers, json.dumps(body).encode()))
        return json.loads(reply.body)["usage"]

    key = {"x-api-key": "k"}
    assert "cache_read_input_tokens" not in ask("/v1/messages", grown(0), key)
    usage = ask("/v1/messages", grown(1), key)
    assert usage["cache_read_input_tokens"] > usage["input_tokens"] > 0
    bearer = {"authorization": "Bearer k"}
    ask("/v1/chat/completions", grown(0), bearer)
    usage = ask("/v1/chat/completions", grown(1), bearer)
    assert 0 < usage["prompt_tokens_details"]["cached_tokens"] < usage["prompt_tokens"]
    assert well_behaved()(FakeRequest("POST", "/v1/messages", key, json.dumps(grown(1)).encode())).body.count(
        b'"input_tokens": 3'
    )  # without a cache: 3 tokens, as before


def test_a_moved_cache_mark_is_not_part_of_the_prompt():
    def body(marked: int) -> dict:
        blocks = [{"type": "text", "text": f"part {i}"} for i in range(3)]
        blocks[marked] = {**blocks[marked], "cache_control": {"type": "ephemeral"}}
        return {"messages": [{"role": "user", "content": blocks}]}

    assert prompt_blocks(body(0)) == prompt_blocks(body(2))
