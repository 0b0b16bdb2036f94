"""A TLS relay on loopback: the attack that attest/verify's `tls channel` check catches.

A host in front of a confidential VM can terminate TLS with a key of its own and
forward the bytes to the genuine gateway: every answer is then genuine, and only the
key the connection was served with gives the relay away. Used by the tests and by
`make rehearse`; never part of the gateway.
"""

from __future__ import annotations

import asyncio
import ssl
import threading
from collections.abc import Callable
from pathlib import Path


class Relay:
    """A loopback TLS server with a key of its own. `forward`: it relays each connection's
    bytes to the gateway over TLS (a host that terminates TLS in front of the VM);
    `replay`: it answers every request with one answer the genuine gateway once gave, or
    with what `replay(path)` makes (a relay that forges answers bound to its own key).
    asyncio's TLS (memory BIOs, one thread) rather than blocking sockets: an SSL object
    must not be read and written from two threads at once."""

    def __init__(
        self, cert: Path, key: Path, gateway_port: int, replay: bytes | Callable[[str], bytes] | None = None
    ) -> None:
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(cert, key)
        self.gateway_port = gateway_port
        self.replay = replay
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()

        async def start() -> None:
            self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self.context)
            self.port = self.server.sockets[0].getsockname()[1]
            ready.set()

        threading.Thread(
            target=lambda: (self.loop.run_until_complete(start()), self.loop.run_forever()), daemon=True
        ).start()
        if not ready.wait(10):
            raise RuntimeError("the relay did not start within 10 s")

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            if self.replay is not None:
                head = await reader.readuntil(b"\r\n\r\n")
                path = head.split(b" ", 2)[1].decode("latin-1")
                body = self.replay(path) if callable(self.replay) else self.replay
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n"
                    b"content-length: %d\r\n\r\n%s" % (len(body), body)
                )
                await writer.drain()
                writer.close()
                await writer.wait_closed()
                return
            outward = ssl.create_default_context()
            outward.check_hostname, outward.verify_mode = False, ssl.CERT_NONE
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.gateway_port, ssl=outward)
            try:
                await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer))
            finally:
                up_writer.transport.abort()
        except (OSError, asyncio.IncompleteReadError, ssl.SSLError, asyncio.CancelledError):
            pass  # a closed peer, or the relay shutting down (asyncio's streams callback trips on a cancelled task)
        finally:
            writer.transport.abort()

    @staticmethod
    async def _pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        while data := await source.read(65536):
            sink.write(data)
            await sink.drain()
        if sink.can_write_eof():
            sink.write_eof()

    def close(self) -> None:
        """Stop serving, end every relayed connection, then stop the loop's thread."""

        async def shutdown() -> None:
            self.server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(10)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
