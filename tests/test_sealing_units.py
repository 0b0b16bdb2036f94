"""The EHBP codec and the receipts' ring and canonical form (docs/confidential.md), as units:
Tinfoil's client seals and opens on the other side; rings bounded by count and bytes, read
across "workers" (two rings in one directory)."""

from __future__ import annotations

import json
import struct

import pytest
from ehbp import FrameDecryptor, ServerIdentity, derive_response_keys
from pyhpke import AEADId, CipherSuite, KDFId, KEMId

from tinygw.errors import SealedBodyRefused
from tinygw.trust import ehbp, receipts


def test_a_body_sealed_by_tinfoils_client_opens_and_the_answer_opens_there_frame_by_frame():
    key = ehbp.KeyPair.generate()
    identity = ServerIdentity.unmarshal_public_config(key.config)
    assert identity.marshal_public_config() == key.config  # the key configuration, byte for byte
    stream = identity.encrypt_request_stream([b'{"model":', b'"m"}'])
    body = b"".join(stream.frames)
    body += struct.pack(">I", 0)  # an empty last write: ignored
    opened = key.open(stream.encapsulated_key.hex().encode(), body)
    assert opened.plaintext == b'{"model":"m"}'
    sealer = opened.sealer()
    frames = [sealer.seal(b"data: one\n\n"), sealer.seal(b""), sealer.seal(b"data: two\n\n")]
    assert frames[1] == b""
    token = stream.token
    decryptor = FrameDecryptor(derive_response_keys(token.exported_secret, token.request_enc, sealer.nonce), 1 << 20)
    assert [list(decryptor.push(f)) for f in frames] == [[b"data: one\n\n"], [], [b"data: two\n\n"]]
    decryptor.finish()
    assert "private" not in repr(key) and key.private_bytes().hex() not in repr(key)


@pytest.mark.parametrize(
    "enc, body, status",
    [
        (b"zz", b"\x00\x00\x00\x01x", 400),  # not hex
        (b"ab" * 31, b"\x00\x00\x00\x01x", 400),  # not 32 bytes
        (None, b"\x00\x00", 400),  # a length cut short
        (None, b"\x00\x00\x00\x40abc", 400),  # a frame longer than the body
        (None, b"\x00\x00\x00\x20" + bytes(32), 422),  # a first frame that does not open
    ],
)
def test_bodies_that_do_not_open_are_refused_with_the_protocols_status(enc, body, status):
    key = ehbp.KeyPair.generate()
    good = ServerIdentity.unmarshal_public_config(key.config).encrypt_request_body(b"x")
    with pytest.raises(SealedBodyRefused) as caught:
        key.open(enc if enc is not None else good.encapsulated_key.hex().encode(), body)
    assert caught.value.status == status


def sealer_to(key: ehbp.KeyPair):
    """(Ehbp-Encapsulated-Key, a frame of `plaintext`) of one sender to `key` (pyhpke's)."""
    suite = CipherSuite.new(KEMId.DHKEM_X25519_HKDF_SHA256, KDFId.HKDF_SHA256, AEADId.AES256_GCM)
    enc, sender = suite.create_sender_context(
        suite.kem.deserialize_public_key(key.config[3:35]), info=ehbp.REQUEST_INFO
    )
    return enc.hex().encode(), lambda plaintext: _frame(sender.seal(plaintext, b""))


def _frame(ciphertext: bytes) -> bytes:
    return struct.pack(">I", len(ciphertext)) + ciphertext


@pytest.mark.parametrize(
    "pieces",
    [
        [b"x", b"", b"y"],  # a ciphertext of no plaintext before the last
        [b"x", None, b"y"],  # an empty write (length 0) before the last
        [None, b"x"],
        [b"x" * 10] * 6,  # 6 frames of 30 bytes: at most ceil(180 / 1024) + 4 = 5
    ],
)
def test_too_many_frames_or_an_empty_frame_before_the_last_is_400_before_any_frame_is_opened(pieces):
    key = ehbp.KeyPair.generate()
    enc, seal = sealer_to(key)
    body = b"".join(struct.pack(">I", 0) if p is None else seal(p) for p in pieces)
    with pytest.raises(SealedBodyRefused) as caught:
        key.open(enc, body)
    assert caught.value.status == 400
    assert ehbp.frames(body[:0]) == []
    with pytest.raises(SealedBodyRefused):  # from the lengths alone: the frames are not opened
        ehbp.frames(body)


def test_the_bound_is_a_frame_a_kib_and_four_and_the_last_frame_may_be_empty():
    assert [ehbp.max_frames(n) for n in (0, 1, 1024, 1025, 10 * 1024 * 1024)] == [4, 5, 5, 6, 10244]
    key = ehbp.KeyPair.generate()
    enc, seal = sealer_to(key)
    body = b"".join(seal(b"x" * 10) for _ in range(4))  # and a last frame of no plaintext: 5, the most
    assert key.open(enc, body + seal(b"")).plaintext == b"x" * 40
    enc, seal = sealer_to(key)
    assert key.open(enc, seal(b"x" * 900) + struct.pack(">I", 0)).plaintext == b"x" * 900  # or of length 0
    enc, seal = sealer_to(key)
    assert key.open(enc, seal(b"x" * 3000)).plaintext == b"x" * 3000


def test_the_canonical_form_is_rfc_8785_for_strings_and_integers():
    fields = {"b": 'é\u2028\x1f\n"\\', "a": 1796000000, "c": "/v1/chat"}
    assert receipts.canonical(fields) == '{"a":1796000000,"b":"é\u2028\\u001f\\n\\"\\\\","c":"/v1/chat"}'.encode()


def test_a_signed_receipt_lists_its_fields_in_order_and_the_signature_covers_them():
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    signer = receipts.Signer.generate()
    fields = {name: 1 if name in ("v", "created", "status") else "x" for name in receipts.FIELDS}
    signed = json.loads(signer.signed(receipts.canonical(fields)))
    assert list(signed) == [*receipts.FIELDS, "signature"]
    import base64

    public = Ed25519PublicKey.from_public_bytes(signer.public_key)
    public.verify(base64.b64decode(signed["signature"]), receipts.canonical(fields))
    assert signer.signed(receipts.canonical(fields)) == signer.signed(receipts.canonical(fields))  # deterministic


def unsigned(receipt_id: str, padding: int = 0) -> bytes:
    return receipts.canonical({"id": receipt_id, "model": "m" * padding})


@pytest.mark.parametrize("directory", [None, "tmp"])
def test_a_ring_drops_its_oldest_by_count(directory, tmp_path):
    ring = receipts.Ring(str(tmp_path) if directory else None, 1, count=4, size=1 << 16)
    ids = [ring.allocate() for _ in range(6)]
    for i in ids:
        ring.put(i, b"owner", unsigned(i))
    assert [ring.find(i) is not None for i in ids] == [False, False, True, True, True, True]
    assert ring.find(ids[-1]) == (b"owner", unsigned(ids[-1]))
    assert ring.find(ids[-1][:-1] + ("0" if ids[-1][-1] != "0" else "1")) is None  # its random part counts
    assert ring.find("not-an-id") is None
    ring.close()


def test_a_ring_drops_its_oldest_by_bytes_and_another_worker_reads_it(tmp_path):
    one = receipts.Ring(str(tmp_path), 1, count=100, size=2000)
    two = receipts.Ring(str(tmp_path), 2, count=100, size=2000)
    ids = [one.allocate() for _ in range(8)]
    for i in ids:
        one.put(i, b"o", unsigned(i, padding=300))  # ~350 bytes each: 5 fit
    found = [two.find(i) is not None for i in ids]  # read from the other worker's side
    assert found[-1] and not found[0] and sum(found) <= 5
    assert two.find(ids[-1]) == (b"o", unsigned(ids[-1], padding=300))
    own = two.allocate()
    two.put(own, b"p", unsigned(own))
    assert one.find(own) == (b"p", unsigned(own))
    one.close()
    two.close()


def test_the_bounds_are_shared_by_the_workers():
    assert receipts.shares(1) == (receipts.MAX_RECEIPTS, receipts.MAX_BYTES)
    count, size = receipts.shares(4)
    assert count * 4 == receipts.MAX_RECEIPTS and size * 4 == receipts.MAX_BYTES
