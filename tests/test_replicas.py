"""Replicas of one service behind a balancer (docs/deploy.md, docs/confidential.md): the EHBP
and receipt keys derived from a shared seed (TINYGW_KEY_SEED_FILE), receipt ids unique across
replicas, and a held answer's whole receipt in its head. Black-box: two gateways behind a
round-robin balancer written here that sends each request to the next replica, as a cloud
load balancer does once it has ended TLS, and Tinfoil's client in the OpenAI SDK."""

from __future__ import annotations

import base64
import hashlib
import json
import socket
import threading

import h11
import httpx
import openai
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from ehbp import EHBPTransport, KeyConfigMismatchError, ServerIdentity

from conftest import LoopbackServer, call, provider, run_tinygw, wait_until
from tinygw import lifecycle
from tinygw.config import sealing
from tinygw.errors import ConfigError
from tinygw.trust import confidential, ehbp, receipts

KEY = "sk-replicas"
SEED = bytes(range(32)) + b"seed-of-the-service"
SEALED = {"TINYGW_EHBP": "on", "TINYGW_RECEIPTS": "on", "TINYGW_API_KEYS": KEY}
REQUESTS = 100


# ---- the seed, in-process ------------------------------------------------------------------


def test_the_seed_gives_each_key_its_own_bytes_the_same_every_time():
    hpke, receipt = confidential.derived(SEED, confidential.HPKE_FILE), confidential.derived(SEED, "receipt.key")
    assert len(hpke) == len(receipt) == 32 and hpke != receipt
    assert confidential.derived(SEED, confidential.HPKE_FILE) == hpke  # a replica given the seed: the same
    assert confidential.derived(SEED[:-1] + b"!", confidential.HPKE_FILE) != hpke
    assert SEED not in (hpke, receipt)
    # each is a key of its algorithm: X25519 and Ed25519 take any 32 bytes
    assert ehbp.KeyPair.from_private_bytes(hpke).config == ehbp.KeyPair.from_private_bytes(hpke).config
    X25519PrivateKey.from_private_bytes(hpke)
    signer = receipts.Signer.from_private_bytes(receipt)
    assert signer.public_key == receipts.Signer.from_private_bytes(receipt).public_key


def test_the_keys_serve_makes_from_one_seed_are_the_same_every_start():
    memory = ["/dev/shm"]  # noqa: S108 -- where serve puts them (a memory file system)
    made = [confidential.make(True, True, memory, SEED) for _ in range(2)]
    try:
        held = [
            confidential.Confidential("on", True, m.directory, None, slot=1, workers=1) for m in made
        ]  # what a worker reads
        assert held[0].hpke.config == held[1].hpke.config and held[0].signer.public_key == held[1].signer.public_key
        random = confidential.make(True, True, memory)
        try:
            other = confidential.Confidential("on", True, random.directory, None, slot=1, workers=1)
            assert other.hpke.config != held[0].hpke.config and other.signer.public_key != held[0].signer.public_key
        finally:
            confidential.remove(random)
            lifecycle.release(random.lock)
    finally:
        for m in made:
            confidential.remove(m)
            lifecycle.release(m.lock)


@pytest.mark.parametrize("content", [b"", b"x" * 31, None])
def test_a_short_or_unreadable_seed_names_the_variable_and_never_a_byte(tmp_path, content):
    path = tmp_path / "seed"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ConfigError) as info:
        sealing.read_key_seed(str(path))
    assert info.value.where == "TINYGW_KEY_SEED_FILE"
    assert sealing.read_key_seed(str(_seed_file(tmp_path))) == SEED


def test_receipt_ids_differ_between_starts_of_the_same_slot():
    first, second = receipts.Ring(None, 1, 8, 1 << 16), receipts.Ring(None, 1, 8, 1 << 16)
    a, b = first.allocate(), second.allocate()
    assert a[:16] == b[:16] and a != b  # slot 1, sequence 0, on two replicas
    assert receipts.parse_id(a) == receipts.parse_id(b) == (1, 0)


# ---- black-box: the start ----------------------------------------------------------------


def _seed_file(tmp_path, content: bytes = SEED):
    path = tmp_path / "key-seed"
    path.write_bytes(content)
    path.chmod(0o400)
    return path


@pytest.mark.parametrize("sealed", [True, False])
@pytest.mark.parametrize("command", ["check", "serve"])
def test_a_short_or_missing_seed_stops_the_start_naming_the_variable(tmp_path, command, sealed):
    env = {"TINYGW_CONFIG": "{}", **(SEALED if sealed else {})}
    short = b"s3cr3t-but-only-31-bytes-long!!"
    for path in (_seed_file(tmp_path, short), tmp_path / "absent"):
        done = run_tinygw([command], {**env, "TINYGW_KEY_SEED_FILE": str(path)}, seconds=30)
        assert done.returncode == 2, done.stdout + done.stderr
        assert "TINYGW_KEY_SEED_FILE" in done.stderr and short.decode() not in done.stdout + done.stderr


def test_an_empty_seed_variable_stops_the_start_rather_than_make_random_keys():
    done = run_tinygw(["check"], {"TINYGW_CONFIG": "{}", "TINYGW_KEY_SEED_FILE": " "})
    assert done.returncode == 2 and "TINYGW_KEY_SEED_FILE: empty" in done.stderr, done.stderr


def test_the_seed_is_not_configuration_and_is_never_shown(tmp_path):
    plain = run_tinygw(["check"], {"TINYGW_CONFIG": "{}"})
    seeded = run_tinygw(["check"], {"TINYGW_CONFIG": "{}", "TINYGW_KEY_SEED_FILE": str(_seed_file(tmp_path))})
    assert seeded.returncode == 0, seeded.stderr
    assert plain.stdout.splitlines()[-1] == seeded.stdout.splitlines()[-1]  # the same config_sha256
    assert str(tmp_path) not in seeded.stdout and SEED.hex() not in seeded.stdout


# ---- black-box: two replicas behind a balancer -------------------------------------------


class RoundRobin(LoopbackServer):
    """An HTTP/1.1 balancer on loopback that sends each request (not each connection) to
    the next backend, on a new connection, and relays the answer as it comes; it keeps the
    client's connection open between requests, as a cloud load balancer does."""

    def __init__(self, ports: list[int]) -> None:
        self.ports, self.sent = ports, [0] * len(ports)
        self._lock = threading.Lock()
        super().__init__()

    def _next(self) -> int:
        with self._lock:
            index = sum(self.sent) % len(self.ports)
            self.sent[index] += 1
            return index

    def connected(self, client: socket.socket) -> None:
        front = h11.Connection(h11.SERVER)
        try:
            while isinstance(request := _pull(front, client), h11.Request):
                with socket.create_connection(("127.0.0.1", self.ports[self._next()]), timeout=10) as upstream:
                    back = h11.Connection(h11.CLIENT)
                    upstream.sendall(back.send(h11.Request(**_relayed(request))))
                    while not isinstance(event := _pull(front, client), h11.EndOfMessage):
                        upstream.sendall(back.send(event))
                    upstream.sendall(back.send(h11.EndOfMessage()))
                    response = _pull(back, upstream)
                    client.sendall(front.send(h11.Response(**_relayed(response))))
                    while not isinstance(event := _pull(back, upstream), h11.EndOfMessage):
                        client.sendall(front.send(event))
                    client.sendall(front.send(h11.EndOfMessage()))
                front.start_next_cycle()
        except (OSError, h11.ProtocolError):
            pass
        finally:
            client.close()


def _relayed(head) -> dict:
    """A request's or an answer's head as the balancer sends it on: hop-by-hop headers dropped."""
    headers = [(n, v) for n, v in head.headers if n not in (b"connection", b"keep-alive")]
    if isinstance(head, h11.Request):
        return {"method": head.method, "target": head.target, "headers": headers}
    return {"status_code": head.status_code, "headers": headers, "reason": head.reason}


def _pull(connection: h11.Connection, sock: socket.socket):
    while (event := connection.next_event()) is h11.NEED_DATA:
        connection.receive_data(sock.recv(65536))
    return event


@pytest.fixture
def replicas(fake, start_gateway, tmp_path):
    """start(seeded) -> (balancer, [replica, replica]): two gateways with EHBP and receipts on,
    given the same seed file when `seeded`."""
    balancers = []

    def start(seeded: bool):
        config = {"providers": {"fake": provider(fake)}, "models": {"m": {"targets": ["fake:m"]}}}
        seed = {"TINYGW_KEY_SEED_FILE": str(_seed_file(tmp_path))} if seeded else {}
        gateways = [start_gateway(config, **SEALED, **seed) for _ in range(2)]
        balancers.append(RoundRobin([g.port for g in gateways]))
        return balancers[-1], gateways

    yield start
    for balancer in balancers:
        balancer.close()


def sdk(balancer: RoundRobin, key_config: bytes) -> openai.OpenAI:
    transport = EHBPTransport(ServerIdentity.unmarshal_public_config(key_config))
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{balancer.port}/v1",
        api_key=KEY,
        max_retries=0,
        timeout=10,
        http_client=httpx.Client(transport=transport),
    )


def ask(client: openai.OpenAI, streamed: bool) -> tuple[str, dict | None]:
    """One sealed request: (its answer's text, the receipt its head carries, if any)."""
    messages = [{"role": "user", "content": "the sealed prompt"}]
    if streamed:
        stream = client.chat.completions.create(model="m", messages=messages, stream=True)
        return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices), None
    raw = client.chat.completions.with_raw_response.create(model="m", messages=messages)
    receipt = json.loads(base64.urlsafe_b64decode(raw.headers["x-tinygw-receipt"]))
    assert receipt["id"] == raw.headers["x-tinygw-receipt-id"]
    return raw.parse().choices[0].message.content, receipt


def test_replicas_given_one_seed_answer_every_sealed_request_and_sign_with_one_key(replicas):
    balancer, gateways = replicas(seeded=True)
    served = [call("GET", f"{g.url}/.well-known/hpke-keys")[2] for g in gateways]
    evidence = [json.loads(call("GET", f"{g.url}/attestation?nonce={'ab' * 32}")[2]) for g in gateways]
    assert served[0] == served[1] and evidence[0]["receipt_public_key"] == evidence[1]["receipt_public_key"]
    client = sdk(balancer, served[0])  # the key configuration of one replica
    answers = [ask(client, streamed=i // 2 % 2 == 1) for i in range(REQUESTS)]  # two held, two streamed, ...
    assert [text for text, _ in answers] == ["Hello from fake."] * REQUESTS
    assert balancer.sent == [REQUESTS // 2, REQUESTS // 2]  # every other request to each replica
    # the receipts of both replicas verify with the one key, and no two share an id
    key = Ed25519PublicKey.from_public_bytes(bytes.fromhex(evidence[0]["receipt_public_key"]))
    held = [receipt for _, receipt in answers if receipt is not None]
    for receipt in held:
        signature = base64.b64decode(receipt.pop("signature"))
        key.verify(signature, receipts.canonical(receipt))  # raises when it does not verify
        assert receipt["status"] == 200 and receipt["client"] == "default"
    assert len({r["id"] for r in held}) == len(held) == REQUESTS // 2
    assert len({r["id"][16:] for r in held}) == 2  # one start's part per replica: both signed some
    # a stream's receipt is fetched by id from the replica that answered
    for gateway in gateways:
        status, headers, _ = call(
            "POST", f"{gateway.url}/v1/chat/completions", {"model": "m", "messages": [], "stream": True},
            {"Authorization": f"Bearer {KEY}"},
        )  # fmt: skip
        assert status == 200 and "x-tinygw-receipt" not in headers
        fetched = call("GET", f"{gateway.url}/v1/receipts/{headers['x-tinygw-receipt-id']}", headers={"x-api-key": KEY})
        assert fetched[0] == 200
        receipt = json.loads(fetched[2])
        key.verify(base64.b64decode(receipt.pop("signature")), receipts.canonical(receipt))
    # the gateway's own answer (no such model) is held too: its head carries its receipt
    status, headers, body = call(
        "POST", f"{gateways[0].url}/v1/chat/completions", {"model": "nope", "messages": []},
        {"Authorization": f"Bearer {KEY}"},
    )  # fmt: skip
    receipt = json.loads(base64.urlsafe_b64decode(headers["x-tinygw-receipt"]))
    assert status == 404 and receipt["status"] == 404 and receipt["model"] == "nope"
    assert receipt["response_sha256"] == hashlib.sha256(body).hexdigest()
    key.verify(base64.b64decode(receipt.pop("signature")), receipts.canonical(receipt))
    assert SEED.hex() not in "".join(g.logs() for g in gateways)


def test_without_the_seed_the_other_replica_refuses_what_was_sealed_to_the_first(replicas):
    balancer, gateways = replicas(seeded=False)
    served = [call("GET", f"{g.url}/.well-known/hpke-keys")[2] for g in gateways]
    assert served[0] != served[1]
    client = sdk(balancer, served[0])
    refused = 0
    for i in range(10):
        try:
            ask(client, streamed=i // 2 % 2 == 1)
        except KeyConfigMismatchError:  # Tinfoil's client on the 422 `key-config` problem
            refused += 1
    assert refused == 5 and balancer.sent == [5, 5]


# ---- attest/verify of several replicas -----------------------------------------------------


@pytest.fixture(scope="module")
def three_on_fake_tdx(tmp_path_factory):
    """(release.json, [url, url, url]): three replicas of one artifact, each launched on a fake
    TDX platform of its own with EHBP and receipts on; the first two given one key seed, the
    third none."""
    from test_attest import FakeTdx, launched_gateway, make_artifact, write_release

    from tinygw.fake.upstream import FakeUpstream

    root = tmp_path_factory.mktemp("replicas")
    artifact = make_artifact(root / "dist")
    release = write_release(artifact, root / "release.json")
    seed = _seed_file(root)
    upstream = FakeUpstream().start_in_thread()
    platforms, gateways = [], []
    try:
        for number, seeded in enumerate((True, True, False)):
            tdx = FakeTdx(root / f"tdx-{number}")
            platforms.append(tdx)
            env = {**tdx.env(), "TINYGW_EVENT_LOG": str(root / f"run-{number}" / "event-log.jsonl"), **SEALED}
            env |= {"TINYGW_KEY_SEED_FILE": str(seed)} if seeded else {}
            gateways.append(launched_gateway(artifact, upstream.url, env, root / f"gateway-{number}.log"))
            wait_until(lambda tdx=tdx: tdx.rtmr3.hex() == release["measurement"]["expected_rtmr3"], what="measured")
        yield root / "release.json", [g.url for g in gateways]
    finally:
        for gateway in gateways:
            gateway.stop()
        for tdx in platforms:
            tdx.stop()
        upstream.stop_thread()


def test_verify_of_replicas_given_one_seed_passes_and_saves_their_one_key(three_on_fake_tdx, tmp_path):
    from test_attest import verify_signed

    release, urls = three_on_fake_tdx
    saved = tmp_path / "service.hpke"
    code, verdicts, output = verify_signed(release, urls[0], "--url", urls[1], "--save-hpke", str(saved))
    assert code == 0 and verdicts["hpke key shared"] == verdicts["receipt key shared"] == "PASS", output
    assert f"replica 1 of 2: {urls[0]}" in output and f"replica 2 of 2: {urls[1]}" in output
    assert output.count("PASS report_data") == 2  # each replica verified on its own
    assert saved.read_bytes() == call("GET", f"{urls[1]}/.well-known/hpke-keys")[2]


def test_verify_fails_naming_the_replica_that_binds_another_key_and_saves_nothing(three_on_fake_tdx, tmp_path):
    from test_attest import verify_signed

    release, urls = three_on_fake_tdx
    saved = tmp_path / "service.hpke"
    code, verdicts, output = verify_signed(
        release, urls[0], "--url", urls[1], "--url", urls[2], "--save-hpke", str(saved)
    )
    assert code == 1 and verdicts["hpke key shared"] == verdicts["receipt key shared"] == "FAIL", output
    assert f"FAIL hpke key shared: {urls[2]} binds another HPKE key configuration than {urls[0]}" in output
    assert f"FAIL receipt key shared: {urls[2]} binds another receipt key" in output
    assert output.count("PASS report_data") == 3  # the third is genuine: only the comparison fails
    assert not saved.exists() and "not writing the HPKE key" in output


def test_verify_refuses_what_one_url_alone_means_with_several(three_on_fake_tdx, tmp_path):
    from test_attest import verify

    release, urls = three_on_fake_tdx
    for extra in (["--save-cert", str(tmp_path / "c.pem")], ["--learn-policy", str(tmp_path / "p.json")]):
        code, _, output = verify("--release", str(release), "--url", urls[0], "--url", urls[1], *extra)
        assert code == 2 and "take one --url" in output, output
    code, _, output = verify("--release", str(release), "--url", urls[0], "--url", urls[0])
    assert code == 2 and "given twice" in output
