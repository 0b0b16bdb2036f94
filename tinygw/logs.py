"""JSON lines on stderr. A log record carries named fields, never a key or a body.

Call sites pass their fields through `extra={"fields": {...}}`; `log()` is the short
form. Granian's own loggers are routed through the same formatter.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import select
import sys
from time import time
from urllib.parse import unquote_plus

import msgspec
from msgspec import UNSET, UnsetType

LOGGER_NAME = "tinygw"

_encode = msgspec.json.Encoder()


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {
            "ts": round(record.created, 3),  # wall clock, for people reading the log
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if fields:
            line.update(fields)
        if record.exc_info and record.exc_info[0] is not None:
            # The type only: an exception's message may quote a request.
            line["exception"] = record.exc_info[0].__name__
        return _encode.encode(line).decode()


def configure(level: str) -> None:
    """Route tinygw's and Granian's loggers to stderr as JSON lines."""
    global _access_on
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    for name in (LOGGER_NAME, "_granian", "granian", "granian.access"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.propagate = False
        logger.setLevel(level.upper())
    _access_on = _logger.isEnabledFor(logging.INFO)


def granian_log_config(level: str) -> dict:
    """Granian's `log_dictconfig`, so that its own lines are JSON too."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {"()": JsonFormatter}},
        "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "json", "stream": "ext://sys.stderr"}},
        "loggers": {
            "_granian": {"handlers": ["stderr"], "level": level.upper(), "propagate": False},
            "granian.access": {"handlers": ["stderr"], "level": level.upper(), "propagate": False},
        },
    }


_logger = logging.getLogger(LOGGER_NAME)
# Whether access lines are written (the level is info or lower): set by configure(), the
# one place that sets the level, so that a request checks a flag, not the logger.
_access_on = False


def log(level: int, message: str, **fields: object) -> None:
    if _logger.isEnabledFor(level):
        flush()
        _logger.log(level, message, extra={"fields": fields})


def log_exception(message: str, **fields: object) -> None:
    """An error line naming the exception's type (never its message) and the fields."""
    flush()
    _logger.error(message, exc_info=True, extra={"fields": fields})


# Access lines wait for the loop's next turn and are written together, in writes of
# whole lines of at most PIPE_BUF bytes: such a write to a pipe is atomic, so the lines
# of workers sharing one stderr never interleave. Under load that is one write(2), and
# one wake-up of the pipe's reader, for many requests instead of one each (a write of
# one line costs the worker ~1 µs alone; 13 lines in one write, ~0.1 µs a line).
_PIPE_BUF = select.PIPE_BUF
_batch: list[bytes] = []


class RequestLine(msgspec.Struct, kw_only=True):
    """The fields of the one `request` line a request writes, in their order: how it went
    (a refused request's line has only the first five of them: the others are UNSET, left
    out), then what the client asked (`access` sets these and the time)."""

    ts: float = 0.0  # wall clock, as JsonFormatter: for people
    level: str = "info"
    logger: str = LOGGER_NAME
    msg: str = "request"
    route: str | None
    model: str | None
    status: int
    worker: int
    request_id: str
    client: str | UnsetType = UNSET
    target: str | None | UnsetType = UNSET
    attempts: str | UnsetType = UNSET
    cut: bool | UnsetType = UNSET
    duration_ms: float | UnsetType = UNSET
    tokens_estimated: bool | UnsetType = UNSET  # a client charged by its tokens: its answer's were estimated
    path: str = ""
    user_agent: str | None = None


def access(loop: asyncio.AbstractEventLoop, path: str, query: bytes, agent: bytes | None, line: RequestLine) -> None:
    """Write `line`, at level info, with what the client asked, for "why did my agent get
    a 404": the `path` (with its `query` string, as ASGI gives it, credential values
    redacted) and the `user_agent` (`agent`, its first user-agent header, cut to
    MAX_USER_AGENT_BYTES).
    The hot path's log line, so it skips the logging module (a record, a formatter, a
    lock and a flush: about 30 µs) and goes to stderr with the other lines of this turn
    of `loop`. Same shape as the other lines."""
    if not _access_on:
        return
    line.ts = round(time(), 3)
    line.path = f"{path}?{_redacted(query.decode('latin-1'))}" if query else path
    line.user_agent = agent if agent is None else agent[:MAX_USER_AGENT_BYTES].decode("latin-1")
    if not _batch:  # the turn's first line: the batch is written when the turn is over
        loop.call_soon(flush)
    _batch.append(_encode.encode_lines((line,)))  # the line and its newline, in one call


# Query parameters whose value is a credential: logged as "***". A name also counts when
# it ends in one of these (x_api_key, access_token, client_secret).
_CREDENTIAL_PARAMETERS = (
    "key",
    "api_key",
    "apikey",
    "token",
    "access_token",
    "auth",
    "authorization",
    "password",
    "passwd",
    "secret",
    "signature",
    "sig",
    "session",
    "code",
    "jwt",
    "credential",
)
_CREDENTIAL_ENDINGS = ("key", "token", "secret", "password", "signature")
# Every name above, and every name with one of the endings, holds one of these (or is
# percent-encoded): a query without any is logged as it is, unparsed.
_CREDENTIAL_HINTS = ("key", "token", "auth", "pass", "secret", "sig", "session", "code", "jwt", "credential")
_CREDENTIAL_HINT = re.compile("|".join([*_CREDENTIAL_HINTS, "%"]), re.IGNORECASE)
# The user-agent on a request line is cut to this many bytes.
MAX_USER_AGENT_BYTES = 200


def _redacted(query: str) -> str:
    if _CREDENTIAL_HINT.search(query) is None:
        return query  # no name in it could be a credential's: the usual case (`beta=true`)
    parts = query.split("&")
    for i, part in enumerate(parts):
        name, equals, _ = part.partition("=")
        if "%" in name or "+" in name:
            name = unquote_plus(name)
        name = name.strip().lower().replace("-", "_")
        if equals and (name in _CREDENTIAL_PARAMETERS or name.endswith(_CREDENTIAL_ENDINGS)):
            parts[i] = part[: part.index("=") + 1] + "***"
    return "&".join(parts)


def flush() -> None:
    """Write the access lines waiting for the loop's turn (tinygw.api.app calls it at
    shutdown too; log() before its own line, to keep the order)."""
    if len(_batch) < 2:  # one line (a quiet loop's turn), or none
        if _batch:
            _write(_batch.pop())
        return
    lines = _batch[:]
    _batch.clear()
    piece: list[bytes] = []
    size = 0
    for line in lines:
        if piece and size + len(line) > _PIPE_BUF:
            _write(b"".join(piece))
            piece, size = [], 0
        piece.append(line)
        size += len(line)
    _write(b"".join(piece) if len(piece) != 1 else piece[0])


def _write(data: bytes) -> None:
    try:
        os.write(2, data)
    except OSError:  # stderr closed or full: the request is not failed for its log line
        pass
