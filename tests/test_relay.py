"""The stream relay: its event splitting piece by piece, and (black-box) its CPU cost,
which must grow with a stream's bytes, not with the number of pieces they come in."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import tracemalloc

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from conftest import provider, wait_until
from tinygw.config.settings import Target
from tinygw.fake.upstream import Reply
from tinygw.protocol import sse
from tinygw.trust.redact import Redactor
from tinygw.worker.record import Record
from tinygw.worker.relay import MAX_HELD_EVENTS, Relay

CHAT = "/v1/chat/completions"
MiB = 1024 * 1024
PIECE_BYTES = 100
# CPU time is counted in ticks of 10 ms: a cost below this floor is taken as the floor.
FLOOR_SECONDS = 0.05


def _event(content: str, finish: str | None = None) -> bytes:
    chunk = {
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": finish}],
    }
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def _stream(large: list[bytes], first_output: bool) -> list[bytes]:
    """A stream whose output is `large`: after a first output (the relay is then
    passing bytes on) or first (it is then held)."""
    return [*([_event("Hi")] if first_output else []), *large, _event("", "stop"), b"data: [DONE]\n\n"]


def _worker_cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rpartition(b")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _relay_cpu(gateway, fake, events: list[bytes], pid: int, burst: int | None = None, pause: float = 0.0) -> float:
    """The worker's CPU seconds for one streamed request: each event in one write, or
    (with `burst`) the stream in PIECE_BYTES-byte writes, `pause` seconds after every
    `burst` of them."""
    if burst is None:
        chunks = [(0, e) for e in events]
    else:
        data = b"".join(events)
        pieces = [data[i : i + PIECE_BYTES] for i in range(0, len(data), PIECE_BYTES)]
        chunks = [(pause if i % burst == 0 else 0, piece) for i, piece in enumerate(pieces)]
    fake.script = lambda request: Reply(headers=[("content-type", "text/event-stream")], chunks=chunks)
    before = _worker_cpu_seconds(pid)
    connection = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=120)
    connection.request("POST", CHAT, json.dumps({"model": "m", "stream": True}), {"content-type": "application/json"})
    response = connection.getresponse()
    body = response.read()
    connection.close()
    assert response.status == 200 and body.endswith(b"data: [DONE]\n\n"), body[-200:]
    assert body == b"".join(events)
    return _worker_cpu_seconds(pid) - before


@pytest.fixture
def relay(fake, start_gateway):
    """(gateway, its worker's pid)."""
    gateway = start_gateway(
        {
            "providers": {"p": provider(fake)},
            "models": {"m": {"targets": ["p:x"]}},
        }
    )
    [pid] = wait_until(
        lambda: [r["pid"] for r in gateway.log_records() if r.get("msg") == "worker started"], what="the worker's pid"
    )
    return gateway, pid


LARGE = _event("x" * (MiB - 200))  # held whole when it comes first: under the relay's 1 MiB bound
SMALL = _event("x" * 900)


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads a worker's CPU time from /proc")
@pytest.mark.parametrize("first_output", [False, True], ids=["held", "relayed"])
def test_a_large_event_in_small_pieces_costs_what_small_events_cost_in_the_same_pieces(fake, relay, first_output):
    """A provider sending one 1 MiB event in 100-byte pieces (ten writes at a time: the
    worker reads between one and ten thousand times) must not make the worker rescan
    what it holds on every read. Its CPU is compared with the same bytes, in the same
    pieces, as 1 KiB events: what the worker pays per read is then about the same in
    both (the large event costs 0.7-1.2 times the small ones here), and a rescan of what
    is held on each read (simulated by looking for an event end in all of it) costs 5
    times more. Each is measured twice, alternately, and the least taken: how many reads
    a write pattern makes depends on the machine's load at that moment."""
    gateway, pid = relay
    streams = {
        "small": _stream([SMALL] * (len(LARGE) // len(SMALL)), first_output),
        "large": _stream([LARGE], first_output),
    }
    _relay_cpu(gateway, fake, streams["large"], pid)  # warm up
    costs: dict[str, float] = {"small": 1e9, "large": 1e9}
    for _ in range(2):
        for name, events in streams.items():
            costs[name] = min(costs[name], _relay_cpu(gateway, fake, events, pid, burst=10, pause=0.0001))
    assert costs["large"] <= 3 * max(costs["small"], FLOOR_SECONDS), costs


_PIECES = [b"data: x", b'data: {"a": 1}', b"\n", b"\r", b"\r\n", b"\n\n", b"\r\r", b"\r\n\r\n", b"event: e", b":", b"y"]
_streams = st.lists(st.sampled_from(_PIECES), max_size=30).map(b"".join)


@given(stream=_streams, data=st.data())
@example(b"a\r\n\r\nb\r\n\r", None)
@example(b"\n\n\n", None)
def test_events_fed_piece_by_piece_are_split_of_the_whole(stream, data):
    """sse.Pending, fed the stream in any pieces, returns the events `sse.split` finds
    in the whole, and holds its rest."""
    cuts = sorted(data.draw(st.sets(st.integers(0, len(stream)), max_size=12))) if data else list(range(len(stream)))
    pending, got = sse.Pending(), []
    for start, end in zip([0, *cuts], [*cuts, len(stream)], strict=True):
        block = pending.feed(stream[start:end])
        assert sse.split(block)[1] == b""
        got += sse.split(block)[0]
        assert pending.size == len(pending.peek())
    assert (got, pending.take()) == sse.split(stream)
    assert pending.size == 0 and pending.take() == b""


def test_events_fed_a_byte_at_a_time_are_split_of_the_whole():
    """Past 16 pieces, sse.Pending gathers the rest in one buffer: what it returns and
    holds is still what `split` of the whole says."""
    stream = b"data: " + b"x" * 100 + b"\r\n\r\n: ping\n\n" + b"event: e\ndata: {}\r\r" + b"y" * 50
    pending, got = sse.Pending(), []
    for i in range(len(stream)):
        got += sse.split(pending.feed(stream[i : i + 1]))[0]
    assert pending.size == 50 == len(pending.peek())
    assert (got, pending.take()) == sse.split(stream)


def _answer_cpu(gateway, fake, head: bytes, rest: bytes, pid: int) -> float:
    """The worker's CPU seconds for one plain request whose answer is `head`, then `rest`
    in PIECE_BYTES // 10-byte writes, a pause after every two (a read each, mostly)."""
    step = PIECE_BYTES // 10
    pieces = [(0.0001 if i % (2 * step) == 0 else 0, rest[i : i + step]) for i in range(0, len(rest), step)]
    fake.script = lambda request: Reply(action="raw", body=head, chunks=pieces)
    before = _worker_cpu_seconds(pid)
    connection = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=120)
    connection.request("POST", CHAT, json.dumps({"model": "m"}), {"content-type": "application/json"})
    response = connection.getresponse()
    body = response.read()
    connection.close()
    assert response.status == 200 and body.startswith(b"{") and body.endswith(b"}"), body[-200:]
    return _worker_cpu_seconds(pid) - before


def test_a_long_chunk_size_line_in_small_pieces_costs_what_chunk_data_costs_in_the_same_pieces(fake, relay):
    """A provider trickling a 60,000-byte chunk-size line (a valid chunk extension) ten
    bytes a write must not make the worker search all of the line held so far on every
    read (before: 0.59 s of CPU for this one answer, 4.5 times the data's). Its CPU is
    compared with the same number of bytes, in the same pieces, as chunk data (1.2 times
    it here); each measured twice, alternately, the least taken."""
    gateway, pid = relay
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
    answers = {
        "long line": b"2;" + b"x" * 60_000 + b"\r\n{}\r\n0\r\n\r\n",
        "data": b"%x\r\n{%s}\r\n0\r\n\r\n" % (60_002, b" " * 60_000),
    }
    _answer_cpu(gateway, fake, head, answers["data"], pid)  # warm up
    costs: dict[str, float] = {"long line": 1e9, "data": 1e9}
    for _ in range(2):
        for name, rest in answers.items():
            costs[name] = min(costs[name], _answer_cpu(gateway, fake, head, rest, pid))
    assert costs["long line"] <= 3 * max(costs["data"], FLOOR_SECONDS), costs


# ---- held leading events: bounded in count and in memory ---------------------------------

PING = b": ping\n\n"


class _Answer:
    """A streamed answer's pieces, as tinygw.upstream.pool.Response gives them; `gate`,
    called before each piece, may look at what was sent meanwhile."""

    headers = [(b"content-type", b"text/event-stream")]

    def __init__(self, pieces: list[bytes], gate=lambda: None) -> None:
        self._pieces = iter(pieces)
        self._gate = gate

    async def next_chunk(self) -> bytes | None:
        self._gate()
        return next(self._pieces, None)


def _relayed(pieces: list[bytes], gate=lambda sent: None) -> tuple[str, list[dict]]:
    """Relay a stream of `pieces` in this process: the attempt's label and what was sent."""
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def run() -> str:
        loop = asyncio.get_running_loop()
        answer = _Answer(pieces, lambda: gate(sent))
        redactor = Redactor((), lambda places: None)
        attempt = await Relay(answer, send, Record(b"id", 0.0), Target("p", "x"), loop, redactor).run()  # type: ignore[arg-type]
        return attempt.judged.label

    return asyncio.run(run()), sent


def _body(sent: list[dict]) -> bytes:
    return b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def test_a_stream_s_held_leading_events_are_sent_on_past_4096_of_them():
    """4,097 tiny events without output (30 KiB, far under the byte bound) commit the
    stream: they go out before the provider sends anything more."""
    events = [PING * MAX_HELD_EVENTS, PING]
    stream = [*events, _event("Hi", "stop"), b"data: [DONE]\n\n"]
    at_gate = []
    label, sent = _relayed(stream, lambda sent: at_gate.append(len(sent)))
    assert label == "200" and _body(sent) == b"".join(stream)
    assert at_gate[:3] == [0, 0, 2]  # after the 4,097th event: the head and the held events were sent


def test_a_stream_s_held_leading_events_cost_at_most_2_mib_however_small_they_are():
    """1 MiB of SSE comments (`: ping`, 8 bytes each) before output, in 64 KiB reads: the
    relay holds them in at most 2 MiB (before: an object per event, 18 MiB, and 0.3 s of
    CPU per stream)."""
    data = PING * (MiB // len(PING))
    stream = [data[i : i + 65536] for i in range(0, len(data), 65536)] + [_event("Hi", "stop"), b"data: [DONE]\n\n"]
    del data
    label, sent, peak = _relayed_with_peak(stream)
    assert label == "200" and _body(sent) == b"".join(stream)
    assert peak < 2 * MiB, f"{peak / MiB:.1f} MiB"


def test_an_endless_event_sent_a_few_bytes_at_a_time_is_held_in_about_its_size():
    """A comment without end, 1 MiB in 16-byte reads, is looked at as an event at the
    byte bound: its pieces are held in one buffer, not as 65,536 objects (7 MiB)."""
    data = b": " + b"p" * MiB
    stream = [data[i : i + 16] for i in range(0, len(data), 16)] + [b"\n\n", _event("Hi", "stop"), b"data: [DONE]\n\n"]
    label, sent, peak = _relayed_with_peak(stream)
    assert label == "200" and _body(sent) == b"".join(stream)
    assert peak < 2.5 * MiB, f"{peak / MiB:.1f} MiB"


def _relayed_with_peak(stream: list[bytes]) -> tuple[str, list, int]:
    """_relayed, and the most memory Python held meanwhile (tracemalloc's peak)."""
    tracemalloc.start()
    try:
        label, sent = _relayed(stream)
        return label, sent, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
