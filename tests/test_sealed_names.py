"""What a sealed request shows (docs/confidential.md): a name its body carried (a
provider-qualified model, a pattern's `*`) is shown as `*#h` in metrics, logs and the status
pages, `h` the first 12 hex digits of HMAC-SHA256 under a key every worker shares; the same
name sent in the clear, and a configured target, are shown as they are.

Black-box: a gateway of 2 workers with EHBP on, Tinfoil's client sealing the requests, a fake
provider that fails one secret name (quick 502s: a quick retry, the circuit opens) and cuts
the stream of the other; then nothing others can read holds either name. In-process: the
rule itself (the name shown, which targets are concealed, a circuit shown so)."""

from __future__ import annotations

import hashlib
import hmac
import json
import re

import httpx
import pytest
from ehbp import EHBPTransport, ServerIdentity

from conftest import call, metric_in, provider, wait_until
from tinygw.config.settings import Breaker, Model, Target
from tinygw.fake.upstream import json_reply, openai_stream_events, sse_reply, well_behaved
from tinygw.protocol.routing import Resolution, concealed
from tinygw.resilience.breaker import OTHER, Circuit, Outcome, State
from tinygw.resilience.breakers import Breakers
from tinygw.trust.confidential import shown_name

KEY = "sk-sealed-names"
CHAT = "/v1/chat/completions"
FAILING = "secret-model-4d1e"  # sent as `p/secret-model-4d1e`
CUT = "cl-secret-9b2c"  # matched by the pattern `cl-*`, whose target is `p:*`
PLAIN = "plain-model-77aa"  # sent in the clear as `p/plain-model-77aa`
SHOWN = re.compile(r"^\*#[0-9a-f]{12}$")


def _names_key(gateway) -> bytes:
    """The names key of `gateway`: in the keys directory its process holds."""
    (directory,) = gateway.held_directories("tinygw-keys-")
    return (directory / "names.key").read_bytes()


def _script(fake):
    ordinary = well_behaved("fake")

    def answer(request):
        model = (request.json() or {}).get("model")
        if model == FAILING:
            return json_reply(502, {"error": {"message": "upstream down", "type": "server_error"}})
        if model == CUT:  # output, then the end without a finish: the stream is cut
            return sse_reply(openai_stream_events(CUT, ["partial"])[:2])
        return ordinary(request)

    return answer


def _sealed_post(gateway, key_config: bytes, body: dict) -> tuple[int, dict, bytes]:
    """(status, headers, opened answer) of `body` sealed by Tinfoil's client."""
    transport = EHBPTransport(ServerIdentity.unmarshal_public_config(key_config))
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    with httpx.Client(transport=transport, timeout=10) as client:
        with client.stream("POST", f"{gateway.url}{CHAT}", content=json.dumps(body).encode(), headers=headers) as r:
            assert r.headers.get("ehbp-response-nonce"), "the answer is sealed"
            return r.status_code, dict(r.headers), b"".join(r.iter_bytes())


def _lines(gateway, message: str) -> list[dict]:
    return [r for r in gateway.log_records() if r.get("msg") == message]


def test_a_sealed_bodys_names_are_concealed_in_metrics_logs_and_status(fake, start_gateway):
    fake.script = _script(fake)
    config = {
        "providers": {"p": provider(fake)},
        "models": {"m": {"targets": ["p:m"]}, "cl-*": {"targets": ["p:*"]}},
        "routing": {"debug": True},
    }
    gateway = start_gateway(
        config, TINYGW_EHBP="on", TINYGW_WORKERS="2", TINYGW_API_KEYS=KEY, PROVIDER_BREAKER_FAILURES="2"
    )
    wait_until(lambda: gateway.logs().count('"msg":"worker started"') == 2, seconds=20, what="both workers")
    key_config = call("GET", f"{gateway.url}/.well-known/hpke-keys")[2]

    status, headers, _ = _sealed_post(gateway, key_config, {"model": f"p/{FAILING}", "messages": []})
    assert status == 502
    status, _, answer = _sealed_post(gateway, key_config, {"model": CUT, "messages": [], "stream": True})
    assert status == 200 and b"partial" in answer
    assert _sealed_post(gateway, key_config, {"model": "m", "messages": []})[0] == 200  # a configured target
    plain = call("POST", f"{gateway.url}{CHAT}", {"model": f"p/{PLAIN}"}, {"Authorization": f"Bearer {KEY}"})
    assert plain[0] == 200 and plain[1]["x-tinygw-provider-model"] == PLAIN
    requests = wait_until(lambda: len(_lines(gateway, "request")) >= 4 and _lines(gateway, "request"))
    metrics = call("GET", f"{gateway.url}/metrics")[2].decode()
    status_json = json.loads(call("GET", f"{gateway.url}/status.json")[2])
    page = call("GET", f"{gateway.url}/status")[2].decode()
    seen = {
        "metrics": metrics,
        "logs": gateway.logs(),
        "status.json": json.dumps(status_json),
        "status": page,
        "headers": json.dumps(headers),
    }
    for where, text in seen.items():
        assert FAILING not in text and CUT not in text, where
    assert PLAIN in metrics and PLAIN in page  # a name sent in the clear is shown as before

    # Each sealed name as `*#` and 12 hex digits of HMAC-SHA256 under the key the workers share.
    names_key = _names_key(gateway)  # read here to check the digits
    failing, cut = (
        "*#" + hmac.new(names_key, name.encode(), hashlib.sha256).hexdigest()[:12] for name in (FAILING, CUT)
    )
    assert failing != cut

    assert headers["x-tinygw-provider-model"] == failing  # the debug headers go in the clear
    assert {r["target"] for r in requests} == {f"p:{failing}", f"p:{cut}", "p:m", f"p:{PLAIN}"}
    [retried] = _lines(gateway, "retrying provider after a quick failure")
    [opened] = _lines(gateway, "provider circuit opened")
    [stream_cut] = _lines(gateway, "stream cut")
    assert retried["provider_model"] == opened["provider_model"] == failing
    assert stream_cut["provider_model"] == cut
    assert metric_in(metrics, "tinygw_circuit_open", provider="p", provider_model=failing) == 1
    assert metric_in(metrics, "tinygw_upstream_attempts_total", provider="p", provider_model=failing) == 2
    assert metric_in(metrics, "tinygw_upstream_attempts_total", provider="p", provider_model=cut) == 1
    assert metric_in(metrics, "tinygw_upstream_attempts_total", provider="p", provider_model=PLAIN) == 1
    [p] = status_json["providers"]
    shown = {c["provider_model"]: c["state"] for c in p["circuits"]}
    assert shown[failing] == "Circuit Open" and cut in shown and PLAIN in shown and "m" in shown
    assert failing in page and cut in page


def test_the_name_shown_is_hmac_sha256s_first_12_hex_digits_under_the_key():
    key = bytes(range(32))
    assert shown_name(key, "m") == "*#" + hmac.new(key, b"m", hashlib.sha256).hexdigest()[:12]
    names = [shown_name(key, f"model-{i}") for i in range(1000)]
    assert all(SHOWN.match(n) for n in names) and len(set(names)) == 1000
    assert shown_name(bytes(32), "m") != shown_name(key, "m")  # another gateway's key, another name
    assert SHOWN.match(shown_name(key, "\ud800 a lone surrogate, as JSON may carry"))


def _hide(name: str) -> str:
    return shown_name(bytes(32), name)


def test_only_the_names_a_body_carried_are_concealed():
    configured = {Target("p", "fixed"): None}
    qualified = Resolution("p/*", (Target("p", "secret"),))
    [target] = concealed(qualified, configured, _hide).targets
    assert (target.upstream_model, target.concealed, target.shown_model) == ("secret", _hide("secret"), _hide("secret"))
    assert target.name == f"p:{_hide('secret')}"
    # A pattern whose targets a strategy orders: its alias's targets are the same ones, concealed.
    pattern = Model(name="cl-*", targets=(Target("p", "cl-x"), Target("p", "fixed")), strategy="round_robin")
    resolution = concealed(Resolution("cl-*", pattern.targets, pattern), configured, _hide)
    assert resolution.targets == resolution.alias.targets  # type: ignore[union-attr]
    assert [t.name for t in resolution.targets] == [f"p:{_hide('cl-x')}", "p:fixed"]
    # An alias's own targets (the operator's names) are shown as they are: nothing is made anew.
    alias = Resolution("m", (Target("p", "fixed"),))
    assert concealed(alias, configured, _hide) is alias
    # A provider-qualified name that is also a configured target is the operator's too.
    assert concealed(Resolution("p/*", (Target("p", "fixed"),)), configured, _hide).targets[0].concealed == ""


def _breakers(changes: list) -> Breakers:
    return Breakers(Breaker(failures=1), lambda: 100.0, configured=[("p", "fixed")], on_change=changes.append)


def test_a_circuit_made_for_a_sealed_name_is_shown_concealed_from_birth():
    changes: list[Circuit] = []
    breakers = _breakers(changes)
    circuit = breakers.by_target[Target("p", "secret", concealed=_hide("secret"))]
    assert (circuit.provider_model, circuit.shown, circuit.label) == ("secret", _hide("secret"), _hide("secret"))
    assert circuit.target() == Target("p", "secret", concealed=_hide("secret"))
    assert breakers.circuit("p", "secret") is circuit and circuit.shown == _hide("secret")  # one circuit per name
    # A configured target is the operator's: shown as it is, whatever a request says.
    fixed = breakers.by_target[Target("p", "fixed", concealed=_hide("fixed"))]
    assert (fixed.shown, fixed.label, fixed.target().name) == ("fixed", "fixed", "p:fixed")


def test_a_name_sent_in_the_clear_then_sealed_is_shown_concealed_from_then_on_keeping_its_state():
    changes: list[tuple[str, bool, State]] = []
    breakers = Breakers(
        Breaker(failures=1),
        lambda: 100.0,
        on_change=lambda c: changes.append((c.shown, c.forgotten, c.snapshot()[0])),
    )
    plain = breakers.circuit("p", "name")
    assert plain.label == plain.shown == "name"
    plain.allow().done(Outcome.FAILURE, "502")  # a plain request's failure opens it (1 failure)
    assert plain.state() is State.OPEN
    changes.clear()
    sealed = breakers.by_target[Target("p", "name", concealed=_hide("name"))]
    assert sealed is plain and sealed.state() is State.OPEN  # the circuit is still per upstream model
    assert (sealed.shown, sealed.label) == (_hide("name"), _hide("name"))
    # The old name is taken off (as a forgotten circuit is), then the circuit is published under its new one.
    assert changes == [("name", True, State.OPEN), (_hide("name"), False, State.OPEN)]
    breakers.circuit("p", "name")  # a plain request again: it stays concealed
    assert sealed.shown == _hide("name") and len(changes) == 2


def test_a_circuit_past_the_labelled_names_stays_other_when_concealed():
    breakers = _breakers([])
    circuit = breakers.circuit("p", "x")
    circuit.label = OTHER  # as Breakers labels the names past MAX_LABELS_PER_PROVIDER
    breakers.circuit("p", "x", _hide("x"))
    assert circuit.label == OTHER and circuit.shown == _hide("x")


@pytest.mark.parametrize("name", ["p:x", "p:*#000000000000"])
def test_a_plain_targets_name_is_its_own(name):
    provider_, model = name.split(":")
    target = Target(provider_, model)
    assert (target.name, target.shown_model, target.concealed) == (name, model, "")
