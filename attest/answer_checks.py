"""The checks of one /attestation answer that every platform shares, for attest/verify (docs/verify.md).

nonce echoed, tls channel, report_data, the event log's replay to RTMR3, artifact measured,
config; then the platform's own (attest/tdx.py, attest/snp.py), chosen by the evidence's
provider, after `check_policy_platform` made sure a policy of one platform is not sidestepped
by the other's evidence. `check_answer` runs them all, in order.
"""

import hashlib
import re
import urllib.parse

import sealing
import tdx

try:
    import snp
except ImportError:  # no `cryptography` (make verifier installs it): SEV-SNP cannot be checked, and says so
    snp = None

DOMAIN = b"tinygw.attest.v1"
DOMAIN_TLS = b"tinygw.attest.v2"
SHA384_HEX = re.compile(r"[0-9a-f]{96}")
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
# The platforms whose evidence this verifier reads, by configfs-tsm provider.
PLATFORMS = {tdx.PROVIDER: tdx, **({snp.PROVIDER: snp} if snp else {})}
NO_SNP = "SEV-SNP needs the cryptography package (make verifier installs it)"


def spki_sha256(certificate, der=False):
    """sha256 hex of a certificate's DER SubjectPublicKeyInfo (`cryptography` parses it)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    load = x509.load_der_x509_certificate if der else x509.load_pem_x509_certificate
    cert = load(certificate if der else certificate.encode())
    spki = cert.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(spki).hexdigest()


def tls_channel(answer, peer):
    """None when the connection's certificate is the attested one, else why not."""
    attested = answer.get("tls_spki_sha256")
    if not isinstance(attested, str) or not SHA256_HEX.fullmatch(attested):
        return "the answer attests no TLS key (tls_spki_sha256): is TINYGW_TLS on?"
    if peer is None:
        return "the connection was served with no certificate"
    try:
        served = spki_sha256(peer, der=True)
        certificate = answer.get("tls_certificate")
        claimed = spki_sha256(certificate) if isinstance(certificate, str) else None
    except ImportError:
        return "the cryptography package is not installed (make verifier)"
    except (ValueError, UnicodeError) as e:
        return f"cannot read a certificate: {str(e)[:200]}"
    if claimed != attested:
        return "the attested tls_certificate does not hold the attested key"
    if served != attested:
        return (
            f"this connection was served with key {served[:16]}..., the gateway attests {attested[:16]}...: "
            "something between you and the gateway terminates TLS"
        )
    return None


def replay(events):
    """RTMR3 after the log's rtmr3 events, from 48 zero bytes."""
    register = bytes(48)
    for number, event in enumerate(events, 1):
        if not isinstance(event, dict):
            raise ValueError(f"event {number} is not an object")
        if event.get("register") != "rtmr3":
            continue
        digest = event.get("digest_sha384")
        if not isinstance(digest, str) or not SHA384_HEX.fullmatch(digest):
            raise ValueError(f"event {number} has no sha384 digest")
        register = hashlib.sha384(register + bytes.fromhex(digest)).digest()
    return register


def evidence_of(answer):
    """(the platform module, its evidence) or (None, None), and why there is none."""
    evidence = answer.get("evidence") if isinstance(answer.get("evidence"), dict) else {}
    provider = evidence.get("provider")
    if provider == "none":
        return None, None, "no hardware evidence"
    platform = PLATFORMS.get(provider) if isinstance(provider, str) else None
    if platform is None:
        return (
            None,
            None,
            (
                NO_SNP
                if provider == "sev_guest"
                else f"evidence from {str(provider)[:40]!r}: this verifier reads {', '.join(PLATFORMS)}"
            ),
        )
    quote, reason = platform.Quote.from_evidence(evidence)
    return platform, quote, reason


def check_report_data(answer, nonce, https, quote, no_quote, skip, checks):
    spki, config = answer.get("tls_spki_sha256"), answer.get("config_sha256")
    with_tls = isinstance(spki, str) and SHA256_HEX.fullmatch(spki) is not None
    if not isinstance(config, str) or not SHA256_HEX.fullmatch(config):
        return checks.report("report_data", "the answer has no config_sha256")
    if https and not with_tls:
        return checks.report(
            "report_data", "over https the report_data must bind the TLS key (v2), and this one does not"
        )
    keys = sealing.bound_digests(answer)  # EHBP's and receipts' keys: v3 (docs/confidential.md)
    if keys is not None:
        expected = sealing.report_data_v3(nonce, config, spki if with_tls else None, keys)
    elif with_tls:
        expected = hashlib.sha512(DOMAIN_TLS + nonce + bytes.fromhex(config) + bytes.fromhex(spki)).digest()
    else:
        expected = hashlib.sha512(DOMAIN + nonce + bytes.fromhex(config)).digest()
    if answer.get("report_data") != expected.hex():
        checks.report("report_data", "the answer's report_data is not the one for this nonce and config_sha256")
    elif quote is None:
        checks.report("report_data", no_quote, skip=skip)
    elif quote.report_data != expected:
        checks.report("report_data", "the quote's REPORTDATA is not the one for this nonce and config_sha256")
    else:
        checks.report("report_data", expected=expected.hex())


def check_event_log(answer, sha384, quote, no_quote, skip, checks):
    events = answer.get("event_log")
    if not isinstance(events, list):
        checks.report("event log replays to RTMR3", "the answer has no event log")
        events = []
    elif quote is None:
        checks.report("event log replays to RTMR3", no_quote, skip=skip)
    else:
        try:
            replayed = replay(events)
            checks.report(
                "event log replays to RTMR3",
                None
                if replayed == quote.rtmr3
                else f"replay gives {replayed.hex()[:16]}..., the quote holds {quote.rtmr3.hex()[:16]}...",
                replayed=replayed.hex(),
                quote=quote.rtmr3.hex(),
            )
        except ValueError as e:
            checks.report("event log replays to RTMR3", str(e))
    # Only rtmr3 events are covered by the replay, and each of them must be this artifact:
    # anything else in the register (another binary, whatever its label) ran here too.
    measured = [e for e in events if isinstance(e, dict) and e.get("register") == "rtmr3"]
    others = [e for e in measured if (e.get("type"), e.get("digest_sha384")) != ("tinygw.artifact", sha384)]
    if len(others) == len(measured):
        checks.report("artifact measured", f"no rtmr3 event measures sha384:{sha384[:16]}...", expected=sha384)
    elif others:
        other = others[0]
        checks.report(
            "artifact measured",
            f"RTMR3 also measures {str(other.get('type'))[:60]!r} sha384:{str(other.get('digest_sha384'))[:16]}...",
        )
    elif quote is None:  # the log says so, but no quote backs the log
        checks.report("artifact measured", no_quote, skip=skip)
    else:
        checks.report("artifact measured", expected=sha384)


# The policy fields that pin a TDX image or machine (`tcb` only widens what is accepted).
TDX_PINS = (*tdx.BODY_FIELDS, "fmspc", "platform_ids", "min_tcb_evaluation_data_number")
PLATFORM_NAMES = {"tdx_guest": "Intel TDX", "sev_guest": "AMD SEV-SNP"}


def check_policy_platform(platform, policy, checks):
    """A policy that pins one platform only is not sidestepped by the other's evidence (a genuine
    machine of that platform running anything): each pinned field FAILs. A policy that pins both
    (one file for a mixed fleet) leaves the evidence to its own platform's fields."""
    tdx_pins = [name for name in TDX_PINS if policy.names(name)]
    snp_pins = sorted(policy.snp or {})
    if platform is tdx and snp_pins and not tdx_pins:
        others = [(f"snp.{key}", f"snp.{key}") for key in snp_pins]
    elif platform is not tdx and tdx_pins and not snp_pins:
        others = [(tdx.CHECK_NAMES[name], name) for name in tdx_pins]
    else:
        return
    for check, field in others:
        checks.report(
            check,
            f"policy {field}: the evidence is {PLATFORM_NAMES[platform.PROVIDER]}, and the policy "
            f"pins only the other platform",
        )


def check_answer(answer, peer, nonce, url, sha384, policy, args, checks):
    """Every check of one answer, in order; the policy its evidence satisfies, or None."""
    platform, quote, no_quote = evidence_of(answer)
    provider = answer["evidence"].get("provider") if isinstance(answer.get("evidence"), dict) else None
    skip = args.allow_no_evidence and provider == "none"
    checks.note(f"gateway {str(answer.get('version'))[:40]!r} at {url}, evidence from {str(provider)[:40]!r}")
    checks.report("nonce echoed", None if answer.get("nonce") == nonce.hex() else "the answer is for another nonce")
    https = urllib.parse.urlsplit(url).scheme == "https"
    if https:
        checks.report("tls channel", tls_channel(answer, peer))
    else:  # no key to bind: what follows is about some gateway's evidence, not about this connection
        checks.caveat = "over plain http:// nothing binds this evidence to this connection"
        checks.note(
            "note: plain http://: nothing binds this evidence to this connection: whatever answers at this "
            "address (the host, a relay) may pass on another gateway's answer; serve attested TLS "
            "(TINYGW_TLS=attested) and verify its https:// URL, whose check tls channel binds it"
        )
    check_report_data(answer, nonce, https, quote, no_quote, skip, checks)
    sealing.check_keys(answer, args, checks)
    if platform is None or platform.RUNTIME_REGISTER:  # SEV-SNP has none: snp.check says what binds the artifact
        check_event_log(answer, sha384, quote, no_quote, skip, checks)
    config = answer.get("config_sha256")
    if args.config_sha256:
        checks.report(
            "config",
            None
            if config == args.config_sha256.lower()
            else f"the gateway runs config_sha256 {str(config)[:64]}, not {args.config_sha256}",
            answer=config,
            expected=args.config_sha256.lower(),
        )
    else:  # the measured binary forwards prompts wherever its configuration says
        checks.note(
            f"note: no --config-sha256: the configuration (config_sha256 {str(config)[:64]}), which names "
            "the providers that receive your prompts, is not checked"
        )
    if quote is None:
        checks.report(platform.SIGNATURE_CHECK if platform else "quote signature", no_quote, skip=skip)
        return None
    check_policy_platform(platform, policy, checks)
    return platform.check(quote, policy, args, checks)
