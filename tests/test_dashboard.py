"""deploy/grafana/tinygw.json: every query names only metric families that a real
gateway exports (scraped from one, after traffic of every kind), so the dashboard
cannot drift from the metrics."""

from __future__ import annotations

import json
import re

from prometheus_client.parser import text_string_to_metric_families

from conftest import ROOT, call

DASHBOARD = ROOT / "deploy" / "grafana" / "tinygw.json"
# Words of PromQL in the queries that are not metric names.
PROMQL = {
    "sum",
    "by",
    "rate",
    "histogram_quantile",
    "min",
    "time",
    "le",
    "status",
    "model",
    "provider",
    "provider_model",
    "kind",
    "outcome",
    "reason",
    "state",
    "worker",
    "version",
    "artifact_sha256",
    "client",
    "limit",
}


def test_every_query_names_a_family_the_gateway_exports(fake, start_gateway):
    gateway = start_gateway(
        {
            "providers": {"p": {"base_url": f"{fake.url}/v1", "api": "openai", "listing": False}},
            "models": {"m": {"targets": ["p:x"]}},
            "clients": {"default": {"requests_per_minute": 2}},
        },
        TINYGW_WORKERS="2",
    )
    assert call("POST", f"{gateway.url}/v1/chat/completions", {"model": "m"})[0] == 200
    assert call("POST", f"{gateway.url}/v1/chat/completions", {"model": "m", "stream": True})[0] == 200
    assert call("POST", f"{gateway.url}/v1/chat/completions", {"model": "m"})[0] == 429  # a client's limit
    text = call("GET", f"{gateway.url}/metrics")[2].decode()
    exported = set()
    for family in text_string_to_metric_families(text):
        exported |= {family.name} | {s.name for s in family.samples}
    exported |= {f"{name}_total" for name in exported}  # counters: the parser names the family without it

    dashboard = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(queries) >= 15
    named = set()
    for query in queries:
        without_labels = re.sub(r"\{[^}]*\}|\[[^]]*\]|\"[^\"]*\"", "", query)
        names = {w for w in re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", without_labels) if w not in PROMQL}
        assert names, query
        assert names <= exported, f"{query}: {names - exported} not exported"
        named |= names
    for family in (
        "tinygw_tokens_total",
        "tinygw_stream_first_token_seconds_bucket",
        "tinygw_requests_in_flight",
        "process_resident_memory_bytes",
        "tinygw_circuit_open",
    ):
        assert family in named, family
