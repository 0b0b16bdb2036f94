"""The status page (docs/design.md section 7): `/status` in HTML and `/status.json`.

Both show the gateway's circuits (one table whatever the number of workers,
tinygw.observe.circuittable) and last listings (tinygw.worker.discovery), and every live
worker's resting keys, read from the shared metric store where each worker publishes them
(tinygw.observe.board), in one view whichever worker answers;
and the gateway: version, artifact sha256 (when frozen), config hash, start and uptime,
live workers (slot and PID) and each model alias's strategy and targets. Times in
status.json are wall-clock ISO 8601 (UTC). For each provider: its listing state (on or
off, as tinygw.worker.discovery decides: off for Claude on a cloud, which has none; `up`
true when the gateway's last listing succeeded, false when it failed or has not
finished yet, null when listing is off) and the number of models listed;
for each circuit of the gateway: the state in words ("Circuit
Open" etc.), the consecutive failures, the current pause, the seconds until the next
probe and when that is (null unless open), when it opened, and the last error. For
each named client (docs/design.md section 16), summed over the workers: its requests in
flight, its admitted requests and its tokens of the last minute, and its limits (null:
none); a client is shown by its name, never by a key. On top, a summary: circuits open and
half-open (each provider and upstream model once),
providers whose listing is down, resting keys per pool. Providers come in the order of
their worst circuit, and each provider's circuits open first, then half-open, then closed;
each provider's key pool shows how many keys it has and each resting key by its place in
the pool (never the key), with its worker and when its rest ends.

`snapshot` builds the plain data from the gateway and is the only reader of it; the
two handlers render that data. The pages show names, states, counts and error labels
only: never a base URL, header, key or key variable. Like /healthz and /metrics, they
ask for no key. The HTML has no script: it reloads itself every 5 seconds with a meta
refresh, and every value in it is HTML-escaped.
"""

from __future__ import annotations

import math
import os
import time
from datetime import UTC, datetime
from html import escape

import msgspec

from tinygw import __version__
from tinygw.config.settings import CLOUDS
from tinygw.errors import EvidenceUnavailable
from tinygw.observe import board
from tinygw.protocol.wire import JSON_HEADERS
from tinygw.resilience.breaker import State
from tinygw.worker import discovery
from tinygw.worker.discovery import lists_models
from tinygw.worker.gateway import Gateway

STATE_WORDS = {
    State.CLOSED: "Circuit Closed",
    State.OPEN: "Circuit Open",
    State.HALF_OPEN: "Circuit Half-Open",
}

REFRESH_SECONDS = 5

_encode = msgspec.json.Encoder()
_HTML_HEADERS = [(b"content-type", b"text/html; charset=utf-8"), (b"cache-control", b"no-store")]


def _iso(wall_seconds: float | None) -> str | None:
    if wall_seconds is None:
        return None
    return datetime.fromtimestamp(wall_seconds, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def _circuit(c: board.CircuitView, now: float, wall: float) -> dict:
    state = c.state_at(now)
    next_probe = c.next_probe_seconds(now)
    return {
        "provider_model": c.provider_model,
        "state": STATE_WORDS[state],
        "consecutive_failures": c.failures,
        "pause_seconds": c.pause_seconds,
        "next_probe_seconds": next_probe,
        "next_probe_at": _iso(wall + next_probe) if next_probe is not None else None,
        "opened_at": _iso(wall - (now - c.opened_at)) if state is State.OPEN and c.opened_at else None,
        "last_error": c.last_error,
    }


# Circuits, and providers by their worst circuit, are shown in this order: what is down first.
_STATE_RANK = {STATE_WORDS[State.OPEN]: 0, STATE_WORDS[State.HALF_OPEN]: 1, STATE_WORDS[State.CLOSED]: 2}


def _key_pool(name: str, size: int, workers: list[board.WorkerView], now: float, wall: float) -> dict:
    """A provider's keys: how many, and each that rests after a 429 on some worker (by its
    place in the pool, 1 to `size`: never the key) with when its rest ends."""
    resting = sorted(
        (
            {
                "key": index + 1,
                "worker": w.slot,
                "seconds_left": round(until - now, 1),
                "until": _iso(wall + (until - now)),
            }
            for w in workers
            for (provider, index), until in w.key_rests.items()
            if provider == name and until > now and index < size
        ),
        key=lambda r: (r["key"], r["worker"]),
    )
    return {"keys": size, "resting_keys": len({r["key"] for r in resting}), "resting": resting}


def _summary(providers: list[dict]) -> dict:
    """What on-call reads first: circuits open and half-open (each (provider, upstream model)
    once, in its worst state over the workers), providers whose listing is down, and the
    resting keys of each provider's pool."""
    worst: dict[tuple[str, str], int] = {}
    for p in providers:
        for c in p["circuits"]:
            key = (p["name"], c["provider_model"])
            worst[key] = min(worst.get(key, 2), _STATE_RANK[c["state"]])
    return {
        "open_circuits": sum(1 for rank in worst.values() if rank == 0),
        "half_open_circuits": sum(1 for rank in worst.values() if rank == 1),
        "providers_listing_down": [p["name"] for p in providers if p["listing"]["up"] is False],
        "keys_resting": {p["name"]: p["key_pool"]["resting_keys"] for p in providers if p["key_pool"]["keys"]},
    }


def snapshot(gateway: Gateway, pid: int, artifact_sha256: str | None = None) -> dict:
    """What both pages show, as plain data (the shape of /status.json): the gateway's
    circuits and listings, and every live worker's resting keys."""
    settings = gateway.settings
    now, wall = gateway.clock(), time.time()  # wall: for display only
    workers = board.read(gateway.metrics.store)
    table = gateway.circuit_table.view()
    providers: list[dict] = []
    for name in sorted(settings.providers):
        provider = settings.providers[name]
        enabled = lists_models(provider) and settings.listing_seconds > 0  # never Claude on a cloud
        models = discovery.listed(gateway, name)  # the gateway's last listing, whichever worker ran it
        circuits = [_circuit(c, now, wall) for c in table if c.provider == name]
        circuits.sort(key=lambda c: (_STATE_RANK[c["state"]], c["provider_model"]))
        providers.append(
            {
                "name": name,
                "api": provider.doc.api,
                "listing": {
                    "enabled": enabled,
                    "up": models is not None if enabled else None,
                    "models": models if enabled else None,
                },
                "key_pool": _key_pool(name, len(provider.keys), workers, now, wall),
                "circuits": circuits,
            }
        )
    providers.sort(key=lambda p: (min((_STATE_RANK[c["state"]] for c in p["circuits"]), default=2), p["name"]))
    started = min((w.started_at for w in workers if w.started_at is not None), default=gateway.started_at)
    return {
        "version": __version__,
        "artifact_sha256": artifact_sha256,
        "config_sha256": settings.config_sha256(),
        "summary": _summary(providers),
        "generated_at": _iso(wall),
        "started_at": _iso(started),
        "uptime_seconds": round(max(0.0, wall - started), 1),
        "worker": {"pid": pid, "slot": gateway.metrics.store.slot},
        "workers": [{"slot": w.slot, "pid": w.pid, "started_at": _iso(w.started_at)} for w in workers],
        "models": [
            {"name": n, "strategy": m.strategy, "targets": [str(t) for t in m.targets]}
            for n, m in sorted(settings.models.items())
        ],
        "providers": providers,
        "clients": [msgspec.structs.asdict(c) for c in gateway.clients.view(now)] if gateway.clients else [],
    }


# ---- handlers ------------------------------------------------------------------------


async def _artifact_sha256(gateway: Gateway) -> str | None:
    try:
        return (await gateway.artifact_hashes())[0]
    except EvidenceUnavailable:
        return None


async def status_json(gateway: Gateway, scope, send) -> None:
    body = _encode.encode(snapshot(gateway, os.getpid(), await _artifact_sha256(gateway)))
    await send({"type": "http.response.start", "status": 200, "headers": JSON_HEADERS})
    await send({"type": "http.response.body", "body": body})


async def status_page(gateway: Gateway, scope, send) -> None:
    body = render_html(snapshot(gateway, os.getpid(), await _artifact_sha256(gateway))).encode()
    await send({"type": "http.response.start", "status": 200, "headers": _HTML_HEADERS})
    await send({"type": "http.response.body", "body": body})


# ---- HTML ----------------------------------------------------------------------------

_STYLE = """
body { font: 15px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 72em; padding: 0 1em;
       color: #1d1d1f; background: #fafafa; }
h1 { font-size: 1.5em; margin-bottom: .2em; }
h2 { font-size: 1.15em; margin: 1.6em 0 .3em; }
.meta, .listing { color: #555; margin: .2em 0; }
table { border-collapse: collapse; width: 100%; table-layout: fixed; background: #fff; }
th, td { text-align: left; padding: .35em .7em; border-bottom: 1px solid #ddd; }
th { background: #eee; font-weight: 600; }
th:nth-child(1) { width: 18%; } th:nth-child(2) { width: 7%; } th:nth-child(4), th:nth-child(6) { width: 16%; }
th:nth-child(5) { width: 12%; }
th.num, td.num { text-align: right; font-variant-numeric: tabular-nums; }
.state { font-weight: 600; }
.summary { font-size: 1.1em; font-weight: 600; margin: .4em 0 1em; }
.keys { color: #555; margin: .2em 0; }
th, td.num, td.state, td.probe { white-space: nowrap; }
td { overflow-wrap: anywhere; }
.closed { color: #17692c; }
.open { color: #b00020; }
.half-open { color: #8a5a00; }
code { font-size: .95em; }
table.facts, table.models, table.clients { table-layout: auto; margin-bottom: 1em; }
table.facts th { width: 12em; }
table.models th, table.clients th { width: auto !important; }
"""

_COLUMNS = [
    ("Upstream model", ""),
    ("State", ""),
    ("Consecutive failures", ' class="num"'),
    ("Current pause", ' class="num"'),
    ("Next probe", ""),
    ("Last error", ""),
]
_STATE_CLASS = {"Circuit Closed": "closed", "Circuit Open": "open", "Circuit Half-Open": "half-open"}


def _seconds(value: float) -> str:
    return f"{value:g} s" if value == int(value) else f"{value:.1f} s"


def _listing_text(listing: dict, api: str) -> str:
    if not listing["enabled"]:
        return "none for Claude on a cloud (its models are those configured)" if api in CLOUDS else "off"
    if listing["up"]:
        count = listing["models"]
        return f"up, {count} model{'' if count == 1 else 's'}"
    return "not up (failed, or not finished yet)"


def _circuit_row(c: dict) -> str:
    next_probe = c["next_probe_seconds"]
    probe = "—" if next_probe is None else f"next probe in {math.ceil(next_probe)} s"
    cells = [
        f"<td><code>{escape(c['provider_model'])}</code></td>"
        if c["provider_model"]
        else "<td><em>(the provider&#x27;s own)</em></td>",
        f'<td class="state {_STATE_CLASS[c["state"]]}">{escape(c["state"])}</td>',
        f'<td class="num">{escape(str(c["consecutive_failures"]))}</td>',
        f'<td class="num">{escape(_seconds(c["pause_seconds"]))}</td>',
        f'<td class="probe">{escape(probe)}</td>',
        f"<td>{escape(c['last_error'] or '—')}</td>",
    ]
    return "<tr>" + "".join(cells) + "</tr>"


def _plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def _key_pool_text(pool: dict) -> str:
    if not pool["resting"]:
        return f"{_plural(pool['keys'], 'key')}, none resting"
    rests = "; ".join(
        f"key {r['key']} on worker {r['worker']} until {r['until']} ({math.ceil(r['seconds_left'])} s)"
        for r in pool["resting"]
    )
    return f"{_plural(pool['keys'], 'key')}, {pool['resting_keys']} resting: {rests}"


def _provider_section(p: dict) -> str:
    head = "".join(f"<th{cls}>{h}</th>" for h, cls in _COLUMNS)
    rows = "".join(_circuit_row(c) for c in p["circuits"])
    table = (
        f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>"
        if rows
        else '<p class="meta">No circuits yet.</p>'
    )
    pool = p.get("key_pool")
    keys = f'<p class="keys">Key pool: {escape(_key_pool_text(pool))}</p>' if pool and pool["keys"] else ""
    return (
        f'<section><h2>{escape(p["name"])} <small class="meta">({escape(p["api"])})</small></h2>'
        f'<p class="listing">Listing: {escape(_listing_text(p["listing"], p["api"]))}</p>{keys}{table}</section>'
    )


def _summary_line(summary: dict | None) -> str:
    """The line on top: what is down, or that nothing is."""
    if summary is None:
        return ""
    down = summary["providers_listing_down"]
    resting = {name: n for name, n in summary["keys_resting"].items() if n}
    parts = [
        (f"{_plural(summary['open_circuits'], 'circuit')} open", "open" if summary["open_circuits"] else "closed"),
        (f"{summary['half_open_circuits']} half-open", "half-open" if summary["half_open_circuits"] else "closed"),
        ("listing down: " + ", ".join(down) if down else "every listing up", "open" if down else "closed"),
        (
            "keys resting: " + ", ".join(f"{name} {n}" for name, n in sorted(resting.items()))
            if resting
            else "no key resting",
            "half-open" if resting else "closed",
        ),
    ]
    cells = " · ".join(f'<span class="{cls}">{escape(text)}</span>' for text, cls in parts)
    return f'<p class="summary">{cells}</p>'


def _uptime(seconds: float) -> str:
    whole = int(seconds)
    days, rest = divmod(whole, 86400)
    return (f"{days} d " if days else "") + f"{rest // 3600} h {rest % 3600 // 60} min {rest % 60} s"


def _overview(data: dict) -> str:
    sha = data.get("artifact_sha256")
    facts = [
        ("Version", escape(str(data.get("version")))),
        ("Artifact sha256", f"<code>{escape(sha)}</code>" if sha else "— (not a frozen build)"),
        ("Config sha256", f"<code>{escape(str(data.get('config_sha256')))}</code>"),
        ("Up since", f"{escape(str(data.get('started_at')))} ({escape(_uptime(data.get('uptime_seconds', 0)))})"),
        ("Workers", escape(", ".join(f"{w['slot']} (PID {w['pid']})" for w in data.get("workers", [])) or "—")),
    ]
    rows = "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in facts)
    models = "".join(
        f"<tr><td><code>{escape(m['name'])}</code></td><td>{escape(m['strategy'])}</td>"
        f"<td>{escape(', '.join(m['targets']))}</td></tr>"
        for m in data.get("models", [])
    )
    model_table = (
        (
            f'<h2>Models</h2><table class="models"><thead><tr><th>Alias</th><th>Strategy</th><th>Targets</th>'
            f"</tr></thead><tbody>{models}</tbody></table>"
        )
        if models
        else ""
    )
    return f'<table class="facts"><tbody>{rows}</tbody></table>{model_table}'


_CLIENT_COLUMNS = [
    ("Client", ""),
    ("In flight", ' class="num"'),
    ("Requests this minute", ' class="num"'),
    ("Tokens this minute", ' class="num"'),
    ("Limits", ""),
]


def _limits_text(limits: dict) -> str:
    words = {"max_concurrent": "in flight", "requests_per_minute": "requests/min", "tokens_per_minute": "tokens/min"}
    set_ = [f"{value} {words[name]}" for name, value in limits.items() if value is not None]
    return ", ".join(set_) or "none"


def _clients_section(clients: list[dict]) -> str:
    if not clients:
        return ""
    head = "".join(f"<th{cls}>{h}</th>" for h, cls in _CLIENT_COLUMNS)
    rows = "".join(
        f"<tr><td><code>{escape(c['name'])}</code></td>"
        f'<td class="num">{escape(str(c["in_flight"]))}</td>'
        f'<td class="num">{escape(str(c["requests_this_minute"]))}</td>'
        f'<td class="num">{escape(str(c["tokens_this_minute"]))}</td>'
        f"<td>{escape(_limits_text(c['limits']))}</td></tr>"
        for c in clients
    )
    return (
        f'<section><h2>Clients</h2><table class="clients"><thead><tr>{head}</tr></thead>'
        f"<tbody>{rows}</tbody></table></section>"
    )


def render_html(data: dict) -> str:
    sections = "".join(_provider_section(p) for p in data["providers"]) or "<p>No providers configured.</p>"
    sections = _clients_section(data.get("clients", [])) + sections
    pid = escape(str(data["worker"]["pid"]))
    return (
        "<!doctype html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="refresh" content="{REFRESH_SECONDS}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>tinygw status</title><style>{_STYLE}</style></head><body>"
        "<h1>tinygw status</h1>"
        f"{_summary_line(data.get('summary'))}"
        f'<p class="meta">Answered by worker PID {pid}, at {escape(str(data.get("generated_at")))}. The workers '
        f"share the gateway&#x27;s circuits; this page shows them, and reloads every {REFRESH_SECONDS} s.</p>"
        f"{_overview(data)}{sections}</body></html>\n"
    )
