"""`tinygw demo`: a real gateway in front of built-in fake providers, telling the story
of an outage (docs/design.md section 1): fallback, circuit opened, 503 with Retry-After, probe,
circuit closed; and an Anthropic model falling back to Claude on Bedrock.

Two fake providers run in this process (the backup also plays Bedrock, its requests
signed with AWS SigV4 by the gateway); a `tinygw serve` process stands in front of
them. Provider `primary` starts answering every request with a 502 in a few
milliseconds, as a real one did for a whole day. The timeline mixes what clients saw
with what the gateway logged. Exits 0 only when every step of the story happened.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

from tinygw.fake.upstream import FakeUpstream, json_reply, well_behaved

START_SECONDS = 20.0
OPEN_SECONDS = 2  # the demo's pause, so that the probe comes quickly


def _reserve_port() -> socket.socket:
    """A socket bound to a free loopback port, never listening, kept open while the demo's
    gateway serves there: no other program's bind to port 0 is given that port meanwhile
    (the gateway binds it beside this one: both with SO_REUSEADDR, this one not listening)."""
    reservation = socket.socket()
    reservation.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    reservation.bind(("127.0.0.1", 0))
    return reservation


def _gateway_command() -> list[str]:
    if getattr(sys, "frozen", False):
        return [sys.executable, "serve"]
    return [sys.executable, "-m", "tinygw", "serve"]


def _chat(url: str, model: str) -> tuple[int, dict, dict]:
    """(status, headers, JSON body) of one chat request."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]}).encode()
    request = urllib.request.Request(
        f"{url}/v1/chat/completions", data=body, method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=15) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, json.loads(e.read() or b"{}")


class Timeline:
    def __init__(self) -> None:
        self.started = time.monotonic()
        self.seen: set[str] = set()
        self._lock = threading.Lock()

    def say(self, who: str, text: str) -> None:
        with self._lock:
            print(f"  {time.monotonic() - self.started:6.2f}s  {who:<8} {text}", flush=True)

    def mark(self, step: str) -> None:
        self.seen.add(step)


def _narrate_gateway_log(stream, timeline: Timeline) -> None:
    """The gateway's JSON log lines that tell the story, as they come."""
    for raw in stream:
        try:
            line = json.loads(raw)
        except ValueError:
            continue
        msg = line.get("msg")
        where = f"{line.get('provider')}:{line.get('provider_model')}"
        if msg == "provider circuit opened":
            timeline.mark("opened")
            timeline.say(
                "gateway",
                f"provider circuit opened   {where} after {line.get('failures')} failures, "
                f"pause {line.get('pause_seconds')} s",
            )
        elif msg == "provider circuit half-open":
            timeline.mark("half_open")
            timeline.say("gateway", f"provider circuit half-open {where}: the next request is a probe")
        elif msg == "provider circuit closed":
            timeline.mark("closed")
            timeline.say("gateway", f"provider circuit closed   {where}")
        elif msg == "retrying provider after a quick failure":
            timeline.say("gateway", f"retrying provider after a quick failure {where}")


def _messages(url: str, model: str) -> tuple[int, dict]:
    """(status, JSON body) of one Anthropic Messages request."""
    body = json.dumps({"model": model, "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}).encode()
    request = urllib.request.Request(
        f"{url}/v1/messages", data=body, method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=15) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


BEDROCK_MODEL = "anthropic.claude-sonnet-5-5-v1:0"


def _config(primary: FakeUpstream, backup: FakeUpstream, port: int) -> dict[str, str]:
    """The gateway's whole environment: nothing of the caller's leaks into the story."""
    config = {
        "providers": {
            "primary": {"base_url": f"{primary.url}/v1", "api": "openai", "listing": False},
            "backup": {"base_url": f"{backup.url}/v1", "api": "openai", "listing": False},
            "anthropic": {"base_url": primary.url, "api": "anthropic", "listing": False},
            "bedrock": {
                "base_url": backup.url,
                "api": "bedrock",
                "region": "us-east-1",
                "aws_access_key_id_env": "DEMO_AWS_ACCESS_KEY_ID",
                "aws_secret_access_key_env": "DEMO_AWS_SECRET_ACCESS_KEY",
            },
        },
        "models": {
            "chat": {"targets": ["primary:chat-large", "backup:chat-large-copy"]},
            "solo": {"targets": ["primary:chat-large"]},
            "claude": {"targets": ["anthropic:claude-sonnet-5-5", f"bedrock:{BEDROCK_MODEL}"]},
        },
    }
    return {
        "TINYGW_CONFIG": json.dumps(config),
        "TINYGW_PORT": str(port),
        "TINYGW_LOG_LEVEL": "info",
        "TINYGW_WORKERS": "1",  # one worker tells the story, whatever the machine's CPUs
        "PROVIDER_BREAKER_OPEN_SECONDS": str(OPEN_SECONDS),
        "PROVIDER_HEALTH_CHECK_SECONDS": "0",
        "PROVIDER_LISTING_SECONDS": "0",
        "DEMO_AWS_ACCESS_KEY_ID": "AKIDDEMO000000000000",
        "DEMO_AWS_SECRET_ACCESS_KEY": "demo-secret-access-key",
        "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    }


def _ready(url: str, gateway: subprocess.Popen) -> bool:
    deadline = time.monotonic() + START_SECONDS
    while True:
        try:
            with urllib.request.urlopen(f"{url}/healthz", timeout=1):
                return True
        except OSError:
            if gateway.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(0.05)


def _outage(url: str, primary: FakeUpstream, timeline: Timeline) -> None:
    """The story: a healthy answer, the primary failing (fallback, circuit opened), a
    503 with Retry-After for the model without a fallback, recovery through a probe."""
    status, _, body = _chat(url, "chat")
    timeline.say("client", f"chat -> {status}, answered by {body.get('model')}")
    primary.script = lambda r: json_reply(502, {"error": {"message": "bad gateway", "type": "server_error"}})
    timeline.say("primary", "starts answering every request with 502, at once")
    for _ in range(6):
        status, _, body = _chat(url, "chat")
        if status == 200 and body.get("model") == "chat-large-copy":
            timeline.mark("fallback")
        timeline.say("client", f"chat -> {status}, answered by {body.get('model')}")
    status, body = _messages(url, "claude")
    if status == 200 and body.get("model") == BEDROCK_MODEL:
        timeline.mark("bedrock")
    timeline.say("client", f"claude -> {status}, answered by {body.get('model')} (Claude on Bedrock, signed SigV4)")
    status, headers, body = _chat(url, "solo")
    error = body.get("error", {})
    if status == 503 and error.get("cause") == "circuit_open" and headers.get("retry-after"):
        timeline.mark("503")
    timeline.say("client", f"solo -> {status} {error.get('cause')}, Retry-After: {headers.get('retry-after')}")
    primary.script = well_behaved("primary")
    timeline.say("primary", "recovers")
    wait_until = time.monotonic() + OPEN_SECONDS + 0.2
    while time.monotonic() < wait_until:  # a demo may wait; the tests drive the clock
        time.sleep(0.05)
    status, _, body = _chat(url, "solo")
    if status == 200:
        timeline.mark("probe")
    timeline.say("client", f"solo -> {status}, answered by {body.get('model')} (the probe)")
    status, _, body = _chat(url, "chat")
    timeline.say("client", f"chat -> {status}, answered by {body.get('model')}")
    deadline = time.monotonic() + 5
    while "closed" not in timeline.seen and time.monotonic() < deadline:
        time.sleep(0.05)


def main(argv: list[str]) -> int:
    primary = FakeUpstream(well_behaved("primary")).start_in_thread()
    backup = FakeUpstream(well_behaved("backup")).start_in_thread()
    reservation = _reserve_port()
    port = reservation.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    timeline = Timeline()
    print(f"tinygw demo: gateway on {url}; fake providers primary ({primary.url}) and backup ({backup.url})")
    print("  model 'chat' -> primary:chat-large, then backup:chat-large-copy; model 'solo' -> primary only;")
    print("  model 'claude' -> Anthropic on primary, then Claude on Bedrock (the backup)\n")
    gateway = subprocess.Popen(
        _gateway_command(),
        env=_config(primary, backup, port),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    threading.Thread(target=_narrate_gateway_log, args=(gateway.stderr, timeline), daemon=True).start()
    try:
        if not _ready(url, gateway):
            print("tinygw demo: the gateway did not start", file=sys.stderr)
            return 1
        _outage(url, primary, timeline)
    finally:
        gateway.send_signal(signal.SIGTERM)
        try:
            gateway.wait(15)
        except subprocess.TimeoutExpired:
            gateway.kill()
        reservation.close()
        primary.stop_thread()
        backup.stop_thread()
    story = ["fallback", "opened", "bedrock", "503", "half_open", "probe", "closed"]
    missing = [step for step in story if step not in timeline.seen]
    print()
    if missing:
        print(f"tinygw demo: the story did not happen; missing: {', '.join(missing)}", file=sys.stderr)
        return 1
    print(
        "tinygw demo: fallback, circuit opened, Anthropic to Bedrock, 503 + Retry-After, probe, circuit closed:"
        " every step happened"
    )
    return 0
