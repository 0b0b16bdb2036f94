"""EHBP's HPKE recipient (tinygw.trust.ehbp.Recipient, RFC 9180 base mode) against the RFC's
own test vector for this KEM and KDF (Appendix A.1.1: AES-128-GCM, the one AEAD of the
appendix with X25519 and AES; the key schedule takes the AEAD's key length), and against
pyhpke (a reference here only) for EHBP's suite, AES-256-GCM. Tinfoil's client is the other
side in tests/test_sealing_units.py and tests/test_ehbp.py."""

from __future__ import annotations

import os

import pytest
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from pyhpke import AEADId, CipherSuite, KDFId, KEMId

from tinygw.errors import SealedBodyRefused
from tinygw.trust import ehbp

# RFC 9180, A.1.1 (DHKEM(X25519, HKDF-SHA256), HKDF-SHA256, AES-128-GCM; base mode).
A11_INFO = bytes.fromhex("4f6465206f6e2061204772656369616e2055726e")
A11_SK_R = bytes.fromhex("4612c550263fc8ad58375df3f557aac531d26850903e55a9f23f21d8534e8ac8")
A11_ENC = bytes.fromhex("37fda3567bdbd628e88668c3c8d7e97d1d1253b6d4ea6d44c150f741f1bf4431")
A11_PT = bytes.fromhex("4265617574792069732074727574682c20747275746820626561757479")
A11_ENCRYPTIONS = {  # sequence number: (aad, ciphertext)
    0: (
        "436f756e742d30",
        "f938558b5d72f1a23810b4be2ab4f84331acc02fc97babc53a52ae8218a355a96d8770ac83d07bea87e13c512a",
    ),
    1: (
        "436f756e742d31",
        "af2d7e9ac9ae7e270f46ba1f975be53c09f8d875bdc8535458c2494e8a6eab251c03d0c22a56b8ca42c2063b84",
    ),
    2: (
        "436f756e742d32",
        "498dfcabd92e8acedc281e85af1cb4e3e31c7dc394a1ca20e173cb72516491588d96a19ad4a683518973dcc180",
    ),
    4: (
        "436f756e742d34",
        "583bd32bc67a5994bb8ceaca813d369bca7b2a42408cddef5e22f880b631215a09fc0012bc69fccaa251c0246d",
    ),
    255: (
        "436f756e742d323535",
        "7175db9717964058640a3a11fb9007941a5d1757fda1a6935c805c21af32505bf106deefec4a49ac38d71c9e0a",
    ),
    256: (
        "436f756e742d323536",
        "957f9800542b0b8891badb026d79cc54597cb2d225b54c00c5238c25d05c30e3fbeda97d2e0e1aba483a2df9f2",
    ),
}
A11_EXPORTS = [  # (exporter_context, L = 32, exported_value)
    ("", "3853fe2b4035195a573ffc53856e77058e15d9ea064de3e59f4961d0095250ee"),
    ("00", "2e8f0b54673c7029649d4eb9d5e33bf1872cf76d623ff164ac185da9e88c21a5"),
    ("54657374436f6e74657874", "e9e43065102c3836401bed8c3c3c75ae46be1639869391d62c61f1ec7af54931"),
]
AES_128_GCM = 0x0001


def a11_context() -> ehbp.Context:
    private = X25519PrivateKey.from_private_bytes(A11_SK_R)
    return ehbp.Recipient(private, A11_INFO, AES_128_GCM, 16).setup(A11_ENC)


def test_the_recipient_opens_the_rfcs_test_vector_in_order_and_exports_its_values():
    context = a11_context()
    for sequence in (0, 1, 2):
        aad, ciphertext = A11_ENCRYPTIONS[sequence]
        assert context.open(bytes.fromhex(ciphertext), bytes.fromhex(aad)) == A11_PT
    with pytest.raises(InvalidTag):  # the next one is sequence number 3: number 4's does not open
        context.open(bytes.fromhex(A11_ENCRYPTIONS[4][1]), bytes.fromhex(A11_ENCRYPTIONS[4][0]))
    for exporter_context, exported in A11_EXPORTS:
        assert context.export(bytes.fromhex(exporter_context), 32).hex() == exported


@pytest.mark.parametrize("sequence", [4, 255, 256])
def test_the_nonce_of_a_later_message_is_the_base_nonce_xor_its_sequence_number(sequence):
    context = a11_context()
    context._sequence = sequence  # skips the messages before it, which the vector does not list
    aad, ciphertext = A11_ENCRYPTIONS[sequence]
    assert context.open(bytes.fromhex(ciphertext), bytes.fromhex(aad)) == A11_PT


def test_ehbps_suite_agrees_with_pyhpke_frame_by_frame_and_on_the_export():
    suite = CipherSuite.new(KEMId.DHKEM_X25519_HKDF_SHA256, KDFId.HKDF_SHA256, AEADId.AES256_GCM)
    for _ in range(8):
        private = X25519PrivateKey.generate()
        recipient = ehbp.Recipient(private, ehbp.REQUEST_INFO, ehbp.AEAD_AES_256_GCM, ehbp.AEAD_KEY_BYTES)
        public = suite.kem.deserialize_public_key(private.public_key().public_bytes_raw())
        enc, sender = suite.create_sender_context(public, info=ehbp.REQUEST_INFO)
        context = recipient.setup(enc)
        for _ in range(3):
            message = os.urandom(1 + os.urandom(1)[0])
            assert context.open(sender.seal(message, b""), b"") == message
        assert context.export(ehbp.EXPORT_LABEL, 32) == sender.export(ehbp.EXPORT_LABEL, 32)


@pytest.mark.parametrize(
    "point",
    [
        bytes(32),  # zero
        bytes([1]) + bytes(31),  # one
        bytes.fromhex("e0eb7a7c3b41b8ae1656e3faf19fc46ada098deb9c32b1fd866205165f49b800"),  # of order 8
    ],
)
def test_a_low_order_encapsulated_key_is_refused_400(point):
    key = ehbp.KeyPair.generate()
    with pytest.raises(ValueError):
        key._recipient.setup(point)
    with pytest.raises(SealedBodyRefused) as caught:
        key.open(point.hex().encode(), b"\x00\x00\x00\x11" + bytes(17))
    assert caught.value.status == 400
