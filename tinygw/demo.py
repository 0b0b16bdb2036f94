"""`tinygw demo`: a real gateway in front of built-in fake providers, narrated.

Starts a fake provider in this process, a `tinygw serve` process in front of it,
sends traffic through it while the provider misbehaves on a script, and prints a
timeline of what the gateway did. Exits 0 only when every step of the story happened.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

from tinygw.fake_upstream import FakeUpstream, Reply, json_reply, well_behaved

START_SECONDS = 20.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gateway_command() -> list[str]:
    if getattr(sys, "frozen", False):
        return [sys.executable, "serve"]
    return [sys.executable, "-m", "tinygw", "serve"]


def _post(url: str, body: dict, stream: bool = False) -> tuple[int, list[bytes], float]:
    """(status, body pieces as they arrived, seconds to the first piece)."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    started = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=15) as response:
            pieces, first = [], None
            while piece := (response.readline() if stream else response.read()):
                first = first if first is not None else time.monotonic() - started
                pieces.append(piece)
            return response.status, pieces, first or 0.0
    except urllib.error.HTTPError as e:
        return e.code, [e.read()], time.monotonic() - started


class Timeline:
    def __init__(self) -> None:
        self.started = time.monotonic()
        self.failed: list[str] = []

    def say(self, text: str) -> None:
        print(f"  {time.monotonic() - self.started:7.3f}s  {text}", flush=True)

    def expect(self, ok: bool, text: str) -> None:
        self.say(("ok    " if ok else "FAILED ") + text)
        if not ok:
            self.failed.append(text)


def main(argv: list[str]) -> int:
    provider = FakeUpstream(well_behaved("provider-a", delay_seconds=0.05)).start_in_thread()
    port = _free_port()
    config = {
        "providers": {"a": {"base_url": f"{provider.url}/v1", "api": "openai", "first_byte_timeout_s": 2}},
        "models": {"chat": {"targets": ["a:upstream-chat-model"]}},
    }
    # The gateway gets this environment alone: nothing of the caller's leaks into the story.
    env = {"TINYGW_CONFIG": json.dumps(config), "TINYGW_PORT": str(port), "TINYGW_LOG_LEVEL": "warning",
           "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    url = f"http://127.0.0.1:{port}"
    timeline = Timeline()
    print(f"tinygw demo: gateway on {url}, fake provider 'a' on {provider.url}\n")
    gateway = subprocess.Popen(_gateway_command(), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + START_SECONDS
        while True:
            try:
                with urllib.request.urlopen(f"{url}/healthz", timeout=1):
                    break
            except OSError:
                if gateway.poll() is not None or time.monotonic() > deadline:
                    print(gateway.stderr.read().decode(errors="replace"), file=sys.stderr)
                    print("tinygw demo: the gateway did not start", file=sys.stderr)
                    return 1
                time.sleep(0.05)
        timeline.say("gateway up (answers /healthz)")

        status, pieces, _ = _post(f"{url}/v1/chat/completions", {"model": "chat", "messages": []})
        answer = json.loads(b"".join(pieces)) if status == 200 else {}
        timeline.expect(status == 200 and answer.get("model") == "upstream-chat-model",
                        f"chat 'chat' -> a:upstream-chat-model, {status}, model rewritten")

        status, pieces, first = _post(f"{url}/v1/chat/completions",
                                      {"model": "chat", "stream": True, "messages": []}, stream=True)
        events = [p for p in pieces if p.startswith(b"data: ")]
        timeline.expect(status == 200 and events[-1:] == [b"data: [DONE]\n"],
                        f"stream relayed event by event: {len(events)} events, first after {first * 1000:.0f} ms")

        provider.script = lambda r: json_reply(502, {"error": {"message": "bad gateway", "type": "server_error"}})
        timeline.say("provider 'a' starts answering 502 at once")
        status, pieces, _ = _post(f"{url}/v1/chat/completions", {"model": "chat", "messages": []})
        timeline.expect(status == 502, f"the provider's {status} is passed through to the client")

        provider.script = lambda r: Reply(action="hang")
        timeline.say("provider 'a' stops answering (hangs)")
        status, pieces, took = _post(f"{url}/v1/chat/completions", {"model": "chat", "messages": []})
        cause = json.loads(b"".join(pieces)).get("error", {}).get("cause") if pieces else None
        timeline.expect(status == 504 and cause == "timeout",
                        f"{status} cause={cause} after {took:.1f} s (first_byte_timeout_s=2)")

        provider.script = well_behaved("provider-a")
        timeline.say("provider 'a' recovers")
        status, _, _ = _post(f"{url}/v1/chat/completions", {"model": "chat", "messages": []})
        timeline.expect(status == 200, f"chat 'chat' -> {status}")
    finally:
        gateway.send_signal(signal.SIGTERM)
        try:
            gateway.wait(15)
        except subprocess.TimeoutExpired:
            gateway.kill()
        provider.stop_thread()
    print()
    if timeline.failed:
        print(f"tinygw demo: {len(timeline.failed)} step(s) did not happen", file=sys.stderr)
        return 1
    print("tinygw demo: every step happened")
    return 0
