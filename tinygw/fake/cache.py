"""The fake provider's prompt cache, as Anthropic and OpenAI keep theirs: per account (here,
per API key) and model, a prompt's prefix is kept for a few minutes after its last use,
and a later prompt that starts with it reads those tokens from the cache.

A prompt is a list of blocks (its system prompt, its tools, each message), a block's
tokens a quarter of its bytes; a block's `cache_control` marks are not part of it (an
agent moves its mark to the last message at every turn). A read finds the longest cached run of leading blocks,
and every prefix of the prompt is then kept for `life_seconds` more. `bench/agents.py`
measures by it what conversation affinity keeps (docs/performance.md).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable

# How long a prefix is kept after its last use (Anthropic's and OpenAI's: about 5 minutes).
LIFE_SECONDS = 300.0
# The most prefixes kept, over every key and model: beyond it the least recently used go first.
MAX_PREFIXES = 200_000


def tokens(block: bytes) -> int:
    """A block's tokens, as the fake counts them: a quarter of its bytes, at least one."""
    return max(1, len(block) // 4)


def prompt_blocks(body: dict) -> list[bytes]:
    """A request's prompt as blocks: its system prompt (`system`, `instructions`), its tools,
    then each message (`messages`, or the Responses API's `input`), as canonical JSON."""
    blocks = [body[name] for name in ("system", "instructions", "tools") if body.get(name)]
    entries = body.get("messages", body.get("input"))
    blocks += entries if isinstance(entries, list) else [entries] if entries else []
    return [json.dumps(_unmarked(block), sort_keys=True, separators=(",", ":")).encode() for block in blocks]


def _unmarked(value: object) -> object:
    """`value` without its `cache_control` marks, at any depth."""
    if isinstance(value, dict):
        return {k: _unmarked(v) for k, v in value.items() if k != "cache_control"}
    if isinstance(value, list):
        return [_unmarked(v) for v in value]
    return value


class PromptCache:
    """The prefixes of the prompts seen, per (key, model), each until it expires."""

    def __init__(
        self, clock: Callable[[], float] = time.monotonic, life_seconds: float = LIFE_SECONDS, limit: int = MAX_PREFIXES
    ) -> None:
        self._clock = clock
        self._life = life_seconds
        self._limit = limit
        self._expires: dict[bytes, float] = {}  # a prefix's hash (with its key and model) -> when it expires

    def read(self, key: str, model: str, blocks: list[bytes]) -> tuple[int, int]:
        """(the prompt's tokens, how many of them were read from the cache); the prompt's
        prefixes are kept from now on, for `life_seconds`."""
        now = self._clock()
        prefix = hashlib.sha256(b"%d:%s\0%s" % (len(key), key.encode(), model.encode())).digest()
        total = cached = 0
        hit = True
        hashes = []
        for block in blocks:
            prefix = hashlib.sha256(prefix + block).digest()
            hashes.append(prefix)
            total += tokens(block)
            if hit and self._expires.get(prefix, 0.0) > now:
                cached = total
            else:
                hit = False
        for h in hashes:  # used now: last in the order of use, kept `life_seconds` from now
            self._expires.pop(h, None)
            self._expires[h] = now + self._life
        while len(self._expires) > self._limit:
            del self._expires[next(iter(self._expires))]
        return total, cached
