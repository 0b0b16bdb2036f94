"""The command line, run as a process: --help and --version everywhere, usage errors
(exit 2), and `tinygw fake` as a tool that the SDKs can use through a gateway."""

from __future__ import annotations

import json
import subprocess

import anthropic
import openai
import pytest

from conftest import ROOT, free_port, gateway_command
from tinygw import __version__
from tinygw.fake.upstream import EMBEDDING

COMMANDS = ["serve", "check", "version", "demo", "fake"]
CONFIG = {
    "providers": {"p": {"base_url": "http://127.0.0.1:9/v1", "api": "openai"}},
    "models": {"m": {"targets": ["p:m"]}},
}


def run(args: list[str], timeout: float = 20, **env: str) -> subprocess.CompletedProcess:
    environment = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", **env}
    return subprocess.run(
        [*gateway_command(), *args], env=environment, cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize("flag", ["--help", "-h", "help"])
def test_top_level_help(flag):
    done = run([flag])
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: tinygw COMMAND")
    for command in COMMANDS:
        assert f"\n  {command} " in done.stdout


@pytest.mark.parametrize("args", [["--version"], ["version"], *[[c, "--version"] for c in COMMANDS]])
def test_version_everywhere(args):
    done = run(args)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[:2] == ["tinygw", __version__]


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_each_command_has_help_and_does_nothing_else(command, flag):
    port = free_port()
    # A valid configuration: were the flag ignored, serve would serve (and not exit),
    # check would print the configuration, demo would run its story.
    done = run([command, flag], TINYGW_CONFIG=json.dumps(CONFIG), TINYGW_PORT=str(port))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: tinygw {command}")
    assert "config_sha256: " not in done.stdout  # what check prints after the configuration
    assert done.stderr == ""


def test_the_fakes_help_names_the_cloud_routes_it_plays():
    """A newcomer finds there how to try Claude Code's Bedrock and Vertex modes without accounts."""
    done = run(["fake", "--help"])
    for route in ("/invoke", "/invoke-with-response-stream", ":rawPredict", ":streamRawPredict", "/token"):
        assert route in done.stdout, route
    assert '"api": "bedrock"' in done.stdout and '"api": "vertex"' in done.stdout


@pytest.mark.parametrize(
    "args,named",
    [
        (["bogus"], "unknown command 'bogus'"),
        ([], "no command given"),
        (["serve", "--bogus"], "unexpected argument '--bogus'"),
        (["check", "extra"], "unexpected argument 'extra'"),
        (["version", "-x"], "unexpected argument '-x'"),
        (["fake", "not-a-port"], "unexpected argument 'not-a-port'"),
        (["fake", "8000", "9000"], "unexpected argument '9000'"),
        (["fake", "70000"], "unexpected argument '70000'"),
    ],
)
def test_unknown_arguments_are_a_usage_error(args, named):
    done = run(args, TINYGW_CONFIG=json.dumps(CONFIG), TINYGW_PORT=str(free_port()))
    assert done.returncode == 2
    assert named in done.stderr
    assert "usage: tinygw" in done.stderr
    assert done.stdout == ""


# ---- tinygw fake ------------------------------------------------------------------------


@pytest.fixture
def gateway(fake_port, start_gateway):
    url = f"http://127.0.0.1:{fake_port}"
    return start_gateway(
        {
            "providers": {
                "oa": {"base_url": f"{url}/v1", "api": "openai"},
                "an": {"base_url": url, "api": "anthropic"},
            },
            "models": {"gpt": {"targets": ["oa:gpt-up"]}, "claude": {"targets": ["an:claude-up"]}},
        },
        PROVIDER_LISTING_SECONDS="0",
    )


WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "unit": {"type": "string", "enum": ["c", "f"]},
    },
    "required": ["city", "days", "unit"],
}


def test_fake_answers_text_and_base64_embeddings(gateway):
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=10)
    answer = client.chat.completions.create(model="gpt", messages=[{"role": "user", "content": "hi"}])
    assert answer.choices[0].message.content == "Hello from fake."
    assert client.embeddings.create(model="gpt", input="hi").data[0].embedding == EMBEDDING  # the SDK asks base64
    raw = client.embeddings.with_raw_response.create(model="gpt", input="hi", encoding_format="base64")
    assert isinstance(json.loads(raw.text)["data"][0]["embedding"], str)
    floats = client.embeddings.with_raw_response.create(model="gpt", input="hi", encoding_format="float")
    assert json.loads(floats.text)["data"][0]["embedding"] == EMBEDDING


def test_fake_calls_a_tool_for_openai_clients(gateway):
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=10)
    tools = [{"type": "function", "function": {"name": "weather", "parameters": WEATHER}}]
    messages = [{"role": "user", "content": "weather?"}]
    choice = client.chat.completions.create(model="gpt", messages=messages, tools=tools).choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.function.name == "weather"
    assert json.loads(call.function.arguments) == {"city": "fake", "days": 1, "unit": "c"}
    arguments = ""
    for chunk in client.chat.completions.create(model="gpt", messages=messages, tools=tools, stream=True):
        for delta in chunk.choices[0].delta.tool_calls or []:
            arguments += delta.function.arguments or ""
    assert json.loads(arguments) == {"city": "fake", "days": 1, "unit": "c"}
    no_tool = client.chat.completions.create(model="gpt", messages=messages, tools=tools, tool_choice="none")
    assert no_tool.choices[0].message.content == "Hello from fake."
    response = client.responses.create(
        model="gpt", input="weather?", tools=[{"type": "function", "name": "weather", "parameters": WEATHER}]
    )
    [item] = response.output
    assert (item.type, item.name, json.loads(item.arguments)["days"]) == ("function_call", "weather", 1)


def test_fake_calls_a_tool_for_anthropic_clients(gateway):
    client = anthropic.Anthropic(base_url=gateway.url, api_key="unused", max_retries=0, timeout=10)
    tools = [{"name": "weather", "description": "the weather", "input_schema": WEATHER}]
    messages = [{"role": "user", "content": "weather?"}]
    message = client.messages.create(model="claude", max_tokens=64, messages=messages, tools=tools)
    assert message.stop_reason == "tool_use"
    [block] = message.content
    assert (block.type, block.name, block.input) == ("tool_use", "weather", {"city": "fake", "days": 1, "unit": "c"})
    with client.messages.stream(model="claude", max_tokens=64, messages=messages, tools=tools) as stream:
        final = stream.get_final_message()
    assert final.content[0].input == {"city": "fake", "days": 1, "unit": "c"}
