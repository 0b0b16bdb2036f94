"""The keys of EHBP and of receipts in an /attestation answer, for attest/verify (docs/confidential.md).

With TINYGW_EHBP or TINYGW_RECEIPTS on, the answer carries `hpke_key_config` (base64 of
the key configuration that /.well-known/hpke-keys serves) with `hpke_key_sha256`, and
`receipt_public_key` (hex, 32 bytes of Ed25519) with `receipt_key_sha256`; report_data is
then v3, SHA-512("tinygw.attest.v3" || nonce || config_sha256 || tls_spki_sha256 ||
hpke_key_sha256 || receipt_key_sha256), 32 zero bytes for each key that is off.

`hpke key bound` and `receipt key bound` PASS when the key in the answer hashes to the
digest that report_data binds (and the key configuration is the X25519 / HKDF-SHA256 /
AES-256-GCM one that Tinfoil's clients read); report_data, checked against the quote,
does the rest. Python 3 stdlib only.
"""

import base64
import binascii
import hashlib
import json
import re

DOMAIN_KEYS = b"tinygw.attest.v3"
# The field of a saved attestation (--save-attestation) that records the run that verified it:
# its verdict and each check's result, all PASS (nothing else is ever saved). attest/verify
# receipt trusts the answer's receipt key only with it (attest/receipt.py).
VERIFIED = "attest_verify"
OFF = bytes(32)
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
ED25519_HEX = re.compile(r"[0-9a-f]{64}")
# key id (any), KEM X25519-HKDF-SHA256, 32 bytes of key, one suite: HKDF-SHA256, AES-256-GCM
_CONFIG = re.compile(rb"[\x00-\xff]\x00\x20[\x00-\xff]{32}\x00\x04\x00\x01\x00\x02", re.DOTALL)


def bound_digests(answer):
    """(hpke_key_sha256, receipt_key_sha256) as raw bytes (OFF for a key that is off), or None
    when the answer has neither (report_data v1 or v2)."""
    hpke, receipt = answer.get("hpke_key_sha256"), answer.get("receipt_key_sha256")
    if hpke is None and receipt is None:
        return None
    return tuple(
        bytes.fromhex(d) if isinstance(d, str) and SHA256_HEX.fullmatch(d) else OFF if d is None else b"?"
        for d in (hpke, receipt)
    )


def report_data_v3(nonce, config_hex, spki_hex, digests):
    spki = bytes.fromhex(spki_hex) if spki_hex else OFF
    return hashlib.sha512(DOMAIN_KEYS + nonce + bytes.fromhex(config_hex) + spki + digests[0] + digests[1]).digest()


def hpke_config(answer):
    """(the key configuration's bytes, None) when the answer binds a well-formed one, else (None, why not)."""
    config, digest = answer.get("hpke_key_config"), answer.get("hpke_key_sha256")
    if config is None and digest is None:
        return None, "the answer attests no HPKE key (hpke_key_config): is TINYGW_EHBP on?"
    try:
        raw = base64.b64decode(config, validate=True) if isinstance(config, str) else None
    except (binascii.Error, ValueError):
        raw = None
    if raw is None:
        return None, "hpke_key_config is not base64"
    if not _CONFIG.fullmatch(raw):
        return None, "hpke_key_config is not one X25519 / HKDF-SHA256 / AES-256-GCM key configuration"
    if hashlib.sha256(raw).hexdigest() != digest:
        return None, "hpke_key_config does not hash to the hpke_key_sha256 that report_data binds"
    return raw, None


def receipt_key(answer):
    """(the raw Ed25519 public key, None) when the answer binds one, else (None, why not)."""
    key, digest = answer.get("receipt_public_key"), answer.get("receipt_key_sha256")
    if key is None and digest is None:
        return None, "the answer attests no receipt key (receipt_public_key): is TINYGW_RECEIPTS on?"
    if not isinstance(key, str) or not ED25519_HEX.fullmatch(key):
        return None, "receipt_public_key is not 32 bytes of lowercase hex"
    if hashlib.sha256(bytes.fromhex(key)).hexdigest() != digest:
        return None, "receipt_public_key does not hash to the receipt_key_sha256 that report_data binds"
    return bytes.fromhex(key), None


def check_keys(answer, args, checks):
    """`hpke key bound` and `receipt key bound`, each when the answer has the key (or when
    --save-hpke asks for the HPKE key)."""
    if "hpke_key_config" in answer or "hpke_key_sha256" in answer or getattr(args, "save_hpke", None):
        checks.report("hpke key bound", hpke_config(answer)[1])
    if "receipt_public_key" in answer or "receipt_key_sha256" in answer:
        checks.report("receipt key bound", receipt_key(answer)[1])


def save(args, answer, write_file, checks):
    """--save-hpke and --save-attestation, once every check PASSed (the caller makes sure): the
    attestation is the answer with the record of this run in VERIFIED (a field the answer
    itself may not set: any it had is replaced)."""
    if getattr(args, "save_hpke", None):
        config, _ = hpke_config(answer)
        if config is not None:
            write_file(args.save_hpke, config, ".hpke-")
            checks.note(f"saved the attested HPKE key configuration to {args.save_hpke}")
    if getattr(args, "save_attestation", None):
        results = [{"name": r["name"], "result": r["result"]} for r in checks.results]
        record = {"verdict": "PASS", "url": args.url, "checks": results}
        write_file(args.save_attestation, json.dumps({**answer, VERIFIED: record}, indent=2) + "\n", ".attestation-")
        checks.note(f"saved the verified attestation to {args.save_attestation}")


def check_replicas(answers, checks):
    """`hpke key shared` and `receipt key shared`: every replica's verified answer binds the
    same key as the first's (replicas given one key seed, docs/deploy.md), else FAIL naming
    the first replica that differs. `answers`: (url, answer) of each replica fetched. A key
    that no replica binds is not checked."""
    for name, digest_field, what in (
        ("hpke key shared", "hpke_key_sha256", "HPKE key configuration"),
        ("receipt key shared", "receipt_key_sha256", "receipt key"),
    ):
        digests = [(url, answer.get(digest_field)) for url, answer in answers]
        if not any(digest for _, digest in digests):
            continue
        first_url, first = digests[0]
        differs = next(((url, digest) for url, digest in digests[1:] if digest != first), None)
        if differs is None:
            checks.report(name, None, replicas=len(digests), sha256=first)
        else:
            url, digest = differs
            checks.report(
                name,
                f"{url} binds another {what} than {first_url} ({digest or 'none'}, not {first or 'none'}): "
                "are both given the same key seed (TINYGW_KEY_SEED_FILE)?",
                replica=url,
            )
