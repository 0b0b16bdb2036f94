"""docs/design.md section 7's metrics, kept in a store shared by the workers, in Prometheus text.

Counters and histograms are summed over every worker, so a scrape of any worker
counts all traffic; so is the in-flight gauge, over live workers. A circuit is the
gateway's (docs/design.md section 4): `tinygw_circuit_open` is read from the shared
circuit table at the scrape, one series per circuit, and `tinygw_listing_up` from the
gateway's last listings. Gauges of per-process state (`process_*`) are shown per
worker, with a `worker` label (its slot,
1..N, stable across restarts: tinygw.observe.metricstore), and only for workers that are
alive. `process_*` is read at the scrape from /proc for each live worker, so it costs
the workers nothing.

Label values come from configuration (routes, model aliases, provider names), from a
fixed set (statuses, outcomes, states, reasons), or from a circuit's upstream model,
of which a provider has at most its configured targets plus
`breaker.MAX_LABELS_PER_PROVIDER` (later names are counted as `breaker.OTHER`): the
number of series stays bounded.
"""

from __future__ import annotations

import logging
import time
from bisect import bisect_left
from collections.abc import Mapping

from tinygw import logs
from tinygw.observe import scrape
from tinygw.observe.metricstore import FileStore, MemoryStore
from tinygw.observe.scrape import COUNTER, DURATION_BUCKETS, GATEWAY, HISTOGRAM, LIVE_SUM

# Each bucket's `le` label, and "+Inf" past the last: an observation's part, by bisect.
_LE = (*(str(bucket) for bucket in DURATION_BUCKETS), "+Inf")


# name -> (type, help, label names).
FAMILIES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "tinygw_requests_total": (COUNTER, "Client requests answered.", ("route", "model", "status")),
    "tinygw_request_duration_seconds": (
        HISTOGRAM,
        "Time from a request's arrival to its end.",
        ("route", "model", "status"),
    ),
    "tinygw_requests_in_flight": (LIVE_SUM, "Proxied requests being answered now.", ()),
    "tinygw_tokens_total": (
        COUNTER,
        "Tokens the providers' answers report in their usage.",
        ("provider", "model", "kind"),
    ),
    "tinygw_stream_first_token_seconds": (
        HISTOGRAM,
        "Time from a streamed request's arrival to its first output event relayed.",
        ("model",),
    ),
    "tinygw_upstream_attempts_total": (
        COUNTER,
        "Provider attempts, by how they ended.",
        ("provider", "provider_model", "outcome"),
    ),
    "tinygw_upstream_first_byte_seconds": (
        HISTOGRAM,
        "Time from an attempt's start to the provider's response head.",
        ("provider",),
    ),
    "tinygw_provider_retries_total": (
        COUNTER,
        "Attempts after the first, by why they were made.",
        ("provider", "provider_model", "reason"),
    ),
    "tinygw_circuit_transitions_total": (
        COUNTER,
        "Circuit state changes, by the state entered.",
        ("provider", "provider_model", "state"),
    ),
    "tinygw_circuit_open": (
        GATEWAY,
        "1 while the circuit is open (the gateway's circuit, whatever the number of workers).",
        ("provider", "provider_model"),
    ),
    "tinygw_pool_waiting": (
        LIVE_SUM,
        "Requests waiting now for one of a provider's connections, all busy.",
        ("provider",),
    ),
    "tinygw_pool_wait_seconds": (
        HISTOGRAM,
        "How long a request waited for one of a provider's connections (with a connection or without).",
        ("provider",),
    ),
    "tinygw_listing_up": (GATEWAY, "1 when the gateway's last model listing of the provider succeeded.", ("provider",)),
    "tinygw_client_requests_total": (
        COUNTER,
        "Proxied requests of each named client, by status class, or limited.",
        ("client", "outcome"),
    ),
    "tinygw_client_tokens_total": (
        COUNTER,
        "Tokens of each named client's answers, as their usage reports them.",
        ("client", "kind"),
    ),
    "tinygw_client_limited_total": (COUNTER, "Requests refused by a client's limit.", ("client", "limit")),
    "tinygw_client_in_flight": (LIVE_SUM, "Each named client's requests being answered now.", ("client",)),
    "tinygw_secret_redactions_total": (
        COUNTER,
        "Places in provider answers where a configured secret was replaced by [redacted].",
        ("provider",),
    ),
}


# A status's class for request_duration_seconds; 1xx/3xx are not answered by the
# gateway's routes, and an unknown class counts as the gateway's fault.
_STATUS_CLASS = {2: "2xx", 4: "4xx", 5: "5xx"}
_IN_FLIGHT = ("tinygw_requests_in_flight", (), "")


class _Histogram:
    """A histogram series' places in the store: each bucket's (by bisect of
    DURATION_BUCKETS, the last one +Inf's) and its sum's."""

    __slots__ = ("buckets", "sum")

    def __init__(self, buckets: tuple[int, ...], sum_: int) -> None:
        self.buckets = buckets
        self.sum = sum_

    def observe(self, values, seconds: float) -> None:
        """One observation, added to `values` (the store's, read after the places were taken)."""
        values[self.buckets[bisect_left(DURATION_BUCKETS, seconds)]] += 1.0
        values[self.sum] += seconds


class _ProxiedSeries:
    """A proxied request's places in the store, by its route, model, status and the
    provider that answered: its count's, its duration histogram's buckets and sum, and its
    tokens' counts (each taken at its kind's first count, None until then; `token_place_missing`
    while either is, so that a series with both asks one question per request, not four)."""

    __slots__ = ("count", "duration", "prompt", "completion", "token_place_missing")

    def __init__(self, count: int, histogram: _Histogram) -> None:
        self.count = count
        self.duration = histogram
        self.prompt: int | None = None
        self.completion: int | None = None
        self.token_place_missing = True


class Metrics:
    def __init__(self, version: str, artifact_sha256: str, directory: str | None = None) -> None:
        self._build = (("version", version), ("artifact_sha256", artifact_sha256))
        self._version = version
        self._tls_not_after: float | None = None
        self.store: MemoryStore | FileStore = MemoryStore()
        if directory:
            try:
                self.store = FileStore(directory)
            except OSError as e:
                logs.log(
                    logging.WARNING, "metrics kept per worker: the shared directory is unusable", error=type(e).__name__
                )
        self._in_flight = self.store.index(_IN_FLIGHT)
        self._requests: dict[tuple[str, str, int], tuple[int, _Histogram]] = {}
        self._histograms: dict[tuple[str, tuple[str, ...]], _Histogram] = {}
        self._tokens: dict[tuple[str, str], list] = {}
        self._attempts: dict[tuple[str, str, str], int] = {}  # (provider, upstream model, outcome) -> its place
        self._first_byte: dict[str, _Histogram] = {}
        self._proxied: dict[tuple[str, str, int, str | None], _ProxiedSeries] = {}
        self._clients: dict[tuple[str, str, str], int] = {}  # (family, client, label) -> its place
        self._client_ended: dict[tuple[str, int], int] = {}  # (client, status) -> _client_requests
        self._client_tokens: dict[str, list[int]] = {}  # client -> _client_token_places

    def set_artifact_sha256(self, digest: str) -> None:
        """The frozen executable's sha256, once a worker has hashed it (tinygw.api.app)."""
        self._build = (("version", self._version), ("artifact_sha256", digest))

    def set_tls_certificate_expiry(self, not_after: float) -> None:
        """When the served certificate expires (Unix time): the same in every worker."""
        self._tls_not_after = not_after

    # ---- the hot path -----------------------------------------------------------------
    # A series' places in the store are found once, kept here by its label values, then
    # added to there (docs/performance.md, speed choices). A counter's place is taken at
    # its first count (a series never counted is not shown); a histogram's, all of its
    # buckets at once, at its first observation. `store.values` is read after any place
    # is taken: taking one may replace it.

    def count_request(self, route: str, model: str, status: int, seconds: float) -> None:
        """A request answered without being proxied (refused at dispatch); a proxied one's
        end is `count_proxied`."""
        series = self._requests.get((route, model, status)) or self._request_series(route, model, status)
        count, histogram = series
        values = self.store.values
        values[count] += 1.0
        histogram.observe(values, seconds)

    def count_proxied(
        self, route: str, model: str, status: int, seconds: float, provider: str | None, prompt: int, completion: int
    ) -> None:
        """A proxied request's end, in one call: count_request's counts, out of flight,
        and the tokens its answer reported (0 without a report), under
        `provider`, the one that answered (None when none did)."""
        # Out of flight first: taking a new series' places may fail (a metrics file that
        # cannot grow), and the gauge must come back down whatever happens.
        self.store.values[self._in_flight] -= 1.0
        series = self._proxied.get((route, model, status, provider)) or self._proxied_series(
            route, model, status, provider
        )
        if series.token_place_missing and (
            (prompt and series.prompt is None) or (completion and series.completion is None)
        ):
            series.prompt, series.completion = self._token_places(provider, model, prompt, completion)  # type: ignore[arg-type]
            series.token_place_missing = series.prompt is None or series.completion is None
        values = self.store.values
        values[series.count] += 1.0
        series.duration.observe(values, seconds)
        if prompt:
            values[series.prompt] += prompt  # type: ignore[index]
        if completion:
            values[series.completion] += completion  # type: ignore[index]

    def add_pool_waiting(self, provider: str, change: int) -> None:
        self.store.add(("tinygw_pool_waiting", (provider,), ""), change)

    def observe_pool_wait(self, provider: str, seconds: float) -> None:
        self._histogram("tinygw_pool_wait_seconds", (provider,)).observe(self.store.values, seconds)

    def add_in_flight(self, change: int) -> None:
        self.store.values[self._in_flight] += change

    def count_client(self, client: str, status: int, prompt: int, completion: int) -> None:
        """A request of `client` that no limit refused ended with `status`, its answer
        reporting `prompt` and `completion` tokens. (Its time in flight is the clients
        table's count, read at the scrape: `render`.)"""
        requests = self._client_ended.get((client, status)) or self._client_requests(client, status)
        tokens = self._client_tokens.get(client) or [0, 0]  # a place 0 is none yet: the store's first is the gateway's
        if (prompt and not tokens[0]) or (completion and not tokens[1]):
            tokens = self._client_token_places(client, prompt, completion)
        values = self.store.values  # read after every place was taken
        values[requests] += 1.0
        if prompt:
            values[tokens[0]] += prompt
        if completion:
            values[tokens[1]] += completion

    def _client_requests(self, client: str, status: int) -> int:
        """The place of `client`'s requests of `status`'s class, kept by (client, status)."""
        requests = self._client_place("tinygw_client_requests_total", client, _STATUS_CLASS.get(status // 100, "5xx"))
        self._client_ended[(client, status)] = requests
        return requests

    def _client_token_places(self, client: str, prompt: int, completion: int) -> list[int]:
        """[input's place, output's] of `client`'s token counts, each taken at its first count (0 until then)."""
        places = self._client_tokens.setdefault(client, [0, 0])
        for which, (kind, amount) in enumerate((("input", prompt), ("output", completion))):
            if amount and not places[which]:
                places[which] = self._client_place("tinygw_client_tokens_total", client, kind)
        return places

    def count_limited(self, client: str, limit: str) -> None:
        """A request of `client` was refused by its limit `limit`."""
        places = (
            self._client_place("tinygw_client_requests_total", client, "limited"),
            self._client_place("tinygw_client_limited_total", client, limit),
        )
        values = self.store.values
        for place in places:
            values[place] += 1.0

    def _client_place(self, family: str, client: str, label: str) -> int:
        place = self._clients.get((family, client, label))
        if place is None:
            labels = (client, label) if label else (client,)
            place = self._clients[(family, client, label)] = self.store.index((family, labels, ""))
        return place

    def observe_first_token(self, model: str, seconds: float) -> None:
        histogram = self._histogram("tinygw_stream_first_token_seconds", (model,))
        histogram.observe(self.store.values, seconds)

    def count_attempt(self, provider: str, provider_model: str, outcome: str) -> None:
        """An attempt ended with `outcome`."""
        place = self._attempts.get((provider, provider_model, outcome)) or self._attempt_place(
            provider, provider_model, outcome
        )
        self.store.values[place] += 1.0

    def observe_first_byte(self, provider: str, seconds: float) -> None:
        histogram = self._first_byte.get(provider) or self._first_byte_series(provider)
        histogram.observe(self.store.values, seconds)

    def count_retry(self, provider: str, provider_model: str, reason: str) -> None:
        self.store.add(("tinygw_provider_retries_total", (provider, provider_model, reason), ""))

    def count_redactions(self, provider: str, places: int) -> None:
        self.store.add(("tinygw_secret_redactions_total", (provider,), ""), places)

    def count_transition(self, provider: str, provider_model: str, state: str) -> None:
        self.store.add(("tinygw_circuit_transitions_total", (provider, provider_model, state), ""))

    # ---- each series' places, found at its first use ------------------------------------

    def _histogram(self, name: str, labels: tuple[str, ...]) -> _Histogram:
        histogram = self._histograms.get((name, labels))
        if histogram is None:
            buckets = tuple(self.store.index((name, labels, le)) for le in _LE)
            histogram = self._histograms[(name, labels)] = _Histogram(buckets, self.store.index((name, labels, "sum")))
        return histogram

    def _request_series(self, route: str, model: str, status: int) -> tuple[int, _Histogram]:
        status_class = _STATUS_CLASS.get(status // 100, "5xx")
        count = self.store.index(("tinygw_requests_total", (route, model, str(status)), ""))
        series = (count, self._histogram("tinygw_request_duration_seconds", (route, model, status_class)))
        self._requests[(route, model, status)] = series
        return series

    def _proxied_series(self, route: str, model: str, status: int, provider: str | None) -> _ProxiedSeries:
        count, histogram = self._requests.get((route, model, status)) or self._request_series(route, model, status)
        series = self._proxied[(route, model, status, provider)] = _ProxiedSeries(count, histogram)
        return series

    def _token_places(self, provider: str, model: str, prompt: int, completion: int) -> list:
        """[the prompt count's place, the completion count's], each taken at its kind's
        first count (None until then)."""
        places = self._tokens.setdefault((provider, model), [None, None])
        for which, (kind, amount) in enumerate((("prompt", prompt), ("completion", completion))):
            if amount and places[which] is None:
                places[which] = self.store.index(("tinygw_tokens_total", (provider, model, kind), ""))
        return places

    def _attempt_place(self, provider: str, provider_model: str, outcome: str) -> int:
        labels = (provider, provider_model, outcome)
        place = self._attempts[labels] = self.store.index(("tinygw_upstream_attempts_total", labels, ""))
        return place

    def _first_byte_series(self, provider: str) -> _Histogram:
        histogram = self._first_byte[provider] = self._histogram("tinygw_upstream_first_byte_seconds", (provider,))
        return histogram

    # ---- the scrape --------------------------------------------------------------------

    def render(
        self,
        client_in_flight: Mapping[str, int] | None = None,
        circuits_open_until: Mapping[tuple[str, str], float] | None = None,
        listings_up: Mapping[str, bool] | None = None,
    ) -> bytes:
        """The scrape, of every worker's store (tinygw.observe.scrape); `client_in_flight`:
        each client's requests in flight over the live workers, as the clients table counts
        them (tinygw.observe.clienttable: not counted twice); `circuits_open_until`: when
        each of the gateway's circuits' pause ends while it is open, else 0
        (tinygw.observe.circuittable); `listings_up`: whether the gateway's last listing of
        each provider that had one succeeded (tinygw.worker.discovery)."""
        gateway = scrape.gateway_gauges(circuits_open_until or {}, listings_up or {}, time.monotonic())
        extra = {("tinygw_client_in_flight", (client,), ""): float(n) for client, n in (client_in_flight or {}).items()}
        return scrape.render(self.store, FAMILIES, self._build, self._tls_not_after, gateway, extra)
