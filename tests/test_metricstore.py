"""The per-worker metric files: what a scrape sees of live, dead and broken workers."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import ROOT
from tinygw.observe import metricstore
from tinygw.observe.metrics import Metrics
from tinygw.observe.metricstore import FileStore, MemoryStore


def samples(metrics: Metrics) -> dict:
    text = metrics.render().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def count_in_another_process(directory, requests: int) -> None:
    """A worker that counts and exits: its file stays, unlocked."""
    code = (
        f"from tinygw.observe.metrics import Metrics\nm = Metrics('1', '', {str(directory)!r})\n"
        f"for _ in range({requests}): m.count_request('/r', 'm', 200, 0.01)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_a_dead_workers_counts_stay(tmp_path):
    count_in_another_process(tmp_path, 3)
    mine = Metrics("1", "", str(tmp_path))
    mine.count_request("/r", "m", 200, 0.01)
    seen = samples(mine)
    assert seen[("tinygw_requests_total", (("model", "m"), ("route", "/r"), ("status", "200")))] == 4
    assert mine.store.slot == 1  # the dead worker's slot is free again, and taken


def test_a_worker_takes_the_first_free_slot_and_a_replacement_the_one_freed(tmp_path):
    first, second = FileStore(str(tmp_path)), FileStore(str(tmp_path))
    assert (first.slot, second.slot) == (1, 2)
    first.close()  # as a worker that dies
    third = FileStore(str(tmp_path))
    assert third.slot == 1
    slots = sorted((slot, alive) for _, slot, alive, _ in third.snapshot())
    assert slots == [(1, False), (1, True), (2, True)]  # the dead file stays, not alive


def test_a_reused_pid_does_not_reopen_an_old_file(tmp_path):
    first = Metrics("1", "", str(tmp_path))
    first.count_request("/r", "m", 200, 0.01)
    second = Metrics("1", "", str(tmp_path))  # same pid, as a reused one would be
    second.count_request("/r", "m", 200, 0.01)
    assert samples(second)[("tinygw_requests_total", (("model", "m"), ("route", "/r"), ("status", "200")))] == 2


def test_a_broken_file_does_not_break_the_scrape(tmp_path):
    mine = Metrics("1", "", str(tmp_path))
    mine.count_request("/r", "m", 200, 0.01)
    (tmp_path / "worker-1-1.db").write_bytes(b"\xff" * 64)
    (tmp_path / "worker-2-2.db").write_bytes(b"\x20\x00\x00\x00\x00\x00\x00\x00" + b'\x0c\x00\x00\x00["nope",[]]')
    assert samples(mine)[("tinygw_requests_total", (("model", "m"), ("route", "/r"), ("status", "200")))] == 1


def test_an_unusable_directory_falls_back_to_memory(tmp_path):
    metrics = Metrics("1", "", str(tmp_path / "missing"))
    assert isinstance(metrics.store, MemoryStore)
    metrics.count_request("/r", "m", 200, 0.01)
    assert samples(metrics)[("tinygw_requests_total", (("model", "m"), ("route", "/r"), ("status", "200")))] == 1


@pytest.mark.parametrize("as_doubles", [True, False], ids=["doubles", "struct"])
def test_a_file_grows_past_its_first_size(tmp_path, monkeypatch, as_doubles):
    monkeypatch.setattr(metricstore, "_NATIVE_LITTLE", as_doubles)  # both ways of writing a value
    store = FileStore(str(tmp_path))
    for i in range(3000):
        store.add(("tinygw_requests_total", ("/r", f"model-{i}", "200"), ""), i)
        store.add(("tinygw_requests_total", ("/r", "model-0", "200"), ""), 0.5)
    store.set(("tinygw_listing_up", ("p",), ""), 1.0)
    [(pid, slot, alive, values)] = store.snapshot()
    assert alive and len(values) == 3001 and values[("tinygw_requests_total", ("/r", "model-2999", "200"), "")] == 2999
    assert values[("tinygw_requests_total", ("/r", "model-0", "200"), "")] == 1500
    assert values[("tinygw_listing_up", ("p",), "")] == 1.0
    store.close()


def test_counts_land_in_place_while_the_file_grows(tmp_path):
    """Each new series takes its places (a histogram's all at once), which may grow the
    file and replace its view: every count made meanwhile is kept. A token kind is shown
    only once counted; a proxied request's end takes it out of flight."""
    metrics = Metrics("1", "", str(tmp_path))
    assert isinstance(metrics.store, FileStore)
    for i in range(300):  # ~20 places a series: past the first 64 KiB
        metrics.add_in_flight(1)
        metrics.count_proxied("/r", f"model-{i}", 200, 0.02, "p", 5, 0)
        metrics.observe_first_byte(f"p{i}", 0.003)
    metrics.add_in_flight(1)
    metrics.count_proxied("/r", "model-0", 200, 0.02, "p", 0, 7)
    seen = samples(metrics)

    def value(name: str, **labels: str) -> float:
        return seen[(name, tuple(sorted(labels.items())))]

    duration = "tinygw_request_duration_seconds"
    assert value(f"{duration}_bucket", route="/r", model="model-299", status="2xx", le="0.01") == 0
    assert value(f"{duration}_bucket", route="/r", model="model-299", status="2xx", le="0.025") == 1
    assert value(f"{duration}_sum", route="/r", model="model-299", status="2xx") == 0.02
    assert value("tinygw_requests_total", route="/r", model="model-299", status="200") == 1
    assert value("tinygw_upstream_first_byte_seconds_count", provider="p299") == 1
    assert value("tinygw_requests_in_flight") == 0
    tokens = [labels for (name, labels) in seen if name == "tinygw_tokens_total"]
    assert len(tokens) == 301  # every prompt count, and model-0's one completion count
    assert value("tinygw_tokens_total", provider="p", model="model-0", kind="completion") == 7
    assert value("tinygw_tokens_total", provider="p", model="model-7", kind="prompt") == 5
    metrics.store.close()


def test_a_proxied_request_leaves_the_in_flight_gauge_even_when_its_series_cannot_be_placed(tmp_path):
    """The first request of a (route, model, status) takes new places in the metrics
    file; when that fails (the file cannot grow: a full tmpfs), the request still leaves
    the in-flight gauge, or it would show one request in flight for ever."""
    metrics = Metrics("1", "", str(tmp_path))
    index = metrics.store.index

    def index_or_full(key):
        if key[0] == "tinygw_requests_total":
            raise OSError(28, "No space left on device")
        return index(key)

    metrics.store.index = index_or_full  # type: ignore[method-assign]
    metrics.add_in_flight(1)
    with pytest.raises(OSError):
        metrics.count_proxied("/v1/chat/completions", "m", 200, 0.01, "p", 0, 0)
    assert metrics.store.values[metrics._in_flight] == 0.0
