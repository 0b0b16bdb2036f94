"""A proxied request's confidential side (docs/confidential.md): its EHBP body opened, its
answer sealed, hashed and receipted; and the two pages, /.well-known/hpke-keys and
/v1/receipts/{id}.

`Exchange` wraps the request's ASGI `send` innermost, next to the server, so that every
answer the request gets after its body was opened passes through it, whoever sends it
(a held answer, a stream, the gateway's own errors, Anthropic-shaped or not): each body
piece is hashed as it is sent (the receipt's `response_sha256`: before encryption, after
the gateway's own shaping) and, for an EHBP request, sealed as one frame, the head's
`content-length` dropped and `Ehbp-Response-Nonce` added. The receipt is kept before the
answer's last piece goes out, so that a client that fetches it after reading its answer
finds it. An answer that is not a stream of events has its head held back until its
first body piece, which every answer path sends right after the head: when that piece is
the whole body (a held answer), the head carries the signed receipt whole
(`x-tinygw-receipt`), for a client behind a balancer. Answers
before the body was opened (401, 413, 408: nothing of the client's was read) are neither
sealed nor receipted. Nothing here logs, counts or keeps a body; the names a sealed body
carried are shown concealed wherever others read them (`Exchange.shown`).

The trust modules behind it (on cryptography) are loaded only when EHBP or receipts
are on (tinygw.worker.gateway); this module reaches them through the worker's
`Confidential`.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Container
from typing import TYPE_CHECKING

from tinygw.api.body import Refused
from tinygw.errors import SealedBodyRefused
from tinygw.protocol.routing import Resolution, concealed
from tinygw.protocol.wire import JSON_HEADERS, error_body

if TYPE_CHECKING:
    from tinygw.config.settings import Target
    from tinygw.trust.confidential import Confidential
    from tinygw.trust.ehbp import Sealer
    from tinygw.worker.record import Record

ENCAPSULATED_KEY_HEADER = b"ehbp-encapsulated-key"
RESPONSE_NONCE_HEADER = b"ehbp-response-nonce"
RECEIPT_ID_HEADER = b"x-tinygw-receipt-id"
RECEIPT_HEADER = b"x-tinygw-receipt"
KEYS_PATH = "/.well-known/hpke-keys"
RECEIPT_PREFIX = "/v1/receipts/"
_KEYS_HEADERS = [(b"content-type", b"application/ohttp-keys")]
_PROBLEM_HEADERS = [(b"content-type", b"application/problem+json")]
_RECEIPT_HEADERS = [*JSON_HEADERS, (b"cache-control", b"no-store")]
KEY_CONFIG_PROBLEM = b"urn:ietf:params:ehbp:error:key-config"
# The largest sealed body opened on the worker's loop (well under a millisecond of AES-GCM,
# however it is framed); a larger one is opened in a thread (docs/confidential.md).
OPEN_ON_LOOP_BYTES = 64 * 1024
_STREAMS = (b"text/event-stream", b"application/vnd.amazon.eventstream")


def _streamed(headers) -> bool:
    """Whether an answer's head says it is a stream of events (SSE, or Bedrock's frames)."""
    return any(name == b"content-type" and value.startswith(_STREAMS) for name, value in headers)


def _owner(client: str) -> bytes:
    """What a receipt is kept under: its client's name, as a fixed-size digest."""
    return hashlib.sha256(client.encode()).digest()


def exchange(gateway, route: str, scope, first: dict, send) -> Exchange:
    """A proxied request's Exchange; `send` is the server's own."""
    return Exchange(gateway.confidential, route, first, send, time.time)


class Exchange:
    """One proxied request's confidential side, from its dispatch to its end (see the
    module's doc). Made only when EHBP or receipts are on."""

    def __init__(self, confidential: Confidential, route: str, first: dict, send, now) -> None:
        self._confidential = confidential
        self._inner = send
        self._encapsulated_key = first.get(ENCAPSULATED_KEY_HEADER)
        self._route = route
        self._now = now  # the wall clock, for the receipt's `created`
        self._sealer: Sealer | None = None
        self._record: Record | None = None
        self._response: hashlib._Hash | None = None  # the answer's sha256 so far (receipts on, body opened)
        self._request_sha256 = ""
        self._model = ""
        self._receipt_id: str | None = None
        self._status = 0
        self._head: dict | None = None  # a held answer's head, sent with its body and its receipt
        self._signed: bytes | None = None  # that receipt, signed, as RECEIPT_HEADER's value

    async def open(self, body: bytes, record: Record) -> bytes:
        """The request body as the gateway routes it: opened when sealed. Raises
        SealedBodyRefused when it does not open, and Refused for a plain request when
        EHBP is `required`. A body over OPEN_ON_LOOP_BYTES is opened in a thread: its frames
        cost an AES-GCM open each, and the loop serves the worker's other requests meanwhile."""
        confidential = self._confidential
        if self._encapsulated_key is not None and body and confidential.hpke is not None:
            if len(body) > OPEN_ON_LOOP_BYTES:
                opened = await asyncio.to_thread(confidential.hpke.open, self._encapsulated_key, body)
            else:
                opened = confidential.hpke.open(self._encapsulated_key, body)
            body = opened.plaintext
            self._sealer = opened.sealer()
        elif confidential.ehbp_mode == "required":
            raise Refused(
                400,
                "this gateway takes only EHBP-encrypted requests (TINYGW_EHBP=required): seal the body to "
                f"the key at {KEYS_PATH} and send Ehbp-Encapsulated-Key",
                "ehbp_required",
            )
        if confidential.ring is not None:
            self._record = record
            self._request_sha256 = hashlib.sha256(body).hexdigest()
            self._response = hashlib.sha256()
        return body

    def shown(self, resolution: Resolution, configured: Container[Target]) -> Resolution:
        """`resolution` as others may see it: when the body was sealed, the names it carried
        concealed (tinygw.protocol.routing.concealed; `configured`: the operator's targets)."""
        if self._sealer is None:
            return resolution
        return concealed(resolution, configured, self._confidential.conceal)

    def named(self, model: str) -> None:
        """The model the request names, as the gateway read it (in its body, or in its path
        for a cloud shape): the receipt's `model` ("" when it names none it can read)."""
        self._model = model

    async def send(self, message) -> None:
        """The request's `send`: its answer sealed and hashed as it goes out."""
        if message["type"] == "http.response.start":
            headers = message["headers"]
            held = self._response is not None and not _streamed(headers)
            if self._sealer is not None:
                headers = [(name, value) for name, value in headers if name != b"content-length"]
                headers.append((RESPONSE_NONCE_HEADER, self._sealer.nonce_header))
            if self._response is not None:
                self._receipt_id = self._confidential.allocate()
                self._status = message["status"]
                headers = [*headers, (RECEIPT_ID_HEADER, self._receipt_id.encode())]
            message = {**message, "headers": headers}
            if held:
                self._head = message
                return
        elif message["type"] == "http.response.body" and (self._sealer is not None or self._response is not None):
            body = message.get("body", b"")
            if self._response is not None:
                self._response.update(body)
                if not message.get("more_body"):
                    self._keep()
            if self._sealer is not None:
                message = {**message, "body": self._sealer.seal(body)}
            if self._head is not None:
                await self._inner(self._held_head())
        await self._inner(message)

    def _held_head(self) -> dict:
        """A held answer's head, with its signed receipt when its body came whole."""
        head, signed = self._head or {}, self._signed
        self._head = self._signed = None
        if signed is None:  # a body in pieces after all: its receipt by id only
            return head
        return {**head, "headers": [*head["headers"], (RECEIPT_HEADER, signed)]}

    def close(self) -> None:
        """The request is over: an answer cut short gets its receipt, of what was sent."""
        self._keep()

    def _keep(self) -> None:
        receipt_id, record, response = self._receipt_id, self._record, self._response
        if receipt_id is None or record is None or response is None:
            return
        self._receipt_id = None
        target = record.target
        fields = {
            "v": 1,
            "id": receipt_id,
            "created": int(self._now()),
            "client": record.client,
            "route": self._route,
            "model": self._model,
            "provider": target.provider if target is not None else "",
            "provider_model": target.upstream_model if target is not None else "",
            "status": self._status,
            "request_sha256": self._request_sha256,
            "response_sha256": response.hexdigest(),
        }
        self._confidential.keep(receipt_id, _owner(record.client), fields)  # served to its client only (receipt_page)
        if self._head is not None:  # a held answer: its head carries the receipt
            self._signed = self._confidential.receipt_header(fields)

    async def refuse(self, e: SealedBodyRefused, record: Record) -> None:
        """The protocol's own error, in the clear (the client has no key to read another),
        with the head a proxied answer gets (x-request-id)."""
        kind = KEY_CONFIG_PROBLEM if e.status == 422 else b"about:blank"
        body = b'{"type":"%s","title":"%s","status":%d}' % (kind, e.title.encode(), e.status)
        await self._inner(record.head(e.status, _PROBLEM_HEADERS))
        await self._inner({"type": "http.response.body", "body": body})


async def hpke_keys_page(gateway, scope, send) -> None:
    """GET /.well-known/hpke-keys: the key configuration to seal requests to (no auth)."""
    confidential = gateway.confidential
    if confidential is None or confidential.hpke is None:
        await _not_found(send, "EHBP is off on this gateway (TINYGW_EHBP)", "not_found")
        return
    await send({"type": "http.response.start", "status": 200, "headers": _KEYS_HEADERS})
    await send({"type": "http.response.body", "body": confidential.hpke.config})


async def receipt_page(gateway, scope, send) -> None:
    """GET /v1/receipts/{id}: a receipt, to the client that made its request only."""
    confidential = gateway.confidential
    if confidential is None or confidential.ring is None:
        await _not_found(send, "receipts are off on this gateway (TINYGW_RECEIPTS)", "not_found")
        return
    receipt_id = scope["path"][len(RECEIPT_PREFIX) :]
    client = gateway.auth.client(scope["headers"])  # the dispatch let it in: it is one
    receipt = confidential.receipt(receipt_id, _owner(client or ""))
    if receipt is None:  # never kept, dropped, or another client's: said alike
        await _not_found(send, "no such receipt (the oldest are dropped)", "receipt_not_found")
        return
    await send({"type": "http.response.start", "status": 200, "headers": _RECEIPT_HEADERS})
    await send({"type": "http.response.body", "body": receipt})


async def _not_found(send, message: str, code: str) -> None:
    await send({"type": "http.response.start", "status": 404, "headers": JSON_HEADERS})
    await send({"type": "http.response.body", "body": error_body(message, "invalid_request_error", code)})
