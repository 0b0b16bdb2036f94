"""Fetching /attestation for attest/verify: one deadline for the whole run, bounded answers.

`Deadline` bounds everything verify waits for (connecting, TLS, the request, the answer,
fetching collateral): each socket operation may take at most what is left, and an
interval timer raises `TimedOut` where it is, should anything block longer (a server
dripping a byte at a time, a collateral server that never answers). A 503 with
Retry-After is retried while the deadline allows. The answer is at most
ANSWER_MAX_BYTES and nested at most DEPTH_MAX levels; anything else is a `FetchFailed`,
which verify prints as one line.
"""

from __future__ import annotations

import http.client
import json
import signal
import ssl
import time
import urllib.parse

# An answer holds a quote (5 to 10 KiB), a certificate and an event log of a line per launch.
ANSWER_MAX_BYTES = 1 << 20
# The answer is a few levels deep; a deeper one is an attack on the parser, not evidence.
DEPTH_MAX = 64
RETRY_AFTER_MAX_SECONDS = 60


class FetchFailed(Exception):
    """The answer could not be had, or is not one: the message says why, in one line."""


class TimedOut(BaseException):
    """The run's deadline passed. A BaseException, so that no `except Exception` on the
    way (http.client, ssl, asyncio, dcap-qvl's fetch) can swallow it."""


class Deadline:
    """`with Deadline(seconds):` arms an interval timer (the main thread's SIGALRM) that
    raises TimedOut; `remaining()` is what socket timeouts are set to."""

    def __init__(self, seconds: float, clock=time.monotonic):
        self.seconds = seconds
        self.clock = clock
        self.end = clock() + seconds
        self._previous = None

    def remaining(self) -> float:
        left = self.end - self.clock()
        if left <= 0:
            raise TimedOut()
        return left

    def __enter__(self) -> Deadline:
        def expired(signum, frame):
            raise TimedOut()

        self._previous = signal.signal(signal.SIGALRM, expired)
        signal.setitimer(signal.ITIMER_REAL, self.seconds)
        return self

    def __exit__(self, *exc) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, self._previous or signal.SIG_DFL)


def fetch(url: str, nonce: bytes, deadline: Deadline) -> tuple[dict, bytes | None]:
    """(the answer, DER of the certificate its connection was served with, or None).

    Over https the certificate is not checked against any CA: what counts is that its
    key is the attested one (the `tls channel` check), taken from the very connection
    that carried the answer. A 503 with Retry-After is asked again, on a new connection."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise FetchFailed(f"not an http(s) URL: {url!r}")
    path = f"{parts.path.rstrip('/')}/attestation?nonce={nonce.hex()}"
    while True:
        status, retry_after, body, peer = _get(parts, path, deadline)
        if status == 503 and retry_after is not None:
            if retry_after >= deadline.remaining():
                raise FetchFailed(f"HTTP 503 (busy), and Retry-After {retry_after:g} s is past the deadline")
            time.sleep(max(retry_after, 0.1))
            continue
        if status != 200:
            raise FetchFailed(f"HTTP {status}: {_printable(body[:300])}")
        return parse_answer(body), peer


def _get(parts, path: str, deadline: Deadline) -> tuple[int, float | None, bytes, bytes | None]:
    timeout = deadline.remaining()
    if parts.scheme == "https":
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE  # the attestation vouches for the key instead
        connection = http.client.HTTPSConnection(parts.hostname, parts.port or 443, timeout=timeout, context=context)
    else:
        connection = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout)
    try:
        connection.request("GET", path)
        sock = connection.sock
        peer = sock.getpeercert(binary_form=True) if parts.scheme == "https" else None
        response = connection.getresponse()
        body = b""
        while len(body) <= ANSWER_MAX_BYTES and not response.isclosed():
            sock.settimeout(deadline.remaining())
            chunk = response.read1(65536)
            if not chunk:
                break
            body += chunk
    except TimeoutError:
        raise TimedOut() from None
    except (OSError, http.client.HTTPException, ValueError) as e:
        raise FetchFailed(f"cannot reach {parts.scheme}://{parts.netloc}: {_printable(str(e))}") from None
    finally:
        connection.close()
    if len(body) > ANSWER_MAX_BYTES:
        raise FetchFailed(f"the answer is over {ANSWER_MAX_BYTES} bytes")
    return response.status, _retry_after(response.getheader("retry-after")), body, peer


def _retry_after(value: str | None) -> float | None:
    """Whole seconds (RFC 9110's delay-seconds), capped; None when absent or not a number."""
    if value is None or not value.strip().isdigit():
        return None
    return min(float(value.strip()), RETRY_AFTER_MAX_SECONDS)


def parse_answer(body: bytes) -> dict:
    """The answer, a JSON object at most DEPTH_MAX deep, or FetchFailed saying what it is instead."""
    if len(body) > ANSWER_MAX_BYTES:
        raise FetchFailed(f"the answer is over {ANSWER_MAX_BYTES} bytes")
    try:
        answer = json.loads(body)
    except RecursionError:
        raise FetchFailed(f"the answer is nested deeper than {DEPTH_MAX} levels") from None
    except ValueError as e:  # UnicodeDecodeError and JSONDecodeError among them
        raise FetchFailed(f"the answer is not JSON: {_printable(str(e))}") from None
    if depth(answer) > DEPTH_MAX:
        raise FetchFailed(f"the answer is nested deeper than {DEPTH_MAX} levels")
    if not isinstance(answer, dict):
        raise FetchFailed("the answer is not a JSON object")
    return answer


def depth(value) -> int:
    """How deeply lists and objects nest in `value` (a scalar is 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, level)
            stack.extend((child, level + 1) for child in children)
    return deepest


def _printable(text) -> str:
    """One line of at most 300 printable characters, whatever a server sent."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    return "".join(c if c.isprintable() else " " for c in text)[:300]
