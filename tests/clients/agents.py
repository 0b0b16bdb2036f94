"""`make test-clients`: one prompt from each real client, through a real gateway and
`tinygw fake`, configured as docs/clients.md shows. The clients are the pinned ones that
`make test-clients` installs (tests/clients/package-lock.json, tests/clients/llm.lock);
tests/clients/offline.sh runs this in a network namespace of its own, where only
loopback exists, and every client's telemetry and update checks are turned off too."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from conftest import Gateway, wait_until

HERE = Path(__file__).resolve().parent
NODE = HERE / ".node" / "node_modules"
LLM = HERE / ".venv-llm" / "bin" / "llm"
GATEWAY_KEY = "gw-key-clients"
ANSWER = "Hello from fake."  # what `tinygw fake` answers
RUN_SECONDS = 120  # each client's one prompt, start to end
MAX_REQUESTS = 40  # an agent that loops on tools would pass this

# Every variable that turns off a client's telemetry, error reports, update checks and
# other traffic that is not the prompt (the network namespace is the guarantee).
QUIET = {
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "DISABLE_TELEMETRY": "1",
    "DISABLE_AUTOUPDATER": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "DISABLE_BUG_COMMAND": "1",
    "DISABLE_COST_WARNINGS": "1",
    "DISABLE_NON_ESSENTIAL_MODEL_CALLS": "1",
    "CLAUDE_CODE_ENABLE_TELEMETRY": "0",
    "DO_NOT_TRACK": "1",
    "NO_UPDATE_NOTIFIER": "1",
    "NO_PROXY": "127.0.0.1,localhost",
    "OTEL_SDK_DISABLED": "true",
}


def service_account(token_uri: str) -> str:
    """A Google service-account key of a fresh RSA key, whose token endpoint is `tinygw fake`'s."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    account = {"type": "service_account", "client_email": "gw@p.iam.gserviceaccount.com", "token_uri": token_uri}
    return json.dumps({**account, "private_key": pem.decode()})


# The model ids Claude Code sends to Bedrock: cross-region inference profiles and plain ids.
BEDROCK_PATTERNS = ("us.anthropic.*", "eu.anthropic.*", "apac.anthropic.*", "global.anthropic.*", "anthropic.*")


@pytest.fixture(scope="module")
def gateway(fake_port, tmp_path_factory):
    """The configuration of docs/clients.md: one fake provider per API, a pattern each; and
    Claude on Bedrock and on Vertex, the fake playing both clouds (and Google's token endpoint)."""
    fake = f"http://127.0.0.1:{fake_port}"
    config = {
        "providers": {
            "fake-anthropic": {"base_url": fake, "api": "anthropic"},
            "fake-openai": {"base_url": f"{fake}/v1", "api": "openai"},
            "fake-bedrock": {
                "base_url": fake,
                "api": "bedrock",
                "region": "us-east-1",
                "aws_access_key_id_env": "FAKE_AWS_ACCESS_KEY_ID",
                "aws_secret_access_key_env": "FAKE_AWS_SECRET_ACCESS_KEY",
            },
            "fake-vertex": {
                "base_url": fake,
                "api": "vertex",
                "project": "tinygw-project",
                "region": "us-east5",
                "credentials_env": "FAKE_VERTEX_CREDENTIALS",
            },
        },
        "models": {
            # /v1/messages tries Anthropic, the Vertex shape reaches Vertex: one alias for both
            "claude-*": {"targets": ["fake-anthropic:*", "fake-vertex:*"]},
            "gpt-*": {"targets": ["fake-openai:*"]},
            **{pattern: {"targets": ["fake-bedrock:*"]} for pattern in BEDROCK_PATTERNS},
        },
    }
    env = {
        "TINYGW_API_KEYS": GATEWAY_KEY,
        "FAKE_AWS_ACCESS_KEY_ID": "AKIDFAKE000000000000",
        "FAKE_AWS_SECRET_ACCESS_KEY": "fake-secret-access-key",
        "FAKE_VERTEX_CREDENTIALS": service_account(f"{fake}/token"),
    }
    gw = Gateway(config, env, tmp_path_factory.mktemp("gw") / "gateway.log")
    yield gw
    gw.stop()


def run(command: list[str], env: dict[str, str], cwd: Path) -> str:
    """One client run, bounded in time, with a home of its own and nothing else set."""
    if not Path(command[0]).exists() and not Path(command[1]).exists():
        pytest.fail(f"{command[:2]} is not installed: run `make test-clients`")
    base = {"PATH": os.environ["PATH"], "HOME": str(cwd / "home"), "LANG": "C.UTF-8", "TERM": "dumb", **QUIET}
    (cwd / "home").mkdir(exist_ok=True)
    done = subprocess.run(
        command,
        env={**base, **env},
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=RUN_SECONDS,
        check=False,
    )
    assert done.returncode == 0, f"{command[:3]} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def requests(gateway: Gateway, route: str, agent: str) -> list[dict]:
    return [
        r
        for r in gateway.log_records()
        if r.get("msg") == "request" and r.get("route") == route and (r.get("user_agent") or "").startswith(agent)
    ]


def test_claude_code(gateway, tmp_path):
    """Only ANTHROPIC_BASE_URL and ANTHROPIC_API_KEY: its default model goes through "claude-*"."""
    out = run(
        ["node", str(NODE / "@anthropic-ai" / "claude-code" / "cli-wrapper.cjs"), "-p", "Say hello"],
        {"ANTHROPIC_BASE_URL": gateway.url, "ANTHROPIC_API_KEY": GATEWAY_KEY},
        tmp_path,
    )
    assert ANSWER in out
    seen = wait_until(lambda: requests(gateway, "/v1/messages", "claude-cli"), 5, "Claude Code's requests")
    assert len(seen) <= MAX_REQUESTS and all(r["status"] == 200 and r["model"] == "claude-*" for r in seen), seen


CLAUDE_CODE = ["node", str(NODE / "@anthropic-ai" / "claude-code" / "cli-wrapper.cjs"), "-p", "Say hello"]
# The gateway's key as Claude Code sends it in its cloud modes (their own auth skipped).
CUSTOM_HEADERS = {"ANTHROPIC_CUSTOM_HEADERS": f"x-api-key: {GATEWAY_KEY}"}


def test_claude_code_on_bedrock(gateway, tmp_path):
    """CLAUDE_CODE_USE_BEDROCK: the Bedrock shape, its model ids through the Bedrock patterns."""
    out = run(
        CLAUDE_CODE,
        {
            "CLAUDE_CODE_USE_BEDROCK": "1",
            "ANTHROPIC_BEDROCK_BASE_URL": gateway.url,
            "CLAUDE_CODE_SKIP_BEDROCK_AUTH": "1",
            "AWS_REGION": "us-east-1",
            **CUSTOM_HEADERS,
        },
        tmp_path,
    )
    assert ANSWER in out
    seen = wait_until(
        lambda: [r for r in requests(gateway, "/model/{model}/invoke-with-response-stream", "") if r["status"] == 200],
        5,
        "Claude Code's Bedrock requests",
    )
    assert len(seen) <= MAX_REQUESTS and all(r["target"].startswith("fake-bedrock:") for r in seen), seen


def test_claude_code_on_vertex(gateway, tmp_path):
    """CLAUDE_CODE_USE_VERTEX: the Vertex shape in the client's project, the provider's used."""
    out = run(
        CLAUDE_CODE,
        {
            "CLAUDE_CODE_USE_VERTEX": "1",
            "ANTHROPIC_VERTEX_BASE_URL": f"{gateway.url}/v1",
            "CLAUDE_CODE_SKIP_VERTEX_AUTH": "1",
            "ANTHROPIC_VERTEX_PROJECT_ID": "the-clients-project",
            "CLOUD_ML_REGION": "us-east5",
            **CUSTOM_HEADERS,
        },
        tmp_path,
    )
    assert ANSWER in out
    route = "/v1/projects/{project}/locations/{location}/publishers/anthropic/models/{model}:streamRawPredict"
    seen = wait_until(
        lambda: [r for r in requests(gateway, route, "") if r["status"] == 200], 5, "Claude Code's Vertex requests"
    )
    assert len(seen) <= MAX_REQUESTS and all(r["target"].startswith("fake-vertex:") for r in seen), seen


CODEX_CONFIG = """\
model = "gpt-5-codex"
model_provider = "tinygw"
check_for_update_on_startup = false

[model_providers.tinygw]
name = "tinygw"
base_url = "{url}/v1"
env_key = "GATEWAY_API_KEY"
wire_api = "responses"

[analytics]
enabled = false
"""


def test_codex(gateway, tmp_path):
    """A provider block pointing at the gateway, `wire_api = "responses"`."""
    home = tmp_path / "codex"
    home.mkdir()
    (home / "config.toml").write_text(CODEX_CONFIG.format(url=gateway.url))
    out = run(
        ["node", str(NODE / "@openai" / "codex" / "bin" / "codex.js"), "exec", "--skip-git-repo-check", "Say hello"],
        {"CODEX_HOME": str(home), "GATEWAY_API_KEY": GATEWAY_KEY},
        tmp_path,
    )
    assert ANSWER in out
    seen = wait_until(lambda: requests(gateway, "/v1/responses", "codex"), 5, "Codex's requests")
    assert len(seen) <= MAX_REQUESTS and all(r["status"] == 200 and r["model"] == "gpt-*" for r in seen), seen


LLM_MODELS = """\
- model_id: tinygw-chat
  model_name: gpt-4o-mini
  api_base: "{url}/v1"
  api_key_name: tinygw
  supports_tools: true
- model_id: tinygw-instruct
  model_name: gpt-3.5-turbo-instruct
  api_base: "{url}/v1"
  api_key_name: tinygw
  completion: true
"""


@pytest.mark.parametrize(
    "model,route", [("tinygw-chat", "/v1/chat/completions"), ("tinygw-instruct", "/v1/completions")]
)
def test_llm(gateway, tmp_path, model, route):
    """llm's extra-openai-models.yaml, streamed (its default), chat and completions."""
    (tmp_path / "extra-openai-models.yaml").write_text(LLM_MODELS.format(url=gateway.url))
    (tmp_path / "keys.json").write_text(json.dumps({"tinygw": GATEWAY_KEY}))
    out = run([str(LLM), "-m", model, "Say hello"], {"LLM_USER_PATH": str(tmp_path)}, tmp_path)
    assert out.strip() == ANSWER
    assert wait_until(lambda: requests(gateway, route, "OpenAI/Python"), 5, "llm's requests")


def test_llm_calls_a_tool_through_the_gateway(gateway, tmp_path):
    """`supports_tools: true` (docs/clients.md): llm sends the tool, the fake calls it once,
    llm runs it and sends its result, and the fake's answer ends the loop: two requests."""
    (tmp_path / "extra-openai-models.yaml").write_text(LLM_MODELS.format(url=gateway.url))
    (tmp_path / "keys.json").write_text(json.dumps({"tinygw": GATEWAY_KEY}))
    before = len(requests(gateway, "/v1/chat/completions", "OpenAI/Python"))
    command = [str(LLM), "-m", "tinygw-chat", "-T", "llm_version", "Which version?"]
    out = run(command, {"LLM_USER_PATH": str(tmp_path)}, tmp_path)
    assert out.strip() == ANSWER
    wait_until(
        lambda: len(requests(gateway, "/v1/chat/completions", "OpenAI/Python")) >= before + 2, 5, "the tool's round"
    )
