"""Where the answer starts, from token ids: the gate itself, and stop strings looked for in the
answer only."""

from __future__ import annotations

import pytest

from tailrace.engine.detokenizer import IncrementalDetokenizer
from tailrace.engine.thinking import Phase, ThinkGate
from tailrace.sampling_params import ThinkTokens
from tailrace.tokenizer import load_tokenizer
from tokenizer_fixtures import EMBEDDED, needs_embedded

OPEN, CLOSE = 8190, 8191  # the embedded tokenizer's <think> and </think>


def test_first_token_other_than_the_open_tag_starts_the_answer():
    gate = ThinkGate(ThinkTokens(OPEN, CLOSE))
    assert gate.phase is Phase.UNDECIDED
    assert gate.feed(42) is True
    assert gate.answering


def test_thinking_lasts_until_the_close_tag_and_neither_tag_is_answer():
    gate = ThinkGate(ThinkTokens(OPEN, CLOSE))
    assert [gate.feed(t) for t in (OPEN, 5, 6, CLOSE, 7)] == [False, False, False, False, True]


def test_a_prompt_that_opened_the_block_starts_thinking():
    gate = ThinkGate(ThinkTokens(OPEN, CLOSE, open_at_start=True))
    assert [gate.feed(t) for t in (OPEN, CLOSE, OPEN)] == [False, False, True]


def stopped_text(text: str, stop: list[str], thinking: ThinkTokens | None, one_by_one: bool) -> tuple[str, str | None]:
    tokenizer = load_tokenizer(str(EMBEDDED))
    detok = IncrementalDetokenizer(tokenizer, [], False, stop, False, thinking)
    ids = tokenizer.encode(text, add_special_tokens=False)
    out = ""
    for batch in ([[t] for t in ids] if one_by_one else [ids]):
        released = detok.add(batch, None, finished=False)
        out += released.text
        if released.stop_str is not None:
            return out, released.stop_str
    return out + detok.add([], None, finished=True).text, None


@needs_embedded
@pytest.mark.parametrize("one_by_one", [False, True])
def test_stop_strings_apply_to_the_answer_only(one_by_one):
    text = "<think>I will say STOP here.</think>Answer before STOP and after."
    out, stop = stopped_text(text, ["STOP"], ThinkTokens(OPEN, CLOSE), one_by_one)
    assert (out, stop) == ("<think>I will say STOP here.</think>Answer before ", "STOP")


@needs_embedded
@pytest.mark.parametrize("one_by_one", [False, True])
def test_stop_string_right_after_the_close_tag_matches(one_by_one):
    out, stop = stopped_text("<think>x</think>END more", ["END"], ThinkTokens(OPEN, CLOSE), one_by_one)
    assert (out, stop) == ("<think>x</think>", "END")


@needs_embedded
def test_without_thinking_stop_strings_apply_from_the_first_token():
    out, stop = stopped_text("Say STOP now", ["STOP"], ThinkTokens(OPEN, CLOSE), one_by_one=True)
    assert (out, stop) == ("Say ", "STOP")


@needs_embedded
def test_stop_text_while_thinking_is_not_held_back():
    tokenizer = load_tokenizer(str(EMBEDDED))
    detok = IncrementalDetokenizer(tokenizer, [], False, ["STOP"], False, ThinkTokens(OPEN, CLOSE))
    released = detok.add(tokenizer.encode("<think>ST", add_special_tokens=False), None, finished=False)
    assert released.text == "<think>ST"
