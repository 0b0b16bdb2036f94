"""`make bench-overhead`: the latency a gateway adds to one request, measured the way independent
harnesses measure it: sequential requests on loopback, the upstream direct and every gateway
interleaved, several rounds after a warm-up; per round and target the median latency, and per
gateway the median over rounds of (its round median - direct's round median), with the spread
(lowest and highest round).

Targets: the instant upstream direct, nginx (proxy_pass, keep-alive), tinygw at its defaults, tinygw with
EHBP and receipts on (one request sealed by Tinfoil's client, its answers sealed; a `floor:` line says
what its cryptography alone costs a request in a loop in this process, and a `goal:` line whether it adds
at most that floor + 0.1 ms over plain tinygw, MET or NOT MET, with the figures), and the
peers of bench/peers.py (LiteLLM, Portkey, TensorZero; installed on first use). One client, one
keep-alive connection per target, plain chat requests, blocks of --block requests to each target in
turn. Prints a markdown table. Loopback only; bounded in time.

    .venv/bin/python bench/overhead.py [--rounds 7] [--requests 300] [--warmup 200] [--peers litellm,portkey,tensorzero]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import time
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: its library
from lib import (  # noqa: E402
    BODY,
    HOST,
    PATH,
    ROOT,
    Proc,
    ensure_nginx,
    log,
    machine,
    start_gateway,
    start_nginx,
    start_upstream,
)
from peers import DEFAULT_PEERS, PEERS  # noqa: E402


class Connection:
    """One keep-alive HTTP/1.1 connection that sends a fixed request and reads whole answers (content-length
    or chunked), as little Python as can be per request: the same client cost for every target."""

    def __init__(self, port: int, path: str, body: str | bytes, headers: dict[str, str] | None) -> None:
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        raw = body if isinstance(body, bytes) else body.encode()
        self.request = (
            f"POST {path} HTTP/1.1\r\nHost: {HOST}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(raw)}\r\n{extra}\r\n"
        ).encode() + raw
        self.port, self.reconnects = port, -1
        self._connect()

    def _connect(self) -> None:
        self.sock = socket.create_connection((HOST, self.port), timeout=30)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buffer = b""
        self.reconnects += 1

    def roundtrip(self) -> int:
        """One request; its latency in ns (from the send to the answer's last byte). A connection the server
        closed while idle (its keep-alive timeout) is opened again, and the request sent again, timed anew."""
        try:
            return self._roundtrip()
        except (ConnectionError, EOFError):
            self.sock.close()
            self._connect()
            return self._roundtrip()

    def _roundtrip(self) -> int:
        started = time.perf_counter_ns()
        self.sock.sendall(self.request)
        while (end := self.buffer.find(b"\r\n\r\n")) < 0:
            self._recv()
        head = self.buffer[:end].lower()
        if not head.startswith(b"http/1.1 200"):
            raise RuntimeError(f"answered {head[:200]!r}")
        rest = end + 4
        i = head.find(b"\r\ncontent-length:")
        if i >= 0:
            j = head.find(b"\r\n", i + 2)
            total = rest + int(head[i + 17 : j if j >= 0 else len(head)])
            while len(self.buffer) < total:
                self._recv()
        else:  # chunked: the answers here are JSON, so the last chunk's marker cannot occur inside them
            while (total := self.buffer.find(b"\r\n0\r\n\r\n", rest - 2)) < 0:
                self._recv()
            total += 7
        elapsed = time.perf_counter_ns() - started
        self.buffer = self.buffer[total:]
        return elapsed

    def _recv(self) -> None:
        data = self.sock.recv(65536)
        if not data:
            raise EOFError("the connection closed")
        self.buffer += data

    def close(self) -> None:
        self.sock.close()


def start_all(wanted: list[str], procs: list[Proc]) -> dict[str, Connection]:
    """The upstream, nginx, tinygw and the wanted peers; one connection to each (direct first)."""
    upstream, up_port = start_upstream()
    procs.append(upstream)
    targets = {"direct": Connection(up_port, PATH, BODY, None)}
    nginx = ensure_nginx()
    if nginx is not None:
        proc, port = start_nginx(nginx, up_port)
        procs.append(proc)
        targets["nginx"] = Connection(port, PATH, BODY, None)
    proc, port = start_gateway(up_port)
    procs.append(proc)
    targets["tinygw"] = Connection(port, PATH, BODY, None)
    proc, port = start_gateway(up_port, extra_env={"TINYGW_EHBP": "on", "TINYGW_RECEIPTS": "on"})
    procs.append(proc)
    targets[SEALED] = sealed_connection(port)
    for name in wanted:
        peer = PEERS[name]
        info = peer.ensure()
        if info is None:
            continue
        log(f"overhead: starting {name}")
        try:
            proc, port, _ = peer.start(info, up_port)
        except RuntimeError as e:
            print(f"WARNING: {name} did not start; left out: {str(e)[-2000:]}")
            continue
        procs.append(proc)
        targets[name] = Connection(port, peer.path, peer.body(False), peer.headers(up_port))
        print(f"peer:    {info['describe']}")
    return targets


SEALED = "tinygw+ehbp+receipts"
# docs/confidential.md: with EHBP and receipts on, at most this much more than plain tinygw at one client,
# over what the protocol's cryptography alone costs a request (the floor, measured in the same run).
SEALED_OVER_FLOOR_MS = 0.1


def sealed_connection(port: int) -> Connection:
    """A connection that sends one request sealed by Tinfoil's client (tinfoil-ehbp) to the gateway's key,
    the same bytes every time (the gateway opens it anew each time, and seals each answer afresh)."""
    import urllib.request

    from ehbp import ServerIdentity

    with urllib.request.urlopen(f"http://{HOST}:{port}/.well-known/hpke-keys", timeout=10) as r:
        identity = ServerIdentity.unmarshal_public_config(r.read())
    sealed = identity.encrypt_request_body(BODY.encode())
    return Connection(port, PATH, sealed.body, {"Ehbp-Encapsulated-Key": sealed.encapsulated_key.hex()})


FLOOR_ANSWER_BYTES = 300  # about the instant upstream's chat.completion


def floor_us() -> tuple[float, float]:
    """What the sealed line's cryptography alone costs a request, in a loop in this process (the best
    of 5 runs of 2,000, µs): opening the request as the bench seals it (X25519, HPKE's key schedule,
    AES-GCM), the answer's key and its one frame, as tinygw.trust.ehbp does them; and X25519 alone.
    Inside a request, beside the server and the other processes, the same calls take longer."""
    sys.path.insert(0, str(ROOT))  # tinygw, from this tree
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
    from ehbp import ServerIdentity

    from tinygw.trust.ehbp import KeyPair

    key = KeyPair.generate()
    sealed = ServerIdentity.unmarshal_public_config(key.config).encrypt_request_body(BODY.encode())
    enc, body, answer = sealed.encapsulated_key.hex().encode(), sealed.body, b"x" * FLOOR_ANSWER_BYTES

    def one() -> None:
        key.open(enc, body).sealer().seal(answer)

    ours, theirs = X25519PrivateKey.generate(), X25519PrivateKey.generate().public_key()

    def best(call) -> float:
        return min(timeit.repeat(call, number=2000, repeat=5)) / 2000 * 1e6

    return best(one), best(lambda: ours.exchange(theirs))


def print_sealed(results: list[dict]) -> str:
    """The floor line, then the sealed line's cost over plain tinygw (the median of the rounds') judged
    against the floor + SEALED_OVER_FLOOR_MS; returns the goal line."""
    total, x25519 = floor_us()
    print(
        f"floor: the cryptography of {SEALED} alone, in a loop in this process: {total:.0f} µs a request "
        f"(X25519 {x25519:.0f} µs)"
    )
    extra = statistics.median((r[SEALED] - r["tinygw"]) / 1e6 for r in results)
    bound = total / 1000 + SEALED_OVER_FLOOR_MS
    verdict = "MET" if extra <= bound else "NOT MET"
    goal = (
        f"goal: {SEALED} at most its floor + {SEALED_OVER_FLOOR_MS} ms over tinygw at c=1 "
        f"({total / 1000:.3f} + {SEALED_OVER_FLOOR_MS} = +{bound:.3f} ms): +{extra:.3f} ms, {verdict}"
    )
    print(goal)
    return goal


def measure(targets: dict[str, Connection], rounds: int, requests: int, warmup: int, block: int) -> list[dict]:
    """Per round, each target's median latency (ns)."""
    for conn in targets.values():
        for _ in range(warmup):
            conn.roundtrip()
    results = []
    for r in range(rounds):
        samples: dict[str, list[int]] = {name: [] for name in targets}
        names = list(targets)
        names = names[r % len(names) :] + names[: r % len(names)]  # each round starts with another target
        for _ in range(0, requests, block):
            for name in names:
                conn = targets[name]
                samples[name] += [conn.roundtrip() for _ in range(block)]
        results.append({name: statistics.median(s) for name, s in samples.items()})
        log(f"overhead: round {r + 1}/{rounds}: " + ", ".join(f"{n} {m / 1000:.0f} µs" for n, m in results[-1].items()))
    return results


def print_table(results: list[dict], names: list[str]) -> None:
    direct = [r["direct"] for r in results]
    print("| target | latency, median of round medians | added over direct | spread of the added (rounds) |")
    print("| --- | --- | --- | --- |")
    print(f"| direct | {statistics.median(direct) / 1e6:.3f} ms | - | - |")
    for name in names:
        added = sorted((r[name] - r["direct"]) / 1e6 for r in results)
        print(
            f"| {name} | {statistics.median(r[name] for r in results) / 1e6:.3f} ms | "
            f"+{statistics.median(added):.3f} ms | {added[0]:+.3f} to {added[-1]:+.3f} ms |"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7, help="rounds, each with every target (default 7)")
    ap.add_argument("--requests", type=int, default=300, help="requests per target and round (default 300)")
    ap.add_argument("--warmup", type=int, default=200, help="requests per target before the first round (200)")
    ap.add_argument("--block", type=int, default=20, help="requests to one target before the next one's (20)")
    ap.add_argument(
        "--peers",
        default=",".join(DEFAULT_PEERS),
        help=f"peers beside tinygw and nginx, of {', '.join(PEERS)} ('' for none)",
    )
    args = ap.parse_args(argv)
    wanted = [p.strip() for p in args.peers.split(",") if p.strip()]
    if set(wanted) - set(PEERS):
        ap.error(f"--peers: unknown {', '.join(sorted(set(wanted) - set(PEERS)))} (known: {', '.join(PEERS)})")
    if min(args.rounds, args.requests, args.block) < 1 or args.warmup < 0:
        ap.error("--rounds, --requests and --block must be at least 1, --warmup at least 0")
    print(f"machine: {machine()}")
    print(
        f"method:  sequential plain requests on {HOST}, one keep-alive connection per target, blocks of "
        f"{args.block} to each target in turn; {args.warmup} warm-up requests per target, then {args.rounds} rounds "
        f"of {args.requests} per target; tinygw at its defaults (log level info, access log on)",
        flush=True,
    )
    procs: list[Proc] = []
    targets: dict[str, Connection] = {}
    try:
        targets = start_all(wanted, procs)
        results = measure(targets, args.rounds, args.requests, args.warmup, args.block)
        print()
        print_table(results, [n for n in targets if n != "direct"])
        print_sealed(results)
        again = {n: c.reconnects for n, c in targets.items() if c.reconnects}
        if again:
            print(
                "connections the server closed while idle, opened again (the request then timed anew): "
                + ", ".join(f"{n} {k}" for n, k in again.items())
            )
    finally:
        for conn in targets.values():
            conn.close()
        for proc in reversed(procs):
            proc.stop()
            proc.cleanup_files()
    return 0


if __name__ == "__main__":
    sys.exit(main())
