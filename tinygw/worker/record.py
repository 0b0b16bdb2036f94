"""The values of one proxied request: what the gateway took from it, its record, a
provider's answer, an attempt's ending.

`Record` is what the access log and the metrics say of a request. Its fields are
written here only, by the methods named after the moments of a request (an attempt
begins or ends, the answer starts, output arrives, the stream is cut, the client
leaves), and read once, when the request is over. It also builds the answer's head,
the one place that adds `x-request-id` and the debug headers to a proxied answer.
"""

from __future__ import annotations

import asyncio
from urllib.parse import quote

from msgspec import Struct

from tinygw.config.settings import DEFAULT_CLIENT, Target
from tinygw.protocol import usage
from tinygw.protocol.routing import Route
from tinygw.resilience.breakers import Breakers
from tinygw.resilience.outcome import CLIENT_LEFT, Judgement
from tinygw.upstream.pool import Response

# The status logged and counted for a request whose client left before its answer
# (never sent, there is nobody to send it to).
CLIENT_CLOSED = CLIENT_LEFT.status


class Inbound(Struct, frozen=True):
    """What the gateway took from the client's request."""

    route: Route
    model: str
    stream: bool
    body: bytes
    headers: list[tuple[bytes, bytes]]
    query: bytes
    request_id: bytes  # the request's id, sent upstream as x-request-id
    # The body asks for a stream's usage that the client did not (its tokens are charged):
    # the chunk that only reports it is not relayed.
    usage_asked: bool = False
    conversation: bytes | None = None  # its conversation key, when it chooses the target and key (Resolution.affinity)

    def __repr__(self) -> str:  # its headers hold the gateway key, its body the prompt
        return f"Inbound({self.route.path!r}, model={self.model!r}, request_id={self.request_id.decode()!r})"

    __str__ = __repr__


class Record(Struct):
    """How a request went. `debug` is the worker's breakers once forwarding began with
    `routing.debug` on: the answer's head then says which attempts were made and the
    circuit's state."""

    request_id: bytes
    started_at: float  # the loop's time when the request came
    client: str = DEFAULT_CLIENT  # the named client whose key it presented (docs/design.md section 16)
    admitted: bool = False  # counted in by the client's limits: counted out when it ends
    limited: str | None = None  # the limit that refused it
    debug: Breakers | None = None
    model: str = "unknown"
    status: int = 0  # the status sent (0 while none was), or the one logged
    target: Target | None = None
    asked: bool = False  # a provider was asked: an attempt began
    attempts: list[str] = []  # "provider:status or cause", one per attempt that ended
    cut: bool = False  # a stream that ended without a finish, or with an error after output
    tokens: usage.Tokens | None = None  # what the sent answer's `usage` reported
    first_output_at: float | None = None  # the loop's time when a stream's first output was sent
    # A client charged by its tokens (tokens_per_minute): the bytes an answer that reports
    # no usage is charged by, its request body's and then every answer byte sent (`charging`).
    charged_bytes: int | None = None
    # The loop's time when a send to the client that is `timed` began, while it waits:
    # the client's watch cuts a client that does not take its answer (tinygw.api.body).
    sending_since: float | None = None

    def admitted_in(self) -> None:
        """The client's limits admitted the request: it is counted out when it ends."""
        self.admitted = True

    def limited_by(self, limit: str) -> None:
        """The client's limit `limit` refused the request."""
        self.limited = limit

    def resolved(self, model: str) -> None:
        self.model = model

    def forwarding(self, debug: Breakers) -> None:
        """Forwarding begins with `routing.debug` on: from now on, the answer's head
        carries the x-tinygw-* headers."""
        self.debug = debug

    def aimed_at(self, target: Target) -> None:
        """An attempt at `target` begins."""
        self.target = target
        self.asked = True

    def refused_at(self, target: Target) -> None:
        """Every circuit is open: `target` is the one named in the 503, and no provider was asked."""
        self.target = target

    def attempt_ended(self, target: Target, label: str) -> None:
        self.attempts.append(f"{target.provider}:{label}")

    def failed(self) -> None:
        """The gateway failed the request itself (whatever was sent): logged as 500."""
        self.status = 500

    def output(self, tokens: usage.Tokens, at: float) -> None:
        """A stream's first output went out: its tokens count from now on."""
        self.tokens = tokens
        self.first_output_at = at

    def counted(self, reported: usage.Usage) -> None:
        """A held answer that reports `reported` is sent."""
        self.tokens = reported.tokens()

    def was_cut(self) -> None:
        self.cut = True

    def client_left(self) -> None:
        self.status = CLIENT_CLOSED

    def charging(self, send, body: bytes):
        """`send`, each answer byte it sends counted in `charged_bytes` after `body`'s."""
        self.charged_bytes = len(body)

        async def counted_send(message: dict) -> None:
            if message["type"] == "http.response.body":
                self.charged_bytes += len(message["body"])  # type: ignore[operator]  # set above
            await send(message)

        return counted_send

    def estimate(self) -> int | None:
        """For a client charged by its tokens: what an answer that reported no usage
        costs, its bytes over 4 (docs/design.md section 16); None when it is charged
        what was reported (or nothing: no provider was asked), or is not charged by its tokens."""
        if self.charged_bytes is not None and self.asked:
            if self.tokens is None or not self.tokens.reported:
                return -(-self.charged_bytes // 4)
        return None

    def timed(self, send, loop: asyncio.AbstractEventLoop):
        """`send`, each of its waits marked in `sending_since`: for the answers whose
        sends may wait on the client (a stream, an answer too large to hold); an answer
        held whole goes into the server's buffers without a wait."""

        async def timed_send(message: dict) -> None:
            self.sending_since = loop.time()
            await send(message)
            self.sending_since = None

        return timed_send

    def head(self, status: int, headers: list[tuple[bytes, bytes]], current: str | None = None) -> dict:
        """The `http.response.start` message of the answer, which is now sent; `current`
        is the label of the attempt whose answer it is (at `target`), while that attempt
        has not ended."""
        self.status = status
        headers = [*headers, (b"x-request-id", self.request_id)]
        if self.debug is not None:
            headers += self._debug_headers(self.debug, current)
        return {"type": "http.response.start", "status": status, "headers": headers}

    def _debug_headers(self, breakers: Breakers, current: str | None) -> list[tuple[bytes, bytes]]:
        """docs/design.md section 7's x-tinygw-* headers. The circuit's state is the one
        when the answer started (a probe's verdict comes after)."""
        attempts = self.attempts
        if current and self.target is not None:  # as attempt_ended will write it
            attempts = [*attempts, f"{self.target.provider}:{current}"]
        headers = [(b"x-tinygw-attempts", _header_value(",".join(attempts)))]
        if self.target is not None:
            circuit = breakers.by_target[self.target]
            headers += [
                (b"x-tinygw-provider", _header_value(self.target.provider)),
                # headers go in the clear past whatever ends TLS: a sealed body's name stays concealed
                (b"x-tinygw-provider-model", _header_value(self.target.shown_model)),
                (b"x-tinygw-circuit", circuit.state().value.encode()),
            ]
        return headers


def _header_value(text: str) -> bytes:
    """Visible ASCII as is, anything else percent-encoded: a provider-qualified model
    is the client's own text, and a line break in a header would break the response."""
    return quote(text, safe=_VISIBLE).encode()


_VISIBLE = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) != "%")


class HeldAnswer(Struct, frozen=True):
    """A provider's answer as the client would get it, not yet sent: it is sent if no
    later attempt is made. `rest` is the provider's response still being read when the
    answer was too large to hold (`body` is then its beginning); it must be relayed or
    closed."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes
    rest: Response | None = None

    async def discard(self) -> None:
        if self.rest is not None:
            await self.rest.aclose()


class Attempt(Struct, frozen=True):
    """How one attempt ended: a value, made when it ended (and made anew, with
    `committed`, once its answer is the client's). What the ending means is `judged`
    (tinygw.resilience.outcome); the rest is what this attempt holds."""

    judged: Judgement
    committed: bool = False  # the client already has the answer (or its start)
    answer: HeldAnswer | None = None  # the provider's, when the client can use it
    other_key: bool = False  # a 429, and another of the provider's keys is free

    async def discard(self) -> None:
        """Another attempt follows: this one's answer will not be sent."""
        if self.answer is not None:
            await self.answer.discard()
