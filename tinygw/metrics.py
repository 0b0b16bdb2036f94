"""Counters and gauges of one worker process, in the Prometheus text format.

Names and labels are SPEC section 7's. Label values come from configuration (routes,
model aliases, provider names), from a fixed set (statuses, outcomes, states), or from
a circuit's upstream model, of which a provider has at most its configured targets plus
breaker.MAX_CIRCUITS_PER_PROVIDER: the number of series stays bounded.
"""

from __future__ import annotations

from collections import Counter

from tinygw.breaker import Breakers, State


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: tuple[str, ...], values: tuple[str, ...]) -> str:
    return ",".join(f'{n}="{_escape(v)}"' for n, v in zip(names, values))


class Family:
    """One metric: its name, type, help and label names, and the values by labels."""

    def __init__(self, name: str, kind: str, help_text: str, labels: tuple[str, ...]) -> None:
        self.name = name
        self.kind = kind
        self.help = help_text
        self.labels = labels
        self.values: Counter[tuple[str, ...]] = Counter()

    def inc(self, *values: str) -> None:
        self.values[values] += 1

    def set(self, value: float, *values: str) -> None:
        self.values[values] = value

    def render(self, lines: list[str]) -> None:
        lines.append(f"# HELP {self.name} {self.help}")
        lines.append(f"# TYPE {self.name} {self.kind}")
        for key, n in sorted(self.values.items()):
            lines.append(f"{self.name}{{{_labels(self.labels, key)}}} {n:g}")


class Metrics:
    def __init__(self, version: str, artifact_sha256: str) -> None:
        self.build_info = Family("tinygw_build_info", "gauge", "The running build; always 1.",
                                 ("version", "artifact_sha256"))
        self.build_info.set(1, version, artifact_sha256)
        self.requests = Family("tinygw_requests_total", "counter",
                               "Client requests answered, by route, model and status.", ("route", "model", "status"))
        self.circuit_open = Family("tinygw_circuit_open", "gauge", "1 while the circuit is open.",
                                   ("provider", "provider_model"))
        self.transitions = Family("tinygw_circuit_transitions_total", "counter",
                                  "Circuit state changes, by the state entered.", ("provider", "provider_model", "state"))
        self.retries = Family("tinygw_provider_retries_total", "counter",
                              "Attempts after the first, by why they were made.", ("provider", "provider_model", "reason"))
        self.listing_up = Family("tinygw_listing_up", "gauge", "1 when the provider's last model listing succeeded.",
                                 ("provider",))

    def count_request(self, route: str, model: str, status: int) -> None:
        self.requests.inc(route, model, str(status))

    def render(self, breakers: Breakers | None = None) -> bytes:
        if breakers is not None:
            for circuit in breakers.all():
                is_open = circuit.state() is State.OPEN
                self.circuit_open.set(1 if is_open else 0, circuit.provider, circuit.provider_model)
        lines: list[str] = []
        for family in (self.build_info, self.requests, self.circuit_open, self.transitions, self.retries,
                       self.listing_up):
            family.render(lines)
        return ("\n".join(lines) + "\n").encode()
