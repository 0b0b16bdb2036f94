"""Unit: the `usage` an answer or an event reports (tinygw.protocol.usage), and the one decode
of a held answer that judges its `error` and reads its `usage` (tinygw.resilience.outcome)."""

from __future__ import annotations

import json

import pytest

from tinygw.protocol import usage
from tinygw.resilience import outcome


def event(data: dict, name: str | None = None) -> bytes:
    return (f"event: {name}\n" if name else "").encode() + b"data: " + json.dumps(data).encode() + b"\n\n"


@pytest.mark.parametrize(
    "raw,expected",
    [
        (event({"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 5}}), (11, 5)),
        (b'data: {"choices":[],"usage" : {"prompt_tokens":2,"completion_tokens":1}}\n\n', (2, 1)),
        (
            event(
                {"type": "message_start", "message": {"usage": {"input_tokens": 25, "output_tokens": 1}}},
                "message_start",
            ),
            (25, 1),
        ),
        (
            event(
                {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 15}},
                "message_delta",
            ),
            (0, 15),
        ),
        (
            event(
                {
                    "type": "response.completed",
                    "response": {"output": [{"text": "usage"}], "usage": {"input_tokens": 3, "output_tokens": 4}},
                }
            ),
            (3, 4),
        ),
    ],
)
def test_events_that_report_usage(raw, expected):
    found = usage.of_event(raw)
    assert found is not None and (found.tokens().prompt, found.tokens().completion) == expected


@pytest.mark.parametrize(
    "raw",
    [
        event({"choices": [{"delta": {"content": "hi"}}], "usage": None}),  # OpenAI's chunks before the last
        b'data: {"choices":[],"usage": null}\n\n',
        event({"type": "response.created", "response": {"usage": None}}),
        event({"type": "error", "message": 'the word "usage": {} inside text'}, "error"),  # `message` a string
        event({"choices": [{"delta": {"content": '"usage":{"prompt_tokens":9}'}}]}),  # usage only in the text
        b'data: {"usage": {"prompt_tokens": -1}}\n\n',
        b'data: {"usage": {"prompt_tokens": \n\n',
    ],
)
def test_events_that_do_not(raw):
    found = usage.of_event(raw)
    assert found is None or (found.tokens().prompt, found.tokens().completion) == (0, 0)


def test_a_streams_tokens_are_the_largest_running_totals():
    tokens = usage.Tokens()
    for raw in (
        event({"type": "message_start", "message": {"usage": {"input_tokens": 25, "output_tokens": 1}}}),
        event({"type": "message_delta", "usage": {"output_tokens": 15}}),
    ):
        tokens.add(usage.of_event(raw))
    tokens.add(None)
    assert (tokens.prompt, tokens.completion) == (25, 15)


@pytest.mark.parametrize(
    "body,expected",
    [
        ({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}, (False, (3, 4))),
        ({"content": [], "usage": {"input_tokens": 3, "output_tokens": 4}}, (False, (3, 4))),
        ({"error": {"message": "no"}, "usage": {"prompt_tokens": 3}}, (True, None)),  # a failure: not sent, not counted
        ({"error": {"message": "no"}, "usage": "a string"}, (True, None)),  # judged without the usage
        ({"error": None, "usage": None}, (False, None)),
        ({"choices": []}, (False, None)),
    ],
)
def test_one_decode_judges_the_error_and_reads_the_usage(body, expected):
    judged = outcome.of_answer(200, 0.1, json.dumps(body).encode())
    failed, found = judged.label == "200+error", judged.usage
    assert (failed, None if found is None else (found.tokens().prompt, found.tokens().completion)) == expected
