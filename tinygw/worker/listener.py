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
first moments of a worker) are set at the same time.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import stat

from tinygw import logs

# At most this many bytes not yet sent to a client wait in the kernel for it.
UNSENT_BYTES = 128 * 1024

# Granian opens the listening socket as the worker starts serving, just after the lifespan
# that starts this search: it is found on the first or second look. Each wait doubles the
# last (10 ms, 20 ms, ... about 10 s in all), so that a search that finds none (the app
# served by something else) costs little while it lasts.
LOOKS = 10
FIRST_WAIT_SECONDS = 0.01


async def bound_unsent(port: int) -> None:
    """Set UNSENT_BYTES on this worker's listening socket for `port` and on the sockets it
    accepted so far; a warning if no listening socket appeared."""
    wait = FIRST_WAIT_SECONDS
    for _ in range(LOOKS):
        if _set_unsent(port):
            return
        await asyncio.sleep(wait)
        wait *= 2
    logs.log(logging.WARNING, "client send queues unbounded: no listening socket found", port=port)


def _set_unsent(port: int) -> bool:
    """Set UNSENT_BYTES on every TCP socket of this process on `port`; True if one of them
    listens. The fds are read from /proc, so each is used through a duplicate of its own:
    one closed and reused meanwhile is looked at as what it is now, and never closed here."""
    listening = False
    for name in os.listdir("/proc/self/fd"):
        try:
            fd = int(name)
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:  # closed meanwhile (the directory's own fd, too)
            continue
        with sock:
            try:
                if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
                    continue
                if sock.getsockname()[1] != port:
                    continue
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, UNSENT_BYTES)
                # The worker inherits a socket its Granian parent bound on the port (its check
                # that the address is free), which never listens: only a listening one counts.
                listening = listening or sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1
            except OSError:  # a socket closing meanwhile
                continue
    return listening
