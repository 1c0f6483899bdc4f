"""The strict SSE framing rules, on bytes."""

from __future__ import annotations

from tailrace.check.framing import bad_end, bad_event, bad_line, split_read

GOOD = b'data: {"a": 1}\n\ndata: {"a": 2}\n\ndata: [DONE]\n\n'


def test_a_well_framed_stream_breaks_no_rule():
    assert (bad_line(GOOD), bad_event(GOOD), bad_end(GOOD), split_read([GOOD])) == (None, None, None, None)


def test_crlf_line_endings_frame_events_too():
    assert bad_end(GOOD.replace(b"\n", b"\r\n")) is None


def test_an_event_line_is_not_a_data_line():
    assert "event: chunk" in bad_line(b'event: chunk\ndata: {"a": 1}\n\n')


def test_comments_are_allowed():
    assert bad_line(b': ping\n\n' + GOOD) is None


def test_json_across_two_data_lines_is_one_bad_event():
    assert "2 data lines" in bad_event(b'data: {"a":\ndata: 1}\n\ndata: [DONE]\n\n')


def test_a_payload_that_is_not_json_is_a_bad_event():
    assert "not JSON" in bad_event(b"data: hello\n\n")


def test_a_stream_without_done_has_a_bad_end():
    assert "no `data: [DONE]`" in bad_end(b'data: {"a": 1}\n\n')


def test_anything_after_done_is_a_bad_end():
    assert "more follows" in bad_end(GOOD + b'data: {"a": 3}\n\n')


def test_done_without_its_blank_line_is_never_dispatched():
    assert "blank line" in bad_end(GOOD[:-2])


def test_done_twice_is_a_bad_end():
    assert "more than once" in bad_end(GOOD + b"data: [DONE]\n\n")


def test_a_read_that_ends_inside_an_event_is_a_split():
    assert "read 0" in split_read([GOOD[:10], GOOD[10:]])


def test_reads_that_end_between_events_are_whole():
    cut = GOOD.index(b"\n\n") + 2
    assert split_read([GOOD[:cut], GOOD[cut:]]) is None

