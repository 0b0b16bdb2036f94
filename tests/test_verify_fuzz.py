"""attest/verify's answer parsing and checks under Hypothesis: whatever a server sends,
a verdict per check, never an exception (docs/verify.md: no traceback on any input)."""

from __future__ import annotations

import base64
import hashlib
import json
import os
from types import SimpleNamespace

import test_attest
from answer import DEPTH_MAX, FetchFailed, parse_answer  # attest/, put on the path by test_attest
from checks import Checks
from fake_tdx import BODY_FIELDS, tdx_quote_v4
from hypothesis import given
from hypothesis import strategies as st
from policy import PolicyError
from policy import parse as parse_policy

verify_script = test_attest.verify_module()
NONCE = bytes(range(32))
SHA384 = hashlib.sha384(b"artifact").hexdigest()
CONFIG = "ab" * 32
RUN = SimpleNamespace(
    allow_no_evidence=False, config_sha256=CONFIG, collateral=None, pccs=None, platform_verifier=None, now=1751328000
)
POLICY = parse_policy(
    {name: ["00" * size] for name, (_, size) in BODY_FIELDS.items()}
    | {"fmspc": ["00" * 6], "platform_ids": ["00" * 16], "min_tcb_evaluation_data_number": 3}
)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=40),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=20,
)


def genuine() -> dict:
    data = hashlib.sha512(b"tinygw.attest.v1" + NONCE + bytes.fromhex(CONFIG)).digest()
    rtmr3 = hashlib.sha384(bytes(48) + bytes.fromhex(SHA384)).digest()
    return {
        "version": "0.1.0",
        "config_sha256": CONFIG,
        "nonce": NONCE.hex(),
        "report_data": data.hex(),
        "event_log": [{"register": "rtmr3", "type": "tinygw.artifact", "digest_sha384": SHA384}],
        "evidence": {"provider": "tdx_guest", "outblob": base64.b64encode(tdx_quote_v4(rtmr3, data)).decode()},
    }


def outblobs():
    quote = tdx_quote_v4(bytes(48), bytes(64))
    return st.one_of(
        json_values,
        st.binary(max_size=700).map(lambda b: base64.b64encode(b).decode()),
        st.integers(0, len(quote)).map(lambda n: base64.b64encode(quote[:n]).decode()),
        st.tuples(st.integers(0, len(quote) - 1), st.integers(0, 255)).map(
            lambda at: base64.b64encode(quote[: at[0]] + bytes([at[1]]) + quote[at[0] + 1 :]).decode()
        ),
    )


@st.composite
def answers(draw) -> dict:
    answer = genuine()
    for key in draw(st.lists(st.sampled_from([*answer, "tls_spki_sha256", "tls_certificate"]), max_size=4)):
        if draw(st.booleans()):
            answer.pop(key, None)
        else:
            answer[key] = draw(json_values)
    if draw(st.booleans()):
        answer["evidence"] = {
            "provider": draw(st.sampled_from(["tdx_guest", "none", "sev_guest", 7])),
            "outblob": draw(outblobs()),
        }
    if draw(st.booleans()):
        answer["event_log"] = draw(
            st.lists(
                st.dictionaries(
                    st.sampled_from(["register", "type", "digest_sha384"]),
                    json_values | st.just("rtmr3") | st.just(SHA384),
                ),
                max_size=3,
            )
        )
    return answer


def judge(answer: dict, url: str, peer) -> Checks:
    checks = Checks(as_json=True)
    verify_script.check_answer(answer, peer, NONCE, url, SHA384, POLICY, RUN, checks)
    return checks


@given(answers(), st.sampled_from(["http://127.0.0.1:1", "https://127.0.0.1:1"]), st.none() | st.binary(max_size=64))
def test_any_answer_gets_a_verdict_per_check_never_an_exception(answer, url, peer):
    checks = judge(answer, url, peer)
    assert checks.results and all(r["result"] in ("PASS", "FAIL", "SKIP") for r in checks.results)
    assert checks.failed or checks.skipped  # nothing here is signed: it never all PASSes
    json.dumps(checks.results)  # --json can print it


@given(st.binary(max_size=2000) | json_values.map(lambda v: json.dumps(v).encode()))
def test_any_bytes_parse_to_an_object_or_one_reason(body):
    try:
        answer = parse_answer(body)
    except FetchFailed as e:
        assert "\n" not in str(e)
        return
    assert isinstance(answer, dict)
    checks = judge(answer, "http://127.0.0.1:1", None)
    assert checks.results and all(r["result"] in ("PASS", "FAIL", "SKIP") for r in checks.results)
    assert checks.failed or checks.skipped  # nothing here is signed: it never all PASSes
    assert all(r["result"] == "PASS" or r["reason"] and "\n" not in r["reason"] for r in checks.results)


@given(st.integers(DEPTH_MAX - 2, DEPTH_MAX + 2), st.sampled_from(["[", '{"a":']))
def test_nesting_is_bounded_at_its_limit(levels, opener):
    closer = "]" if opener == "[" else "}"
    body = ('{"x": ' + opener * (levels - 1) + "1" + closer * (levels - 1) + "}").encode()
    if levels <= DEPTH_MAX:
        assert isinstance(parse_answer(body), dict)
    else:
        try:
            parse_answer(body)
            raise AssertionError("deeper than the limit, and parsed")
        except FetchFailed as e:
            assert "nested deeper" in str(e)


def test_a_random_answer_from_os_urandom_is_judged():
    """A genuine answer but for its quote, 5,000 random bytes: every check has its verdict, and
    the quote is a FAIL that says why."""
    answer = genuine()
    answer["evidence"] = {"provider": "tdx_guest", "outblob": base64.b64encode(os.urandom(5000)).decode()}
    checks = judge(answer, "https://127.0.0.1:1", os.urandom(600))
    results = {r["name"]: r for r in checks.results}
    assert results["nonce echoed"]["result"] == "PASS"  # judged as the rest of the answer deserves
    assert results["quote signature"]["result"] == "FAIL" and results["quote signature"]["reason"]
    assert all(r["result"] in ("PASS", "FAIL", "SKIP") for r in checks.results)


policy_documents = st.dictionaries(
    st.sampled_from(["mrtd", "xfam", "fmspc", "platform_ids", "tcb", "min_tcb_evaluation_data_number", "snp", "x"]),
    json_values
    | st.lists(st.sampled_from(["UpToDate", "OutOfDate", "Revoked", "00" * 48, "00" * 8, {}]), max_size=3)
    | st.lists(
        st.fixed_dictionaries(
            {"status": st.sampled_from(["UpToDate", "Revoked", 3]), "grace_days": st.integers(-2, 2) | json_values}
        ),
        max_size=2,
    ),
    max_size=4,
)


@given(policy_documents | json_values)
def test_any_policy_document_is_a_policy_or_one_reason(document):
    try:
        parse_policy(document)
    except PolicyError as e:
        assert "\n" not in str(e)
