"""SIGTERM drains: no new requests, and in-flight streams get to finish."""

from __future__ import annotations

import json
import signal
import socket
import threading

from conftest import wait_until
from tinygw.fake.upstream import Reply, openai_stream_events


def refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return False
    except OSError:
        return True


def test_sigterm_lets_an_in_flight_stream_finish(fake, start_gateway):
    gate = threading.Event()
    events = openai_stream_events("m", ["one", " two"])
    fake.script = lambda r: Reply(
        headers=[("content-type", "text/event-stream")],
        chunks=[(0, events[0]), (0, events[1]), (gate, events[2]), *[(0, e) for e in events[3:]]],
    )
    gateway = start_gateway(
        {"providers": {"p": {"base_url": f"{fake.url}/v1", "api": "openai"}}, "models": {"m": {"targets": ["p:m"]}}},
        TINYGW_DRAIN_SECONDS="20",
    )
    try:
        client = socket.create_connection(("127.0.0.1", gateway.port), timeout=10)
        body = json.dumps({"model": "m", "stream": True}).encode()
        client.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        received = b""
        while b'"one"' not in received:
            received += client.recv(65536)

        gateway.process.send_signal(signal.SIGTERM)
        wait_until(lambda: refused(gateway.port), seconds=10, what="the gateway to stop accepting connections")
        assert gateway.process.poll() is None  # still draining the stream
        gate.set()
        while b"[DONE]" not in received:
            chunk = client.recv(65536)
            assert chunk, f"the stream ended before [DONE]: {received[-200:]!r}"
            received += chunk
        client.close()
        assert b'" two"' in received
        assert gateway.process.wait(15) == 0
    finally:
        gate.set()


def test_an_answer_that_starts_during_the_drain_says_connection_close(fake, start_gateway):
    """A keep-alive client must learn from the answer itself that the connection ends,
    not from an EOF on its next request."""
    gate = threading.Event()
    answer = json.dumps({"choices": [{"message": {"content": "late"}}]}).encode()
    fake.script = lambda r: Reply(headers=[("content-type", "application/json")], chunks=[(gate, answer)])
    gateway = start_gateway(
        {"providers": {"p": {"base_url": f"{fake.url}/v1", "api": "openai"}}, "models": {"m": {"targets": ["p:m"]}}},
        TINYGW_DRAIN_SECONDS="20",
    )
    try:
        client = socket.create_connection(("127.0.0.1", gateway.port), timeout=10)
        body = json.dumps({"model": "m"}).encode()
        client.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        wait_until(lambda: fake.requests, what="the request to reach the provider")
        gateway.process.send_signal(signal.SIGTERM)
        wait_until(lambda: refused(gateway.port), seconds=10, what="the gateway to stop accepting connections")
        gate.set()
        received = b""
        while chunk := client.recv(65536):
            received += chunk
        client.close()
        head = received.partition(b"\r\n\r\n")[0].lower()
        assert head.startswith(b"http/1.1 200") and b"connection: close" in head
        assert gateway.process.wait(15) == 0
    finally:
        gate.set()
