"""The exact comparisons behind the checks, without a server."""

from __future__ import annotations

from tailrace.check.compare import (choice_difference, coverage_problem, cumulative_piece, incomplete_utf8,
                                    offset_problem, out_of_step, usage_difference)
from tailrace.check.wire import Choice, Piece, Token, token_bytes


def tokens(*texts: str, start: int = 0) -> list[Token]:
    out, offset = [], start
    for text in texts:
        out.append(Token(text, -1.0, {text: -1.0}, text.encode(), offset))
        offset += len(text)
    return out


def test_a_chunk_repeating_all_text_before_it_is_cumulative():
    pieces = [Piece(0, "Hel", [], None), Piece(1, "Hello", [], None)]
    assert "cumulative" in cumulative_piece(pieces)


def test_deltas_are_not_cumulative():
    assert cumulative_piece([Piece(0, "Hel", [], None), Piece(1, "lo", [], None)]) is None


def test_a_streamed_choice_with_other_offsets_differs():
    streamed, full = Choice(0, "ab", "length", tokens("a", "b", start=5)), Choice(0, "ab", "length", tokens("a", "b"))
    assert "text_offset 5" in choice_difference(streamed, full)


def test_logprobs_within_tolerance_are_equal():
    moved = tokens("a")
    moved[0].logprob -= 1e-6
    assert choice_difference(Choice(0, "a", "stop", moved), Choice(0, "a", "stop", tokens("a"))) is None


def test_offsets_that_restart_after_echo_break_continuity():
    broken = tokens("Once", " upon") + tokens(" a")
    assert "decreases" in offset_problem(broken, "Once upon a", 0)


def test_continuous_offsets_from_the_base_are_right():
    assert offset_problem(tokens("x", "yz", start=3), "xyz", 3) is None


def test_a_partial_multibyte_character_is_incomplete_utf8():
    assert incomplete_utf8("é".encode()[:1]) and not incomplete_utf8(b"a")


def test_tokens_sent_ahead_of_held_back_text_are_out_of_step():
    pieces = [Piece(0, "ab", tokens("ab"), None), Piece(1, "", tokens("cd"), None), Piece(2, "cd", [], None)]
    assert "after chunk 1" in out_of_step(pieces, "zz")


def test_half_a_character_may_wait_for_its_text():
    half = [Token("bytes:\\xc3", -1.0, None, b"\xc3"), Token("bytes:\\xa9", -1.0, None, b"\xa9")]
    pieces = [Piece(0, "", half[:1], None), Piece(1, "é", half[1:], None)]
    assert out_of_step(pieces, "zz") is None


def test_the_tokens_that_made_the_stop_string_may_follow_the_text():
    assert coverage_problem(tokens("ab", "cd", "ef"), "abc", "def") is None


def test_tokens_beyond_the_stop_string_are_not_covered_text():
    assert coverage_problem(tokens("ab", "cd", "ef", "gh"), "abc", "de") is not None


def test_usage_totals_must_match():
    assert "completion_tokens" in usage_difference({"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4},
                                                   {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3})


def test_a_bytes_token_string_spells_its_bytes():
    assert token_bytes("bytes:\\xe6\\x97") == b"\xe6\x97"
