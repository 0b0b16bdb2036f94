"""EHBP and signed receipts (docs/confidential.md), black-box: a gateway launched on the fake
TDX platform with both on and 2 workers, Tinfoil's own Python client (`tinfoil-ehbp`) in the
OpenAI SDK with the key configuration that attest/verify saved from a verified /attestation,
a recording relay on loopback where the prompt must never show, and attest/verify receipt on
a receipt fetched after a streamed answer."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from ehbp import EHBPTransport, KeyConfigMismatchError, ServerIdentity
from pyhpke import AEADId, CipherSuite, KDFId, KEMId
from test_attest import SIMULATED_SIGNATURE, two_workers_on_fake_tdx, verify

from conftest import LoopbackServer, call, provider, wait_until

KEYS = ("sk-client-one", "sk-client-two")
PROMPT = "the secret prompt 7f3a9c"


@pytest.fixture(scope="module")
def sealed(tmp_path_factory):
    """(gateway, release.json, its directory): EHBP and receipts on, 2 workers, two clients
    (`default` with KEYS[0], `other` with KEYS[1])."""
    root = tmp_path_factory.mktemp("ehbp")
    env = {"TINYGW_EHBP": "on", "TINYGW_RECEIPTS": "on", "TINYGW_API_KEYS": KEYS[0], "OTHER_KEYS": KEYS[1]}
    with two_workers_on_fake_tdx(root, env, clients={"other": {"keys_env": "OTHER_KEYS"}}) as (gateway, _, upstream):
        yield gateway, root / "release.json", root, upstream


@pytest.fixture(scope="module")
def verified(sealed):
    """attest/verify's saved key configuration and attestation, every check PASSed (the
    signature by the SIMULATED check)."""
    gateway, release, root, _ = sealed
    hpke, evidence = root / "gateway.hpke", root / "evidence.json"
    code, verdicts, output = verify(
        "--release", str(release), "--url", gateway.url, "--platform-verifier", SIMULATED_SIGNATURE,
        "--save-hpke", str(hpke), "--save-attestation", str(evidence),
    )  # fmt: skip
    assert code == 0 and set(verdicts.values()) == {"PASS"}, output
    assert verdicts["hpke key bound"] == verdicts["receipt key bound"] == "PASS", output
    return hpke.read_bytes(), evidence


def sdk(gateway, key_config: bytes, api_key: str = KEYS[0], url: str | None = None) -> openai.OpenAI:
    """The OpenAI SDK with Tinfoil's transport, sealing to `key_config` (docs/confidential.md's recipe)."""
    transport = EHBPTransport(ServerIdentity.unmarshal_public_config(key_config))
    return openai.OpenAI(
        base_url=f"{url or gateway.url}/v1",
        api_key=api_key,
        max_retries=0,
        timeout=10,
        http_client=httpx.Client(transport=transport),
    )


def ask(content: str = PROMPT) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": content}]}


# ---- the key, verified --------------------------------------------------------------------


def test_verify_binds_both_keys_and_saves_the_hpke_key_only_after_every_check(sealed, verified, tmp_path):
    gateway, release, _, _ = sealed
    key_config, _ = verified
    status, headers, served = call("GET", f"{gateway.url}/.well-known/hpke-keys")
    assert status == 200 and headers["content-type"] == "application/ohttp-keys" and served == key_config
    answer = json.loads(call("GET", f"{gateway.url}/attestation?nonce={'ab' * 32}")[2])
    assert base64.b64decode(answer["hpke_key_config"]) == key_config
    assert answer["hpke_key_sha256"] == hashlib.sha256(key_config).hexdigest()
    assert answer["receipt_key_sha256"] == hashlib.sha256(bytes.fromhex(answer["receipt_public_key"])).hexdigest()
    # v3: nonce, config, no TLS key (32 zero bytes), the HPKE key's digest, the receipt key's
    expected = hashlib.sha512(
        b"tinygw.attest.v3"
        + bytes.fromhex("ab" * 32)
        + bytes.fromhex(answer["config_sha256"])
        + bytes(32)
        + bytes.fromhex(answer["hpke_key_sha256"])
        + bytes.fromhex(answer["receipt_key_sha256"])
    )
    assert answer["report_data"] == expected.hexdigest()
    # Unverified (no signature check: a SKIP), nothing is saved.
    saved = tmp_path / "unverified.hpke"
    code, verdicts, output = verify("--release", str(release), "--url", gateway.url, "--save-hpke", str(saved))
    assert code == 4 and not saved.exists() and "not writing the HPKE key" in output, output


def test_a_substituted_key_fails_hpke_key_bound(sealed, tmp_path):
    """A relay that hands out its own key configuration (and its digest) cannot keep report_data."""
    gateway, release, _, _ = sealed
    import sealing  # attest/sealing.py

    answer = json.loads(call("GET", f"{gateway.url}/attestation?nonce={'ab' * 32}")[2])
    other = bytearray(base64.b64decode(answer["hpke_key_config"]))
    other[5] ^= 1
    forged = {**answer, "hpke_key_config": base64.b64encode(bytes(other)).decode()}
    assert sealing.hpke_config(forged)[1] and "does not hash" in sealing.hpke_config(forged)[1]
    forged["hpke_key_sha256"] = hashlib.sha256(bytes(other)).hexdigest()
    assert sealing.hpke_config(forged)[1] is None  # consistent in itself: report_data is what catches it
    digests = sealing.bound_digests(forged)
    assert (
        sealing.report_data_v3(bytes.fromhex("ab" * 32), answer["config_sha256"], None, digests).hex()
        != (answer["report_data"])
    )


# ---- Tinfoil's client through the OpenAI SDK ------------------------------------------------


def test_a_sealed_prompt_through_the_openai_sdk_plain_and_streamed(sealed, verified):
    gateway, _, _, upstream = sealed
    key_config, _ = verified
    client = sdk(gateway, key_config)
    raw = client.chat.completions.with_raw_response.create(**ask())
    assert raw.headers.get("ehbp-response-nonce") and raw.headers.get("x-tinygw-receipt-id")
    assert raw.parse().choices[0].message.content == "Hello from fake."
    assert upstream.requests[-1].json()["messages"][0]["content"] == PROMPT  # opened before routing
    assert "ehbp-encapsulated-key" not in upstream.requests[-1].headers  # the gateway's own: never forwarded
    stream = client.chat.completions.create(**ask(), stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == "Hello from fake."
    # a plain client still works with EHBP `on`, and gets a plain answer
    status, headers, _ = call(
        "POST", f"{gateway.url}/v1/chat/completions", ask(), {"Authorization": f"Bearer {KEYS[0]}"}
    )
    assert status == 200 and "ehbp-response-nonce" not in headers
    assert PROMPT not in gateway.logs()


def test_the_gateways_own_errors_are_sealed_too(sealed, verified):
    gateway, _, _, _ = sealed
    client = sdk(gateway, verified[0])
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": PROMPT}])
    assert caught.value.response.headers.get("ehbp-response-nonce")  # decrypted by the transport
    assert "no-such-model" in caught.value.response.text


class RecordingRelay(LoopbackServer):
    """A plain TCP relay on loopback (a load balancer that ends TLS before the gateway) that
    keeps every byte it carries, both ways."""

    def __init__(self, port: int) -> None:
        self.port_to = port
        self.seen = bytearray()
        super().__init__()

    def connected(self, client: socket.socket) -> None:
        upstream = socket.create_connection(("127.0.0.1", self.port_to))
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                self.seen += data
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def test_the_bytes_between_client_and_gateway_never_hold_the_prompt(sealed, verified):
    gateway, _, _, _ = sealed
    relay = RecordingRelay(gateway.port)
    try:
        client = sdk(gateway, verified[0], url=f"http://127.0.0.1:{relay.port}")
        assert client.chat.completions.create(**ask()).choices[0].message.content == "Hello from fake."
        stream = client.chat.completions.create(**ask(), stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "Hello from fake."
        seen = bytes(relay.seen)
        assert b"ehbp-encapsulated-key" in seen.lower() and b"ehbp-response-nonce" in seen.lower()
        assert PROMPT.encode() not in seen and b"Hello from" not in seen and b"secret" not in seen
        # the relay does see what is not sealed: the test would catch a plain body
        call("POST", f"http://127.0.0.1:{relay.port}/v1/chat/completions", ask(), {"x-api-key": KEYS[0]})
        wait_until(lambda: PROMPT.encode() in bytes(relay.seen), what="the relay to see a plain prompt")
    finally:
        relay.close()


# ---- the protocol's errors ---------------------------------------------------------------


def sealed_request(key_config: bytes, plaintext: bytes, frame: int) -> tuple[str, bytes]:
    """(Ehbp-Encapsulated-Key, body) of `plaintext` sealed by Tinfoil's client in frames of `frame` bytes."""
    identity = ServerIdentity.unmarshal_public_config(key_config)
    pieces = [plaintext[i : i + frame] for i in range(0, len(plaintext), frame)]
    stream = identity.encrypt_request_stream(pieces)
    frames = b"".join(stream.frames)
    return stream.encapsulated_key.hex(), frames


def post_sealed(gateway, enc: str, body: bytes):
    headers = {"Authorization": f"Bearer {KEYS[0]}", "Ehbp-Encapsulated-Key": enc}
    return call("POST", f"{gateway.url}/v1/chat/completions", body, headers)


def test_a_tampered_frame_is_400_and_the_first_frame_under_another_key_is_422(sealed, verified):
    gateway, _, _, upstream = sealed
    key_config = verified[0]
    plaintext = json.dumps(ask()).encode() + b" " * (70 * 1024)  # two frames of Tinfoil's 64 KiB
    enc, body = sealed_request(key_config, plaintext, 64 * 1024)
    (first,) = struct.unpack(">I", body[:4])
    assert len(body) > first + 8
    before = len(upstream.requests)
    later = bytearray(body)
    later[first + 4 + 10] ^= 1  # a byte of the second frame
    status, headers, answer = post_sealed(gateway, enc, bytes(later))
    assert status == 400 and headers["content-type"] == "application/problem+json", answer
    assert "ehbp-response-nonce" not in headers
    status, headers, answer = post_sealed(gateway, enc, body[:-3])  # a frame cut short: bad framing
    assert status == 400 and headers["content-type"] == "application/problem+json"
    early = bytearray(body)
    early[4 + 10] ^= 1  # a byte of the first frame: sealed to a key configuration not the gateway's
    status, headers, answer = post_sealed(gateway, enc, bytes(early))
    assert status == 422 and headers["content-type"] == "application/problem+json"
    assert json.loads(answer)["type"] == "urn:ietf:params:ehbp:error:key-config"
    assert len(upstream.requests) == before  # nothing that does not open is forwarded
    assert post_sealed(gateway, enc, body)[0] == 200  # and the untouched body opens


def test_a_wrong_key_configuration_is_422_key_config_and_tinfoils_client_says_so(sealed, verified):
    gateway, _, _, _ = sealed
    other = bytearray(verified[0])
    other[3:35] = ServerIdentity.unmarshal_public_config(verified[0]).public_key_bytes()[::-1]  # another key
    with pytest.raises(KeyConfigMismatchError):
        sdk(gateway, bytes(other)).chat.completions.create(**ask())


# ---- a sealed body's frames are bounded ----------------------------------------------------

HOSTILE = "the hostile prompt 11d0"
MAX_BODY = 10 * 1024 * 1024  # the default TINYGW_MAX_BODY_BYTES


def sender_to(key_config: bytes):
    """(Ehbp-Encapsulated-Key, an HPKE sender context) sealing to the key configuration's key:
    pyhpke's, so that a test may frame a body as no well-behaved client would."""
    suite = CipherSuite.new(KEMId.DHKEM_X25519_HKDF_SHA256, KDFId.HKDF_SHA256, AEADId.AES256_GCM)
    enc, sender = suite.create_sender_context(suite.kem.deserialize_public_key(key_config[3:35]), info=b"ehbp request")
    return enc.hex(), sender


def frame(ciphertext: bytes) -> bytes:
    return struct.pack(">I", len(ciphertext)) + ciphertext


def hostile_bodies(key_config: bytes) -> list[tuple[str, bytes]]:
    """A real request in its first frame, then 10 MiB of empty frames (length 0), and then
    5 MiB of frames each sealing no plaintext (all authentic): each opened well before."""
    enc, sender = sender_to(key_config)
    head = frame(sender.seal(json.dumps(ask(HOSTILE)).encode(), b""))
    zeros = head + bytes(4 * ((MAX_BODY - len(head)) // 4))
    enc_2, sender_2 = sender_to(key_config)
    head_2 = frame(sender_2.seal(json.dumps(ask(HOSTILE)).encode(), b""))
    empties = head_2 + b"".join(frame(sender_2.seal(b"", b"")) for _ in range(5 * 1024 * 1024 // 20))
    return [(enc, zeros), (enc_2, empties)]


def test_a_sealed_body_of_too_many_or_empty_frames_is_400_at_once_and_the_worker_serves_others(fake, start_gateway):
    """Before: each was opened frame by frame on the worker's loop (0.7 to 1.8 s each), held
    every other request of the worker meanwhile, and then forwarded."""
    config = {"providers": {"fake": provider(fake)}, "models": {"m": {"targets": ["fake:m"]}}}
    gateway = start_gateway(config, TINYGW_EHBP="on", TINYGW_API_KEYS=KEYS[0])
    key_config = call("GET", f"{gateway.url}/.well-known/hpke-keys")[2]
    bodies = hostile_bodies(key_config) * 3
    waits: list[float] = []
    with ThreadPoolExecutor(len(bodies)) as pool:
        answers = [pool.submit(post_sealed, gateway, enc, body) for enc, body in bodies]
        while not waits or not all(a.done() for a in answers):  # a well-behaved request, meanwhile
            started = time.monotonic()
            assert call("POST", f"{gateway.url}/v1/chat/completions", ask("probe"), {"x-api-key": KEYS[0]})[0] == 200
            waits.append(time.monotonic() - started)
    for status, headers, answer in (a.result() for a in answers):
        assert status == 400 and headers["content-type"] == "application/problem+json", answer[:200]
        problem = json.loads(answer)
        assert problem["type"] == "about:blank" and problem["status"] == 400 and problem["title"]
    assert not [r for r in fake.requests if HOSTILE.encode() in r.body]  # no attempt
    assert max(waits) < 1.0, waits  # not held by seconds (a request takes milliseconds)
    # a body framed as a client frames it, however large, still opens: Tinfoil's 64 KiB frames
    plaintext = json.dumps(ask()).encode() + b" " * (MAX_BODY - 64 * 1024)
    assert post_sealed(gateway, *sealed_request(key_config, plaintext, 64 * 1024))[0] == 200


def test_required_refuses_plain_requests_naming_ehbp_and_serves_sealed_ones(fake, start_gateway):
    config = {"providers": {"fake": provider(fake)}, "models": {"m": {"targets": ["fake:m"]}}}
    gateway = start_gateway(config, TINYGW_EHBP="required")
    status, headers, body = call("POST", f"{gateway.url}/v1/chat/completions", ask())
    assert status == 400 and "EHBP" in json.loads(body)["error"]["message"], body
    assert json.loads(body)["error"]["code"] == "ehbp_required" and not fake.requests
    key_config = call("GET", f"{gateway.url}/.well-known/hpke-keys")[2]
    answer = sdk(gateway, key_config, api_key="unused").chat.completions.create(**ask())
    assert answer.choices[0].message.content == "Hello from fake."
    assert call("GET", f"{gateway.url}/healthz")[0] == 200  # pages are not proxied routes
    assert call("GET", f"{gateway.url}/v1/receipts/{'0' * 32}")[0] == 404  # receipts are off


def test_with_both_off_nothing_is_served_or_attested(fake, start_gateway):
    gateway = start_gateway({"providers": {"fake": provider(fake)}, "models": {"m": {"targets": ["fake:m"]}}})
    assert call("GET", f"{gateway.url}/.well-known/hpke-keys")[0] == 404
    answer = json.loads(call("GET", f"{gateway.url}/attestation?nonce={'ab' * 32}")[2])
    assert not {"hpke_key_config", "hpke_key_sha256", "receipt_public_key", "receipt_key_sha256"} & set(answer)
    v1 = hashlib.sha512(b"tinygw.attest.v1" + bytes.fromhex("ab" * 32) + bytes.fromhex(answer["config_sha256"]))
    assert answer["report_data"] == v1.hexdigest()
    status, headers, _ = call("POST", f"{gateway.url}/v1/chat/completions", ask())
    assert status == 200 and "x-tinygw-receipt-id" not in headers


# ---- receipts -------------------------------------------------------------------------------


def receipt_verify(*args: str | Path) -> tuple[int, dict[str, str], str]:
    return verify("receipt", *[str(a) for a in args])


def test_a_receipt_of_a_streamed_answer_verifies_and_fails_after_one_flipped_byte(sealed, verified, tmp_path):
    gateway, _, _, _ = sealed
    key_config, evidence = verified
    request = json.dumps({**ask(), "stream": True}).encode()
    transport = EHBPTransport(ServerIdentity.unmarshal_public_config(key_config))
    with httpx.Client(transport=transport) as client:
        headers = {"Authorization": f"Bearer {KEYS[0]}", "Content-Type": "application/json"}
        with client.stream("POST", f"{gateway.url}/v1/chat/completions", content=request, headers=headers) as r:
            assert r.status_code == 200 and r.headers["ehbp-response-nonce"]
            receipt_id = r.headers["x-tinygw-receipt-id"]
            response = b"".join(r.iter_bytes())
    assert b"data: [DONE]" in response
    # Fetched at once, from whichever worker the connection lands on (both keep and read them).
    fetched = [call("GET", f"{gateway.url}/v1/receipts/{receipt_id}", headers={"x-api-key": KEYS[0]}) for _ in range(6)]
    assert {f[0] for f in fetched} == {200} and len({f[2] for f in fetched}) == 1
    receipt = json.loads(fetched[0][2])
    assert list(receipt) == [
        "v", "id", "created", "client", "route", "model", "provider", "provider_model", "status",
        "request_sha256", "response_sha256", "signature",
    ]  # fmt: skip
    assert receipt["route"] == "/v1/chat/completions" and receipt["status"] == 200 and receipt["model"] == "m"
    assert (receipt["provider"], receipt["provider_model"]) == ("up", "m")  # test_attest's configuration
    paths = {"receipt": tmp_path / "receipt.json", "request": tmp_path / "request", "response": tmp_path / "response"}
    paths["receipt"].write_bytes(fetched[0][2])
    paths["request"].write_bytes(request)
    paths["response"].write_bytes(response)
    args = (paths["receipt"], "--attestation", evidence, "--request", paths["request"], "--response", paths["response"])
    code, verdicts, output = receipt_verify(*args)
    assert (
        code == 0
        and set(verdicts)
        == {
            "receipt key bound",
            "receipt fields",
            "receipt signature",
            "request hash",
            "response hash",
        }
        and set(verdicts.values()) == {"PASS"}
    ), output
    # One flipped byte anywhere is a FAIL naming the check.
    receipt_bytes = paths["receipt"].read_bytes()
    flip_at = receipt_bytes.index(b'"model": "m"') + len('"model": "')
    for name, path, at, check in (
        ("receipt", paths["receipt"], flip_at, "receipt signature"),
        ("request", paths["request"], len(request) // 2, "request hash"),
        ("response", paths["response"], len(response) // 2, "response hash"),
    ):
        original = path.read_bytes()
        changed = bytearray(original)
        changed[at] ^= 0x01
        path.write_bytes(bytes(changed))
        code, verdicts, output = receipt_verify(*args)
        assert code == 1 and verdicts[check] == "FAIL", (name, output)
        path.write_bytes(original)
    assert receipt_verify(*args)[0] == 0


def test_another_client_cannot_fetch_a_receipt(sealed, verified):
    gateway, _, _, _ = sealed
    raw = sdk(gateway, verified[0]).chat.completions.with_raw_response.create(**ask())
    receipt_id = raw.headers["x-tinygw-receipt-id"]
    url = f"{gateway.url}/v1/receipts/{receipt_id}"
    assert call("GET", url, headers={"Authorization": f"Bearer {KEYS[0]}"})[0] == 200
    assert call("GET", url, headers={"Authorization": f"Bearer {KEYS[1]}"})[0] == 404  # said as for none
    assert call("GET", url)[0] == 401
    other_id = receipt_id[:-1] + ("1" if receipt_id.endswith("0") else "0")  # an id one character off, never this one
    assert call("GET", f"{gateway.url}/v1/receipts/{other_id}", headers={"x-api-key": KEYS[0]})[0] == 404


def test_a_receipt_of_a_gateway_error_and_a_plain_request(sealed):
    gateway, _, _, _ = sealed
    headers = {"Authorization": f"Bearer {KEYS[1]}"}
    status, answer_headers, body = call("POST", f"{gateway.url}/v1/chat/completions", ask(), headers)
    receipt = json.loads(
        call("GET", f"{gateway.url}/v1/receipts/{answer_headers['x-tinygw-receipt-id']}", headers=headers)[2]
    )
    assert receipt["response_sha256"] == hashlib.sha256(body).hexdigest()
    assert receipt["request_sha256"] == hashlib.sha256(json.dumps(ask()).encode()).hexdigest()
    status, answer_headers, body = call(
        "POST", f"{gateway.url}/v1/chat/completions", {**ask(), "model": "nope"}, headers
    )
    assert status == 404
    receipt = json.loads(
        call("GET", f"{gateway.url}/v1/receipts/{answer_headers['x-tinygw-receipt-id']}", headers=headers)[2]
    )
    assert receipt["status"] == 404 and receipt["provider"] == "" and receipt["model"] == "nope"
    assert receipt["response_sha256"] == hashlib.sha256(body).hexdigest()


def test_a_receipt_is_proven_only_by_an_attestation_that_verify_verified_and_saved(sealed, verified, tmp_path):
    """Before: the gateway's /attestation answer as it came (its quote never checked) made the
    receipt PASS, exit 0, with no verdict line."""
    gateway, _, _, _ = sealed
    headers = {"Authorization": f"Bearer {KEYS[0]}"}
    answer_headers = call("POST", f"{gateway.url}/v1/chat/completions", ask(), headers)[1]
    receipt = tmp_path / "receipt.json"
    receipt.write_bytes(
        call("GET", f"{gateway.url}/v1/receipts/{answer_headers['x-tinygw-receipt-id']}", headers=headers)[2]
    )
    saved = json.loads(verified[1].read_text())
    record = saved["attest_verify"]
    assert record["verdict"] == "PASS" and record["url"] == gateway.url
    assert {"quote signature", "report_data", "receipt key bound"} <= {c["name"] for c in record["checks"]}
    code, verdicts, output = receipt_verify(receipt, "--attestation", verified[1])
    assert code == 0 and set(verdicts.values()) == {"PASS"}, output
    assert output.splitlines()[-1] == "verdict: PASS: every check PASSed (3 checks); exit 0", output
    raw = tmp_path / "raw.json"  # the same gateway's evidence, fetched, never verified
    raw.write_bytes(call("GET", f"{gateway.url}/attestation?nonce={os.urandom(32).hex()}")[2])
    skipped = tmp_path / "skipped.json"  # saved, but a check did not PASS (as --save-attestation never writes)
    record = {
        **record,
        "checks": [{**c, "result": "SKIP"} if c["name"] == "quote signature" else c for c in record["checks"]],
    }
    skipped.write_text(json.dumps({**saved, "attest_verify": record}))
    for evidence in (raw, skipped):
        code, verdicts, output = receipt_verify(receipt, "--attestation", evidence)
        assert code == 4 and verdicts["receipt key bound"] == verdicts["receipt signature"] == "SKIP", output
        assert "PASS receipt signature" not in output and output.splitlines()[-1].startswith("verdict: UNVERIFIED: ")


def test_the_private_keys_are_in_a_private_memory_directory_removed_at_exit(fake, start_gateway):
    config = {"providers": {"fake": provider(fake)}, "models": {"m": {"targets": ["fake:m"]}}}
    gateway = start_gateway(config, TINYGW_EHBP="on", TINYGW_RECEIPTS="on")
    made = gateway.held_directories("tinygw-keys-")
    assert len(made) == 1, made
    (directory,) = made
    assert str(directory.parent) in ("/dev/shm", "/run", os.environ.get("TMPDIR") or "/tmp")  # noqa: S108
    assert directory.stat().st_mode & 0o777 == 0o700
    files = {p.name: p.stat().st_mode & 0o777 for p in directory.iterdir()}
    assert files == {"hpke.key": 0o600, "names.key": 0o600, "receipt.key": 0o600}
    hpke = (directory / "hpke.key").read_bytes()
    assert hpke.hex() not in gateway.logs() and base64.b64encode(hpke).decode() not in gateway.logs()
    gateway.stop()
    assert not directory.exists()
