"""Capacity at the defaults (docs/design.md section 17): no request waits silently for a
provider connection. The defaults hold many streams at once; a target whose connections
are all busy is busy, not failing: another target serves, or the client gets 503
`provider_busy` with Retry-After, and the wait is seen in the metrics and the log."""

from __future__ import annotations

import asyncio
import json
import select
import socket
import threading

import pytest

from conftest import call, metric_value, provider, read_request, second_fake, tcp_queues, wait_until
from tinygw.fake.upstream import Reply, openai_stream_events, well_behaved
from tinygw.upstream.pool import default_max_connections
from tinygw.worker import listener

KEY = "gw-key-capacity"
CHAT = "/v1/chat/completions"

backup = second_fake("backup")


@pytest.mark.parametrize(
    "open_files,connections",
    [(20000, 9872), (8448, 4096), (1 << 20, 65536), (1024, 384), (300, 64)],
)
def test_a_providers_default_connections_are_its_half_of_the_open_file_limit(open_files, connections):
    assert default_max_connections(open_files) == connections


def held_streams(gate: threading.Event):
    """A provider whose streams send their first event, then wait for `gate`."""
    events = openai_stream_events("m", ["one", "two"])

    def script(request):
        if (request.json() or {}).get("stream"):
            chunks = [(0, events[0] + events[1]), (gate, b"".join(events[2:]))]
            return Reply(headers=[("content-type", "text/event-stream")], chunks=chunks)
        return well_behaved("fake")(request)

    return script


def open_stream(port: int, model: str, receive_buffer: int | None = None) -> socket.socket:
    """A streamed request sent; `receive_buffer` sets the client's SO_RCVBUF before it
    connects (the window it offers from the start: set later, a larger one was offered)."""
    body = json.dumps({"model": model, "stream": True, "messages": []}).encode()
    s = socket.socket()
    if receive_buffer is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    s.settimeout(10)
    s.connect(("127.0.0.1", port))
    s.sendall(
        b"POST %s HTTP/1.1\r\nhost: x\r\nauthorization: Bearer %s\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (CHAT.encode(), KEY.encode(), len(body), body)
    )
    return s


def chat(gateway, model: str):
    return call("POST", f"{gateway.url}{CHAT}", {"model": model, "messages": []}, {"Authorization": f"Bearer {KEY}"})


def test_at_the_defaults_a_hundred_streams_at_once_all_reach_the_provider(fake, start_gateway):
    """max_connections was 64: stream 65 and later waited silently in the pool until an
    earlier one ended. At the defaults every one of them starts."""
    gate = threading.Event()
    fake.script = held_streams(gate)
    gateway = start_gateway(
        {"providers": {"p": provider(fake)}, "models": {"m": {"targets": ["p:m"]}}}, TINYGW_API_KEYS=KEY
    )
    sockets = []
    try:
        for _ in range(100):
            sockets.append(open_stream(gateway.port, "m"))
        wait_until(lambda: len(fake.requests) == 100, seconds=15, what="every stream to reach the provider")
        assert metric_value(gateway, "tinygw_pool_waiting", provider="p") in (None, 0.0)
        assert '"provider connections exhausted"' not in gateway.logs()
    finally:
        gate.set()
        for s in sockets:
            s.close()


def test_a_target_whose_connections_are_all_busy_is_busy_not_failing(fake, backup, start_gateway):
    gate = threading.Event()
    fake.script = held_streams(gate)
    busy = provider(fake, max_connections=2, pool_timeout_s=0.5)
    config = {
        "providers": {"busy": busy, "b": provider(backup), "patient": provider(fake, max_connections=2)},
        "models": {
            "m": {"targets": ["busy:m"]},
            "with-backup": {"targets": ["busy:m", "b:m"]},
            "patient": {"targets": ["patient:m"]},
        },
    }
    gateway = start_gateway(config, TINYGW_API_KEYS=KEY, PROVIDER_BREAKER_FAILURES="1")
    held = [open_stream(gateway.port, "m") for _ in range(2)]
    try:
        wait_until(lambda: len(fake.requests) == 2, what="two streams to hold both connections")
        status, _, _ = chat(gateway, "with-backup")
        assert status == 200 and len(backup.requests) == 1  # another target served it
        for _ in range(2):
            status, headers, body = chat(gateway, "m")
            error = json.loads(body)["error"]
            assert (status, headers["retry-after"]) == (503, "1")
            assert (error["type"], error["cause"], error["provider"], error["provider_model"]) == (
                "provider_unavailable",
                "provider_busy",
                "busy",
                "m",
            )
        assert metric_value(gateway, "tinygw_circuit_open", provider="busy") == 0  # busy is no failure
        assert metric_value(gateway, "tinygw_pool_wait_seconds_count", provider="busy") == 3
        warnings = [r for r in gateway.log_records() if r.get("msg") == "provider connections exhausted"]
        assert [(w["provider"], w["max_connections"], w["waited"]) for w in warnings] == [("busy", 2, 1)]
    finally:
        gate.set()
        for s in held:
            s.close()


def test_a_request_waiting_for_a_connection_is_seen_waiting_and_served_when_one_frees(fake, start_gateway):
    gate = threading.Event()
    fake.script = held_streams(gate)
    config = {"providers": {"patient": provider(fake, max_connections=1)}, "models": {"m": {"targets": ["patient:m"]}}}
    gateway = start_gateway(config, TINYGW_API_KEYS=KEY)
    held = open_stream(gateway.port, "m")
    answers = []
    try:
        wait_until(lambda: len(fake.requests) == 1, what="the stream to hold the connection")
        waiting = threading.Thread(target=lambda: answers.append(chat(gateway, "m")))
        waiting.start()
        wait_until(lambda: metric_value(gateway, "tinygw_pool_waiting", provider="patient") == 1, what="a waiter")
        gate.set()  # the stream ends: its connection serves the waiting request
        waiting.join(10)
        assert answers and answers[0][0] == 200
        assert metric_value(gateway, "tinygw_pool_waiting", provider="patient") == 0
    finally:
        gate.set()
        held.close()


# ---- what a reader that never reads holds ----------------------------------------------------

# What the gateway may hold of an answer its client does not take (docs/design.md section
# 15.4's bounds): its read and read-ahead (32 KiB), the piece it is sending (48 KiB), the
# server's queue of 4 such pieces and its HTTP writer's 64 KiB: 336 KiB, and some slack.
HELD_PER_STREAM_BYTES = 512 * 1024
# What the kernel may hold unsent for one client (tinygw.worker.listener), and what its
# last write may take past the mark: one segment's buffer of up to 64 KiB.
UNSENT_TO_CLIENT_BYTES = (128 + 64) * 1024


class Pump:
    """A provider that answers one streamed request with events for as long as its
    connection takes them, counting every byte the kernel accepted from it."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.written = 0  # bytes of the answer (head and body) the kernel took
        self.blocked = threading.Event()  # set while a write waits: the connection takes no more
        self.connection: socket.socket | None = None
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        self.connection = conn
        read_request(conn)
        first = openai_stream_events("m", ["x"])[0]
        event = openai_stream_events("m", ["x" * 16000])[1]
        chunk = b"%x\r\n%s\r\n" % (len(event) * 4, event * 4)
        pending = memoryview(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        pending = memoryview(pending.tobytes() + b"%x\r\n%s\r\n" % (len(first), first) + chunk)
        conn.setblocking(False)
        try:
            while True:
                try:
                    sent = conn.send(pending)
                except BlockingIOError:
                    self.blocked.set()
                    select.select([], [conn], [], 0.5)
                    continue
                self.blocked.clear()
                self.written += sent
                pending = pending[sent:] if sent < len(pending) else memoryview(chunk)
        except OSError:  # the gateway closed the connection
            return

    def close(self) -> None:
        if self.connection is not None:
            self.connection.close()
        self.listener.close()


def never_read(start_gateway) -> tuple[int, int]:
    """A stream whose provider sends as fast as it is read and whose client reads nothing,
    once nothing moves: (bytes the gateway holds in its memory, bytes the kernel holds not
    yet sent to the client). What the provider wrote is in the kernel's socket queues (its,
    the gateway's both ways, the client's) or in the gateway's memory."""
    pump = Pump()
    config = {"providers": {"p": {"base_url": f"http://127.0.0.1:{pump.port}/v1", "api": "openai", "listing": False}}}
    gateway = start_gateway({**config, "models": {"m": {"targets": ["p:m"]}}}, TINYGW_API_KEYS=KEY)
    client = open_stream(gateway.port, "m", receive_buffer=4096)
    try:
        wait_until(lambda: pump.connection is not None, what="the stream to reach the provider")
        provider_side = pump.connection.getsockname()[1], pump.connection.getpeername()[1]
        client_side = client.getsockname()[1], gateway.port
        last: list[tuple[int, int]] = []

        def settled() -> tuple[int, int] | None:
            queues = tcp_queues()
            unsent = queues[client_side[::-1]][0]  # the gateway's unsent to the client
            in_kernel = (
                queues[provider_side][0]  # the provider's unsent
                + queues[provider_side[::-1]][1]  # the gateway's unread from the provider
                + unsent
                + queues[client_side][1]  # the client's unread
            )
            last.append((pump.written - in_kernel, unsent))
            if pump.blocked.is_set() and len(last) >= 25 and len(set(last[-25:])) == 1:  # still for 0.5 s
                return last[-1]
            return None

        return wait_until(settled, seconds=20, what="the stream to stop moving")
    finally:
        client.close()
        pump.close()


def test_a_client_that_never_reads_holds_at_most_half_a_mebibyte_of_the_gateways_memory(start_gateway):
    """At most the bound (0.36 MiB measured). It was 4.2 MiB: 256 KiB reads joined into
    pieces of ~700 KiB, which the server queues a few of; then 0.7 MiB, while Granian's
    HTTP writer took 400 KiB."""
    held, _ = never_read(start_gateway)
    assert held <= HELD_PER_STREAM_BYTES, f"{held / 1048576:.1f} MiB held for a client that never reads"


def test_the_kernel_holds_at_most_128_KiB_unsent_to_a_client_that_never_reads(start_gateway):
    """Each byte the kernel holds for the client the gateway has relayed first. It was
    4 MiB: the socket's send buffer grew to its maximum (net.ipv4.tcp_wmem)."""
    _, unsent = never_read(start_gateway)
    assert unsent <= UNSENT_TO_CLIENT_BYTES, f"{unsent / 1024:.0f} KiB queued to a client that never reads"


# ---- the listener search (tinygw.worker.listener), on sockets of this process ---------------


def unsent_mark(sock: socket.socket) -> int:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT)


@pytest.mark.parametrize("by_port", [True, False], ids=["its-port", "port-0"])
def test_the_search_sets_a_listener_and_what_it_accepted_and_nothing_else(by_port):
    """With TINYGW_PORT=0 the port is the one Granian chose: the listener's."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    early = socket.create_connection(("127.0.0.1", port))
    accepted, _ = server.accept()
    elsewhere = socket.create_server(("127.0.0.1", 0))
    outgoing = socket.create_connection(("127.0.0.1", elsewhere.getsockname()[1]))
    try:
        set_on = listener._set_unsent(port if by_port else 0)
        assert set_on == 1 if by_port else set_on >= 2  # port 0: every listener of the process, these two among them
        assert unsent_mark(server) == unsent_mark(accepted) == listener.UNSENT_BYTES
        assert unsent_mark(early) == 0  # the client's end is on another port
        if by_port:
            assert unsent_mark(elsewhere) == unsent_mark(outgoing) == 0
        later = socket.create_connection(("127.0.0.1", port))
        inherited, _ = server.accept()
        assert unsent_mark(inherited) == listener.UNSENT_BYTES
        later.close()
        inherited.close()
    finally:
        for s in (server, early, accepted, elsewhere, outgoing):
            s.close()


def test_a_search_that_finds_no_listener_ends_in_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(listener, "_waits", lambda: [0] * 3)
    unused = socket.socket()
    unused.bind(("127.0.0.1", 0))  # bound, never listening: as Granian's parent leaves one
    try:
        asyncio.run(listener.bound_unsent(unused.getsockname()[1], workers=1))
    finally:
        unused.close()
    assert "client send queues unbounded: no listening socket found" in caplog.messages
