"""The SSE parser on byte streams cut at arbitrary points."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.loadgen.sse import DONE, SSEEvent, SSEParser

STREAM = (
    b": keep-alive comment\n\n"
    b'data: {"choices": [{"text": "h\xc3\xa9llo"}]}\n\n'
    b'data: {"choices": [{"text": " world"}]}\r\n\r\n'
    b"event: update\r\nid: 7\r\ndata: line one\r\ndata: line two\r\n\r\n"
    b"data: [DONE]\n\n"
)
EXPECTED = [
    SSEEvent('{"choices": [{"text": "héllo"}]}'),
    SSEEvent('{"choices": [{"text": " world"}]}'),
    SSEEvent("line one\nline two", event="update", id="7"),
    SSEEvent(DONE, id="7"),  # the last event id carries over, as the spec says
]


def parse_in_pieces(data: bytes, cuts: list[int]) -> list[SSEEvent]:
    parser = SSEParser()
    events: list[SSEEvent] = []
    start = 0
    for cut in [*sorted(cuts), len(data)]:
        events += parser.feed(data[start:cut])
        start = cut
    return events + parser.close()


def test_whole_stream_in_one_chunk() -> None:
    assert parse_in_pieces(STREAM, []) == EXPECTED


def test_one_byte_at_a_time() -> None:
    assert parse_in_pieces(STREAM, list(range(1, len(STREAM)))) == EXPECTED


@settings(deadline=None)  # a busy machine must not fail a correct parser
@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=12))
def test_any_split_gives_the_same_events(cuts: list[int]) -> None:
    assert parse_in_pieces(STREAM, cuts) == EXPECTED


def test_crlf_split_between_cr_and_lf_is_one_line_end() -> None:
    parser = SSEParser()
    assert parser.feed(b"data: a\r") == []
    assert parser.feed(b"\n\r") == []
    assert parser.feed(b"\n") == [SSEEvent("a")]


def test_bare_cr_line_endings() -> None:
    assert parse_in_pieces(b"data: a\r\rdata: b\r\r", []) == [SSEEvent("a"), SSEEvent("b")]


def test_comments_and_blank_events_dispatch_nothing() -> None:
    assert parse_in_pieces(b": ping\n\n:another\n\n\n\n", []) == []


def test_field_without_space_and_unknown_fields() -> None:
    assert parse_in_pieces(b"data:x\nretry: 100\nfoo: bar\n\n", []) == [SSEEvent("x")]


def test_unterminated_last_event_is_kept_at_close() -> None:
    parser = SSEParser()
    assert parser.feed(b"data: [DONE]") == []
    assert parser.close() == [SSEEvent(DONE)]


def test_empty_data_line_is_an_event() -> None:
    assert parse_in_pieces(b"data:\n\n", []) == [SSEEvent("")]
