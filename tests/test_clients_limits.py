"""Named clients and their limits (docs/design.md section 15): the sliding minute on a
fake clock, the table the workers share, and black-box: a hostile client over each
limit beside a well-behaved one, across workers too; the 429 in each API's shape; the
configuration's errors; the metrics, the access log and the status page, with no key
anywhere."""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import call, metric_value, provider, run_tinygw, wait_until
from tinygw.config.settings import Client
from tinygw.fake.upstream import FakeUpstream, Reply, openai_stream_events, well_behaved
from tinygw.observe.clienttable import ClientTable
from tinygw.resilience import limits

HOSTILE_KEY = "sk-hostile-0123456789abcdef"
GOOD_KEY = "sk-good-fedcba9876543210"
OTHER_KEY = "sk-other-5555aaaa5555"
KEYS = (HOSTILE_KEY, GOOD_KEY, OTHER_KEY)
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
HELD = {**CHAT, "stream": True, "user": "hold"}  # the fake holds this one's stream until the gate opens


# ---- the sliding minute, on a fake clock ------------------------------------------------


def minute() -> list[float]:
    return [0.0] * limits.MINUTE_FLOATS


def test_a_count_stays_in_the_window_for_a_minute_to_the_second():
    values = minute()
    limits.add(values, 0, 1000.2, 3)
    limits.add(values, 0, 1000.9, 1)  # the same second's bucket
    limits.add(values, 0, 1030.0, 2)
    assert limits.total(limits.in_window(values, 0, 1059.9)) == 6
    assert limits.total(limits.in_window(values, 0, 1060.0)) == 2  # second 1000 has left
    assert limits.total(limits.in_window(values, 0, 1090.0)) == 0


def test_a_bucket_reused_a_minute_later_starts_again_from_zero():
    values = minute()
    limits.add(values, 0, 500.0, 7)
    limits.add(values, 0, 560.5, 1)  # the same bucket (500 % 60 == 560 % 60)
    assert limits.in_window(values, 0, 561.0) == [(560.0, 1.0)]


def test_a_minute_lives_at_its_offset_and_touches_nothing_else():
    values = [0.0] * (limits.MINUTE_FLOATS + 3)
    limits.add(values, 3, 123.0, 5)
    assert values[:3] == [0.0, 0.0, 0.0]
    assert limits.in_window(values, 3, 123.5) == [(123.0, 5.0)]


def test_seconds_until_below_counts_the_oldest_leaving_first():
    buckets = [(110.0, 2.0), (100.0, 3.0), (100.0, 1.0), (130.0, 4.0)]  # second 100 from two workers
    assert limits.seconds_until_below(buckets, 10, 131.0) == 29  # 100 leaves at 160: 6 left
    assert limits.seconds_until_below(buckets, 6, 131.0) == 39  # then 110 at 170: 4 left
    assert limits.seconds_until_below(buckets, 3, 131.5) == 59  # then 130 at 190
    assert limits.seconds_until_below(buckets, 10, 159.9) == 1  # at least 1


def test_decide_refuses_at_each_limit_in_order():
    client = Client(name="c", max_concurrent=2, requests_per_minute=3, tokens_per_minute=100)
    assert limits.decide(client, 1, [(10.0, 2.0)], [(10.0, 99.0)], 20.0) is None
    assert limits.decide(client, 2, [], [], 20.0) == limits.OverLimit("max_concurrent", 1)
    assert limits.decide(client, 0, [(10.0, 3.0)], [], 20.0) == limits.OverLimit("requests_per_minute", 50)
    assert limits.decide(client, 0, [], [(15.0, 60.0), (18.0, 40.0)], 20.0) == limits.OverLimit("tokens_per_minute", 55)
    assert limits.decide(Client(name="free"), 10**6, [(1.0, 10.0**9)], [], 2.0) is None


def test_the_table_counts_in_and_out_and_refuses_without_counting():
    clock = [100.0]
    table = ClientTable({"a": Client(name="a", max_concurrent=1, requests_per_minute=2), "b": Client(name="b")})
    assert table.admit("a", clock[0]) is None
    assert table.admit("a", clock[0]) == limits.OverLimit("max_concurrent", 1)
    table.finish("a", 12, clock[0])
    assert table.admit("a", clock[0]) is None
    table.finish("a", 0, clock[0])
    clock[0] = 130.0
    assert table.admit("a", clock[0]) == limits.OverLimit("requests_per_minute", 30)
    for _ in range(50):
        assert table.admit("b", clock[0]) is None  # a client without limits is never refused
    views = {v.name: v for v in table.view(clock[0])}
    assert (views["a"].in_flight, views["a"].requests_this_minute, views["a"].tokens_this_minute) == (0, 2, 12)
    assert (views["b"].in_flight, views["b"].requests_this_minute) == (50, 50)
    assert table.admit("a", 160.0) is None  # second 100 left the window


def test_tables_in_one_directory_share_their_counts_and_a_dead_ones_in_flight_is_not_counted(tmp_path):
    clients = {"a": Client(name="a", max_concurrent=2, requests_per_minute=3)}
    one, two = ClientTable(clients, str(tmp_path), 1), ClientTable(clients, str(tmp_path), 2)
    try:
        assert one.admit("a", 100.0) is None
        assert two.admit("a", 100.0) is None
        assert one.admit("a", 100.0) == limits.OverLimit("max_concurrent", 1)  # one in flight in each
        two.close()  # its worker died with a request in flight
        assert one.admit("a", 100.0) is None  # the dead one's in flight is not counted; its minute is
        assert one.admit("a", 100.0) == limits.OverLimit("max_concurrent", 1)
        one.finish("a", 0, 100.0)
        assert one.admit("a", 100.0) == limits.OverLimit("requests_per_minute", 60)
        two = ClientTable(clients, str(tmp_path), 2)  # its slot's new worker: in flight from 0, the minute kept
        assert {v.name: (v.in_flight, v.requests_this_minute) for v in two.view(101.0)} == {"a": (1, 3)}
    finally:
        one.close()
        two.close()


def _admit_many(directory: str, slot: int, start, tries: int, results) -> None:
    """A worker's admissions of a client with one place: (admitted, times it saw two taken)."""
    table = ClientTable({"a": Client(name="a", max_concurrent=1)}, directory, slot)
    start.wait()
    admitted = over = 0
    for _ in range(tries):
        if table.admit("a", 100.0) is None:
            admitted += 1
            over += table.view(100.0)[0].in_flight > 1
            table.finish("a", 0, 100.0)
    results.put((admitted, over))
    table.close()


def test_two_workers_admitting_at_once_never_both_take_the_last_place(tmp_path):
    context = multiprocessing.get_context("fork")
    start, results = context.Event(), context.Queue()
    workers = [context.Process(target=_admit_many, args=(str(tmp_path), slot, start, 3000, results)) for slot in (1, 2)]
    for worker in workers:
        worker.start()
    wait_until(lambda: len([n for n in os.listdir(tmp_path) if n.startswith("clients-")]) == 2, 10, "both files")
    start.set()
    counts = [results.get(timeout=60) for _ in workers]
    for worker in workers:
        worker.join(10)
    assert all(admitted > 0 for admitted, _ in counts) and sum(over for _, over in counts) == 0, counts


# ---- black-box: a gateway in front of a fake that holds marked streams ---------------------------


class Held:
    """A fake provider whose streams marked `"user": "hold"` wait for `gate`."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.upstream = FakeUpstream(self.script).start_in_thread()
        self._plain = well_behaved("fake")

    def script(self, request):
        body = request.json() if request.method == "POST" else None
        if isinstance(body, dict) and body.get("user") == "hold":
            events = openai_stream_events(str(body.get("model")), ["held", " answer"], include_usage=True)
            return Reply(headers=[("content-type", "text/event-stream")], chunks=[(self.gate, e) for e in events])
        return self._plain(request)

    def posts(self) -> int:
        return sum(1 for r in self.upstream.requests if r.method == "POST")


@pytest.fixture
def held():
    fake = Held()
    yield fake
    fake.gate.set()
    fake.upstream.stop_thread()


def clients_config(fake: FakeUpstream, clients: dict) -> dict:
    return {
        "providers": {
            "fake": provider(fake),
            "an": {"base_url": fake.url, "api": "anthropic", "listing": False},
        },
        "models": {"m": {"targets": ["fake:up"]}, "claude": {"targets": ["an:claude-up"]}},
        "clients": clients,
    }


def key_env() -> dict[str, str]:
    return {"TINYGW_API_KEYS": OTHER_KEY, "HOSTILE_KEYS": HOSTILE_KEY, "GOOD_KEYS": f"unused-key-1,{GOOD_KEY}"}


def as_client(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def chat(gateway, key: str, body=CHAT, path="/v1/chat/completions", **headers):
    return call("POST", f"{gateway.url}{path}", body, {**as_client(key), **headers}, timeout=30)


def attempts(gateway) -> float:
    return metric_value(gateway, "tinygw_upstream_attempts_total") or 0.0


def assert_no_key_anywhere(gateway) -> None:
    shown = gateway.logs()
    for path in ("/metrics", "/status", "/status.json"):
        shown += call("GET", f"{gateway.url}{path}")[2].decode()
    for key in KEYS:
        assert key not in shown


def test_requests_per_minute_refuses_the_hostile_client_alone_with_429_in_openai_shape(start_gateway, fake):
    clients = {
        "hostile": {"keys_env": "HOSTILE_KEYS", "requests_per_minute": 3},
        "good": {"keys_env": ["GOOD_KEYS"], "requests_per_minute": 1000},
    }
    gateway = start_gateway(clients_config(fake, clients), **key_env())
    for _ in range(3):
        assert chat(gateway, HOSTILE_KEY)[0] == 200
    before, seen = attempts(gateway), len(fake.requests)
    status, headers, body = chat(gateway, HOSTILE_KEY)
    assert status == 429
    assert headers["x-tinygw-limit"] == "requests_per_minute"
    assert 1 <= int(headers["retry-after"]) <= 60
    error = json.loads(body)["error"]
    assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
    assert "hostile" in error["message"] and "requests_per_minute" in error["message"]
    assert headers["x-request-id"]
    assert (attempts(gateway), len(fake.requests)) == (before, seen)  # no attempt was made
    for _ in range(5):  # the well-behaved client, and the default one, are not touched
        assert chat(gateway, GOOD_KEY)[0] == 200
    assert chat(gateway, OTHER_KEY)[0] == 200
    assert metric_value(gateway, "tinygw_circuit_transitions_total") is None  # no circuit moved
    assert metric_value(gateway, "tinygw_client_requests_total", client="hostile", outcome="2xx") == 3
    assert metric_value(gateway, "tinygw_client_requests_total", client="hostile", outcome="limited") == 1
    assert metric_value(gateway, "tinygw_client_limited_total", client="hostile", limit="requests_per_minute") == 1
    assert metric_value(gateway, "tinygw_client_requests_total", client="good", outcome="2xx") == 5
    assert metric_value(gateway, "tinygw_client_requests_total", client="default", outcome="2xx") == 1
    assert metric_value(gateway, "tinygw_client_limited_total", client="good") is None
    assert metric_value(gateway, "tinygw_client_tokens_total", client="good", kind="input") == 5 * 3
    assert metric_value(gateway, "tinygw_client_tokens_total", client="good", kind="output") == 5 * 4
    lines = [r for r in gateway.log_records() if r.get("msg") == "request"]
    assert [r["status"] for r in lines if r.get("client") == "hostile"] == [200, 200, 200, 429]
    assert {r.get("client") for r in lines} == {"hostile", "good", "default"}
    assert_no_key_anywhere(gateway)


def test_the_429_takes_anthropic_shape_on_anthropic_routes(start_gateway, fake):
    clients = {"hostile": {"keys_env": "HOSTILE_KEYS", "requests_per_minute": 1}}
    gateway = start_gateway(clients_config(fake, clients), **key_env())
    message = {"model": "claude", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    assert chat(gateway, HOSTILE_KEY, message, "/v1/messages", **{"anthropic-version": "2023-06-01"})[0] == 200
    seen = len(fake.requests)
    status, headers, body = chat(gateway, HOSTILE_KEY, message, "/v1/messages")
    assert (status, headers["x-tinygw-limit"]) == (429, "requests_per_minute")
    assert 1 <= int(headers["retry-after"]) <= 60
    document = json.loads(body)
    assert document["type"] == "error" and document["error"]["type"] == "rate_limit_error"
    assert "requests_per_minute" in document["error"]["message"]
    assert len(fake.requests) == seen


def test_max_concurrent_holds_streams_and_frees_the_slot_when_they_end(start_gateway, held):
    clients = {
        "hostile": {"keys_env": "HOSTILE_KEYS", "max_concurrent": 2},
        "good": {"keys_env": "GOOD_KEYS", "max_concurrent": 2},
    }
    gateway = start_gateway(clients_config(held.upstream, clients), **key_env())
    with ThreadPoolExecutor(3) as pool:
        streams = [pool.submit(chat, gateway, HOSTILE_KEY, HELD) for _ in range(2)]
        wait_until(lambda: held.posts() == 2, 10, "the two streams to reach the provider")
        wait_until(lambda: metric_value(gateway, "tinygw_client_in_flight", client="hostile") == 2, 5, "2 in flight")
        before = attempts(gateway)
        status, headers, body = chat(gateway, HOSTILE_KEY, {**CHAT, "stream": True})
        assert (status, headers["x-tinygw-limit"], headers["retry-after"]) == (429, "max_concurrent", "1")
        assert json.loads(body)["error"]["type"] == "rate_limit_error"
        assert attempts(gateway) == before and held.posts() == 2
        assert chat(gateway, GOOD_KEY)[0] == 200  # the well-behaved client still gets through
        status_json = json.loads(call("GET", f"{gateway.url}/status.json")[2])
        rows = {c["name"]: c for c in status_json["clients"]}
        assert rows["hostile"]["in_flight"] == 2 and rows["hostile"]["requests_this_minute"] == 2
        assert rows["hostile"]["limits"] == {
            "max_concurrent": 2,
            "requests_per_minute": None,
            "tokens_per_minute": None,
        }
        assert rows["good"]["in_flight"] == 0 and rows["good"]["requests_this_minute"] == 1
        page = call("GET", f"{gateway.url}/status")[2].decode()
        assert "<h2>Clients</h2>" in page and "<code>hostile</code>" in page and "2 in flight" in page
        held.gate.set()
        assert [s.result()[0] for s in streams] == [200, 200]
    wait_until(lambda: metric_value(gateway, "tinygw_client_in_flight", client="hostile") == 0, 5, "none in flight")
    assert chat(gateway, HOSTILE_KEY)[0] == 200  # its places are free again
    assert metric_value(gateway, "tinygw_client_limited_total", client="hostile", limit="max_concurrent") == 1
    assert metric_value(gateway, "tinygw_client_tokens_total", client="hostile", kind="output") > 0  # streams' usage
    assert_no_key_anywhere(gateway)


def test_tokens_per_minute_charges_each_answers_usage_when_it_ends(start_gateway, fake):
    # The fake's chat answer reports 3 prompt and 4 completion tokens: 7 a request.
    clients = {"hostile": {"keys_env": "HOSTILE_KEYS", "tokens_per_minute": 10}, "good": {"keys_env": "GOOD_KEYS"}}
    gateway = start_gateway(clients_config(fake, clients), **key_env())
    assert chat(gateway, HOSTILE_KEY)[0] == 200  # 7 of 10
    assert chat(gateway, HOSTILE_KEY)[0] == 200  # 7 < 10 when it came: 14 now
    seen = len(fake.requests)
    status, headers, _ = chat(gateway, HOSTILE_KEY)
    assert (status, headers["x-tinygw-limit"]) == (429, "tokens_per_minute")
    assert 1 <= int(headers["retry-after"]) <= 60
    assert len(fake.requests) == seen
    assert chat(gateway, GOOD_KEY)[0] == 200
    rows = {c["name"]: c for c in json.loads(call("GET", f"{gateway.url}/status.json")[2])["clients"]}
    assert rows["hostile"]["tokens_this_minute"] == 14 and rows["good"]["tokens_this_minute"] == 7
    assert "default" in rows  # the keys of TINYGW_API_KEYS


STREAM = {**CHAT, "stream": True}
NO_CHOICES = re.compile(rb'"choices":\s*\[\]')  # the chunk that only reports the usage


def client_rows(gateway) -> dict:
    return {c["name"]: c for c in json.loads(call("GET", f"{gateway.url}/status.json")[2])["clients"]}


def test_tokens_per_minute_charges_every_stream_asking_the_usage_the_client_did_not(start_gateway, fake):
    """An OpenAI chat stream reports its usage only when asked: the gateway asks for a
    charged client and does not relay the usage-only chunk it did not ask for; its limit
    then bites after streams as after held answers (7 tokens each)."""
    clients = {"hostile": {"keys_env": "HOSTILE_KEYS", "tokens_per_minute": 30}, "good": {"keys_env": "GOOD_KEYS"}}
    gateway = start_gateway(clients_config(fake, clients), **key_env())
    status, _, body = chat(gateway, HOSTILE_KEY, STREAM)
    assert status == 200 and body.endswith(b"data: [DONE]\n\n") and not NO_CHOICES.search(body), body
    assert json.loads(fake.requests[-1].body)["stream_options"] == {"include_usage": True}
    assert client_rows(gateway)["hostile"]["tokens_this_minute"] == 7
    asked = {**STREAM, "stream_options": {"include_usage": True}}  # asked by the client: it gets the chunk
    status, _, body = chat(gateway, HOSTILE_KEY, asked)
    assert status == 200 and NO_CHOICES.search(body) and b"data: [DONE]" in body
    status, _, body = chat(gateway, GOOD_KEY, STREAM)  # a client not charged by its tokens: as it sent it
    assert status == 200 and "stream_options" not in json.loads(fake.requests[-1].body)
    for _ in range(3):  # 14, 21, 28: each under 30 when it came
        assert chat(gateway, HOSTILE_KEY, STREAM)[0] == 200
    status, headers, _ = chat(gateway, HOSTILE_KEY, STREAM)
    assert (status, headers["x-tinygw-limit"]) == (429, "tokens_per_minute")
    assert client_rows(gateway)["hostile"]["tokens_this_minute"] == 35
    lines = [r for r in gateway.log_records() if r.get("msg") == "request" and r.get("client") == "hostile"]
    assert [r["tokens_estimated"] for r in lines if r["status"] == 200] == [False] * 5
    assert all("tokens_estimated" not in r for r in gateway.log_records() if r.get("client") == "good")


def test_a_stream_that_ends_without_usage_is_charged_its_bytes_over_4(start_gateway, fake):
    clients = {"hostile": {"keys_env": "HOSTILE_KEYS", "tokens_per_minute": 100000}}
    gateway = start_gateway(clients_config(fake, clients), **key_env())
    events = openai_stream_events("up", ["one", " two", " three"], include_usage=True)
    fake.script = lambda r: Reply(
        headers=[("content-type", "text/event-stream")], chunks=[(0, e) for e in events[:3]], action="cut"
    )
    status, _, body = chat(gateway, HOSTILE_KEY, STREAM)
    assert status == 200 and b"event: error" in body  # cut by the provider before its usage
    expected = -(-(len(json.dumps(STREAM).encode()) + len(body)) // 4)
    assert client_rows(gateway)["hostile"]["tokens_this_minute"] == expected
    [line] = [r for r in gateway.log_records() if r.get("msg") == "request" and r.get("client") == "hostile"]
    assert line["tokens_estimated"] is True


def test_a_stream_the_client_cuts_before_its_usage_is_charged_too(start_gateway, fake):
    clients = {"hostile": {"keys_env": "HOSTILE_KEYS", "tokens_per_minute": 100000}}
    gateway = start_gateway(clients_config(fake, clients), **key_env())
    gate = threading.Event()
    events = openai_stream_events("up", ["one", " two"], include_usage=True)
    fake.script = lambda r: Reply(
        headers=[("content-type", "text/event-stream")], chunks=[(0, e) for e in events[:3]] + [(gate, events[3])]
    )
    body = json.dumps(STREAM).encode()
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=10) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            + b"authorization: Bearer %s\r\ncontent-length: %d\r\n\r\n" % (HOSTILE_KEY.encode(), len(body))
            + body
        )
        received = b""
        while b" two" not in received:
            received += s.recv(65536)
    try:
        wait_until(lambda: client_rows(gateway)["hostile"]["tokens_this_minute"] > 0, 10, "the cut stream charged")
    finally:
        gate.set()
    [line] = [r for r in gateway.log_records() if r.get("msg") == "request" and r.get("client") == "hostile"]
    assert (line["status"], line["tokens_estimated"]) == (499, True)


# ---- across workers --------------------------------------------------------------------------


def test_requests_per_minute_holds_across_four_workers(start_gateway, fake):
    clients = {"hostile": {"keys_env": "HOSTILE_KEYS", "requests_per_minute": 10}, "good": {"keys_env": "GOOD_KEYS"}}
    gateway = start_gateway(clients_config(fake, clients), TINYGW_WORKERS="4", **key_env())
    statuses: list[int] = []
    with ThreadPoolExecutor(6) as pool:  # each call on a connection of its own: any worker may take it
        # which worker accepts is the kernel's choice, and a quiet gateway may give one worker
        # every connection: the calls go on (in the same minute) until two workers have served
        while len(statuses) < 30 or len(workers_that_served(gateway)) < 2:
            assert len(statuses) < 600, "every call was taken by one worker"
            statuses += pool.map(lambda _: chat(gateway, HOSTILE_KEY)[0], range(30))
    assert sorted(statuses) == [200] * 10 + [429] * (len(statuses) - 10)
    assert sum(1 for r in fake.requests if r.method == "POST") == 10
    assert all(chat(gateway, GOOD_KEY)[0] == 200 for _ in range(5))
    limited = metric_value(gateway, "tinygw_client_limited_total", client="hostile", limit="requests_per_minute")
    assert limited == len(statuses) - 10


def workers_that_served(gateway) -> set[int]:
    return {r["worker"] for r in gateway.log_records() if r.get("msg") == "request"}


def test_max_concurrent_holds_across_four_workers_whichever_takes_the_request(start_gateway, held):
    clients = {"hostile": {"keys_env": "HOSTILE_KEYS", "max_concurrent": 2}, "good": {"keys_env": "GOOD_KEYS"}}
    gateway = start_gateway(clients_config(held.upstream, clients), TINYGW_WORKERS="4", **key_env())
    with ThreadPoolExecutor(2) as pool:
        streams = [pool.submit(chat, gateway, HOSTILE_KEY, HELD) for _ in range(2)]
        wait_until(lambda: held.posts() == 2, 10, "the two streams to reach the provider")
        refused_by: set[int] = set()
        calls = 0
        # a connection each, until three workers have refused: one of them holds neither stream
        # (which worker accepts is the kernel's choice, and it may favour one)
        while calls < 24 or len(refused_by) < 3:
            assert calls < 600, "the calls were not spread over three workers"
            status, headers, _ = chat(gateway, HOSTILE_KEY, HELD)
            assert (status, headers["x-tinygw-limit"]) == (429, "max_concurrent")
            calls += 1
            refused_by = {r["worker"] for r in hostile_lines(gateway) if r["status"] == 429}
        assert held.posts() == 2
        assert chat(gateway, GOOD_KEY)[0] == 200
        assert metric_value(gateway, "tinygw_client_in_flight", client="hostile") == 2  # summed over workers
        held.gate.set()
        assert [s.result()[0] for s in streams] == [200, 200]
    holders = {r["worker"] for r in hostile_lines(gateway) if r["status"] == 200}
    assert len(holders) <= 2 and refused_by - holders  # refused by a worker holding none
    wait_until(lambda: chat(gateway, HOSTILE_KEY)[0] == 200, 5, "the places to be free again")


def hostile_lines(gateway) -> list[dict]:
    return [r for r in gateway.log_records() if r.get("msg") == "request" and r.get("client") == "hostile"]


# ---- configuration ---------------------------------------------------------------------------


def check(clients: dict, **env: str):
    config = {"providers": {}, "models": {}, "clients": clients}
    return run_tinygw(["check"], {"TINYGW_CONFIG": json.dumps(config), **env})


@pytest.mark.parametrize(
    "clients,env,named",
    [
        ({"team": {"max_concurrent": 2}}, {}, "$.clients.team"),
        ({"team": {"keys_env": []}}, {}, "$.clients.team"),
        ({"team": {"keys_env": "TEAM_KEYS"}}, {}, "TEAM_KEYS"),  # unset
        ({"team": {"keys_env": "TEAM_KEYS"}}, {"TEAM_KEYS": " , "}, "TEAM_KEYS"),  # holds no key
        ({"team": {"keys_env": "TEAM_KEYS"}}, {"TEAM_KEYS": "good-key,bad key"}, "TEAM_KEYS"),  # a space
        ({"team": {"keys_env": "TEAM_KEYS"}}, {"TEAM_KEYS": "k\u00e9y"}, "TEAM_KEYS"),
        ({"team": {"keys_env": "TEAM KEYS"}}, {}, "$.clients.team.keys_env"),
        ({"team": {"keys_env": "TEAM_KEYS", "max_concurrent": 0}}, {"TEAM_KEYS": "k"}, "$.clients.team.max_concurrent"),
        ({"team": {"keys_env": "K", "requests_per_minute": -1}}, {"K": "k"}, "$.clients.team.requests_per_minute"),
        ({"team": {"keys_env": "K", "tokens_per_minute": 1.5}}, {"K": "k"}, "$.clients.team.tokens_per_minute"),
        ({"team": {"keys_env": "K", "max_concurrent": "8"}}, {"K": "k"}, "$.clients.team.max_concurrent"),
        ({"team": {"keys_env": "K", "burst": 3}}, {"K": "k"}, "$.clients.team"),
        ({"te am": {"keys_env": "K"}}, {"K": "k"}, "$.clients.te am"),
        ({"default": {"keys_env": "K"}}, {"K": "k", "TINYGW_API_KEYS": "d"}, "$.clients.default.keys_env"),
        ({"default": {"max_concurrent": 1}, "team": {"keys_env": "K"}}, {"K": "k"}, "$.clients.default"),
        ({}, {"TINYGW_API_KEYS": "one,has space"}, "TINYGW_API_KEYS"),
    ],
)
def test_a_bad_client_stops_the_start_naming_it(clients, env, named):
    done = check(clients, **env)
    assert done.returncode == 2, done.stdout + done.stderr
    assert named in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("second", ["team-b", "default"])
def test_a_key_of_two_clients_stops_the_start_naming_both_and_never_the_key(second):
    shared = "sk-shared-between-two-0001"
    clients = {"team-a": {"keys_env": "A_KEYS"}, **({"team-b": {"keys_env": "B_KEYS"}} if second == "team-b" else {})}
    default_keys = shared if second == "default" else "sk-default-only"
    done = check(clients, A_KEYS=f"a-only,{shared}", B_KEYS=shared, TINYGW_API_KEYS=default_keys)
    assert done.returncode == 2
    assert "team-a" in done.stderr and second in done.stderr
    assert shared not in done.stderr + done.stdout


def test_clients_are_configuration_their_keys_are_not(tmp_path):
    keys = tmp_path / "team-keys"
    keys.write_text("sk-from-a-file-1, sk-from-a-file-2\n")
    clients = {"team": {"keys_env": ["TINYGW_TEAM_KEYS"], "requests_per_minute": 60}, "default": {"max_concurrent": 4}}
    # a key variable with our prefix is one the configuration names: the strict check lets it be
    done = check(clients, TINYGW_TEAM_KEYS_FILE=str(keys), TINYGW_API_KEYS="sk-default-key")
    assert done.returncode == 0, done.stderr
    effective = json.loads(done.stdout[: done.stdout.rindex("}") + 1])
    assert effective["clients"] == {
        "default": {
            "keys_env": ["TINYGW_API_KEYS"],
            "max_concurrent": 4,
            "requests_per_minute": None,
            "tokens_per_minute": None,
        },
        "team": {
            "keys_env": ["TINYGW_TEAM_KEYS"],
            "max_concurrent": None,
            "requests_per_minute": 60,
            "tokens_per_minute": None,
        },
    }
    assert "sk-" not in done.stdout
    other = check(
        {**clients, "team": {**clients["team"], "requests_per_minute": 61}},
        TINYGW_TEAM_KEYS_FILE=str(keys),
        TINYGW_API_KEYS="sk-default-key",
    )
    same_but_keys = check(clients, TINYGW_TEAM_KEYS="sk-another", TINYGW_API_KEYS="sk-default-key")
    hash_of = lambda run: run.stdout.strip().splitlines()[-1]  # noqa: E731
    assert hash_of(other) != hash_of(done) and hash_of(same_but_keys) == hash_of(done)


def test_client_keys_alone_let_the_gateway_listen_beyond_loopback_and_ask_every_request_for_a_key(start_gateway, fake):
    clients = {"team": {"keys_env": "GOOD_KEYS"}}
    done = run_tinygw(
        ["check"],
        {"TINYGW_CONFIG": json.dumps(clients_config(fake, clients)), "TINYGW_HOST": "0.0.0.0", "GOOD_KEYS": GOOD_KEY},
    )
    assert done.returncode == 0, done.stderr
    gateway = start_gateway(clients_config(fake, clients), GOOD_KEYS=GOOD_KEY)
    assert chat(gateway, GOOD_KEY)[0] == 200
    assert call("POST", f"{gateway.url}/v1/chat/completions", CHAT)[0] == 401
    assert chat(gateway, "sk-not-a-key")[0] == 401


def test_without_keys_every_request_is_the_default_client_with_its_limits(start_gateway, fake):
    gateway = start_gateway(clients_config(fake, {"default": {"requests_per_minute": 2}}))
    assert [call("POST", f"{gateway.url}/v1/chat/completions", CHAT)[0] for _ in range(3)] == [200, 200, 429]
    assert metric_value(gateway, "tinygw_client_limited_total", client="default", limit="requests_per_minute") == 1
