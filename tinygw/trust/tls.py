"""The gateway's own TLS (docs/design.md section 9): the key that attestation binds.

`attested`: one ECDSA P-256 key and a self-signed certificate, made at start, before
Granian starts its workers, with the `cryptography` library. Granian takes a key by
path, so the key is written once, as a 0600 file in a fresh 0700 directory on a
memory file system (tmpfs; never a disk), which `serve` removes at exit. It is never
logged or shown. `files`: a certificate and key made elsewhere (a CA-issued
certificate whose key was made inside the VM), checked to belong together.

Everything here runs at start; nothing is on a request's path but the certificate's
PEM and its SubjectPublicKeyInfo digest, which /attestation reports.
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import os
import shutil
import tempfile

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, rsa
from cryptography.x509.oid import NameOID
from msgspec import Struct

from tinygw import lifecycle
from tinygw.errors import ConfigError

# A certificate made at start lives as long as the process; a gateway restarted once a
# year gets a new one (and clients pin the new one through attestation).
VALIDITY_DAYS = 365

# File systems that live in memory only: where the attested key may be written.
MEMORY_FILE_SYSTEMS = frozenset({"tmpfs", "ramfs"})

# The weakest keys a `files` certificate may have (NIST SP 800-57's 112-bit floor:
# RSA 2048, and elliptic curves of at least 256 bits).
MIN_RSA_BITS = 2048
MIN_EC_BITS = 256


class Served(Struct, frozen=True):
    """What Granian serves: the certificate and key files, and the key's digest."""

    cert_path: str
    key_path: str
    spki_sha256: str
    directory: str | None  # made for the attested key: removed at exit
    not_after: float  # when the certificate expires, Unix time
    lock: int | None = None  # the file descriptor that holds `directory`'s lock (tinygw.lifecycle)


def not_after(cert_pem: bytes) -> float:
    return x509.load_pem_x509_certificate(cert_pem).not_valid_after_utc.timestamp()


def spki_sha256(cert_pem: bytes) -> str:
    """sha256 of the certificate's DER SubjectPublicKeyInfo, hex."""
    certificate = x509.load_pem_x509_certificate(cert_pem)
    spki = certificate.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return hashlib.sha256(spki).hexdigest()


def subject_alt_names(names: tuple[str, ...]) -> list[x509.GeneralName]:
    alt: list[x509.GeneralName] = []
    for name in names:
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            alt.append(x509.DNSName(name))
    return alt


def make_attested(names: tuple[str, ...], now: datetime.datetime) -> tuple[bytes, ec.EllipticCurvePrivateKey]:
    """A fresh P-256 key and a self-signed certificate for `names`: (certificate PEM, key)."""
    key = ec.generate_private_key(ec.SECP256R1())
    # The names are in subjectAltName, which is what clients check; a CN holds at most 64.
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tinygw attested")])
    certificate = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # small clock differences
        .not_valid_after(now + datetime.timedelta(days=VALIDITY_DAYS))
        .add_extension(x509.SubjectAlternativeName(subject_alt_names(names)), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(key, hashes.SHA256())
    )
    return certificate.public_bytes(serialization.Encoding.PEM), key


def memory_directory(candidates: list[str]) -> str:
    """The first candidate directory that exists and lives on tmpfs/ramfs; it must be
    writable (a directory is made there and removed, as the key's will be)."""
    mounts = _mounts()
    for candidate in candidates:
        if (
            candidate
            and os.path.isdir(candidate)
            and _file_system(os.path.realpath(candidate), mounts) in MEMORY_FILE_SYSTEMS
        ):
            try:
                os.rmdir(tempfile.mkdtemp(prefix="tinygw-probe-", dir=candidate))
            except OSError as e:
                raise ConfigError(
                    "TINYGW_TLS", f"attested: cannot write the key in {candidate!r}: {e.strerror or type(e).__name__}"
                ) from None
            return candidate
    raise ConfigError("TINYGW_TLS", f"attested: no memory file system (tmpfs) to hold the key among {candidates}")


def write_attested(names: tuple[str, ...], candidates: list[str], now: datetime.datetime) -> Served:
    """Make the key and certificate and write them for Granian (see the module's doc)."""
    cert_pem, key = make_attested(names, now)
    try:
        # 0700, locked before it bears its name: serve holds it (tinygw.lifecycle tells dead gateways' by it)
        directory, lock = lifecycle.make_held(memory_directory(candidates), "tinygw-tls-")
    except OSError as e:
        raise ConfigError("TINYGW_TLS", f"attested: cannot make the key's directory: {e.strerror}") from None
    try:
        # Unencrypted: Granian 2.8's reader of encrypted PKCS#8 keys rejects standard
        # PBES2 files (checked with cryptography's and openssl's), so the file's
        # protection is its place (a 0700 directory on tmpfs) and its mode.
        key_pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        key_path = os.path.join(directory, "key.pem")
        cert_path = os.path.join(directory, "cert.pem")
        _write_new(key_path, key_pem, 0o600)
        _write_new(cert_path, cert_pem, 0o644)
    except OSError as e:
        shutil.rmtree(directory, ignore_errors=True)
        lifecycle.release(lock)
        raise ConfigError("TINYGW_TLS", f"attested: cannot write the key in {directory!r}: {e.strerror}") from None
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        lifecycle.release(lock)
        raise
    return Served(cert_path, key_path, spki_sha256(cert_pem), directory, not_after(cert_pem), lock)


def served_files(cert_path: str, key_path: str) -> Served:
    """`TINYGW_TLS=files`, as checked by the configuration."""
    try:
        with open(cert_path, "rb") as f:
            cert_pem = f.read()
    except OSError as e:  # checked by the configuration a moment ago; moved since
        raise ConfigError("TINYGW_TLS_CERT_FILE", f"cannot read {cert_path!r}: {e.strerror}") from None
    return Served(cert_path, key_path, spki_sha256(cert_pem), None, not_after(cert_pem))


def check_files(cert_path: str, key_path: str, cert_pem: bytes, key_pem: bytes) -> Served:
    """`TINYGW_TLS=files`: the certificate and key must parse and belong together."""
    try:
        certificate = x509.load_pem_x509_certificate(cert_pem)
    except ValueError:
        raise ConfigError("TINYGW_TLS_CERT_FILE", f"{cert_path!r} holds no PEM certificate") from None
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm):  # never the key's bytes in a message
        raise ConfigError("TINYGW_TLS_KEY_FILE", f"{key_path!r} holds no unencrypted PEM private key") from None
    public = serialization.PublicFormat.SubjectPublicKeyInfo
    if certificate.public_key().public_bytes(serialization.Encoding.DER, public) != key.public_key().public_bytes(
        serialization.Encoding.DER, public
    ):
        raise ConfigError(
            "TINYGW_TLS_KEY_FILE", f"{key_path!r} is not the key of the certificate in TINYGW_TLS_CERT_FILE"
        )
    weak = _weakness(key)
    if weak:
        raise ConfigError("TINYGW_TLS_KEY_FILE", f"{key_path!r} holds {weak}")
    return Served(cert_path, key_path, spki_sha256(cert_pem), None, certificate.not_valid_after_utc.timestamp())


def _weakness(key) -> str | None:
    """What is too weak about a private key, or None: RSA under MIN_RSA_BITS, an
    elliptic curve under MIN_EC_BITS, or any other kind but Ed25519/Ed448."""
    if isinstance(key, rsa.RSAPrivateKey):
        return f"an RSA key of {key.key_size} bits (at least {MIN_RSA_BITS})" if key.key_size < MIN_RSA_BITS else None
    if isinstance(key, ec.EllipticCurvePrivateKey):
        size = key.curve.key_size
        return f"an EC key on {key.curve.name} ({size} bits; at least {MIN_EC_BITS})" if size < MIN_EC_BITS else None
    if isinstance(key, (ed25519.Ed25519PrivateKey, ed448.Ed448PrivateKey)):
        return None
    return f"a {type(key).__name__.removeprefix('_')} key, which TLS servers do not use"


def remove(served: Served | None) -> None:
    if served is not None and served.directory:
        shutil.rmtree(served.directory, ignore_errors=True)


def _write_new(path: str, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _mounts() -> list[tuple[str, str]]:
    """(mount point, file system type) of this process's mounts."""
    try:
        with open("/proc/self/mounts", encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    mounts = []
    for line in lines:
        fields = line.split()
        if len(fields) >= 3:
            mounts.append((fields[1].replace("\\040", " "), fields[2]))
    return mounts


def _file_system(path: str, mounts: list[tuple[str, str]]) -> str | None:
    """The type of the file system `path` is on: that of its longest mount point."""
    best, kind = -1, None
    for point, fs_type in mounts:
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) > best:
            best, kind = len(point), fs_type
    return kind
