"""What the fake provider got and what it answers: a request, a `Reply`, and the two
usual replies (JSON, server-sent events)."""

from __future__ import annotations

import json

from msgspec import Struct, field


class FakeRequest(Struct):
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    connection: int = 0  # which connection it came on: the fake's count of accepted ones
    # Every header line as it came, in order, names lowered (`headers` keeps the last of each name).
    header_lines: list[tuple[str, str]] = field(default_factory=list)

    def json(self):
        return json.loads(self.body) if self.body else None


class Reply(Struct):
    """What to answer. `action`: answer | hang (never answer) | close (no answer) |
    cut (send the head and `chunks`, then close without ending the body) |
    answer_close (answer in full, keep-alive, then close the idle connection) |
    raw (write `body` as the whole response, in one write, and keep the connection:
    for answers that break HTTP on purpose, such as bytes past their content-length;
    `chunks`, if any, are then written as they are, raw pieces of the same response)."""

    status: int = 200
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""
    # A chunked body: (wait, data) pairs, where wait is seconds to sleep or a
    # threading.Event to wait for (a test's gate) before sending data.
    chunks: list[tuple[object, bytes]] | None = None
    action: str = "answer"
    delay_seconds: float = 0.0  # how long to wait before the head (a generation's time)


REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    429: "Too Many Requests",
    500: "Internal Server Error",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
    529: "Overloaded",
}


def json_reply(status: int, value, headers: list[tuple[str, str]] | None = None) -> Reply:
    return Reply(
        status=status, headers=[("content-type", "application/json"), *(headers or [])], body=json.dumps(value).encode()
    )


def sse_reply(events: list[bytes], delay_seconds: float = 0.0, cut: bool = False) -> Reply:
    return Reply(
        headers=[("content-type", "text/event-stream")],
        chunks=[(delay_seconds, e) for e in events],
        action="cut" if cut else "answer",
    )
