"""A fake provider that speaks just enough OpenAI, Anthropic and Claude on the clouds, and
misbehaves on cue.

Used by `tinygw demo`, the tests and the benchmark. It answers in one write when it
can (a plain `http.server` adds tens of milliseconds), keeps connections alive, and
records every request it got. What it answers is decided per request by a `script`:
a function from the request to a `Reply`, so a test can refuse, hang, answer 502 fast,
cut a stream or answer 429 with Retry-After exactly when it wants. The well-behaved
script, which answers like the real APIs, is in `tinygw.fake.answers`.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

# This module is the fake provider's one door: the tests, the demo and bench import from
# here what they need to script it, so some of these names are only passed on.
from tinygw.fake.answers import EMBEDDING, well_behaved  # noqa: F401 -- passed on
from tinygw.fake.cache import PromptCache
from tinygw.fake.events import (  # noqa: F401 -- passed on
    EVENTSTREAM,
    anthropic_stream_events,
    bedrock_exception,
    bedrock_frames,
    openai_stream_events,
    responses_stream_events,
)
from tinygw.fake.replies import REASONS, FakeRequest, Reply, json_reply, sse_reply  # noqa: F401 -- passed on


class FakeUpstream:
    """An HTTP/1.1 server on 127.0.0.1. `script` may be replaced at any time."""

    def __init__(
        self, script: Callable[[FakeRequest], Reply] | None = None, port: int = 0, record: bool = True
    ) -> None:
        self.script = script or well_behaved()
        self.requests: list[FakeRequest] = []
        self.record = record
        self.port = port
        self.open_connections = 0
        self.accepted = 0  # connections accepted, ever
        self.peer_closed = 0  # streams the peer closed while this fake was still sending
        self.ended: list[int] = []  # the connections (numbered as FakeRequest.connection) that are over
        self._server: asyncio.AbstractServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port, backlog=1024)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()

    def start_in_thread(self) -> FakeUpstream:
        """Serve on an event loop of its own, in a daemon thread; returns self."""
        ready = threading.Event()

        def run() -> None:
            self._loop = loop = asyncio.new_event_loop()
            try:
                loop.run_until_complete(self.start())
                ready.set()
                loop.run_forever()
            finally:
                loop.close()  # here, not by the collector at exit: its self-pipe may be closed by then

        self._thread = threading.Thread(target=run, daemon=True, name=f"fake-upstream-{id(self)}")
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("the fake upstream did not start")
        return self

    def stop_thread(self) -> None:
        """Close the server and every connection, then stop the thread's loop."""
        if self._loop is None:
            return

        async def shutdown() -> None:
            await self.stop()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(5)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._thread is not None:
                self._thread.join(5)  # its loop closed

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.open_connections += 1
        self.accepted += 1
        connection = self.accepted
        try:
            while True:
                request = await _read_request(reader)
                if request is None:
                    return
                request.connection = connection
                if self.record:
                    self.requests.append(request)
                reply = self.script(request)
                if not await _write_reply(reader, writer, reply, self) or reply.action == "answer_close":
                    return
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            return
        finally:
            writer.close()
            try:
                await writer.wait_closed()  # the FIN is out before the count drops
            except (ConnectionError, OSError):
                pass
            self.open_connections -= 1
            self.ended.append(connection)


async def _read_request(reader: asyncio.StreamReader) -> FakeRequest | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    header_lines = []
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            header_lines.append((name.strip().lower(), value.strip()))
    headers = dict(header_lines)
    length = int(headers.get("content-length", "0"))
    body = await reader.readexactly(length) if length else b""
    return FakeRequest(method, path, headers, body, header_lines=header_lines)


async def _wait(reader: asyncio.StreamReader, wait) -> bool:
    """Sleep or wait for a gate, watching the connection; False if the peer closed it."""
    waiting: asyncio.Future[Any]  # the result is never read: only that it came
    if isinstance(wait, threading.Event):
        waiting = asyncio.ensure_future(asyncio.get_running_loop().run_in_executor(None, wait.wait, 60))
    else:
        waiting = asyncio.ensure_future(asyncio.sleep(wait))
    eof = asyncio.ensure_future(reader.read(1))
    done, _ = await asyncio.wait([waiting, eof], return_when=asyncio.FIRST_COMPLETED)
    if eof in done:
        waiting.cancel()
        return False
    eof.cancel()
    await asyncio.gather(eof, return_exceptions=True)  # the reader takes no second waiter
    return True


async def _write_reply(reader, writer: asyncio.StreamWriter, reply: Reply, upstream: FakeUpstream) -> bool:
    """Write `reply`; False when the connection must end after it."""
    try:
        return await _write(reader, writer, reply, upstream)
    except ConnectionError:
        upstream.peer_closed += 1
        return False


async def _write(reader, writer: asyncio.StreamWriter, reply: Reply, upstream: FakeUpstream) -> bool:
    if reply.delay_seconds and not await _wait(reader, reply.delay_seconds):
        upstream.peer_closed += 1
        return False
    if reply.action == "hang":
        if not await _wait(reader, 3600):
            upstream.peer_closed += 1
        return False
    if reply.action == "close":
        return False
    if reply.action == "raw":
        writer.write(reply.body)
        if not await _write_paced(reader, writer, upstream, reply.chunks or ()):  # raw pieces after it
            return False
        await writer.drain()
        return True
    head = [f"HTTP/1.1 {reply.status} {REASONS.get(reply.status, 'Status')}"]
    head += [f"{k}: {v}" for k, v in reply.headers]
    if reply.chunks is None:
        head.append(f"content-length: {len(reply.body)}")
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + reply.body)
        await writer.drain()
        return True
    head.append("transfer-encoding: chunked")
    writer.write(("\r\n".join(head) + "\r\n\r\n").encode())
    chunks = ((wait, b"%x\r\n%s\r\n" % (len(data), data)) for wait, data in reply.chunks)
    if not await _write_paced(reader, writer, upstream, chunks):
        return False
    await writer.drain()
    if reply.action == "cut":
        return False
    writer.write(b"0\r\n\r\n")
    await writer.drain()
    return True


async def _write_paced(reader, writer: asyncio.StreamWriter, upstream: FakeUpstream, pieces) -> bool:
    """Write each (wait, bytes) piece after its wait (seconds, or a test's gate); False
    when the client left during a wait."""
    for wait, data in pieces:
        if wait:
            await writer.drain()
            if not await _wait(reader, wait):
                upstream.peer_closed += 1
                return False
        writer.write(data)
    return True


def main(argv: list[str] | None = None) -> None:
    """`tinygw fake [PORT]` (or `python -m tinygw.fake.upstream [PORT]`): a well-behaved
    fake provider on 127.0.0.1, every API at once (Bedrock's, Vertex's and Google's token
    endpoint too), with a prompt cache, until interrupted. Prints its port (a free one
    without PORT) on the first line of stdout."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    upstream = FakeUpstream(well_behaved(cache=PromptCache()), port=int(args[0]) if args else 0, record=False)

    async def run() -> None:
        await upstream.start()
        print(upstream.port, flush=True)
        await asyncio.Event().wait()

    try:
        asyncio.run(run())
    except KeyboardInterrupt:  # Ctrl-C is how it is meant to stop
        pass


if __name__ == "__main__":
    main()
