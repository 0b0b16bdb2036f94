"""Each client's counts in every worker, so that a client's limits hold across all of the
gateway's workers (docs/design.md section 16), decided by tinygw.resilience.limits.

As the metric store (tinygw.observe.metricstore) keeps its values, each worker keeps its
counts of every configured client in a file of its own in the run's directory,
`clients-SLOT.db` (SLOT: the worker's metric-store slot), mapped into memory: a count is
a write of 8 bytes into the map. The layout is fixed by the configuration, which every
worker of a run shares: two floats of header (a layout number, then a marker written
last, when the file is ready), then per client, in the order of their names, the
requests in flight, a minute of admitted requests and a minute of tokens
(tinygw.resilience.limits' buckets).

A worker holds an exclusive flock on its file while it lives: a reader tells a dead
worker's file by being able to take a shared one for an instant. A dead worker's
requests in flight are not counted (they ended with it); its minutes are, until they
leave the window. A worker that takes a slot whose worker died takes its file as it is:
its minutes go on, its in-flight counts start again from 0.

Admission of a client with limits reads every worker's row of the client and counts
the request in its own under an exclusive flock of `clients.lock`, so that two workers
cannot both admit the last place. Clients without limits take no lock: their counts are
written for the status page alone. Without a run directory (a Gateway built in a test)
the table is a list of this process's counts only.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import zlib
from collections.abc import Mapping

from msgspec import Struct

from tinygw import logs
from tinygw.config.settings import Client
from tinygw.observe.metricstore import held
from tinygw.resilience import limits
from tinygw.resilience.limits import MINUTE_FLOATS, Floats, OverLimit

_HEADER_FLOATS = 2
_LAYOUT, _READY = 0, 1  # the header's floats
_READY_MARK = 7.0e15 + 77.0  # a marker no zeroed or half-written file holds
_ROW_FLOATS = 1 + 2 * MINUTE_FLOATS  # in flight, requests' minute, tokens' minute
_PREFIX, _SUFFIX = "clients-", ".db"
_LOCK_NAME = "clients.lock"
# After the directory changed, it is looked through again at every admission for this
# long (seconds of `now`): files made within one tick of its clock leave one mtime.
RESCAN_SECONDS = 1.0


class ClientView(Struct):
    """A client as the status page shows it: summed over the workers."""

    name: str
    in_flight: int
    requests_this_minute: int
    tokens_this_minute: int
    limits: dict[str, int | None]


class _Peer(Struct):
    """Another worker's file, mapped read-only."""

    fd: int
    map: mmap.mmap
    values: Floats

    def alive(self) -> bool:
        return held(self.fd)


class ClientTable:
    def __init__(self, clients: Mapping[str, Client], directory: str | None = None, slot: int = 1) -> None:
        names = sorted(clients)
        self.clients = {name: clients[name] for name in names}
        # The clients whose every answer is charged by its tokens (tokens_per_minute).
        self.charged = frozenset(name for name in names if clients[name].tokens_per_minute is not None)
        self._rows = {name: _HEADER_FLOATS + i * _ROW_FLOATS for i, name in enumerate(names)}
        self._floats = _HEADER_FLOATS + len(names) * _ROW_FLOATS
        self._layout = float(zlib.crc32("\n".join(names).encode()) + len(names))
        self.values: Floats = [0.0] * self._floats
        self.directory: str | None = None
        self._peers: dict[str, _Peer] = {}
        self._own_name = f"{_PREFIX}{slot}{_SUFFIX}"
        self._lock_fd = -1
        self._own: tuple[int, mmap.mmap] | None = None
        self._scanned_mtime = -1
        self._scan_until = 0.0
        if directory:
            try:
                self._share(directory)
            except OSError as e:
                logs.log(
                    logging.WARNING,
                    "client limits kept per worker: the shared directory is unusable",
                    error=type(e).__name__,
                )

    # ---- the file -----------------------------------------------------------------------

    def _share(self, directory: str) -> None:
        size = 8 * self._floats
        lock_fd = os.open(os.path.join(directory, _LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fd = os.open(os.path.join(directory, self._own_name), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # a dead worker's file: a reader's probe holds it an instant at most
            kept = os.fstat(fd).st_size == size
            if not kept:
                os.ftruncate(fd, 0)
                os.ftruncate(fd, size)
            own = mmap.mmap(fd, size)
        except OSError:
            os.close(fd)
            os.close(lock_fd)
            raise
        values = memoryview(own).cast("d")
        if kept and values[_LAYOUT] == self._layout and values[_READY] == _READY_MARK:
            for row in self._rows.values():  # the dead worker's requests ended with it; its minutes go on
                values[row] = 0.0
        else:
            values[_READY] = 0.0
            for i in range(self._floats):
                values[i] = 0.0
            values[_LAYOUT] = self._layout
        values[_READY] = _READY_MARK
        self.values, self.directory, self._lock_fd, self._own = values, directory, lock_fd, (fd, own)

    def _peers_now(self, now: float) -> list[_Peer]:
        """The other workers' files, the directory looked through again when it changed."""
        if self.directory is None:
            return []
        try:
            mtime = os.stat(self.directory).st_mtime_ns
        except OSError:
            return list(self._peers.values())
        if mtime != self._scanned_mtime:
            self._scanned_mtime, self._scan_until = mtime, now + RESCAN_SECONDS
        if now <= self._scan_until:
            self._scan(self.directory)
        return list(self._peers.values())

    def _scan(self, directory: str) -> None:
        size = 8 * self._floats
        try:
            names = os.listdir(directory)
        except OSError:
            return
        for name in names:
            if not (name.startswith(_PREFIX) and name.endswith(_SUFFIX)) or name == self._own_name:
                continue
            if name in self._peers:
                continue
            try:
                fd = os.open(os.path.join(directory, name), os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                if os.fstat(fd).st_size != size:  # not made yet, or of another layout: not mapped (no SIGBUS)
                    raise OSError
                peer_map = mmap.mmap(fd, size, prot=mmap.PROT_READ)
            except OSError:
                os.close(fd)
                continue
            values = memoryview(peer_map).cast("d")
            if values[_LAYOUT] != self._layout or values[_READY] != _READY_MARK:
                values.release()
                peer_map.close()
                os.close(fd)
                continue
            self._peers[name] = _Peer(fd, peer_map, values)

    def close(self) -> None:
        for peer in self._peers.values():
            peer.values.release()
            peer.map.close()
            os.close(peer.fd)
        self._peers.clear()
        if self._own is not None:
            fd, own = self._own
            if isinstance(self.values, memoryview):
                self.values.release()
            own.close()
            os.close(fd)
            os.close(self._lock_fd)
            self._own = None

    # ---- a request ------------------------------------------------------------------------

    def admit(self, name: str, now: float) -> OverLimit | None:
        """Count a request of the client `name` in, or say which limit refuses it (it is
        then not counted). A client with limits is decided over every worker's counts."""
        client = self.clients[name]
        row = self._rows[name]
        if not client.limited:  # counted for the status page alone
            self._count_in(row, now)
            return None
        if self._lock_fd >= 0:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        try:
            peers = self._peers_now(now)
            in_flight = self._in_flight(row, peers)
            requests = self._minute(row + 1, peers, now) if client.requests_per_minute is not None else []
            tokens = self._minute(row + 1 + MINUTE_FLOATS, peers, now) if client.tokens_per_minute is not None else []
            refusal = limits.decide(client, in_flight, requests, tokens, now)
            if refusal is None:
                self._count_in(row, now)
            return refusal
        finally:
            if self._lock_fd >= 0:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def finish(self, name: str, tokens: int, now: float) -> None:
        """An admitted request of the client `name` ended; its answer reported `tokens`."""
        row = self._rows[name]
        values = self.values
        values[row] -= 1.0
        if tokens:
            limits.add(values, row + 1 + MINUTE_FLOATS, now, tokens)

    def _count_in(self, row: int, now: float) -> None:
        values = self.values
        values[row] += 1.0
        limits.add(values, row + 1, now, 1.0)

    def _in_flight(self, row: int, peers: list[_Peer]) -> float:
        return float(self.values[row] + sum(p.values[row] for p in peers if p.alive()))

    def _minute(self, at: int, peers: list[_Peer], now: float) -> list[tuple[float, float]]:
        buckets = limits.in_window(self.values, at, now)
        for peer in peers:
            buckets += limits.in_window(peer.values, at, now)
        return buckets

    # ---- the status page ------------------------------------------------------------------

    def in_flight(self, now: float) -> dict[str, int]:
        """Each client's requests in flight now, over the live workers (the metric
        tinygw_client_in_flight and the status page read it)."""
        peers = self._peers_now(now)
        return {name: max(0, round(self._in_flight(row, peers))) for name, row in self._rows.items()}

    def view(self, now: float) -> list[ClientView]:
        """Every client, by name, summed over the workers (in flight: the live ones)."""
        peers = self._peers_now(now)
        in_flight = self.in_flight(now)
        views = []
        for name, client in self.clients.items():
            row = self._rows[name]
            views.append(
                ClientView(
                    name=name,
                    in_flight=in_flight[name],
                    requests_this_minute=round(limits.total(self._minute(row + 1, peers, now))),
                    tokens_this_minute=round(limits.total(self._minute(row + 1 + MINUTE_FLOATS, peers, now))),
                    limits=client.limits(),
                )
            )
        return views
