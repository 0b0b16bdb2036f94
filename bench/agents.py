"""`make bench-agents`: whether agents keep their prompt cache through the gateway.

An agent (Claude Code, Codex) sends its whole growing conversation at every turn, and a
provider bills what it reads from its prompt cache, kept per account and model for about
5 minutes, at a tenth of the input price: a conversation moved to another target or key
loses it. Here 16 concurrent agent sessions of 40 turns each, in Claude Code's shape (a
system prompt and tools, each turn's prompt the last one plus the answer and a new user
message carrying a tool's result, the cache mark on the last message,
`metadata.user_id` naming the session), go through one alias of two targets with
`round_robin`, both on one provider with a pool of three keys, to the fake provider
(tinygw.fake), whose prompt cache is per (key, model) and reports what each turn read
(`usage.cache_read_input_tokens`).

Per run, with conversation affinity on (the default) and off (`"affinity": false` on the
model and the provider): the share of the prompt tokens after each session's first turn
that were read from the cache, the turns per session that changed target or key, and the
spread of the sessions over the targets and the keys (each session counted where most of
its turns went). The gateway runs at its defaults (workers `auto`, log level info, access
log on). Goal: at least 90% read from the cache with affinity on, and the sessions within
25% of even over the targets and over the keys.

    .venv/bin/python bench/agents.py [--sessions 16] [--turns 40]

Loopback only; bounded in time (each request 30 s, the run --deadline seconds).
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import sys
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: its library
from lib import HOST, ROOT, log, machine, print_rows, start_gateway  # noqa: E402

sys.path.insert(0, str(ROOT))  # tinygw, from this tree
from tinygw.fake.cache import PromptCache  # noqa: E402
from tinygw.fake.upstream import FakeRequest, FakeUpstream, Reply, well_behaved  # noqa: E402
from tinygw.protocol.conversation import conversation_key  # noqa: E402
from tinygw.protocol.wire import read_head  # noqa: E402
from tinygw.resilience.strategy import rendezvous  # noqa: E402

GATEWAY_KEY = "bench-agents-key"
KEYS = {
    "BENCH_AGENT_KEY_1": "agent-key-one",
    "BENCH_AGENT_KEY_2": "agent-key-two",
    "BENCH_AGENT_KEY_3": "agent-key-three",
}
TARGETS = ("claude-east", "claude-west")  # the alias's two targets' upstream models
GOAL_CACHED = 0.90  # of the prompt tokens after each session's first turn
GOAL_SPREAD = 0.25  # the most a target's or key's sessions may differ from an even share
REQUEST_SECONDS = 30.0
CACHE_READ_PRICE = 0.1  # of the input price: what Anthropic and OpenAI bill a token read from the cache
RULE_CONVERSATIONS = 10_000  # the rule alone, in this process: how it spreads many conversations

# Claude Code's shape, in small: a long system prompt and a few tools, the same at every turn.
SYSTEM = [
    {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude."},
    {
        "type": "text",
        "text": "You are an interactive CLI tool that helps users with software engineering tasks. " * 60,
        "cache_control": {"type": "ephemeral"},
    },
]
TOOLS = [
    {
        "name": name,
        "description": f"{name}: " + "reads, searches and edits the files of the project. " * 12,
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    }
    for name in ("Read", "Edit", "Grep", "Bash")
]


def config(fake_port: int, affinity: bool) -> dict:
    off = {} if affinity else {"affinity": False}
    return {
        "providers": {
            "pool": {
                "base_url": f"http://{HOST}:{fake_port}",
                "api": "anthropic",
                "api_key_env": list(KEYS),
                "listing": False,
                **off,
            }
        },
        "models": {"claude-agent": {"targets": [f"pool:{m}" for m in TARGETS], "strategy": "round_robin", **off}},
    }


class Seen:
    """What the fake provider saw: per session, the (target, key) of each turn in order."""

    def __init__(self) -> None:
        self.turns: dict[str, list[tuple[str, str]]] = collections.defaultdict(list)
        self._lock = threading.Lock()

    def recording(self, script: Callable[[FakeRequest], Reply]) -> Callable[[FakeRequest], Reply]:
        def script_that_records(request: FakeRequest) -> Reply:
            body = request.json() or {}
            session = str((body.get("metadata") or {}).get("user_id", "?"))
            with self._lock:
                self.turns[session].append((str(body.get("model")), request.headers.get("x-api-key", "")))
            return script(request)

        return script_that_records


def user_message(text: str) -> dict:
    return {"role": "user", "content": [{"type": "text", "text": text, "cache_control": {"type": "ephemeral"}}]}


def unmarked(message: dict) -> dict:
    """A message as the next turn sends it: its cache mark moved on to the newer last message."""
    content = message["content"]
    if isinstance(content, list):
        content = [{k: v for k, v in block.items() if k != "cache_control"} for block in content]
    return {**message, "content": content}


def read_stream(response: http.client.HTTPResponse) -> tuple[str, int, int]:
    """(the answer's text, prompt tokens, of which read from the cache) of a Messages stream."""
    text, prompt, cached = [], 0, 0
    for line in response.read().decode().splitlines():
        if not line.startswith("data: "):
            continue
        event = json.loads(line[6:])
        if event.get("type") == "message_start":
            usage = event["message"]["usage"]
            cached = usage.get("cache_read_input_tokens", 0)
            prompt = usage["input_tokens"] + cached
        elif event.get("type") == "content_block_delta":
            text.append(event["delta"].get("text", ""))
    return "".join(text), prompt, cached


def session_id(number: int) -> str:
    """Claude Code's `metadata.user_id`: its user, account and session."""
    return f"user_{'0' * 16}_account__session_{uuid.uuid5(uuid.NAMESPACE_URL, f'agent-{number}')}"


def session(port: int, number: int, turns: int, deadline: float) -> list[tuple[int, int]]:
    """One agent's session: `turns` turns, each the last prompt plus its answer and a new
    message. (prompt tokens, read from the cache) per turn."""
    messages = [user_message(f"Session {number}: fix the failing test in module_{number}.py. " * 4)]
    usage = []
    connection = http.client.HTTPConnection(HOST, port, timeout=REQUEST_SECONDS)
    try:
        for n in range(turns):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the run's deadline passed at session {number}'s turn {n}")
            body = {
                "model": "claude-agent",
                "max_tokens": 1024,
                "stream": True,
                "system": SYSTEM,
                "tools": TOOLS,
                "metadata": {"user_id": session_id(number)},
                "messages": messages,
            }
            headers = {"content-type": "application/json", "x-api-key": GATEWAY_KEY, "anthropic-version": "2023-06-01"}
            connection.request("POST", "/v1/messages", json.dumps(body).encode(), headers)
            response = connection.getresponse()
            if response.status != 200:
                raise RuntimeError(f"turn {n} of session {number}: {response.status} {response.read()[:300]!r}")
            text, prompt, cached = read_stream(response)
            usage.append((prompt, cached))
            result = f"Turn {n}: the tool's output, lines {n * 40} to {n * 40 + 40} of the file. " * 6
            messages = [*messages[:-1], unmarked(messages[-1]), {"role": "assistant", "content": text}]
            messages.append(user_message(result))
    finally:
        connection.close()
    return usage


def spread(counts: collections.Counter, names: list[str], sessions: int) -> tuple[str, float]:
    """The sessions per name ("8/8") and the largest relative distance from an even share."""
    even = sessions / len(names)
    return "/".join(str(counts[n]) for n in names), max(abs(counts[n] - even) / even for n in names)


def run(affinity: bool, sessions: int, turns: int, deadline: float) -> dict:
    """One gateway at its defaults in front of a fresh fake provider; the sessions at once."""
    seen = Seen()
    fake = FakeUpstream(seen.recording(well_behaved("agent", cache=PromptCache())), record=False).start_in_thread()
    gateway, port = start_gateway(
        fake.port, config=config(fake.port, affinity), extra_env={"TINYGW_API_KEYS": GATEWAY_KEY, **KEYS}
    )
    try:
        with ThreadPoolExecutor(sessions) as pool:
            usages = list(pool.map(lambda i: session(port, i, turns, deadline), range(sessions)))
    finally:
        gateway.stop()
        gateway.cleanup_files()
        fake.stop_thread()
    later = [u for usage in usages for u in usage[1:]]  # every turn after a session's first
    prompt = max(1, sum(p for p, _ in later))
    cached = sum(c for _, c in later) / prompt
    changes, targets, keys = [], collections.Counter(), collections.Counter()
    for served in seen.turns.values():
        changes.append(sum(1 for a, b in zip(served, served[1:], strict=False) if a != b))
        targets[collections.Counter(t for t, _ in served).most_common(1)[0][0]] += 1
        keys[collections.Counter(k for _, k in served).most_common(1)[0][0]] += 1
    target_spread, target_off = spread(targets, list(TARGETS), sessions)
    key_spread, key_off = spread(keys, list(KEYS.values()), sessions)
    return {
        "affinity": "on" if affinity else "off",
        "cached": cached,
        "price": 1 - cached + CACHE_READ_PRICE * cached,
        "changes": sum(changes) / max(1, len(changes)),
        "changes_max": max(changes, default=0),
        "targets": target_spread,
        "keys": key_spread,
        "uneven": max(target_off, key_off),
        "requests": sum(len(s) for s in seen.turns.values()),
    }


def rule_spread() -> str:
    """How the gateway's rule alone (tinygw.resilience.strategy.rendezvous over the names it
    hashes) spreads RULE_CONVERSATIONS conversations over the targets and the keys."""
    targets = [f"pool:{m}".encode() for m in TARGETS]
    keys = [b"%d" % i for i in range(len(KEYS))]
    by_target, by_key = collections.Counter(), collections.Counter()
    for i in range(RULE_CONVERSATIONS):
        body = json.dumps({"model": "claude-agent", "metadata": {"user_id": f"conversation-{i}"}}).encode()
        conversation = conversation_key(read_head(body), [], "default")
        by_target[rendezvous(conversation, targets, [1] * len(targets))[0]] += 1
        by_key[rendezvous(conversation, keys, [1] * len(keys))[0]] += 1

    def shares(counts: collections.Counter, n: int) -> str:
        return "/".join(f"{counts[i] / RULE_CONVERSATIONS:.1%}" for i in range(n))

    return f"targets {shares(by_target, len(targets))}, keys {shares(by_key, len(keys))}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=40)
    parser.add_argument("--deadline", type=float, default=600.0, help="seconds for the whole run")
    args = parser.parse_args()
    deadline = time.monotonic() + args.deadline
    rows = []
    for affinity in (True, False):
        log(f"affinity {'on' if affinity else 'off'}: {args.sessions} sessions x {args.turns} turns")
        rows.append(run(affinity, args.sessions, args.turns, deadline))
    print(f"# {machine()}")
    print(
        f"# {args.sessions} agent sessions x {args.turns} turns, Claude Code's shape; alias of 2 targets "
        "(round_robin) on a provider with a pool of 3 keys; fake provider's prompt cache per (key, model)"
    )
    print_rows(
        [
            "affinity",
            "read from cache (turns 2+)",
            "prompt price",
            "changes/session (max)",
            "sessions/target",
            "sessions/key",
        ],
        [
            [
                r["affinity"],
                f"{r['cached']:.1%}",
                f"{r['price']:.0%}",
                f"{r['changes']:.1f} ({r['changes_max']})",
                r["targets"],
                r["keys"],
            ]
            for r in rows
        ],
    )
    print(f"# prompt price: of the uncached price, a cache read at {CACHE_READ_PRICE:g}; turns 2 to {args.turns}")
    print(f"# the rule alone over {RULE_CONVERSATIONS:,} conversations: {rule_spread()}")
    on = rows[0]
    met = on["cached"] >= GOAL_CACHED and on["uneven"] <= GOAL_SPREAD
    print(
        f"goal: >= {GOAL_CACHED:.0%} of the prompt tokens after each session's first turn read from cache with "
        f"affinity on ({on['cached']:.1%}), sessions within {GOAL_SPREAD:.0%} of even over targets and keys "
        f"(largest distance {on['uneven']:.0%}): {'MET' if met else 'NOT MET'}"
    )


if __name__ == "__main__":
    main()
