"""An answer's `content-encoding` undone: gzip or deflate, in bounded pieces (docs/design.md section 10)."""

from __future__ import annotations

import zlib
from operator import itemgetter

from tinygw import errors

# A compressed answer is decoded in pieces of at most this many bytes, so that a small
# compressed chunk cannot expand into a large one in memory (a "zip bomb").
DECODED_PIECE_BYTES = 64 * 1024

_NAME_OF = itemgetter(0)


class Decoder:
    """Undoes a `content-encoding` of gzip or deflate, in bounded pieces.

    The gateway asks for `accept-encoding: identity`; a provider that compresses anyway
    is decoded rather than relayed as mislabeled bytes (docs/design.md section 10). Any other
    coding cannot be read: the answer is a protocol error (502). `deflate` is zlib-
    wrapped as RFC 9110 says, or raw as some servers send it: told apart by the zlib
    header's two bytes, as browsers do."""

    __slots__ = ("_z", "_deflate", "_pending", "_started")

    def __init__(self, coding: bytes) -> None:
        self._deflate = coding == b"deflate"
        self._z = None if self._deflate else zlib.decompressobj(31)  # gzip: chosen at once
        self._pending = b""  # deflate: the first bytes, until two tell zlib from raw
        self._started = False

    def feed(self, data: bytes) -> bytes:
        if self._z is None:
            self._pending += data
            if len(self._pending) < 2:
                return b""
            cmf, flg = self._pending[0], self._pending[1]
            zlib_wrapped = cmf & 0x0F == 8 and (cmf << 8 | flg) % 31 == 0
            self._z = zlib.decompressobj(15 if zlib_wrapped else -15)
            data, self._pending = self._pending, b""
        self._started = True
        try:
            return self._z.decompress(data, DECODED_PIECE_BYTES)
        except zlib.error:
            raise errors.RemoteProtocolError("the answer's compressed body is corrupt") from None

    def pending(self) -> bytes:
        """More of what was fed, while a piece was cut at DECODED_PIECE_BYTES."""
        tail = self._z.unconsumed_tail if self._z is not None else b""
        return self.feed(tail) if tail else b""

    def finish(self) -> None:
        if not self._started and not self._pending:  # an empty body: nothing was encoded
            return
        if self._z is None or not self._z.eof or self._z.unused_data:
            raise errors.RemoteProtocolError("the answer's compressed body is cut short or has trailing bytes")


def decoder_for(headers: list[tuple[bytes, bytes]]) -> Decoder | None:
    """The decoder that an answer's `content-encoding` needs, or None for identity;
    raises RemoteProtocolError for a coding the gateway cannot undo."""
    if b"content-encoding" not in map(_NAME_OF, headers):  # the usual answer
        return None
    codings = [c.strip().lower() for k, v in headers if k == b"content-encoding" for c in v.split(b",") if c.strip()]
    codings = [c for c in codings if c != b"identity"]
    if not codings:
        return None
    if len(codings) == 1 and codings[0] in (b"gzip", b"x-gzip", b"deflate"):
        return Decoder(b"deflate" if codings[0] == b"deflate" else b"gzip")
    raise errors.RemoteProtocolError("the answer is compressed with a coding the gateway cannot decode")
