"""Stop strings cut from the model's own output, across a token boundary."""

from __future__ import annotations

from tailrace.check.probe import spanning_stop


def crosses(stop_at: int, stop: str, tokens: list[bytes]) -> bool:
    """A token boundary lies strictly inside the stop string."""
    boundaries = {len(b"".join(tokens[:i]).decode(errors="ignore")) for i in range(1, len(tokens))}
    return any(stop_at < boundary < stop_at + len(stop) for boundary in boundaries)


def test_the_stop_string_spans_a_token_boundary():
    tokens = [b" one", b" two", b" three", b" four"]
    stop, at = spanning_stop(" one two three four", tokens)
    assert crosses(at, stop, tokens)


def test_the_stop_string_is_found_first_where_it_is_cut():
    text = "abab abab"
    stop, at = spanning_stop(text, [b"ab", b"ab", b" ab", b"ab"])
    assert text.find(stop) == at


def test_tokens_that_split_a_character_still_give_a_spanning_stop():
    tokens = [b"xx", b" caf", b"\xc3", b"\xa9", b" yy"]
    stop, at = spanning_stop("xx caf\u00e9 yy", tokens)
    assert crosses(at, stop, tokens)


def test_text_too_short_gives_no_stop():
    assert spanning_stop("a", [b"a"]) is None


def test_an_end_of_sequence_token_after_the_text_still_gives_token_boundaries():
    tokens = [b" one", b" two", b" three", b"<|im_end|>"]
    stop, at = spanning_stop(" one two three", tokens)
    assert crosses(at, stop, tokens)
