"""Black-box: metrics across workers, parsed by Prometheus' own parser; the access log;
debug headers; and no configured key anywhere a gateway writes."""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import call, closed_port, metric_value, provider, wait_until
from tinygw.fake.upstream import FakeUpstream, Reply, json_reply, openai_stream_events, sse_reply, well_behaved

CHAT = "/v1/chat/completions"
GATEWAY_KEY = "gw-secret-0c1d"
PROVIDER_KEYS = {"K_ONE": "sk-prov-one-93aa", "K_TWO": "sk-prov-two-1b7e", "K_ANTH": "sk-ant-5f20"}


def test_every_metric_of_spec_section_7_parses(fake, start_gateway):
    gateway = start_gateway({"providers": {"p": provider(fake)}, "models": {"m": {"targets": ["p:x"]}}})
    for _ in range(3):
        assert call("POST", f"{gateway.url}{CHAT}", {"model": "m"})[0] == 200
    text = call("GET", f"{gateway.url}/metrics")[2].decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert {
        "tinygw_requests",
        "tinygw_request_duration_seconds",
        "tinygw_upstream_attempts",
        "tinygw_upstream_first_byte_seconds",
        "tinygw_provider_retries",
        "tinygw_circuit_transitions",
        "tinygw_circuit_open",
        "tinygw_listing_up",
        "tinygw_build_info",
    } <= set(families)
    assert metric_value(gateway, "tinygw_requests_total", route=CHAT, model="m", status="200") == 3
    assert metric_value(gateway, "tinygw_request_duration_seconds_count", route=CHAT) == 3
    assert metric_value(gateway, "tinygw_request_duration_seconds_bucket", route=CHAT, le="+Inf") == 3
    assert metric_value(gateway, "tinygw_upstream_attempts_total", provider="p", provider_model="x", outcome="200") == 3
    assert metric_value(gateway, "tinygw_upstream_first_byte_seconds_count", provider="p") == 3
    assert metric_value(gateway, "tinygw_build_info") == 1


def test_every_answered_attempt_s_first_byte_is_observed_once(fake, start_gateway):
    """tinygw_upstream_first_byte_seconds: one observation per attempt that got an answer's
    head, whatever the answer (held whole, an error status, a 200 carrying an error, a
    stream, one too large to hold); none for an attempt that got no answer."""
    dead = {"base_url": f"http://127.0.0.1:{closed_port()}/v1", "api": "openai", "listing": False}
    models = {"m": {"targets": ["p:x"]}, "d": {"targets": ["dead:x"]}}
    gateway = start_gateway({"providers": {"p": provider(fake), "dead": dead}, "models": models})
    large = {"choices": [{"message": {"content": "a" * (1024 * 1024 + 10)}}]}
    replies = [
        json_reply(200, {"choices": []}),
        json_reply(400, {"error": {"message": "bad", "type": "invalid_request_error"}}),
        json_reply(200, {"error": {"message": "overloaded", "type": "server_error"}}),
        sse_reply(openai_stream_events("x", ["hi"])),
        json_reply(200, large),
    ]
    for reply in replies:
        fake.script = lambda request, reply=reply: reply
        call("POST", f"{gateway.url}{CHAT}", {"model": "m", "stream": bool(reply.chunks)})
    call("POST", f"{gateway.url}{CHAT}", {"model": "d"})
    attempts = metric_value(gateway, "tinygw_upstream_attempts_total", provider="p")
    assert attempts is not None and attempts >= len(replies)  # a 200 carrying an error may be retried
    assert metric_value(gateway, "tinygw_upstream_first_byte_seconds_count", provider="p") == attempts
    assert metric_value(gateway, "tinygw_upstream_attempts_total", provider="dead")
    assert metric_value(gateway, "tinygw_upstream_first_byte_seconds_count", provider="dead") is None


def test_build_info_names_the_frozen_artifact_s_sha256(fake, start_gateway):
    """docs/design.md section 7: the artifact's sha256 is filled in whenever frozen (the frozen
    suite runs this against build/dist/tinygw); from source it is empty."""
    gateway = start_gateway({"providers": {"p": provider(fake)}, "models": {"m": {"targets": ["p:x"]}}})
    binary = os.environ.get("TINYGW_BINARY")
    expected = hashlib.sha256(Path(binary).read_bytes()).hexdigest() if binary else ""

    def build_info_sha256():
        text = call("GET", f"{gateway.url}/metrics")[2].decode()
        [sample] = [s for f in text_string_to_metric_families(text) for s in f.samples if s.name == "tinygw_build_info"]
        return sample.labels["artifact_sha256"]

    assert wait_until(lambda: build_info_sha256() == expected, seconds=10, what="the artifact's sha256")


# A private mount namespace whose /dev/shm is read-only, as on some locked-down hosts.
READ_ONLY_SHM = [
    "unshare",
    "--mount",
    "--propagation",
    "private",
    "sh",
    "-c",
    'mount -t tmpfs -o ro tinygw-test /dev/shm && exec "$@"',
    "sh",
]


def read_only_shm_or_skip() -> list[str]:
    probe = subprocess.run([*READ_ONLY_SHM, "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a read-only /dev/shm here: {probe.stderr.strip()[:200]}")
    return READ_ONLY_SHM


@pytest.mark.parametrize("shm", ["writable", "read-only"])
def test_a_scrape_counts_the_traffic_of_every_worker(fake, start_gateway, shm):
    prefix = read_only_shm_or_skip() if shm == "read-only" else None
    gateway = start_gateway(
        {"providers": {"p": provider(fake)}, "models": {"m": {"targets": ["p:x"]}}}, prefix=prefix, TINYGW_WORKERS="2"
    )
    warned = [r for r in gateway.log_records() if r.get("msg") == "metrics directory is not in /dev/shm"]
    assert len(warned) == (1 if shm == "read-only" else 0)  # said in the log, never silent
    workers = set()

    def both_workers_answered() -> bool:
        # each call is a new connection; the kernel spreads them over the two workers
        workers.add(json.loads(call("GET", f"{gateway.url}/status.json")[2])["worker"]["pid"])
        return len(workers) == 2

    wait_until(both_workers_answered, seconds=20, what="both workers to answer")
    n = 40
    for _ in range(n):
        assert call("POST", f"{gateway.url}{CHAT}", {"model": "m"})[0] == 200
    served_by = wait_until(
        lambda: (
            {r["worker"] for r in gateway.log_records() if r.get("msg") == "request"}
            if len([r for r in gateway.log_records() if r.get("msg") == "request"]) == n
            else None
        ),
        what="every access log line",
    )
    assert len(served_by) == 2, "both workers must have served chat traffic for this test to mean anything"
    for _ in range(6):  # whichever worker answers the scrape, it counts all n
        assert metric_value(gateway, "tinygw_requests_total", route=CHAT, model="m", status="200") == n
        assert metric_value(gateway, "tinygw_request_duration_seconds_count", route=CHAT) == n
        assert metric_value(gateway, "tinygw_upstream_attempts_total", provider="p", outcome="200") == n


def test_an_open_circuit_shows_once_for_the_gateway_and_ends_with_its_pause(fake, start_gateway):
    fake.script = lambda r: json_reply(502, {"error": {"message": "down"}})
    gateway = start_gateway(
        {"providers": {"p": provider(fake)}, "models": {"m": {"targets": ["p:x"]}}},
        PROVIDER_BREAKER_FAILURES="1",
        PROVIDER_RETRY_FAST_FAILURES="false",
        PROVIDER_BREAKER_OPEN_SECONDS="1",
        TINYGW_WORKERS="2",
    )
    assert call("POST", f"{gateway.url}{CHAT}", {"model": "m"})[0] == 502
    for _ in range(4):  # whichever worker answers the scrape: one series, no `worker` label
        text = call("GET", f"{gateway.url}/metrics")[2].decode()
        samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
        [sample] = [s for s in samples if s.name == "tinygw_circuit_open"]
        assert sample.value == 1 and sample.labels == {"provider": "p", "provider_model": "x"}
        [opened] = [s for s in samples if s.name == "tinygw_circuit_transitions_total"]
        assert opened.value == 1 and opened.labels == {"provider": "p", "provider_model": "x", "state": "open"}
    # No request reads the circuit again, yet the gauge drops when the pause is over.
    wait_until(
        lambda: metric_value(gateway, "tinygw_circuit_open", provider="p") == 0,
        seconds=5,
        what="the gauge to drop after the pause",
    )


def test_every_configured_circuit_has_a_series_from_the_start(fake, start_gateway):
    gateway = start_gateway({"providers": {"p": provider(fake)}, "models": {"m": {"targets": ["p:x", "p:y"]}}})
    assert metric_value(gateway, "tinygw_circuit_open", provider="p", provider_model="x") == 0
    assert metric_value(gateway, "tinygw_circuit_open", provider="p", provider_model="y") == 0


def test_access_log_line(fake, start_gateway):
    gateway = start_gateway({"providers": {"p": provider(fake)}, "models": {"m": {"targets": ["p:x"]}}})
    assert call("POST", f"{gateway.url}{CHAT}", {"model": "m"})[0] == 200
    [line] = wait_until(
        lambda: [r for r in gateway.log_records() if r.get("msg") == "request"], what="the access log line"
    )
    assert (line["level"], line["route"], line["model"], line["target"], line["status"], line["attempts"]) == (
        "info",
        CHAT,
        "m",
        "p:x",
        200,
        "p:200",
    )
    assert line["duration_ms"] >= 0


def test_debug_headers_only_with_routing_debug(fake, start_gateway):
    answers = iter([502, 200])
    fake.script = lambda r: json_reply(next(answers), {"ok": True})
    config = {"providers": {"qwen": provider(fake)}, "models": {"m": {"targets": ["qwen:Q"]}}}
    debug = start_gateway({**config, "routing": {"debug": True}})
    _, headers, _ = call("POST", f"{debug.url}{CHAT}", {"model": "m"})
    assert headers["x-tinygw-attempts"] == "qwen:502,qwen:200"
    assert (headers["x-tinygw-provider"], headers["x-tinygw-provider-model"]) == ("qwen", "Q")
    assert headers["x-tinygw-circuit"] == "closed"
    assert any(r.get("level") == "warning" and "debug" in r.get("msg", "") for r in debug.log_records())

    # after a fallback, on a stream, and for a client's own model name with a line break
    backup = FakeUpstream(well_behaved("backup")).start_in_thread()
    try:
        fake.script = lambda r: json_reply(500, {"error": {"message": "no"}})
        both = start_gateway(
            {
                "providers": {"qwen": provider(fake), "b": provider(backup)},
                "models": {"m": {"targets": ["qwen:Q", "b:B"]}},
                "routing": {"debug": True},
            },
            PROVIDER_BREAKER_FAILURES="1",
        )
        _, headers, _ = call("POST", f"{both.url}{CHAT}", {"model": "m"})
        assert (headers["x-tinygw-attempts"], headers["x-tinygw-provider"]) == ("qwen:500,b:200", "b")
        status, headers, _ = call("POST", f"{both.url}{CHAT}", {"model": "m", "stream": True})
        assert status == 200 and headers["x-tinygw-attempts"] == "b:200"  # qwen's circuit is open: skipped
        status, headers, _ = call("POST", f"{both.url}{CHAT}", {"model": "qwen/Q"})
        assert status == 503 and headers["x-tinygw-circuit"] == "open"
        status, headers, _ = call("POST", f"{both.url}{CHAT}", {"model": "b/a\r\nx-evil: 1"})
        assert status == 200 and "x-evil" not in headers and "%0D%0A" in headers["x-tinygw-provider-model"]
    finally:
        backup.stop_thread()

    fake.script = well_behaved()
    quiet = start_gateway(config)
    _, headers, _ = call("POST", f"{quiet.url}{CHAT}", {"model": "m"})
    assert not any(name.lower().startswith("x-tinygw-") for name in headers.keys())


def test_no_configured_key_appears_anywhere(fake, start_gateway):
    """Success and every failure path; logs, metrics, status pages, headers, bodies."""

    def script(request):
        body = request.json() or {}
        model = body.get("model")
        if model == "rate-limited" and request.headers.get("authorization") == f"Bearer {PROVIDER_KEYS['K_ONE']}":
            return json_reply(429, {"error": {"message": "slow"}}, headers=[("retry-after", "30")])
        if model == "broken":
            return json_reply(500, {"error": {"message": "boom"}})
        if model == "hang":
            return Reply(action="hang")
        return well_behaved()(request)

    fake.script = script
    config = {
        "providers": {
            "p": provider(fake, api_key_env=["K_ONE", "K_TWO"], timeout_s=0.5, listing=True),
            "a": {"base_url": fake.url, "api": "anthropic", "api_key_env": "K_ANTH"},
            "dead": {"base_url": f"http://127.0.0.1:{closed_port()}/v1", "api": "openai", "api_key_env": "K_ONE"},
        },
        "models": {name: {"targets": [f"p:{name}"]} for name in ("ok", "rate-limited", "broken", "hang")}
        | {"gone": {"targets": ["dead:x"]}, "claude": {"targets": ["a:c"]}},
        "routing": {"debug": True},
    }
    gateway = start_gateway(
        config,
        TINYGW_API_KEYS=GATEWAY_KEY,
        PROVIDER_BREAKER_FAILURES="1",
        PROVIDER_LISTING_SECONDS="0.2",
        TINYGW_MAX_BODY_BYTES="2000",
        **PROVIDER_KEYS,
    )
    auth = {"Authorization": f"Bearer {GATEWAY_KEY}"}
    seen: list[bytes] = []

    def record(status, headers, body):
        seen.append(str(status).encode() + json.dumps(dict(headers.items())).encode() + body)
        return status

    for model in ("ok", "rate-limited", "broken", "broken", "hang", "gone", "gone"):
        record(*call("POST", f"{gateway.url}{CHAT}", {"model": model}, headers=auth))
    record(*call("POST", f"{gateway.url}{CHAT}", {"model": "ok", "stream": True}, headers=auth))
    record(
        *call(
            "POST",
            f"{gateway.url}/v1/messages",
            {"model": "claude", "max_tokens": 5},
            headers={"x-api-key": GATEWAY_KEY, "anthropic-version": "2023-06-01"},
        )
    )
    record(*call("POST", f"{gateway.url}{CHAT}", {"model": "ok"}, headers={"Authorization": "Bearer nope"}))
    record(*call("POST", f"{gateway.url}{CHAT}", b"{", headers=auth))
    record(*call("POST", f"{gateway.url}{CHAT}", {"model": "ok", "pad": "x" * 3000}, headers=auth))
    record(*call("POST", f"{gateway.url}{CHAT}", {"model": "nope"}, headers=auth))
    for page in ("/metrics", "/status", "/status.json", "/v1/models", "/healthz"):
        record(*call("GET", f"{gateway.url}{page}", headers=auth))
    connection = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=5)  # a client that leaves
    connection.request("POST", CHAT, body=json.dumps({"model": "hang"}), headers=auth)
    connection.close()
    statuses = [int(s[:3]) for s in seen]
    assert {200, 400, 401, 404, 413, 500, 502, 503, 504} <= set(statuses)
    everything = b"\n".join(seen) + gateway.logs().encode()
    for secret in (GATEWAY_KEY, *PROVIDER_KEYS.values()):
        assert secret.encode() not in everything, f"a configured key leaked: {secret[:6]}…"


# ---- issue 12: tokens, latency by model and status, time to first token, in flight,
# process metrics per worker slot ------------------------------------------------------


def _openai_usage_stream(model: str) -> list[bytes]:
    """Chat chunks as OpenAI sends them with `stream_options.include_usage`: `"usage": null`
    on every chunk, then one chunk with no choices and the usage."""

    def chunk(choices, usage):
        return (
            b"data: "
            + json.dumps(
                {"id": "c", "object": "chat.completion.chunk", "model": model, "choices": choices, "usage": usage}
            ).encode()
            + b"\n\n"
        )

    return [
        chunk([{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}], None),
        chunk([{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}], None),
        chunk([{"index": 0, "delta": {}, "finish_reason": "stop"}], None),
        chunk([], {"prompt_tokens": 11, "completion_tokens": 5, "total_tokens": 16}),
        b"data: [DONE]\n\n",
    ]


def test_tokens_from_the_answers_usage_plain_and_streamed(fake, start_gateway):
    healthy = well_behaved()

    def script(request):
        body = request.json() or {}
        if body.get("stream_options"):
            return sse_reply(_openai_usage_stream(body["model"]))
        if body.get("model") == "erroring":  # a 200 carrying an error: a 502, its usage not counted
            return json_reply(200, {"error": {"message": "no"}, "usage": {"prompt_tokens": 99}})
        return healthy(request)

    fake.script = script
    gateway = start_gateway(
        {
            "providers": {"p": provider(fake), "a": {"base_url": fake.url, "api": "anthropic", "listing": False}},
            "models": {
                "chat": {"targets": ["p:x"]},
                "resp": {"targets": ["p:r"]},
                "emb": {"targets": ["p:e"]},
                "claude": {"targets": ["a:c"]},
                "bad": {"targets": ["p:erroring"]},
            },
        },
        PROVIDER_RETRY_FAST_FAILURES="false",
    )
    anthropic = {"anthropic-version": "2023-06-01"}
    assert call("POST", f"{gateway.url}{CHAT}", {"model": "chat"})[0] == 200  # 3 + 4
    assert (
        call(
            "POST", f"{gateway.url}{CHAT}", {"model": "chat", "stream": True, "stream_options": {"include_usage": True}}
        )[0]
        == 200
    )  # 11 + 5
    assert call("POST", f"{gateway.url}{CHAT}", {"model": "chat", "stream": True})[0] == 200  # no usage: 0
    assert call("POST", f"{gateway.url}/v1/responses", {"model": "resp", "input": "hi"})[0] == 200  # 3 + 4
    assert call("POST", f"{gateway.url}/v1/responses", {"model": "resp", "input": "hi", "stream": True})[0] == 200
    assert call("POST", f"{gateway.url}/v1/embeddings", {"model": "emb", "input": "hi"})[0] == 200  # 1 + 0
    assert (
        call("POST", f"{gateway.url}/v1/messages", {"model": "claude", "max_tokens": 9}, headers=anthropic)[0] == 200
    )  # 3 + 4
    assert (
        call(
            "POST",
            f"{gateway.url}/v1/messages",
            {"model": "claude", "max_tokens": 9, "stream": True},
            headers=anthropic,
        )[0]
        == 200
    )  # message_start 3, message_delta 4
    assert call("POST", f"{gateway.url}{CHAT}", {"model": "bad"})[0] == 502

    def tokens(provider_name, model, kind):
        return metric_value(gateway, "tinygw_tokens_total", provider=provider_name, model=model, kind=kind)

    assert (tokens("p", "chat", "prompt"), tokens("p", "chat", "completion")) == (14, 9)
    assert (tokens("p", "resp", "prompt"), tokens("p", "resp", "completion")) == (6, 8)
    assert (tokens("p", "emb", "prompt"), tokens("p", "emb", "completion")) == (1, None)
    assert (tokens("a", "claude", "prompt"), tokens("a", "claude", "completion")) == (6, 8)
    assert tokens("p", "bad", "prompt") is None


def test_duration_by_model_and_status_class_first_token_and_in_flight(fake, start_gateway):
    healthy = well_behaved()

    def script(request):
        body = request.json() or {}
        if body.get("model") == "slow":
            return sse_reply(openai_stream_events("slow", ["a", "b", "c"]), delay_seconds=0.15)
        if body.get("model") == "down":
            return json_reply(500, {"error": {"message": "down"}})
        return healthy(request)

    fake.script = script
    gateway = start_gateway(
        {
            "providers": {"p": provider(fake)},
            "models": {"m": {"targets": ["p:x"]}, "s": {"targets": ["p:slow"]}, "d": {"targets": ["p:down"]}},
        },
        PROVIDER_RETRY_FAST_FAILURES="false",
    )
    assert metric_value(gateway, "tinygw_requests_in_flight") == 0
    for _ in range(2):
        assert call("POST", f"{gateway.url}{CHAT}", {"model": "m"})[0] == 200
    assert call("POST", f"{gateway.url}{CHAT}", {"model": "nope"})[0] == 404
    assert call("POST", f"{gateway.url}{CHAT}", {"model": "d"})[0] == 500
    streamed = []
    thread = threading.Thread(
        target=lambda: streamed.append(call("POST", f"{gateway.url}{CHAT}", {"model": "s", "stream": True})[0])
    )
    thread.start()
    wait_until(lambda: metric_value(gateway, "tinygw_requests_in_flight") == 1, what="the stream in flight")
    thread.join(10)
    assert streamed == [200]
    assert metric_value(gateway, "tinygw_requests_in_flight") == 0

    def durations(**labels):
        return metric_value(gateway, "tinygw_request_duration_seconds_count", route=CHAT, **labels)

    assert durations(model="m", status="2xx") == 2
    assert durations(model="unknown", status="4xx") == 1
    assert durations(model="d", status="5xx") == 1
    assert durations(model="s", status="2xx") == 1
    # the stream's first output came after two pauses (role chunk, then "a"); its end after five
    first = metric_value(gateway, "tinygw_stream_first_token_seconds_sum", model="s")
    total = metric_value(gateway, "tinygw_request_duration_seconds_sum", model="s")
    assert metric_value(gateway, "tinygw_stream_first_token_seconds_count", model="s") == 1
    assert 0.25 <= first < total and total >= 0.7
    assert metric_value(gateway, "tinygw_stream_first_token_seconds_count", model="m") is None  # plain answers


def _process_samples(gateway) -> dict[str, dict[str, float]]:
    """process_* family -> worker label -> value."""
    text = call("GET", f"{gateway.url}/metrics")[2].decode()
    seen: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("process_"):
                seen.setdefault(sample.name, {})[sample.labels["worker"]] = sample.value
    return seen


def test_process_metrics_per_worker_slot_stable_across_restarts(fake, start_gateway):
    config = {"providers": {"p": provider(fake)}, "models": {"m": {"targets": ["p:x"]}}}
    pids_by_run = []
    for _ in range(2):  # the same gateway, restarted: new pids, the same labels
        gateway = start_gateway(config, TINYGW_WORKERS="2")
        pids = set()

        def both_workers_answered(pids: set = pids, gateway=gateway) -> bool:
            pids.add(json.loads(call("GET", f"{gateway.url}/status.json")[2])["worker"]["pid"])
            return len(pids) == 2

        wait_until(both_workers_answered, seconds=20, what="both workers to answer")
        for _ in range(4):  # whichever worker answers, it shows both
            seen = _process_samples(gateway)
            assert set(seen) == {
                "process_resident_memory_bytes",
                "process_cpu_seconds_total",
                "process_open_fds",
                "process_start_time_seconds",
            }
            for family, by_worker in seen.items():
                assert set(by_worker) == {"1", "2"}, family
                assert all(v > 0 for v in by_worker.values()), family
            assert all(abs(v - time.time()) < 120 for v in seen["process_start_time_seconds"].values())
            assert all(v > 10 * 1024 * 1024 for v in seen["process_resident_memory_bytes"].values())
        pids_by_run.append(pids)
        gateway.stop()
    assert not pids_by_run[0] & pids_by_run[1]
