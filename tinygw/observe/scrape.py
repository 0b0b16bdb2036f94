"""The Prometheus text of a scrape (tinygw.observe.metrics): every worker's store summed,
the gateway's own gauges as they are given, and each live worker's `process_*`."""

from __future__ import annotations

from collections.abc import Mapping

from tinygw.observe import process
from tinygw.observe.metricstore import FileStore, Key, MemoryStore

COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
LIVE_SUM = "live_sum"  # a gauge summed over live workers, shown without a `worker` label
GATEWAY = "gateway"  # a gauge of the gateway's shared state, given to `render`: one series, no `worker` label
# Seconds; from a cached answer to a long generation (timeout_s defaults to 600).
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

Families = Mapping[str, tuple[str, str, tuple[str, ...]]]  # name -> (type, help, label names)
Gauges = dict[tuple[str, tuple[str, ...]], float]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(pairs) -> str:
    return ",".join(f'{n}="{_escape(str(v))}"' for n, v in pairs)


def _number(value: float) -> str:
    return str(int(value)) if value.is_integer() and abs(value) < 2**53 else repr(value)


def gateway_gauges(
    circuits_open_until: Mapping[tuple[str, str], float], listings_up: Mapping[str, bool], now: float
) -> Gauges:
    """The gateway's gauges: each circuit open while its pause has not ended (read against
    `now`, so a pause that ended shows 0 before any worker looks at the circuit again), and
    each provider's last listing up."""
    gauges: Gauges = {
        ("tinygw_circuit_open", labels): 1.0 if until > now else 0.0 for labels, until in circuits_open_until.items()
    }
    return gauges | {("tinygw_listing_up", (name,)): 1.0 if up else 0.0 for name, up in listings_up.items()}


def _summed(
    store: MemoryStore | FileStore, families: Families, extra: dict[Key, float]
) -> tuple[dict[Key, float], list[tuple[int, int]]]:
    """Every worker's values summed (a LIVE_SUM's over the live workers only) onto `extra`,
    and the (slot, pid) of the live workers."""
    summed = dict(extra)
    live: list[tuple[int, int]] = []
    for pid, slot, alive, values in store.snapshot():
        if alive:
            live.append((slot, pid))
        for (name, labels, part), value in values.items():
            if name not in families:
                continue  # written by another version of tinygw
            kind = families[name][0]
            if kind == GATEWAY or (kind == LIVE_SUM and not alive):
                continue  # given to render, not kept in the store; or a dead worker's live count
            summed[(name, labels, part)] = summed.get((name, labels, part), 0.0) + value
    return summed, live


def render(
    store: MemoryStore | FileStore,
    families: Families,
    build: tuple[tuple[str, str], ...],
    tls_not_after: float | None,
    gateway: Gauges,
    extra: dict[Key, float],
) -> bytes:
    """The scrape: the build, the served certificate's expiry, each family in turn, then
    each live worker's `process_*`."""
    summed, live = _summed(store, families, extra)
    lines = [
        "# HELP tinygw_build_info The running build; always 1.",
        "# TYPE tinygw_build_info gauge",
        f"tinygw_build_info{{{_labels(build)}}} 1",
    ]
    if tls_not_after is not None:
        lines += [
            "# HELP tinygw_tls_certificate_expiry_seconds When the served TLS certificate expires (its notAfter), "
            "Unix time.",
            "# TYPE tinygw_tls_certificate_expiry_seconds gauge",
            f"tinygw_tls_certificate_expiry_seconds {_number(tls_not_after)}",
        ]
    for name, (kind, help_text, label_names) in families.items():
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {GAUGE if kind in (LIVE_SUM, GATEWAY) else kind}")
        if kind == GATEWAY:
            for (family, labels), value in sorted(gateway.items()):
                if family == name:
                    lines.append(f"{name}{{{_labels(zip(label_names, labels, strict=True))}}} {_number(value)}")
        elif kind == LIVE_SUM and not label_names:
            lines.append(f"{name} {_number(summed.get((name, (), ''), 0.0))}")
        elif kind in (COUNTER, LIVE_SUM):
            for (family, labels, _), value in sorted(summed.items()):
                if family == name:
                    lines.append(f"{name}{{{_labels(zip(label_names, labels, strict=False))}}} {_number(value)}")
        else:
            _render_histogram(lines, name, label_names, summed)
    lines += process.render(sorted(live))
    return ("\n".join(lines) + "\n").encode()


def _render_histogram(lines: list[str], name: str, label_names: tuple[str, ...], summed: dict) -> None:
    series = sorted({labels for (family, labels, _) in summed if family == name})
    for labels in series:
        base = list(zip(label_names, labels, strict=False))
        cumulative = 0.0
        for le in (*map(str, DURATION_BUCKETS), "+Inf"):
            cumulative += summed.get((name, labels, le), 0.0)
            lines.append(f"{name}_bucket{{{_labels([*base, ('le', le)])}}} {_number(cumulative)}")
        lines.append(f"{name}_sum{{{_labels(base)}}} {_number(summed.get((name, labels, 'sum'), 0.0))}")
        lines.append(f"{name}_count{{{_labels(base)}}} {_number(cumulative)}")
