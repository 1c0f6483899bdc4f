"""text_offset placement and the logprob objects of both endpoints."""

from __future__ import annotations

import math

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tailrace.outputs import TokenLogprob
from tailrace.serving.logprobs import (
    LOGPROB_FLOOR, chat_logprob_content, completion_logprobs, token_offsets,
)
from serving_fakes import tiny_tokenizer

TOKENIZER = tiny_tokenizer()


def pieces(*chunks: bytes):
    """A token_bytes function over made-up ids 0..k-1."""
    return lambda token_id: list(chunks[token_id])


def offsets_of(start: int, text: str, *chunks: bytes) -> list[int]:
    return token_offsets(start, text, list(range(len(chunks))), pieces(*chunks))


def test_single_token_sits_at_the_running_offset():
    assert offsets_of(7, "hello", b"hello") == [7]


def test_ascii_tokens_sit_at_their_cumulative_lengths():
    assert offsets_of(3, "Hello world", b"Hel", b"lo", b" wor", b"ld") == [3, 6, 8, 12]


def test_tokens_splitting_one_character_both_point_at_it():
    assert offsets_of(0, "aé!", b"a", b"\xc3", b"\xa9", b"!") == [0, 1, 1, 2]


def test_token_starting_inside_a_character_points_at_that_character():
    # "日" is e6 97 a5: the second token carries its tail and the whole of "x"
    assert offsets_of(0, "日x", b"\xe6\x97", b"\xa5x") == [0, 0]


def test_skipped_special_token_contributes_no_characters():
    assert offsets_of(0, "ab", b"a", b"<|im_end|>", b"b") == [0, 1, 1]


def test_skipped_special_token_at_the_start_sits_at_zero():
    assert offsets_of(0, "<div>", b"<s>", b"<div", b">") == [0, 0, 4]


def test_token_cut_by_a_stop_string_keeps_its_start_and_later_tokens_sit_at_the_end():
    assert offsets_of(10, "Hello", b"Hel", b"lo wor", b"ld") == [10, 13, 15]


def test_tokens_without_text_sit_at_the_running_offset():
    assert offsets_of(5, "", b"x", b"y") == [5, 5]


def test_leading_space_dropped_by_the_decoder_is_tolerated():
    assert offsets_of(0, "Hello world", b" Hello", b" world") == [0, 5]


def test_completion_logprobs_include_the_sampled_token_in_top():
    [sampled] = TOKENIZER.encode(" and")
    other = TOKENIZER.encode("Once")[0]
    entry = TokenLogprob(-1.5, [(other, -0.2)])
    result = completion_logprobs(TOKENIZER, [sampled], [entry], [4], as_token_ids=False)
    assert result == {"tokens": [" and"], "token_logprobs": [-1.5],
                      "top_logprobs": [{TOKENIZER.token_text(other): -0.2, " and": -1.5}], "text_offset": [4]}


def test_completion_logprobs_give_null_for_a_token_without_an_entry():
    ids = TOKENIZER.encode("Once")[:2]
    result = completion_logprobs(TOKENIZER, ids, [None, TokenLogprob(-0.5, [])], [0, 1], as_token_ids=False)
    assert result["token_logprobs"] == [None, -0.5]
    assert result["top_logprobs"] == [None, {TOKENIZER.token_text(ids[1]): -0.5}]


def test_completion_logprobs_name_tokens_by_id_when_asked():
    result = completion_logprobs(TOKENIZER, [67], [TokenLogprob(-0.5, [(68, -0.1)])], [0], as_token_ids=True)
    assert result["tokens"] == ["token_id:67"]
    assert result["top_logprobs"] == [{"token_id:68": -0.1, "token_id:67": -0.5}]


def test_minus_infinity_is_reported_as_the_openai_floor():
    result = completion_logprobs(TOKENIZER, [67], [TokenLogprob(-math.inf, [])], [0], as_token_ids=False)
    assert result["token_logprobs"] == [LOGPROB_FLOOR]


def test_chat_logprob_content_carries_bytes_and_top_alternatives():
    lone_byte = TOKENIZER.hf.token_to_id("Ã")  # the byte-level stand-in for 0xC3
    [a] = TOKENIZER.encode("a")
    entry = TokenLogprob(-0.1, [(lone_byte, -0.1), (a, -2.0), (a + 1, -3.0)])
    [item] = chat_logprob_content(TOKENIZER, [lone_byte], [entry], top_n=2, as_token_ids=False)
    assert item == {"token": "\ufffd", "logprob": -0.1, "bytes": [0xC3],
                    "top_logprobs": [{"token": "\ufffd", "logprob": -0.1, "bytes": [0xC3]},
                                     {"token": "a", "logprob": -2.0, "bytes": [ord("a")]}]}


# ---- properties ---------------------------------------------------------------------------------

TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=40) \
    .filter(lambda s: "<|" not in s)


def reference_offsets(token_ids: list[int]) -> list[int]:
    """Whole characters in the bytes before each token, computed from scratch."""
    result, before = [], b""
    for token_id in token_ids:
        result.append(len(before.decode("utf-8", errors="ignore")))
        before += TOKENIZER.token_raw_bytes(token_id)
    return result


def char_boundary_splits(token_ids: list[int], cuts: list[int]) -> list[list[int]]:
    """Split at the requested token positions, moved forward past any cut inside a character
    (the detokenizer never releases half a character)."""
    groups, current, pending = [], [], b""
    cut_set = set(cuts)
    for i, token_id in enumerate(token_ids):
        current.append(token_id)
        pending += TOKENIZER.token_raw_bytes(token_id)
        try:
            pending.decode("utf-8")
        except UnicodeDecodeError:
            continue
        pending = b""
        if i + 1 in cut_set:
            groups.append(current)
            current = []
    if current:
        groups.append(current)
    return groups


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=TEXT, cuts=st.lists(st.integers(min_value=1, max_value=60), max_size=12),
       start=st.integers(min_value=0, max_value=50))
def test_offsets_do_not_depend_on_how_the_text_is_split_into_deltas(text, cuts, start):
    token_ids = TOKENIZER.encode(text)
    assume(TOKENIZER.decode(token_ids) == text)
    offset, streamed = start, []
    for group in char_boundary_splits(token_ids, cuts):
        delta_text = TOKENIZER.decode(group)
        streamed += token_offsets(offset, delta_text, group, TOKENIZER.token_bytes)
        offset += len(delta_text)
    assert streamed == token_offsets(start, text, token_ids, TOKENIZER.token_bytes)
    assert streamed == [start + o for o in reference_offsets(token_ids)]


@settings(max_examples=150, deadline=None)
@given(chunks=st.lists(st.binary(min_size=1, max_size=4), min_size=1, max_size=12),
       start=st.integers(min_value=0, max_value=50))
def test_offsets_stay_ordered_and_inside_the_text_for_any_bytes(chunks, start):
    text = b"".join(chunks).decode("utf-8", errors="replace")
    offsets = offsets_of(start, text, *chunks)
    assert offsets == sorted(offsets)
    assert offsets[0] == start
    assert all(start <= o <= start + len(text) for o in offsets)
