"""attest/verify receipt: check a tinygw receipt against a verified attestation (docs/confidential.md).

    attest/verify receipt RECEIPT.json --attestation EVIDENCE.json [--request FILE] [--response FILE] [--json]

EVIDENCE.json is an /attestation answer that attest/verify checked in full and saved
(`--save-attestation FILE`: written only when every check PASSed, with the record of that run,
attest/sealing.py's VERIFIED). Checks, one line each:

  receipt key bound   the evidence's receipt_public_key hashes to its receipt_key_sha256, and its
                      report_data is the v3 one over its own nonce, config and key digests (the
                      quote's REPORTDATA was checked against it when the evidence was verified);
                      SKIP when nothing says the evidence was verified: a hardware provider's, saved
                      with the record of a run whose checks all PASSed (an /attestation answer as
                      it came, `"provider": "none"`, a check FAILed or SKIPped: the key is anyone's)
  receipt fields      the receipt is version 1 with every field, of the right types
  receipt signature   Ed25519, by that key, over the RFC 8785 canonical JSON of every field but
                      `signature`; SKIP (when it holds) by a key that is not trusted
  request hash        (--request FILE) sha256 of the file is the receipt's request_sha256: the
                      request body the gateway received (after EHBP decryption)
  response hash       (--response FILE) sha256 of the file is the receipt's response_sha256: the
                      answer body the gateway sent (before encryption; a stream: every byte of it)

Then, last, the verdict line (checks.Checks.verdict_line), or with --json one document. Exit status
as attest/verify's: 0 every check PASSed, 1 one FAILed, 2 bad usage or a file that cannot be read,
4 none FAILed but one was SKIPped (not proven). Needs `cryptography` (make verifier installs it).
"""

import base64
import binascii
import hashlib
import json
import re
import sys

import sealing
from checks import EXIT_FAILED, EXIT_OK, EXIT_UNVERIFIED, EXIT_USAGE, PASS, Checks
from options import Parser, UsageError

FILE_MAX_BYTES = 64 << 20  # a request body is at most the gateway's limit (10 MiB by default); answers larger
STRINGS = ("id", "client", "route", "model", "provider", "provider_model", "request_sha256", "response_sha256")
INTEGERS = ("v", "created", "status")
_HEX64 = re.compile(r"[0-9a-f]{64}")
# The providers whose evidence is a quote or report that the hardware signed.
HARDWARE_PROVIDERS = ("tdx_guest", "sev_guest")
# What a run must have PASSed for the key to be the quoted gateway's: the key's binding,
# report_data against the quote, and the quote's (or SEV-SNP report's) signature.
VOUCHING_CHECKS = ("receipt key bound", "report_data")
SIGNATURE_CHECKS = ("quote signature", "report signature")


def canonical(fields):
    """RFC 8785 (JCS) of an object of strings and integers below 2**53, which is what a
    receipt holds: Python's json with these options writes exactly that (tinygw/trust/receipts.py)."""
    return json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def parser():
    p = Parser(
        prog="attest/verify receipt",
        description="Check a tinygw receipt against a verified attestation (docs/confidential.md).",
        epilog="exit status: 0 every check PASSed, 1 a check FAILed, 2 bad usage or a local I/O error, "
        "4 unverified (a check was SKIPped: the attestation was not verified)",
    )
    p.add_argument("receipt", metavar="RECEIPT.json", help="the receipt, as GET /v1/receipts/{id} answered it")
    p.add_argument(
        "--attestation",
        required=True,
        metavar="EVIDENCE.json",
        help="the /attestation answer that attest/verify verified and saved (--save-attestation)",
    )
    p.add_argument("--request", metavar="FILE", help="the request body the receipt is for")
    p.add_argument("--response", metavar="FILE", help="the answer body the receipt is for")
    p.add_argument("--json", action="store_true", help="print the checks as one JSON document")
    return p


class LocalError(Exception):
    pass


def read(path, what, limit=FILE_MAX_BYTES):
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise LocalError(f"cannot read {what}: {e.strerror}: {e.filename}") from None
    if len(data) > limit:
        raise LocalError(f"{what} is over {limit} bytes")
    return data


def read_json(path, what):
    try:
        value = json.loads(read(path, what, 1 << 20))
    except (ValueError, RecursionError):
        raise LocalError(f"{what} is not JSON: {path}") from None
    if not isinstance(value, dict):
        raise LocalError(f"{what} is not a JSON object: {path}")
    return value


def unverified(evidence):
    """Why nothing says that `evidence` was verified (its receipt key may be anyone's), or None:
    it is a hardware provider's, saved by attest/verify with the record of a run whose checks
    all PASSed, among them those that bind the key to the quote (VOUCHING_CHECKS, a signature)."""
    quoted = evidence.get("evidence")
    provider = quoted.get("provider") if isinstance(quoted, dict) else None
    if provider not in HARDWARE_PROVIDERS:
        return f"the evidence is from provider {str(provider)[:40]!r}, not a quote the hardware signed"
    record = evidence.get(sealing.VERIFIED)
    results = record.get("checks") if isinstance(record, dict) else None
    if not isinstance(results, list) or not all(isinstance(r, dict) for r in results):
        return (
            "the attestation is not one that attest/verify verified and saved (--save-attestation, "
            "written only when every check PASSed): nothing says its quote was verified"
        )
    names = [str(r.get("name"))[:40] for r in results]
    not_passed = [name for name, r in zip(names, results, strict=True) if r.get("result") != PASS]
    if not_passed or record.get("verdict") != PASS:
        return f"the attestation's checks did not all PASS ({', '.join(not_passed) or 'its verdict'})"
    missing = [n for n in VOUCHING_CHECKS if n not in names]
    missing += [] if set(SIGNATURE_CHECKS) & set(names) else ["quote signature"]
    if missing:
        return f"the attestation's run did not check {', '.join(missing)}"
    return None


def check_key(evidence, checks):
    """(the receipt key of the evidence, whether it is trusted), or (None, False) (a FAIL said)."""
    key, why = sealing.receipt_key(evidence)
    if key is None:
        checks.report("receipt key bound", why)
        return None, False
    config, spki, nonce = evidence.get("config_sha256"), evidence.get("tls_spki_sha256"), evidence.get("nonce")
    digests = sealing.bound_digests(evidence)
    try:
        expected = sealing.report_data_v3(bytes.fromhex(nonce), config, spki, digests).hex()
    except (TypeError, ValueError, AttributeError):
        expected = None
    if expected is None or evidence.get("report_data") != expected:
        checks.report("receipt key bound", "the evidence's report_data is not the v3 one over its own fields")
        return None, False
    why = unverified(evidence)
    checks.report("receipt key bound", why, skip=True, receipt_key_sha256=evidence["receipt_key_sha256"])
    return key, why is None


def check_fields(receipt, checks):
    missing = [n for n in (*INTEGERS, *STRINGS, "signature") if n not in receipt]
    wrong = [n for n in INTEGERS if n in receipt and (type(receipt[n]) is not int)]
    wrong += [n for n in (*STRINGS, "signature") if n in receipt and not isinstance(receipt[n], str)]
    extra = sorted(set(receipt) - {*INTEGERS, *STRINGS, "signature"})
    if missing or wrong or extra or receipt.get("v") != 1:
        parts = [f"missing {', '.join(missing)}"] if missing else []
        parts += [f"wrong type: {', '.join(wrong)}"] if wrong else []
        parts += [f"unknown: {', '.join(extra)}"] if extra else []
        parts += [] if receipt.get("v") == 1 else ["not version 1"]
        checks.report("receipt fields", "; ".join(parts))
        return False
    checks.report("receipt fields", id=receipt["id"])
    return True


def check_signature(receipt, key, trusted, checks):
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    unsigned = {name: value for name, value in receipt.items() if name != "signature"}
    try:
        signature = base64.b64decode(receipt["signature"], validate=True)
        Ed25519PublicKey.from_public_bytes(key).verify(signature, canonical(unsigned))
    except (binascii.Error, ValueError, InvalidSignature):
        return checks.report("receipt signature", "the signature is not the attested receipt key's over this receipt")
    untrusted = "by the evidence's receipt key, which no verified attestation vouches for: proves nothing"
    checks.report("receipt signature", None if trusted else untrusted, skip=True)


def check_hash(name, field, path, what, receipt, checks):
    digest = hashlib.sha256(read(path, what)).hexdigest()
    claimed = receipt.get(field)
    if not isinstance(claimed, str) or not _HEX64.fullmatch(claimed):
        return checks.report(name, f"the receipt has no {field}")
    checks.report(
        name,
        None if digest == claimed else f"sha256 of {path} is {digest[:16]}..., the receipt says {claimed[:16]}...",
        file=digest,
        receipt=claimed,
    )


def run(args, checks):
    receipt = read_json(args.receipt, "the receipt")
    evidence = read_json(args.attestation, "the attestation")
    key, trusted = check_key(evidence, checks)
    if check_fields(receipt, checks) and key is not None:
        check_signature(receipt, key, trusted, checks)
    if args.request:
        check_hash("request hash", "request_sha256", args.request, "--request", receipt, checks)
    if args.response:
        check_hash("response hash", "response_sha256", args.response, "--response", receipt, checks)
    return EXIT_FAILED if checks.failed else EXIT_UNVERIFIED if checks.skipped else EXIT_OK


def main(argv):
    """The exit status of one run; it ends with the verdict line (or the --json document),
    whatever happened, as attest/verify's own runs do."""
    checks = Checks(as_json=any(len(arg) > 2 and "--json".startswith(arg) for arg in argv))
    p, error = parser(), None
    try:
        args = p.parse_args(argv)  # --help: its text, exit 0, no verdict (nothing was run)
        checks.as_json = args.json
        code = run(args, checks)
    except UsageError as e:
        p.print_usage(sys.stderr)
        print(f"attest/verify receipt: error: {e}", file=sys.stderr)
        error, code = f"bad usage: {e}", EXIT_USAGE
    except LocalError as e:
        print(f"attest/verify receipt: {e}", file=sys.stderr)
        error, code = str(e), EXIT_USAGE
    except ImportError:
        checks.report("receipt signature", "the cryptography package is not installed (make verifier)")
        code = EXIT_FAILED
    sys.stderr.flush()  # what went to stderr comes before the verdict, which is the last line
    if checks.as_json:
        print(checks.document(code, **({"error": error} if error else {})), flush=True)
    else:
        print(checks.verdict_line(code, error), flush=True)
    return code
