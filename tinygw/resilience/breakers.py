"""Every circuit one worker uses, found by (provider, upstream model): the configured
targets' made at the start, the names requests carry made on first use and bounded per
provider (docs/design.md sections 4 and 16). With a table (tinygw.observe.circuittable),
each circuit's numbers are its row there, shared with the gateway's other workers.
The state machine itself is tinygw.resilience.breaker.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Protocol, TypeVar

from tinygw.config.settings import Breaker as BreakerSettings
from tinygw.config.settings import Target
from tinygw.resilience import rows
from tinygw.resilience.breaker import (
    MAX_CIRCUITS_PER_PROVIDER,
    MAX_LABELS_PER_PROVIDER,
    OTHER,
    Circuit,
    Clock,
    NamedCircuit,
    OnChange,
    OnTransition,
    forgettable,
)
from tinygw.resilience.rows import Rows

_C = TypeVar("_C", bound=Circuit)


def _show_as(circuit: NamedCircuit, concealed: str) -> None:
    """A sealed request named a circuit shown by its name (a plain request's first): it is shown as
    `concealed` from now on, its old name taken off as a forgotten circuit's is; its state is kept."""
    circuit.forgotten = True
    circuit._changed()
    circuit.forgotten = False
    circuit.shown = concealed
    if circuit.label != OTHER:
        circuit.label = concealed
    circuit._changed()


class ByTarget(dict[Target, Circuit]):
    """The circuit of a target, `by_target[target]`: `circuit(target.provider,
    target.upstream_model, target.concealed)`. A configured target's is an entry, found by
    the subscript alone (no Python call); any other's (a name as sent, or a
    provider-qualified one) is asked of `circuit` each time and not kept here: clients
    cannot grow this dict. Only the subscript asks (`get` and `in` see the configured
    targets alone)."""

    def __init__(self, circuit: Callable[[str, str, str], Circuit]) -> None:
        super().__init__()
        self._circuit = circuit

    def __missing__(self, target: Target) -> Circuit:
        return self._circuit(target.provider, target.upstream_model, target.concealed)


class Table(Rows, Protocol):
    """The gateway's rows, shared by its workers (tinygw.observe.circuittable.CircuitTable)."""

    def bind(self, provider: str, name: str, kind: float, shown: str, now: float) -> int: ...

    def shown(self, at: int) -> str: ...

    def conceal(self, at: int, shown: str) -> None: ...

    def rows_of(self, provider: str) -> list[tuple[int, str]]: ...


class Breakers:
    """Every circuit one worker process uses: the configured targets', made at the start and
    kept for good, and the named ones, made on first use and kept up to
    MAX_CIRCUITS_PER_PROVIDER per provider. With a `table`, each circuit's numbers are its
    row there, shared with the other workers, and the table bounds the names for the
    gateway: a name it gave away is looked up again (`_current`)."""

    def __init__(
        self,
        settings: BreakerSettings,
        clock: Clock,
        on_transition: OnTransition | None = None,
        configured: Iterable[tuple[str, str]] = (),
        on_change: OnChange | None = None,
        table: Table | None = None,
    ) -> None:
        """`on_transition` is told of every move, `on_change` of every circuit made and
        forgotten, and of every change to what its `snapshot()` returns."""
        self.settings = settings
        self._clock = clock
        self._on_transition = on_transition
        self._on_change = on_change
        self.table = table
        self._circuits: dict[tuple[str, str], Circuit] = {}  # the configured targets'
        # Per provider, by name, least recently used first.
        self._named: dict[str, OrderedDict[str, NamedCircuit]] = {}
        self._labelled: dict[str, set[str]] = {}  # per provider: the names that have a label of their own
        # The configured targets' circuits exist from the start and are never forgotten;
        # found by their Target too, in one subscript (`by_target`).
        self.by_target = ByTarget(self.circuit)
        for provider, provider_model in configured:
            circuit = self._made(Circuit, provider, provider_model, rows.CONFIGURED, "")
            self._circuits[(provider, provider_model)] = self.by_target[Target(provider, provider_model)] = circuit
            circuit._changed()

    def _made(self, kind: type[_C], provider: str, provider_model: str, table_kind: float, concealed: str) -> _C:
        """A new circuit, over its row in the table (found or given to it) if there is one."""
        settings, clock, table = self.settings, self._clock, self.table
        at = -1 if table is None else table.bind(provider, provider_model, table_kind, concealed, clock())
        if table is None or at < 0:  # kept by this worker alone
            return kind(provider, provider_model, settings, clock, self._on_transition, self._on_change, concealed)
        if not concealed and table.values[at + rows.CONCEALED]:
            concealed = table.shown(at)  # a sealed body named it in another worker
        circuit = kind(
            provider, provider_model, settings, clock, self._on_transition, self._on_change, concealed, table, at
        )
        circuit.key = table.values[at + rows.NAME]
        return circuit

    def circuit(self, provider: str, provider_model: str = "", concealed: str = "") -> Circuit:
        """The circuit of (provider, upstream model); "" is the provider's own breaker,
        for requests that name no model. `concealed`: the upstream model is a name a sealed
        body carried, to be shown so (docs/confidential.md); a configured target's name is
        the operator's, shown as it is."""
        circuit = self._circuits.get((provider, provider_model))
        if circuit is not None:
            return circuit
        named = self._named.setdefault(provider, OrderedDict())
        kept = named.get(provider_model)
        if kept is not None and self._current(kept):
            named.move_to_end(provider_model)
            if concealed and kept.shown != concealed:
                _show_as(kept, concealed)
                if kept._rows is self.table:
                    kept._locked(self.table.conceal, kept._at, concealed)
            return kept
        if kept is not None:  # the gateway gave its row to another name
            del named[provider_model]
            kept.forgotten = True
            kept._changed()
        return self._make_named(provider, provider_model, named, concealed)

    def _current(self, circuit: NamedCircuit) -> bool:
        """Is a kept circuit's row still its own (a name's lookup, for the least recently used)?"""
        table = self.table
        if table is None or circuit._rows is not table:
            return True
        v, at = table.values, circuit._at
        if v[at + rows.NAME] != circuit.key:
            return False
        v[at + rows.USED_AT] = self._clock()
        if v[at + rows.CONCEALED] and circuit.shown == circuit.provider_model:
            _show_as(circuit, table.shown(at))
        return True

    def _make_named(
        self, provider: str, provider_model: str, named: OrderedDict[str, NamedCircuit], concealed: str
    ) -> Circuit:
        kept = True
        if len(named) >= MAX_CIRCUITS_PER_PROVIDER:
            old = forgettable(named.values(), self._clock(), self.settings.max_open_seconds)
            if old is None:  # every kept name is one that had a success lately: this one is not kept
                kept = False
            else:
                del named[old.provider_model]
                old.forgotten = True
                old._changed()
        circuit = self._made(NamedCircuit, provider, provider_model, rows.NAMED, concealed)
        labelled = self._labelled.setdefault(provider, set())
        if kept and provider_model not in labelled and len(labelled) < MAX_LABELS_PER_PROVIDER:
            labelled.add(provider_model)
        elif not kept or provider_model not in labelled:
            circuit.label = OTHER
        if kept:
            named[provider_model] = circuit
        circuit._changed()
        return circuit

    def of_provider(self, provider: str) -> list[Circuit]:
        """Every circuit of `provider` this worker keeps; with a table, also those that other
        workers made (over their rows, by the names they are shown by), so that the
        gateway's health check sees every open one (tinygw.worker.discovery)."""
        configured = [c for (p, _), c in self._circuits.items() if p == provider]
        circuits = configured + list(self._named.get(provider, {}).values())
        table = self.table
        if table is not None:
            known = {c._at for c in circuits if c._rows is table}
            settings, clock = self.settings, self._clock
            circuits += [
                Circuit(provider, shown, settings, clock, self._on_transition, self._on_change, shown, table, at)
                for at, shown in table.rows_of(provider)
                if at not in known
            ]
        return circuits

    def all(self) -> list[Circuit]:
        return list(self._circuits.values()) + [c for named in self._named.values() for c in named.values()]
