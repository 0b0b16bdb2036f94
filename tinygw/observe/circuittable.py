"""The gateway's circuits, one per (provider, upstream model) whatever the number of workers
(docs/design.md section 4, "One circuit for the gateway").

Every worker maps one file of the run's directory, `circuits.db`, read and written by
all (the client table, tinygw.observe.clienttable, keeps a file per worker instead: its
counts add up; a circuit's are one). Its size and layout are fixed by the configuration,
which every worker of a run shares:

- a header of 4 floats: a layout number (a hash of the providers, their configured
  targets and the sizes below), a marker written last when the file is ready;
- per provider, in the order of their names, a region of rows: one per configured
  target plus MAX_CIRCUITS_PER_PROVIDER for the names requests carry; a row is
  ROW_FLOATS floats (tinygw.resilience.rows: state, generation, failures, pause,
  opened_at, probes, ...; its `NAME` the 52-bit hash of the upstream model, 0 free);
- MAX_HOLDS records of probes in flight (worker slot, row, generation), so that the
  probes of a worker that died are given back;
- per row, its shown name (the upstream model, or `*#h` for a name a sealed body carried)
  and its last error label, as text, for the status page and the metrics.

A name's row is found from its hash: the scan of its provider's region starts at
hash mod size and stops at the name or at the first free row. A row is never freed:
a full region gives the row `forgettable` picks (over its named rows, least recently
used first) to the new name; configured targets' rows are never given away. So a
provider has at most MAX_CIRCUITS_PER_PROVIDER named circuits for the gateway.

Who writes what: the header and a row's name, once, by the worker that made the file or
claimed the row, under an exclusive flock of `circuits.lock`; a row's numbers by its
circuit (tinygw.resilience.breaker), every change under that lock. Two writes take no
lock: a success's time and a lookup's time (single 8-byte stores, read only to choose
what to forget). Admitting through a CLOSED circuit reads the state and the generation,
two aligned 8-byte loads that no writer can tear: it takes no lock, and an attempt
admitted just as another worker opens the circuit is one of those "in flight when it
opened". What a crash leaves: a worker that dies under the lock loses it with its file
descriptors (flock), having written some of one transition's floats: the generation is
written before the state and the pause before the opening, so the row reads as one
state or the other. Its probes are given back when it is seen dead: its slot's lock in
the metric store's directory is free (or taken by the worker started in its place,
which gives back its slot's records at start).

Without a run directory (a Gateway built in a test) the same layout lives in this
process's memory alone.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Mapping
from hashlib import blake2b

from tinygw.config.settings import Breaker as BreakerSettings
from tinygw.observe.board import STATES, CircuitView
from tinygw.observe.mapped import Mapped
from tinygw.observe.metricstore import slot_alive
from tinygw.resilience import rows
from tinygw.resilience.breaker import MAX_CIRCUITS_PER_PROVIDER, Circuit, State, forgettable, pause_ends

_HEADER_FLOATS = 4
MAX_HOLDS = 4096  # probes in flight at once, over every circuit: past this a probe is not let through
_HOLD_FLOATS = 4  # slot (0: free), row, generation, spare
NAME_BYTES = 320  # a model name is at most 256 bytes (tinygw.protocol.wire.MAX_MODEL_BYTES)
ERROR_BYTES = 60  # a row's text is then 384 bytes: the file stays whole floats
_TEXT_BYTES = 2 + NAME_BYTES + 2 + ERROR_BYTES  # a 2-byte length before each
_LENGTH = struct.Struct("<H")
_FILE, _LOCK = "circuits.db", "circuits.lock"
# A full half-open circuit looks for dead workers' probes at most this often (seconds).
GIVE_BACK_SECONDS = 1.0


def name_hash(name: str) -> float:
    """A name's row key: 52 bits of its BLAKE2b (exact in a float), never 0."""
    return float((int.from_bytes(blake2b(name.encode(), digest_size=8).digest()) >> 12) | 1)


class CircuitTable:
    """The rows of every circuit (tinygw.resilience.rows.Rows), and the names' regions."""

    def __init__(
        self,
        settings: BreakerSettings,
        configured: Mapping[str, list[str]],
        directory: str | None = None,
        slot: int = 1,
    ) -> None:
        """`configured`: every provider's configured targets' upstream models (a provider
        with none still has a region for the names requests carry)."""
        self.settings = settings
        self.slot = float(slot)
        self.directory = directory
        self._regions: dict[str, tuple[int, int]] = {}  # provider -> (first row's float index, rows)
        at = _HEADER_FLOATS
        for provider in sorted(configured):
            size = len(set(configured[provider])) + MAX_CIRCUITS_PER_PROVIDER
            self._regions[provider] = (at, size)
            at += size * rows.ROW_FLOATS
        self._row_count = (at - _HEADER_FLOATS) // rows.ROW_FLOATS
        self._holds = at
        self._floats = at + MAX_HOLDS * _HOLD_FLOATS
        self._text = 8 * self._floats
        size = self._text + self._row_count * _TEXT_BYTES
        shape = "\n".join(f"{p}={','.join(sorted(set(configured[p])))}" for p in sorted(configured))
        self._layout = float(zlib.crc32(f"{shape}|{rows.ROW_FLOATS}|{MAX_HOLDS}|{_TEXT_BYTES}".encode()))
        self._given_back_at = -GIVE_BACK_SECONDS
        self._file = Mapped(directory, (_FILE, _LOCK), size, self._layout, self._prepare)
        self.values, self._map = self._file.values, self._file.map
        self.lock, self.unlock = self._file.lock, self._file.unlock
        if directory:
            self.lock()
            try:
                self._free_holds(lambda holder: holder == self.slot)  # a dead worker's, in this slot
            finally:
                self.unlock()

    def _prepare(self, values) -> None:
        """A new table: every circuit's pause the first one."""
        for start, size in self._regions.values():
            for row in range(start, start + size * rows.ROW_FLOATS, rows.ROW_FLOATS):
                values[row + rows.PAUSE] = self.settings.open_seconds

    def close(self) -> None:
        self._file.close()

    # ---- Rows -----------------------------------------------------------------------------

    def hold(self, at: int, generation: float) -> int:
        v = self.values
        for record in range(self._holds, self._floats, _HOLD_FLOATS):
            if not v[record]:
                v[record + 1], v[record + 2], v[record] = float(at), generation, self.slot
                return record
        return -1

    def release(self, hold: int) -> None:
        self.values[hold] = 0.0

    def give_back(self, at: int, now: float) -> bool:
        """Under the lock: free the probes of the row at `at` that dead workers held (at
        most every GIVE_BACK_SECONDS of this worker's asking)."""
        if self.directory is None or now - self._given_back_at < GIVE_BACK_SECONDS:
            return False
        self._given_back_at = now
        dead: dict[float, bool] = {}

        def is_dead(holder: float) -> bool:
            if holder not in dead:
                dead[holder] = holder != self.slot and not slot_alive(self.directory or "", int(holder))
            return dead[holder]

        return self._free_holds(is_dead, at) > 0

    def _free_holds(self, whose, only_at: int = -1) -> int:
        """Free the records whose holder `whose` says, giving their probes back to rows still
        in the generation they were taken in; how many probes were given back."""
        v = self.values
        given = 0
        for record in range(self._holds, self._floats, _HOLD_FLOATS):
            holder = v[record]
            if not holder or (only_at >= 0 and v[record + 1] != only_at) or not whose(holder):
                continue
            at = int(v[record + 1])
            if v[at + rows.GENERATION] == v[record + 2] and v[at + rows.PROBES] > 0:
                v[at + rows.PROBES] -= 1
                given += 1
            v[record] = 0.0
        return given

    def set_error(self, at: int, error: str) -> None:
        self._write_text(at, 2 + NAME_BYTES, error, ERROR_BYTES)

    # ---- names ---------------------------------------------------------------------------------

    def _text_at(self, at: int) -> int:
        return self._text + ((at - _HEADER_FLOATS) // rows.ROW_FLOATS) * _TEXT_BYTES

    def _write_text(self, at: int, offset: int, text: str, limit: int) -> None:
        raw = text.encode()[:limit]
        place = self._text_at(at) + offset
        self._map[place + 2 : place + 2 + len(raw)] = raw
        _LENGTH.pack_into(self._map, place, len(raw))

    def _read_text(self, at: int, offset: int) -> str | None:
        place = self._text_at(at) + offset
        (length,) = _LENGTH.unpack_from(self._map, place)
        return bytes(self._map[place + 2 : place + 2 + length]).decode(errors="replace") if length else None

    def shown(self, at: int) -> str:
        """The name the row is shown by."""
        return self._read_text(at, 0) or ""

    def bind(self, provider: str, name: str, kind: float, shown: str, now: float) -> int:
        """The row of (provider, name): found, or given to it (a free row, else the one
        `forgettable` picks); -1 when the provider has no region or every row is kept.
        `shown`: the name to show it by (a sealed body's `*#h`), "" for `name` itself."""
        region = self._regions.get(provider)
        if region is None:
            return -1
        key = name_hash(name)
        self.lock()
        try:
            at = self._find(region, key)
            v = self.values
            if at >= 0 and v[at + rows.NAME] == key:
                if kind == rows.NAMED:
                    v[at + rows.USED_AT] = now
                if shown and not v[at + rows.CONCEALED]:
                    self.conceal(at, shown)
                return at
            at = at if at >= 0 else self._forget(region, now)
            if at >= 0:
                self._claim(at, key, kind, shown or name, bool(shown), now)
            return at
        finally:
            self.unlock()

    def conceal(self, at: int, shown: str) -> None:
        """Under the lock: the row is shown as `shown` (`*#h`) from now on."""
        self._write_text(at, 0, shown, NAME_BYTES)
        self.values[at + rows.CONCEALED] = 1.0

    def _find(self, region: tuple[int, int], key: float) -> int:
        """The row holding `key`, else the first free one on its path, else -1 (full)."""
        start, size = region
        v = self.values
        first = int(key) % size
        for step in range(size):
            at = start + ((first + step) % size) * rows.ROW_FLOATS
            if v[at + rows.NAME] == key or not v[at + rows.NAME]:
                return at
        return -1

    def _forget(self, region: tuple[int, int], now: float) -> int:
        start, size = region
        v = self.values
        named = sorted(
            (v[at + rows.USED_AT], at)
            for at in range(start, start + size * rows.ROW_FLOATS, rows.ROW_FLOATS)
            if v[at + rows.KIND] == rows.NAMED
        )
        views = [Circuit("", "", self.settings, lambda: now, rows=self, at=at) for _, at in named]
        old = forgettable(views, now, self.settings.max_open_seconds)
        return -1 if old is None else old._at

    def _claim(self, at: int, key: float, kind: float, shown: str, concealed: bool, now: float) -> None:
        v = self.values
        v[at + rows.NAME] = 0.0
        v[at + rows.GENERATION] += 1  # an attempt admitted under the old name cannot move the new one
        for index in (rows.STATE, rows.FAILURES, rows.OPENED_AT, rows.PROBES, rows.PASSED, rows.SUCCEEDED_AT):
            v[at + index] = 0.0
        v[at + rows.PAUSE] = self.settings.open_seconds
        v[at + rows.USED_AT] = now
        v[at + rows.KIND] = kind
        v[at + rows.CONCEALED] = 1.0 if concealed else 0.0
        self._write_text(at, 0, shown, NAME_BYTES)
        self._write_text(at, 2 + NAME_BYTES, "", ERROR_BYTES)
        v[at + rows.NAME] = key

    # ---- reading ---------------------------------------------------------------------------

    def rows_of(self, provider: str) -> list[tuple[int, str]]:
        """(row, shown name) of every circuit of `provider` in the table."""
        start, size = self._regions.get(provider, (0, 0))
        v = self.values
        self.lock()
        try:
            return [
                (at, self.shown(at))
                for at in range(start, start + size * rows.ROW_FLOATS, rows.ROW_FLOATS)
                if v[at + rows.NAME]
            ]
        finally:
            self.unlock()

    def view(self) -> list[CircuitView]:
        """Every circuit of the gateway, by provider, as its row says now."""
        views = []
        v = self.values
        self.lock()
        try:
            for provider, (start, size) in self._regions.items():
                for at in range(start, start + size * rows.ROW_FLOATS, rows.ROW_FLOATS):
                    if v[at + rows.NAME]:
                        views.append(
                            CircuitView(
                                provider=provider,
                                provider_model=self.shown(at),
                                state=STATES.get(int(v[at + rows.STATE]), State.CLOSED),
                                failures=int(v[at + rows.FAILURES]),
                                pause_seconds=v[at + rows.PAUSE],
                                opened_at=v[at + rows.OPENED_AT] or None,
                                last_error=self._read_text(at, 2 + NAME_BYTES),
                            )
                        )
        finally:
            self.unlock()
        return views

    def open_until(self) -> dict[tuple[str, str], float]:
        """(provider, shown name) -> when its pause ends while it is open, else 0: the
        gauge tinygw_circuit_open's values."""
        return {
            (c.provider, c.provider_model): pause_ends(c.opened_at, c.pause_seconds) if c.state is State.OPEN else 0.0
            for c in self.view()
        }
