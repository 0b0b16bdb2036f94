"""One gateway, however many workers (docs/design.md section 4, "One circuit for the gateway"):
black-box tests of a real gateway of four workers against fake providers.

Each request is on a new connection (`call`), from several threads at once, so that the
kernel spreads them over the workers; a test that needs several workers to have taken
part checks the access log's `worker` field.
"""

from __future__ import annotations

import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

from conftest import call, children, metric_value, provider, wait_until
from tinygw.fake.upstream import FakeRequest, Reply, json_reply, well_behaved

CHAT = "/v1/chat/completions"
WORKERS = 4
FAILURES = 5
REQUEST = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
ONE_TARGET = {"models": {"m": {"targets": ["p:x"]}}}
QUIET = {  # nothing but the clients' requests reaches the fake
    "PROVIDER_HEALTH_CHECK_SECONDS": "0",
    "PROVIDER_LISTING_SECONDS": "0",
    "PROVIDER_RETRY_FAST_FAILURES": "false",
}


def failing(request: FakeRequest) -> Reply:
    return json_reply(502, {"error": {"message": "down", "type": "server_error"}})


def chats(fake) -> list[FakeRequest]:
    return [r for r in fake.requests if r.path.endswith("/chat/completions")]


def send_many(gateway, n: int, threads: int = WORKERS) -> list[int]:
    """`n` chat requests, `threads` at a time, each on a new connection: their statuses."""
    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(lambda _: call("POST", f"{gateway.url}{CHAT}", REQUEST)[0], range(n)))


def status_or_reset(gateway) -> int | None:
    """A chat request's status; None when its connection was reset (it reached the killed worker)."""
    try:
        return call("POST", f"{gateway.url}{CHAT}", REQUEST)[0]
    except OSError:
        return None


def serving_workers(gateway) -> set[int]:
    return {r["worker"] for r in gateway.log_records() if r.get("msg") == "request"}


def worker_pids(gateway) -> set[int]:
    """The gateway's workers: the live children of its process."""
    return {pid for pid, state in children(gateway.server_pid).items() if not state.startswith("Z")}


def holder_of_connection_to(fake, pids: set[int]) -> int | None:
    """Which of `pids` has a TCP connection open to the fake (its socket's inode in /proc/net/tcp)."""
    inodes = set()
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            remote_port, state = int(fields[2].split(":")[1], 16), fields[3]
            if remote_port == fake.port and state == "01":  # ESTABLISHED
                inodes.add(fields[9])
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in inodes:
                return pid
    return None


def test_an_outage_costs_the_gateway_the_threshold_plus_what_was_in_flight(fake, start_gateway):
    fake.script = failing
    gateway = start_gateway(
        {"providers": {"p": provider(fake)}, **ONE_TARGET},
        TINYGW_WORKERS=str(WORKERS),
        PROVIDER_BREAKER_FAILURES=str(FAILURES),
        PROVIDER_BREAKER_OPEN_SECONDS="300",
        **QUIET,
    )
    statuses = send_many(gateway, 120)
    assert set(statuses) == {502, 503}
    assert len(serving_workers(gateway)) >= 2, "several workers must have served for this test to mean anything"
    # Today's per-worker circuits: up to 4 x 5 = 20.
    assert FAILURES <= len(chats(fake)) <= FAILURES + WORKERS
    assert statuses.count(502) == len(chats(fake))
    assert metric_value(gateway, "tinygw_circuit_open", provider="p", provider_model="x") == 1
    assert metric_value(gateway, "tinygw_circuit_transitions_total", provider="p", state="open") == 1
    opened = [r for r in gateway.log_records() if r.get("msg") == "provider circuit opened"]
    assert len(opened) == 1 and opened[0]["failures"] == FAILURES


def test_each_pause_admits_one_probe_for_the_gateway(fake, start_gateway):
    fake.script = failing
    gateway = start_gateway(
        {"providers": {"p": provider(fake)}, **ONE_TARGET},
        TINYGW_WORKERS=str(WORKERS),
        PROVIDER_BREAKER_FAILURES="1",
        PROVIDER_BREAKER_OPEN_SECONDS="0.5",
        **QUIET,
    )
    assert call("POST", f"{gateway.url}{CHAT}", REQUEST)[0] == 502  # the trip, alone: none other in flight
    stop = threading.Event()

    def keep_asking() -> None:
        while not stop.is_set():
            call("POST", f"{gateway.url}{CHAT}", REQUEST)

    threads = [threading.Thread(target=keep_asking) for _ in range(WORKERS)]
    for thread in threads:
        thread.start()
    try:
        # The trip, then pauses of 0.5, 1 and 2 s, each ended by one failed probe.
        wait_until(lambda: len(chats(fake)) >= 4, seconds=15, what="three probes")
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert len(serving_workers(gateway)) >= 2, "several workers must have served for this test to mean anything"
    attempts = len(chats(fake))

    def openings() -> list[dict] | None:  # one per attempt: the trip, then one probe per pause
        opened = [r for r in gateway.log_records() if r.get("msg") == "provider circuit opened"]
        return opened if len(opened) >= attempts else None

    opened = wait_until(openings, what="every opening logged")
    # One circuit: each opening doubles the one pause; per-worker circuits would each start at 0.5.
    assert [r["pause_seconds"] for r in opened][:4] == [0.5, 1.0, 2.0, 4.0]
    assert [r["after_probe"] for r in opened] == [False] + [True] * (len(opened) - 1)
    assert len(chats(fake)) == len(opened)  # one attempt per opening: the trip, then one probe per pause


def test_a_probe_whose_worker_is_killed_is_given_back(fake, start_gateway):
    probe_taken = threading.Event()

    def script(request: FakeRequest) -> Reply:
        if len(chats(fake)) == 1:  # opens the circuit; its connection closed, so the probe's is the one open
            reply = failing(request)
            reply.action = "answer_close"
            return reply
        if len(chats(fake)) == 2:
            probe_taken.set()
            return Reply(action="hang")  # the probe: its worker is killed while it waits
        return well_behaved()(request)

    fake.script = script
    gateway = start_gateway(
        {"providers": {"p": provider(fake)}, **ONE_TARGET},
        TINYGW_WORKERS=str(WORKERS),
        PROVIDER_BREAKER_FAILURES="1",
        PROVIDER_BREAKER_OPEN_SECONDS="0.5",
        **QUIET,
    )
    wait_until(lambda: len(worker_pids(gateway)) == WORKERS, seconds=20, what="every worker")
    assert call("POST", f"{gateway.url}{CHAT}", REQUEST)[0] == 502

    def ask_until_probed() -> None:  # 503 until the pause is over; then the probe, which hangs
        while not probe_taken.is_set():
            try:
                call("POST", f"{gateway.url}{CHAT}", REQUEST, timeout=60)
            except OSError:  # its worker was killed
                return

    threading.Thread(target=ask_until_probed, daemon=True).start()
    wait_until(probe_taken.is_set, seconds=10, what="a probe")
    holder = wait_until(lambda: holder_of_connection_to(fake, worker_pids(gateway)), what="the probe's worker")
    # While the probe is held, the other workers skip the circuit.
    assert {call("POST", f"{gateway.url}{CHAT}", REQUEST)[0] for _ in range(8)} == {503}
    os.kill(holder, signal.SIGKILL)
    # The worker is started again; the probe it held is given back, and the next request probes and closes it.
    wait_until(lambda: status_or_reset(gateway) == 200, seconds=20, what="a probe after the kill")
    assert gateway.process.poll() is None
    assert len(chats(fake)) == 3
    closed = wait_until(
        lambda: [r for r in gateway.log_records() if r.get("msg") == "provider circuit closed"], what="the close"
    )
    assert len(closed) == 1


def test_a_killed_worker_is_started_again_and_the_others_serve_on(fake, start_gateway):
    gateway = start_gateway({"providers": {"p": provider(fake)}, **ONE_TARGET}, TINYGW_WORKERS=str(WORKERS), **QUIET)
    before = wait_until(
        lambda: pids if len(pids := worker_pids(gateway)) == WORKERS else None, seconds=20, what="every worker"
    )
    killed = sorted(before)[1]
    os.kill(killed, signal.SIGKILL)
    # The others serve on (a connection the kernel had queued to the killed worker's own
    # listening socket is reset with it, as is one that arrives as its socket closes).
    answered = [status_or_reset(gateway) for _ in range(20)]
    assert answered.count(200) >= 15 and set(answered) <= {200, None}, answered
    after = wait_until(
        lambda: pids if len(pids := worker_pids(gateway)) == WORKERS and killed not in pids else None,
        seconds=20,
        what="the worker started again",
    )
    assert len(after - before) == 1 and gateway.process.poll() is None

    def every_slot_back() -> bool:
        import json

        workers = json.loads(call("GET", f"{gateway.url}/status.json")[2])["workers"]
        return sorted(w["slot"] for w in workers) == [1, 2, 3, 4] and {w["pid"] for w in workers} == after

    wait_until(every_slot_back, seconds=20, what="the new worker in the freed slot")
    assert set(send_many(gateway, 40)) == {200}


def test_a_key_resting_after_a_429_is_skipped_by_every_worker(fake, start_gateway):
    def script(request: FakeRequest) -> Reply:
        if request.headers["authorization"] == "Bearer key-one":
            return json_reply(429, {"error": {"message": "slow down"}}, [("retry-after", "60")])
        return well_behaved()(request)

    fake.script = script
    gateway = start_gateway(
        {"providers": {"p": provider(fake, api_key_env=["K1", "K2"], affinity=False)}, **ONE_TARGET},
        K1="key-one",
        K2="key-two",
        TINYGW_WORKERS=str(WORKERS),
        **QUIET,
    )
    assert call("POST", f"{gateway.url}{CHAT}", REQUEST)[0] == 200  # key-one's 429, then key-two
    assert set(send_many(gateway, 60)) == {200}
    assert len(serving_workers(gateway)) >= 2, "several workers must have served for this test to mean anything"
    used = [r.headers["authorization"] for r in chats(fake)]
    assert used.count("Bearer key-one") == 1  # per-worker rests: once per worker
    assert used.count("Bearer key-two") == 61


def test_round_robin_spreads_the_gateways_requests(fake, start_gateway):
    gateway = start_gateway(
        {
            "providers": {"a": provider(fake), "b": provider(fake)},
            "models": {"m": {"targets": ["a:x", "b:y"], "strategy": "round_robin", "affinity": False}},
        },
        TINYGW_WORKERS=str(WORKERS),
        **QUIET,
    )
    ids: list[str] = []
    for _ in range(20):  # rounds of 24, one request at a time, each on a new connection: any worker
        for _ in range(24):
            status, headers, _ = call("POST", f"{gateway.url}{CHAT}", REQUEST)
            assert status == 200
            ids.append(headers["x-request-id"])
        if _a_worker_saw_a_target_twice_running(gateway, ids, [r.json()["model"] for r in chats(fake)]):
            break
    else:
        raise AssertionError("no worker's turns were interleaved with another's: the test means nothing yet")
    models = [r.json()["model"] for r in chats(fake)]
    assert all(a != b for a, b in zip(models, models[1:], strict=False)), models  # the gateway's turns alternate


def _a_worker_saw_a_target_twice_running(gateway, ids: list[str], models: list[str]) -> bool:
    """Whether one worker's own requests (in order) went to one target twice running: another
    worker took a turn between them, which turns of its own would not have done."""
    worker_of = wait_until(
        lambda: found if len(found := _workers_of(gateway)) >= len(ids) else None, what="every request's access line"
    )
    by_worker: dict[int, list[str]] = {}
    for request_id, model in zip(ids, models, strict=True):
        by_worker.setdefault(worker_of[request_id], []).append(model)
    return any(a == b for seen in by_worker.values() for a, b in zip(seen, seen[1:], strict=False))


def _workers_of(gateway) -> dict[str, int]:
    return {r["request_id"]: r["worker"] for r in gateway.log_records() if r.get("msg") == "request"}


def test_a_health_check_and_a_listing_run_once_per_interval_for_the_gateway(fake, start_gateway):
    import time

    asked: dict[str, list[float]] = {"health": [], "listing": []}

    def script(request: FakeRequest) -> Reply:
        if request.path == "/health":
            asked["health"].append(time.monotonic())
            return json_reply(500, {"error": {"message": "still down"}})
        if request.method == "GET" and request.path.endswith("/models"):
            asked["listing"].append(time.monotonic())
        if request.path.endswith("/chat/completions"):
            return failing(request)
        return well_behaved()(request)

    fake.script = script
    gateway = start_gateway(
        {"providers": {"p": provider(fake, listing=True, health_path="/health")}, **ONE_TARGET},
        TINYGW_WORKERS=str(WORKERS),
        PROVIDER_BREAKER_FAILURES="1",
        PROVIDER_BREAKER_OPEN_SECONDS="300",
        PROVIDER_RETRY_FAST_FAILURES="false",
        PROVIDER_HEALTH_CHECK_SECONDS="0.5",
        PROVIDER_LISTING_SECONDS="0.5",
    )
    wait_until(lambda: len(worker_pids(gateway)) == WORKERS, seconds=20, what="every worker")
    assert call("POST", f"{gateway.url}{CHAT}", REQUEST)[0] == 502  # opens the circuit: health checks begin
    wait_until(lambda: len(asked["health"]) >= 5 and len(asked["listing"]) >= 5, seconds=10, what="five rounds")
    for kind in ("health", "listing"):
        times = asked[kind][:5]
        gaps = [later - earlier for earlier, later in zip(times, times[1:], strict=False)]
        assert min(gaps) > 0.25, (kind, gaps)  # per-worker loops: four at each interval
