"""The status page (SPEC section 7): `/status` in HTML and `/status.json`.

Both show what this worker process knows, and say which worker answered (its PID):
with several workers, each has its own circuits and listings, so two reloads may be
answered by two workers. For each provider: its listing state (on or off; `up` true
when its last listing succeeded, false when it failed or has not finished yet, null
when listing is off) and the number of models it listed; for each of its circuits,
the state in words ("Circuit Open" etc.), the consecutive failures, the current pause,
the seconds until the next probe (null unless open) and the last error.

`snapshot` builds the plain data from the gateway and is the only reader of it; the
two handlers render that data. The pages show names, states, counts and error labels
only: never a base URL, header, key or key variable. Like /healthz and /metrics, they
ask for no key. The HTML has no script: it reloads itself every 5 seconds with a meta
refresh, and every value in it is HTML-escaped.
"""

from __future__ import annotations

import math
import os
from html import escape

import msgspec

from tinygw.breaker import Circuit, State
from tinygw.gateway import Gateway
from tinygw.wire import JSON_HEADERS

STATE_WORDS = {
    State.CLOSED: "Circuit Closed",
    State.OPEN: "Circuit Open",
    State.HALF_OPEN: "Circuit Half-Open",
}

REFRESH_SECONDS = 5

_encode = msgspec.json.Encoder()
_HTML_HEADERS = [(b"content-type", b"text/html; charset=utf-8"), (b"cache-control", b"no-store")]


def _circuit(circuit: Circuit) -> dict:
    state = circuit.state()  # read first: an open circuit whose pause is over turns half-open here
    return {
        "provider_model": circuit.provider_model,
        "state": STATE_WORDS[state],
        "consecutive_failures": circuit.failures,
        "pause_seconds": circuit.pause_seconds,
        "next_probe_seconds": circuit.retry_after() if state is State.OPEN else None,
        "last_error": circuit.last_error,
    }


def snapshot(gateway: Gateway, pid: int) -> dict:
    """What both pages show, as plain data (the shape of /status.json)."""
    settings = gateway.settings
    providers = []
    for name in sorted(settings.providers):
        provider = settings.providers[name]
        enabled = provider.doc.listing and settings.listing_seconds > 0
        listed = gateway.listings.get(name)
        circuits = sorted(gateway.breakers.of_provider(name), key=lambda c: c.provider_model)
        providers.append(
            {
                "name": name,
                "api": provider.doc.api,
                "listing": {
                    "enabled": enabled,
                    "up": (listed is not None) if enabled else None,
                    "models": len(listed) if enabled and listed is not None else None,
                },
                "circuits": [_circuit(c) for c in circuits],
            }
        )
    return {"worker": {"pid": pid}, "generated_at_monotonic": gateway.clock(), "providers": providers}


# ---- handlers ------------------------------------------------------------------------


async def status_json(gateway: Gateway, scope, send) -> None:
    body = _encode.encode(snapshot(gateway, os.getpid()))
    await send({"type": "http.response.start", "status": 200, "headers": JSON_HEADERS})
    await send({"type": "http.response.body", "body": body})


async def status_page(gateway: Gateway, scope, send) -> None:
    body = render_html(snapshot(gateway, os.getpid())).encode()
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
th:nth-child(1) { width: 20%; } th:nth-child(3), th:nth-child(5) { width: 18%; } th:nth-child(4) { width: 13%; }
th.num, td.num { text-align: right; font-variant-numeric: tabular-nums; }
.state { font-weight: 600; }
th, td.num, td.state, td.probe { white-space: nowrap; }
td { overflow-wrap: anywhere; }
.closed { color: #17692c; }
.open { color: #b00020; }
.half-open { color: #8a5a00; }
code { font-size: .95em; }
"""

_COLUMNS = [("Upstream model", ""), ("State", ""), ("Consecutive failures", ' class="num"'),
            ("Current pause", ' class="num"'), ("Next probe", ""), ("Last error", "")]
_STATE_CLASS = {"Circuit Closed": "closed", "Circuit Open": "open", "Circuit Half-Open": "half-open"}


def _seconds(value: float) -> str:
    return f"{value:g} s" if value == int(value) else f"{value:.1f} s"


def _listing_text(listing: dict) -> str:
    if not listing["enabled"]:
        return "off"
    if listing["up"]:
        count = listing["models"]
        return f"up, {count} model{'' if count == 1 else 's'}"
    return "not up (failed, or not finished yet)"


def _circuit_row(c: dict) -> str:
    next_probe = c["next_probe_seconds"]
    probe = "—" if next_probe is None else f"next probe in {math.ceil(next_probe)} s"
    cells = [
        f'<td><code>{escape(c["provider_model"])}</code></td>' if c["provider_model"]
        else "<td><em>(the provider&#x27;s own)</em></td>",
        f'<td class="state {_STATE_CLASS[c["state"]]}">{escape(c["state"])}</td>',
        f'<td class="num">{escape(str(c["consecutive_failures"]))}</td>',
        f'<td class="num">{escape(_seconds(c["pause_seconds"]))}</td>',
        f'<td class="probe">{escape(probe)}</td>',
        f'<td>{escape(c["last_error"] or "—")}</td>',
    ]
    return "<tr>" + "".join(cells) + "</tr>"


def _provider_section(p: dict) -> str:
    head = "".join(f"<th{cls}>{h}</th>" for h, cls in _COLUMNS)
    rows = "".join(_circuit_row(c) for c in p["circuits"])
    table = (f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>" if rows
             else "<p class=\"meta\">No circuits yet.</p>")
    return (
        f'<section><h2>{escape(p["name"])} <small class="meta">({escape(p["api"])})</small></h2>'
        f'<p class="listing">Listing: {escape(_listing_text(p["listing"]))}</p>{table}</section>'
    )


def render_html(data: dict) -> str:
    sections = "".join(_provider_section(p) for p in data["providers"]) or "<p>No providers configured.</p>"
    pid = escape(str(data["worker"]["pid"]))
    return (
        "<!doctype html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="refresh" content="{REFRESH_SECONDS}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>tinygw status</title><style>{_STYLE}</style></head><body>"
        "<h1>tinygw status</h1>"
        f'<p class="meta">Answered by worker PID {pid}. Each worker keeps its own circuits; '
        f"this page reloads every {REFRESH_SECONDS} s.</p>"
        f"{sections}</body></html>\n"
    )
