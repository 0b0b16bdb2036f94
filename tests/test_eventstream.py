"""Units: AWS's event stream, as the gateway reads and writes it (tinygw/protocol/eventstream.py),
against botocore's decoder, split anywhere, with CRCs that do not match."""

from __future__ import annotations

import base64
import json

import pytest
from botocore.eventstream import EventStreamBuffer
from hypothesis import given
from hypothesis import strategies as st

from tinygw.fake.upstream import anthropic_stream_events, bedrock_exception, bedrock_frames
from tinygw.protocol import eventstream
from tinygw.protocol.eventstream import BadFrame, FrameReader

EVENTS = anthropic_stream_events("m", ["Hello", " there"])
STREAM = b"".join(bedrock_frames(EVENTS)) + bedrock_exception("throttlingException", "slow down")


def test_the_fakes_frames_are_botocores_and_ours():
    buffer = EventStreamBuffer()
    buffer.add_data(STREAM)
    theirs = [(m.headers, m.payload) for m in buffer]
    ours = [(f.headers, f.payload) for f in FrameReader().feed(STREAM)]
    assert ours == theirs


@given(st.lists(st.integers(0, len(STREAM)), max_size=8))
def test_frames_split_anywhere_read_the_same(cuts):
    reader = FrameReader()
    frames = []
    last = 0
    for cut in sorted(cuts):
        frames += reader.feed(STREAM[last:cut])
        last = cut
    frames += reader.feed(STREAM[last:])
    reader.close()
    assert b"".join(f.raw for f in frames) == STREAM
    events = [eventstream.event_of(f) for f in frames]
    assert events[: len(EVENTS)] == [_compact(e) for e in EVENTS]
    assert json.loads(events[-1].partition(b"data: ")[2]) == {
        "type": "error",
        "error": {"type": "throttlingException", "message": "slow down"},
    }


def _compact(event: bytes) -> bytes:
    name, _, data = event.partition(b"\ndata: ")
    return name + b"\ndata: " + data.strip() + b"\n\n"


def test_our_frames_are_read_by_botocore():
    frame = eventstream.chunk_frame(b'{"type":"ping"}') + eventstream.exception_frame("validationException", "no")
    buffer = EventStreamBuffer()
    buffer.add_data(frame)
    first, second = list(buffer)
    assert base64.b64decode(json.loads(first.payload)["bytes"]) == b'{"type":"ping"}'
    assert second.headers[":message-type"] == "exception" and json.loads(second.payload) == {"message": "no"}


@pytest.mark.parametrize("at", [0, 5, 9, 11, 14, 40, -1], ids=lambda at: f"byte{at}")
def test_a_flipped_bit_is_a_bad_frame(at):
    frame = bedrock_frames(EVENTS)[0]
    bad = bytearray(frame)
    bad[at] ^= 0x10
    with pytest.raises(BadFrame):
        reader = FrameReader()
        reader.feed(bytes(bad))
        reader.close()


def test_the_good_frames_before_a_bad_one_are_the_streams():
    frames = bedrock_frames(EVENTS)
    bad = bytearray(frames[2])
    bad[-1] ^= 1
    reader = FrameReader()
    assert [f.raw for f in reader.feed(b"".join([*frames[:2], bytes(bad), *frames[3:]]))] == frames[:2]
    with pytest.raises(BadFrame):
        reader.feed(frames[3])
    with pytest.raises(BadFrame):
        reader.close()


def test_a_stream_that_ends_inside_a_frame_is_bad():
    reader = FrameReader()
    assert reader.feed(STREAM[:-3]) != []
    with pytest.raises(BadFrame, match="inside a frame"):
        reader.close()


def test_lengths_out_of_bounds_are_bad_before_the_bytes_come():
    import struct
    import zlib

    prelude = struct.pack(">II", eventstream.MAX_FRAME_BYTES + 1, 0)
    with pytest.raises(BadFrame, match="out of bounds"):
        FrameReader().feed(prelude + struct.pack(">I", zlib.crc32(prelude)))


def test_a_frame_without_an_event_is_bad():
    (frame,) = FrameReader().feed(eventstream.encode_frame({":message-type": "event"}, b'{"bytes": "%%%"}'))
    with pytest.raises(BadFrame):
        eventstream.event_of(frame)
