"""`.venv/bin/python bench/sealed_bodies.py`: what a 10 MiB request body costs a tinygw worker's
loop, plain against sealed (EHBP) in the smallest frames the gateway accepts, and in Tinfoil's
64 KiB frames (docs/confidential.md).

A sealed body may hold at most ceil(its bytes / 1 KiB) + 4 frames, so the smallest frames of a
10 MiB body are ~1 KiB each (4 bytes of length, 1,004 of plaintext, 16 of tag): over 10,000
AES-GCM opens, in a thread (the body is over 64 KiB), against 159 in 64 KiB frames. One tinygw
worker (TINYGW_EHBP=on, receipts off) in front of the instant upstream, which answers each body
with the same small chat.completion. Every body is one chat request, its message padded so that
BODY_BYTES go on the wire (under TINYGW_MAX_BODY_BYTES). Per kind, `--rounds` rounds of:

- the body alone: the CPU it costs the worker's loop thread (the process's main thread, where
  Granian runs the asyncio loop) and its other threads (Granian's own, asyncio's executor), from
  /proc/PID/task/*/schedstat, ns;
- the body beside a probe client that sends small plain requests one after the other on a
  connection of its own: what the probes that started while the body was in the gateway waited
  beyond their median without it, summed (the loop's hold, as the worker's other requests see
  it), and the longest of them.

Medians of the rounds; then each sealed kind as a factor of plain, and a `goal:` line: the
smallest frames cost the loop at most twice a plain body, by both measures, MET or NOT MET.
Loopback only; bounded (under a minute with the defaults).

    .venv/bin/python bench/sealed_bodies.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import http.client
import statistics
import struct
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: its library
from lib import BODY, HOST, PATH, descendants, log, machine, start_gateway, start_upstream  # noqa: E402

BODY_BYTES = 10 * 2**20 - 64 * 1024  # what goes on the wire, for every kind
FRAME_OVERHEAD = 4 + 16  # a frame's length prefix and AES-GCM tag
SMALLEST_FRAME = 1024  # tinygw.trust.ehbp.FRAME_BYTES_PER_FRAME: one frame a KiB, at most
TINFOIL_FRAME = 64 * 1024 + FRAME_OVERHEAD  # as Tinfoil's clients frame: 64 KiB of plaintext each
PROBES_WITHOUT = 200
SMALLEST = "sealed, 1 KiB frames (the smallest)"
GOAL_FACTOR = 2.0  # docs/confidential.md: the smallest frames cost the loop at most twice a plain body


def chat_request(size: int) -> bytes:
    """A chat request of exactly `size` bytes: its one message padded."""
    head, tail = b'{"model":"bench","messages":[{"role":"user","content":"', b'"}]}'
    return head + b"a" * (size - len(head) - len(tail)) + tail


def sealed(key_config: bytes, frame_bytes: int) -> tuple[dict[str, str], bytes]:
    """(headers, body): BODY_BYTES or a little less on the wire, sealed to the gateway's key in
    frames of `frame_bytes` on the wire (pyhpke's sender: Tinfoil's client always writes 64 KiB)."""
    from pyhpke import AEADId, CipherSuite, KDFId, KEMId

    suite = CipherSuite.new(KEMId.DHKEM_X25519_HKDF_SHA256, KDFId.HKDF_SHA256, AEADId.AES256_GCM)
    public = suite.kem.deserialize_public_key(key_config[3:35])  # RFC 9458 key_config: id, kem, then the key
    enc, sender = suite.create_sender_context(public, info=b"ehbp request")
    piece = frame_bytes - FRAME_OVERHEAD
    text = chat_request(BODY_BYTES // frame_bytes * piece)
    frames = []
    for at in range(0, len(text), piece):
        ciphertext = sender.seal(text[at : at + piece], b"")
        frames.append(struct.pack(">I", len(ciphertext)) + ciphertext)
    return {"Ehbp-Encapsulated-Key": enc.hex()}, b"".join(frames)


def send(port: int, headers: dict[str, str], body: bytes) -> int:
    conn = http.client.HTTPConnection(HOST, port, timeout=60)
    try:
        conn.request("POST", PATH, body, {"content-type": "application/json", **headers})
        answer = conn.getresponse()
        answer.read()
        return answer.status
    finally:
        conn.close()


def cpu_ns(pids: list[int]) -> tuple[int, int]:
    """(the main threads' CPU, every other thread's), ns, over `pids`."""
    main = other = 0
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                ns = int((task / "schedstat").read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue
            if int(task.name) == pid:
                main += ns
            else:
                other += ns
    return main, other


def alone(port: int, pids: list[int], headers: dict[str, str], body: bytes) -> tuple[float, float]:
    """(loop thread ms, other threads ms) for one body."""
    before = cpu_ns(pids)
    status = send(port, headers, body)
    after = cpu_ns(pids)
    if status != 200:
        raise RuntimeError(f"the body was answered {status}")
    return (after[0] - before[0]) / 1e6, (after[1] - before[1]) / 1e6


def beside_probes(port: int, headers: dict[str, str], body: bytes, baseline: float) -> tuple[float, float]:
    """(ms the probes waited beyond `baseline` while the body was in the gateway, the longest probe ms)."""
    probe = http.client.HTTPConnection(HOST, port, timeout=30)
    window: dict[str, float] = {}

    def big() -> None:
        window["start"] = time.perf_counter()
        window["status"] = send(port, headers, body)
        window["end"] = time.perf_counter()

    thread = threading.Thread(target=big)
    samples = []
    thread.start()
    while thread.is_alive():
        started = time.perf_counter()
        probe_once(probe)
        samples.append((started, time.perf_counter() - started))
    thread.join()
    probe.close()
    if window.get("status") != 200:
        raise RuntimeError(f"the body was answered {window.get('status')}")
    inside = [s for at, s in samples if window["start"] <= at <= window["end"]]
    return sum(max(0.0, s - baseline) for s in inside) * 1000, max(inside, default=0.0) * 1000


def probe_once(conn: http.client.HTTPConnection) -> None:
    conn.request("POST", PATH, BODY, {"content-type": "application/json"})
    answer = conn.getresponse()
    answer.read()
    if answer.status != 200:
        raise RuntimeError(f"a probe was answered {answer.status}")


def probe_median(port: int) -> float:
    conn = http.client.HTTPConnection(HOST, port, timeout=30)
    latencies = []
    for _ in range(PROBES_WITHOUT):
        started = time.perf_counter()
        probe_once(conn)
        latencies.append(time.perf_counter() - started)
    conn.close()
    return statistics.median(latencies)


def frame_count(kind: tuple[dict[str, str], bytes]) -> int:
    headers, body = kind
    if not headers:
        return 0
    count, at = 0, 0
    while at < len(body):
        at += 4 + struct.unpack_from(">I", body, at)[0]
        count += 1
    return count


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5, help="rounds of each kind; medians (default 5)")
    args = ap.parse_args(argv)
    if not 1 <= args.rounds <= 50:
        ap.error("--rounds: 1 to 50")
    print(f"machine: {machine()}")
    upstream, up_port = start_upstream()
    gateway, port = start_gateway(up_port, extra_env={"TINYGW_EHBP": "on"})
    try:
        with urllib.request.urlopen(f"http://{HOST}:{port}/.well-known/hpke-keys", timeout=10) as r:
            key_config = r.read()
        kinds = {"plain": ({}, chat_request(BODY_BYTES))}
        kinds["sealed, 64 KiB frames"] = sealed(key_config, TINFOIL_FRAME)
        kinds[SMALLEST] = sealed(key_config, SMALLEST_FRAME)
        pids = [gateway.pid, *descendants(gateway.pid)]
        for headers, body in kinds.values():  # warm-up: one of each
            send(port, headers, body)
        baseline = probe_median(port)
        rows: dict[str, list[tuple[float, float, float, float]]] = {kind: [] for kind in kinds}
        for r in range(args.rounds):
            for kind, (headers, body) in kinds.items():
                rows[kind].append((*alone(port, pids, headers, body), *beside_probes(port, headers, body, baseline)))
            log(f"sealed_bodies: round {r + 1}/{args.rounds}")
    finally:
        gateway.stop()
        upstream.stop()
        gateway.cleanup_files()
        upstream.cleanup_files()
    print(
        f"method:  one worker, EHBP on; {BODY_BYTES:,} bytes on the wire a body; {args.rounds} rounds; probe "
        f"median without a body {baseline * 1000:.2f} ms"
    )
    print(
        "| body | loop thread CPU (ms) | other threads CPU (ms) | probes' wait beyond median (ms) "
        "| longest probe (ms) |"
    )
    print("| --- | --- | --- | --- | --- |")
    medians = {
        kind: [statistics.median(column) for column in zip(*values, strict=True)] for kind, values in rows.items()
    }
    for kind, (loop, others, waited, longest) in medians.items():
        size = f"{len(kinds[kind][1]):,} bytes, {frame_count(kinds[kind]):,} frames"
        print(f"| {kind} ({size}) | {loop:.1f} | {others:.1f} | {waited:.1f} | {longest:.1f} |")
    plain = medians["plain"]
    factors = {}
    for kind in list(kinds)[1:]:
        loop, _, waited, _ = medians[kind]
        factors[kind] = (loop / plain[0], waited / plain[2] if plain[2] else float("inf"))
        print(f"{kind} / plain: loop thread CPU {factors[kind][0]:.2f}x, probes' wait {factors[kind][1]:.2f}x")
    smallest = factors[SMALLEST]
    print(
        f"goal: a body in the smallest frames costs the worker's loop at most {GOAL_FACTOR:g}x a plain one: "
        f"loop thread CPU {smallest[0]:.2f}x, probes' wait {smallest[1]:.2f}x -> "
        + ("MET" if max(smallest) <= GOAL_FACTOR else "NOT MET")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
