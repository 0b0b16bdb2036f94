"""GET /attestation?nonce=HEX: the page that hands a client the evidence (docs/design.md).

What goes into the evidence and how it is fetched is `tinygw.trust.attestation`; this
page parses the nonce, waits its turn for a quote (`tinygw.trust.evidence_queue`), and
answers in JSON. A refusal is a 503 with Retry-After; its warning is rate-limited.
"""

from __future__ import annotations

import asyncio
import base64
import logging

import msgspec

from tinygw import __version__, logs
from tinygw.errors import EvidenceUnavailable
from tinygw.protocol.wire import JSON_HEADERS, error_body
from tinygw.trust.attestation import fetch_evidence, parse_nonce, read_event_log, report_data
from tinygw.trust.evidence_queue import RETRY_AFTER_SECONDS

_encode = msgspec.json.Encoder()
_HEADERS = [*JSON_HEADERS, (b"cache-control", b"no-store")]
_SNP_FIELDS = ("platform", "report", "vcek", "ask", "ark")
_KEY_DIGESTS = ("hpke_key_sha256", "receipt_key_sha256")
_REFUSED_HEADERS = [*_HEADERS, (b"retry-after", b"%d" % RETRY_AFTER_SECONDS)]


async def attestation_page(gateway, scope, send) -> None:
    try:
        nonce = parse_nonce(scope.get("query_string", b""))
    except ValueError as e:
        await _send(send, 400, error_body(str(e), "invalid_request_error", "invalid_nonce"))
        return
    config_sha256 = gateway.settings.config_sha256()
    keys = _confidential_keys(gateway.confidential)
    data = report_data(nonce, config_sha256, gateway.tls_spki_sha256, *[keys.get(k) for k in _KEY_DIGESTS])
    try:
        artifact_sha256, artifact_sha384 = await gateway.artifact_hashes()
        client = scope.get("client")
        # one quote at a time (the platform makes them slowly); a full queue is shared fairly by address
        async with gateway.evidence_queue.turn(client[0] if client else None):
            evidence = await fetch_evidence(gateway.settings.tsm_report_dir, data)
        events = await asyncio.to_thread(read_event_log, gateway.settings.event_log)
    except EvidenceUnavailable as e:
        # Anyone may ask, so anyone could flood the log: one line a minute, with the count.
        if (count := gateway.attestation_refusals.note(gateway.clock())) is not None:
            logs.log(logging.WARNING, "attestation failed", reason=str(e), count=count)
        await _send(send, 503, error_body(str(e), "attestation_unavailable", e.code), _REFUSED_HEADERS)
        return
    answer = {
        "version": __version__,
        "artifact_sha256": artifact_sha256,
        "artifact_sha384": artifact_sha384,
        "config_sha256": config_sha256,
        "nonce": nonce.hex(),
        "report_data": data.hex(),
        "event_log": events,
        "evidence": evidence,
    }
    # SEV-SNP: the report and the host's certificates also at the top, where clients look for them.
    answer.update({name: evidence[name] for name in _SNP_FIELDS if name in evidence})
    if gateway.tls_spki_sha256 is not None:
        answer["tls_spki_sha256"] = gateway.tls_spki_sha256
        answer["tls_certificate"] = gateway.tls_certificate
    answer.update(keys)
    await _send(send, 200, _encode.encode(answer))


def _confidential_keys(confidential) -> dict[str, str]:
    """The EHBP key configuration and the receipt key, with their digests, of those on (docs/confidential.md)."""
    if confidential is None:
        return {}
    keys = {}
    if confidential.hpke is not None:
        keys["hpke_key_config"] = base64.b64encode(confidential.hpke.config).decode()
        keys["hpke_key_sha256"] = confidential.hpke.config_sha256
    if confidential.signer is not None:
        keys["receipt_public_key"] = confidential.signer.public_key.hex()
        keys["receipt_key_sha256"] = confidential.signer.public_key_sha256
    return keys


async def _send(send, status: int, body: bytes, headers: list = _HEADERS) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
