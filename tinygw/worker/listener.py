"""What the kernel may queue to a client that does not read (docs/design.md section 17).

A client socket's send buffer grows with the connection (Linux autotunes it up to
`net.ipv4.tcp_wmem`'s maximum, 4 MiB by default), and every byte the kernel takes for a
client that reads nothing the gateway has first read from the provider and relayed: 64
such clients made a worker relay ~4 MiB each, 1.9 s of its CPU, before its sends stopped
(bench/neighbours.py's `streams` phase). TCP_NOTSENT_LOWAT bounds the bytes a socket
holds that are not yet sent: past it, a send waits, as it does for a full buffer. Bytes
in flight do not count, so a client far away still gets the window its link needs.

Granian makes each worker's listening socket itself and takes no socket options, so the
worker finds it among its own file descriptors once it serves and sets the option there:
a socket accepted from it inherits its options. The sockets accepted before that (the
first moments of a worker) are set at the same time, and once more a moment later (those
the kernel had queued to it). Linux before 6.5 could stall a send under this option: a
kernel older than that wants its commit 4bfe744ff164 ("tcp: fix potential xmit stalls
caused by TCP_NOTSENT_LOWAT") backported.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import stat

from granian.server import MTServer, Server

from tinygw import logs

# At most this many bytes not yet sent to a client wait in the kernel for it.
UNSENT_BYTES = 128 * 1024

# Granian opens the listening socket as the worker starts serving, just after the lifespan
# that starts this search (~11 ms after its first look, measured), and accepts at once: a
# client accepted before the option is set may have more queued by then. So the search
# looks every millisecond for the first 0.1 s; then each wait doubles the last (10 ms,
# 20 ms, ... about 10 s in all), so that a search that finds none (the app served by
# something else) costs little while it lasts.
QUICK_LOOKS, QUICK_WAIT_SECONDS = 100, 0.001
LOOKS, FIRST_WAIT_SECONDS = 10, 0.01


def _waits():
    yield from [QUICK_WAIT_SECONDS] * QUICK_LOOKS
    for look in range(LOOKS):
        yield FIRST_WAIT_SECONDS * 2**look


async def bound_unsent(port: int, workers: int) -> None:
    """Set UNSENT_BYTES on this process's listening sockets for `port` and on the sockets
    they accepted so far. A process holds one listener, or one for each of the `workers`
    when Granian runs them as threads of one process (a free-threaded Python): the search
    ends once all are there, with one look more after a wait, for what the kernel had
    queued to them before; a warning if they did not all appear."""
    expected = workers if Server is MTServer else 1
    for wait in _waits():
        found = _set_unsent(port) >= expected
        await asyncio.sleep(wait)
        if found:
            _set_unsent(port)
            return
    logs.log(logging.WARNING, "client send queues unbounded: no listening socket found", port=port)


def _set_unsent(port: int) -> int:
    """Set UNSENT_BYTES on every TCP socket of this process on `port` (port 0: on the ports
    its listening sockets have, which Granian chose); how many of those listen. The worker
    also holds a socket its Granian parent bound on the port (its check that the address
    is free), which never listens: it is not counted."""
    sockets = _tcp_sockets()
    try:
        listening = [s for s in sockets if _accepting(s)]
        ports = {port} if port else {_port(s) for s in listening}
        count = 0
        for sock in sockets:
            if _port(sock) not in ports:
                continue
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, UNSENT_BYTES)
            except OSError:  # a socket closing meanwhile
                continue
            count += sock in listening
        return count
    finally:
        for sock in sockets:
            sock.close()


def _tcp_sockets() -> list[socket.socket]:
    """Duplicates of this process's TCP sockets, one for each, from the fds in /proc: an fd
    closed and reused meanwhile (by a duplicate made here, too) is looked at as what it is
    now, a socket met twice is taken once, and only the duplicates are closed."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:  # no /proc: none found, and the search ends in its warning
        return []
    found, seen = [], set()
    for name in names:
        try:
            fd = os.dup(int(name))
        except OSError:  # closed meanwhile (the directory's own fd, too)
            continue
        sock = None
        try:
            status = os.fstat(fd)
            if stat.S_ISSOCK(status.st_mode) and status.st_ino not in seen:
                seen.add(status.st_ino)
                sock = socket.socket(fileno=fd)
        except OSError:
            pass
        if sock is None:
            os.close(fd)
        elif sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
            found.append(sock)
        else:
            sock.close()
    return found


def _port(sock: socket.socket) -> int | None:
    try:
        port: int = sock.getsockname()[1]
    except OSError:
        return None
    return port


def _accepting(sock: socket.socket) -> bool:
    try:
        return sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1
    except OSError:
        return False
