"""Unit tests of the wire helpers: the model rewrite and header filtering."""

from __future__ import annotations

import json

import pytest

from tinygw.protocol.request import BadBody, read_head, rewrite_model
from tinygw.protocol.wire import forward_headers, relay_headers


def test_rewrite_replaces_only_the_model_bytes():
    body = b'{"model" :  "alias", "messages": [{"content": "a \\"model\\": \\"alias\\""}], "t": 1.10}'
    out = rewrite_model(body, "alias", "org/up-7b")
    assert out == body.replace(b'"alias",', b'"org/up-7b",', 1)


def test_rewrite_with_a_nested_model_key_re_encodes_and_keeps_meaning():
    body = json.dumps({"tools": [{"model": "alias"}], "model": "alias", "x": [1, 2]}).encode()
    out = json.loads(rewrite_model(body, "alias", "up"))
    assert out == {"tools": [{"model": "alias"}], "model": "up", "x": [1, 2]}


def test_rewrite_with_an_escaped_model_value():
    body = b'{"model": "caf\\u00e9", "n": 1}'
    assert json.loads(rewrite_model(body, "caf\u00e9", 'q"x')) == {"model": 'q"x', "n": 1}


def test_rewrite_is_a_no_op_for_the_same_name():
    body = b'{"model":"m"}'
    assert rewrite_model(body, "m", "m") is body


@pytest.mark.parametrize("body", [b"", b"{", b"[]", b'{"model": null}', b'{"model": ["x"]}', b'{"stream": "yes"}'])
def test_bad_heads(body):
    with pytest.raises(BadBody):
        read_head(body)


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "m", "stream": true, "x": "\\ud83d"}',
        b'{"x": ["\\udfff", {"y": "\\ud800"}], "stream": true, "model": "m"}',
        b'{"model": "m", "stream": true, "x": "\\\\ud83d \\ud83d\\ude00 \\uDBFF"}',
    ],
)
def test_a_lone_surrogate_escape_is_json_read_and_rewritten_byte_exact(body):
    """msgspec refuses `"\\ud83d"` alone, which RFC 8259's grammar allows: the standard
    library's parser reads the head then; the rewrite still splices the model's bytes."""
    head = read_head(body)
    assert (head.model, head.stream) == ("m", True)
    assert rewrite_model(body, "m", "up/x") == body.replace(b'"model": "m"', b'"model": "up/x"')


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "m", "x": "\\ud83d", "y": NaN}',  # the standard library's parser takes NaN: refused still
        b'{"model": "m", "x": "\\ud83d", "y": Infinity}',
        b'{"model": "m", "x": "\\ud83d", }',
        b'{"model": "m", "x": "\\ud83d\x01"}',  # a control character in a string
        b'{"model": "m", "x": "\\ud83d", "y": "\xff"}',  # not UTF-8
        b'["\\ud83d"]',
        b'{"model": 1, "x": "\\ud83d"}',
        b'{"model": "m\\ud83d"}',  # a model is a label: Unicode text
        b'{"stream": "\\ud800", "model": "0"}',  # a lone surrogate where a boolean belongs (once a UnicodeEncodeError)
        b'{"model": "m", "x": "\\ud83d", "y": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    ],
)
def test_a_body_with_a_lone_surrogate_is_still_judged_as_json(body):
    with pytest.raises(BadBody):
        read_head(body)


def test_an_ambiguous_body_with_a_lone_surrogate_is_re_encoded_in_meaning():
    body = b'{"model": "m", "tools": [{"model": "t"}], "x": "\\ud83d caf\xc3\xa9", "n": 1.5}'
    out = rewrite_model(body, "m", "up")
    assert json.loads(out) == {**json.loads(body), "model": "up"}


def test_head_reads_model_and_stream():
    head = read_head(b'{"messages": [], "stream": true, "model": "m"}')
    assert (head.model, head.stream) == ("m", True)


@pytest.mark.parametrize(
    ("model", "served"),
    [
        ("\U0001f600" * 64, True),  # 256 bytes in 64 characters: the most a name under the shortcut can be
        ("\U0001f600" * 65, False),
        ("\u00e9" * 128, True),
        ("\u00e9" * 129, False),  # 258 bytes
        ("x" * 256, True),
        ("x" * 257, False),
    ],
)
def test_a_model_name_is_bounded_in_bytes(model, served):
    body = json.dumps({"model": model}, ensure_ascii=False).encode()
    if served:
        assert read_head(body).model == model
    else:
        with pytest.raises(BadBody, match="over 256 bytes"):
            read_head(body)


def test_forward_headers_drop_credentials_and_hop_by_hop():
    headers = [
        (b"authorization", b"Bearer client"),
        (b"x-api-key", b"client"),
        (b"connection", b"close, x-a"),
        (b"x-a", b"1"),
        (b"keep-alive", b"5"),
        (b"transfer-encoding", b"chunked"),
        (b"host", b"gw"),
        (b"content-length", b"9"),
        (b"accept-encoding", b"gzip"),
        (b"anthropic-version", b"2023-06-01"),
    ]
    assert forward_headers(headers) == [(b"anthropic-version", b"2023-06-01")]


@pytest.mark.parametrize(
    "connection",
    [
        [b"keep-alive"],  # the usual: names a header dropped anyway
        [b"Keep-Alive, x-a"],
        [b"x-a"],
        [b"keep-alive", b"x-a"],  # a second connection header names one more
        [b"x-a", b"keep-alive"],
    ],
)
def test_forward_headers_drop_what_any_connection_header_names(connection):
    headers = [(b"x-a", b"1"), *((b"connection", value) for value in connection), (b"x-b", b"2")]
    kept = [(b"x-b", b"2")] if any(b"x-a" in value for value in connection) else [(b"x-a", b"1"), (b"x-b", b"2")]
    assert forward_headers(headers) == kept


def test_relay_headers_drop_framing():
    headers = [
        (b"content-type", b"text/event-stream"),
        (b"transfer-encoding", b"chunked"),
        (b"content-length", b"5"),
        (b"connection", b"keep-alive"),
        (b"x-request-id", b"r"),
    ]
    assert relay_headers(headers) == [(b"content-type", b"text/event-stream"), (b"x-upstream-request-id", b"r")]
