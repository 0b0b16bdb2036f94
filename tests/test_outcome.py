"""The failure table (tinygw/resilience/outcome.py), row by row, in-process.

Each case is one row of docs/design.md section 4's failure table, named as the row is
there: what the breaker is told, whether the request may go on, whether the one quick
retry may repeat it, the label, and the status the client gets should the attempt be
the last. A change to one row breaks its case and no other; a row added to the table
(or to the code's) without its case fails `test_the_design_s_failure_table_is_these_rows`.
"""

from __future__ import annotations

import json
import pathlib
import re

import pytest

from tinygw import errors
from tinygw.resilience import outcome
from tinygw.resilience.outcome import Ending

DESIGN = pathlib.Path(__file__).parent.parent / "docs" / "design.md"

F, S, N = "failure", "success", "neutral"
FAST, SLOW = 0.2, 6.0  # seconds before the answer's head: within the quick bound, and past it

ROWS: dict[str, tuple] = {
    # row: (what judges it, (outcome, may_fall_back, quick, label, status))
    "refused": (lambda: outcome.of_error(errors.ConnectError("refused")), (F, True, True, "connect_error", 502)),
    "closed_early": (lambda: outcome.of_error(errors.ReadError("closed")), (F, True, True, "connect_error", 502)),
    "protocol_error": (
        lambda: outcome.of_error(errors.RemoteProtocolError("bad")),
        (F, True, False, "protocol_error", 502),
    ),
    "timeout": (lambda: outcome.of_error(errors.FirstByteTimeout("slow")), (F, True, False, "timeout", 504)),
    "busy": (lambda: outcome.of_error(errors.PoolTimeout("busy")), (N, True, False, "provider_busy", 503)),
    "too_large": (lambda: outcome.of_error(errors.ResponseTooLarge("big")), (N, False, False, "connect_error", 502)),
    "credentials": (
        lambda: outcome.of_error(errors.ProviderCredentials("no token")),
        (F, True, False, "provider_credentials", 502),
    ),
    "redirect": (lambda: outcome.of_answer(302, FAST, b""), (F, True, False, "302", 502)),
    "5xx": (lambda: outcome.of_answer(529, FAST, b"{}"), (F, True, False, "529", 529)),
    "5xx_quick": (lambda: outcome.of_answer(503, FAST, b"{}"), (F, True, True, "503", 503)),
    "key_refused": (lambda: outcome.of_answer(401, FAST, b"{}"), (F, True, False, "401", 401)),
    "account_chosen": (lambda: outcome.of_answer(403, FAST, b"{}", account_chosen=True), (N, False, False, "403", 403)),
    "200_error": (
        lambda: outcome.of_answer(200, FAST, b'{"error": {"message": "no"}}'),
        (F, True, False, "200+error", 502),
    ),
    "200_not_json": (lambda: outcome.of_answer(200, FAST, b"<html>"), (F, True, False, "200+not_json", 502)),
    "rate_limited": (lambda: outcome.of_answer(429, FAST, b"{}"), (N, True, False, "429", 429)),
    "client_error": (lambda: outcome.of_answer(404, FAST, b"{}"), (N, False, False, "404", 404)),
    "too_long": (
        lambda: outcome.of_answer(400, FAST, b'{"error": {"code": "context_length_exceeded", "message": "too many"}}'),
        (N, False, False, "400", 400),
    ),
    "success": (lambda: outcome.of_answer(200, FAST, b'{"choices": []}'), (S, False, False, "200", 200)),
    "cloud_throttled": (
        lambda: outcome.of_cloud_answer(429, FAST, b"{}", "ThrottlingException"),
        (N, True, False, "429+ThrottlingException", 429),
    ),
    "cloud_unavailable": (
        lambda: outcome.of_cloud_answer(503, FAST, b"{}", "ServiceUnavailableException"),
        (F, True, True, "503+ServiceUnavailableException", 503),
    ),
    "cloud_refused": (
        lambda: outcome.of_cloud_answer(403, FAST, b"{}", "AccessDeniedException"),
        (F, True, False, "403+AccessDeniedException", 502),
    ),
    "cloud_validation": (
        lambda: outcome.of_cloud_answer(400, FAST, b"{}", "ValidationException"),
        (N, False, False, "400+ValidationException", 400),
    ),
    "stream_error_first": (
        lambda: outcome.of_stream(Ending.ERROR_EVENT, output=False),
        (F, True, False, "200+error_event", 502),
    ),
    "stream_cloud_throttled": (
        lambda: outcome.of_stream(Ending.ERROR_EVENT, output=False, cloud_error=("throttlingException", FAST, b"")),
        (N, True, False, "429+throttlingException", 429),
    ),
    "stream_cloud_unavailable": (
        lambda: outcome.of_stream(
            Ending.ERROR_EVENT, output=False, cloud_error=("serviceUnavailableException", FAST, b"")
        ),
        (F, True, True, "503+serviceUnavailableException", 503),
    ),
    "stream_cloud_validation": (
        lambda: outcome.of_stream(Ending.ERROR_EVENT, output=False, cloud_error=("validationException", FAST, b"")),
        (N, False, False, "400+validationException", 400),
    ),
    "stream_no_output": (
        lambda: outcome.of_stream(Ending.FINISHED, output=False),
        (F, True, False, "200+no_output", 502),
    ),
    "stream_broken_first": (
        lambda: outcome.of_stream(Ending.BROKEN, output=False, error=errors.StallTimeout("paused")),
        (F, True, False, "timeout", 504),
    ),
    "stream_finished": (lambda: outcome.of_stream(Ending.FINISHED, output=True), (S, False, False, "200", 200)),
    "stream_error_after": (
        lambda: outcome.of_stream(Ending.ERROR_EVENT, output=True),
        (F, False, False, "200+error_event", 200),
    ),
    "stream_cut": (lambda: outcome.of_stream(Ending.UNFINISHED, output=True), (F, False, False, "200+cut", 200)),
    "stream_broken_after": (
        lambda: outcome.of_stream(Ending.BROKEN, output=True, error=errors.ReadError("reset")),
        (F, False, False, "200+connect_error", 200),
    ),
    "client_left": (lambda: outcome.CLIENT_LEFT, (N, False, False, "client_closed", 499)),
}


TOO_LONG_ANSWERS = [
    (400, b'{"error": {"message": "x", "type": "invalid_request_error", "code": "context_length_exceeded"}}', None),
    (
        400,
        b'{"type": "error", "error": {"type": "invalid_request_error", "message": "prompt is too long: 9 > 8"}}',
        None,
    ),
    (400, b'{"message": "Input is too long for requested model."}', "ValidationException"),
    (400, b'{"message": "Input is too long for requested model."}', "validationException"),
]


@pytest.mark.parametrize("status,body,name", TOO_LONG_ANSWERS)
def test_each_provider_s_words_for_a_prompt_too_long_are_too_long(status, body, name):
    judged = (
        outcome.of_answer(status, FAST, body) if name is None else outcome.of_cloud_answer(status, FAST, body, name)
    )
    assert judged.verdict.too_long and judged.verdict.outcome.value == N and judged.status == 400


def test_other_400s_and_other_statuses_are_not_too_long():
    assert not outcome.of_answer(400, FAST, b'{"error": {"code": "invalid_value"}}').verdict.too_long
    assert not outcome.of_answer(500, FAST, b'{"error": {"code": "context_length_exceeded"}}').verdict.too_long
    assert not outcome.of_cloud_answer(400, FAST, b'{"message": "bad"}', "ValidationException").verdict.too_long


@pytest.mark.parametrize("row", ROWS)
def test_each_row_of_the_failure_table(row):
    judge, expected = ROWS[row]
    judged = judge()
    verdict = judged.verdict
    assert (verdict.outcome.value, verdict.may_fall_back, verdict.quick, judged.label, judged.status) == expected
    assert verdict.too_long == (row == "too_long")


def test_the_design_s_failure_table_is_these_rows():
    text = DESIGN.read_text()
    table = text[text.index("**The failure table**") : text.index("**The breaker's transitions**")]
    assert re.findall(r"^\| `([a-z0-9_]+)` \|", table, re.MULTILINE) == list(ROWS)


# The rows' edges: where one row ends and the next begins.


@pytest.mark.parametrize("status", [502, 503])
def test_a_502_or_503_is_quick_only_within_5_seconds(status):
    assert outcome.of_answer(status, outcome.QUICK_SECONDS, b"{}").verdict.quick
    assert not outcome.of_answer(status, SLOW, b"{}").verdict.quick


def test_an_account_chosen_by_the_client_does_not_make_a_402_the_client_s():
    assert outcome.of_answer(402, FAST, b"{}", account_chosen=True).verdict.outcome.value == F


def test_every_timeout_is_a_504_and_not_quick():
    for kind in (errors.ConnectTimeout, errors.FirstByteTimeout, errors.StallTimeout, errors.TotalTimeout):
        judged = outcome.of_error(kind("slow"))
        assert (judged.status, judged.verdict.quick, judged.label) == (504, False, "timeout"), kind


def test_an_error_without_an_answer_is_the_gateway_s_own_answer_and_says_when_to_retry():
    busy = errors.PoolTimeout("busy")
    assert (outcome.of_error(busy).error, outcome.of_error(busy).retry_after_seconds) == (busy, 1)
    assert outcome.of_error(errors.ConnectError("refused")).retry_after_seconds is None


def test_a_held_answer_too_large_to_hold_and_cut_is_cut_with_its_own_status():
    assert outcome.of_stream(Ending.UNFINISHED, output=True, status=206).label == "206+cut"


def test_a_success_s_usage_is_read_in_the_same_decode():
    judged = outcome.of_answer(200, FAST, json.dumps({"usage": {"prompt_tokens": 3, "completion_tokens": 4}}).encode())
    assert judged.usage is not None and (judged.usage.tokens().prompt, judged.usage.tokens().completion) == (3, 4)


def test_a_cloud_s_401_without_a_name_is_its_credentials():
    judged = outcome.of_cloud_answer(401, FAST, b"{}", None)
    assert (judged.verdict.outcome.value, judged.status, judged.label) == (F, 502, "401")
    assert isinstance(judged.error, errors.ProviderCredentials)


def test_a_cloud_s_error_names_are_matched_in_any_case_and_other_names_are_error_events():
    for name in ("ThrottlingException", "throttlingexception", "THROTTLINGEXCEPTION"):
        assert outcome.of_cloud_error(name, FAST).status == 429, name
    assert outcome.of_cloud_error("throttlingException", FAST).retry_after_seconds == 1
    assert outcome.of_cloud_error("internalServerException", FAST).label == "200+error_event"
    assert outcome.of_cloud_answer(429, FAST, b"{}", "throttlingexception").verdict.outcome.value == N
