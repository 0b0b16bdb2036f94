"""Black-box: the fake provider (`tinygw fake`) through a real gateway, read by the
official SDKs' own stream parsers, as real clients read it: every route streams, query
strings are honoured, a tool is called once and a text answer follows its result."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from conftest import Gateway, module_fake, provider, sdk_clients

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
