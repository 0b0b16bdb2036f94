"""Counters and gauges of one worker process, in the Prometheus text format.

Names and labels are SPEC section 7's. Label values come from configuration (routes,
model aliases, provider names) or from a fixed set (statuses, outcomes), never from
raw client input, so the number of series stays bounded.
"""

from __future__ import annotations

from collections import Counter


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: tuple[str, ...], values: tuple[str, ...]) -> str:
    return ",".join(f'{n}="{_escape(v)}"' for n, v in zip(names, values))


class Metrics:
    def __init__(self, version: str, artifact_sha256: str) -> None:
        self._build = (version, artifact_sha256)
        self.requests: Counter[tuple[str, str, str]] = Counter()

    def count_request(self, route: str, model: str, status: int) -> None:
        self.requests[(route, model, str(status))] += 1

    def render(self) -> bytes:
        lines = [
            "# HELP tinygw_build_info The running build; always 1.",
            "# TYPE tinygw_build_info gauge",
            f"tinygw_build_info{{{_labels(('version', 'artifact_sha256'), self._build)}}} 1",
            "# HELP tinygw_requests_total Client requests answered, by route, model and status.",
            "# TYPE tinygw_requests_total counter",
        ]
        for key, n in sorted(self.requests.items()):
            lines.append(f"tinygw_requests_total{{{_labels(('route', 'model', 'status'), key)}}} {n}")
        return ("\n".join(lines) + "\n").encode()
