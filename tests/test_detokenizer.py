"""Incremental detokenizing with stop-string hold-back: the streamed text, ids and logprobs must
add up to the one-shot decode, cut at the first stop string, whatever the chunking."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tailrace.engine.detokenizer import IncrementalDetokenizer, Released
from tailrace.outputs import TokenLogprob
from tailrace.tokenizer import Tokenizer
from tokenizer_fixtures import byte_level, embedded, needs_embedded, sentencepiece  # noqa: F401 (fixtures)

REPLACEMENT = "\ufffd"

PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module", params=["byte_level", "sentencepiece", pytest.param("embedded", marks=needs_embedded)])
def tok(request) -> Tokenizer:
    return request.getfixturevalue(request.param)


# ---------------------------------------------------------------- helpers


def lp(k: int) -> TokenLogprob:
    """A logprob that names its token's position, so misalignment is visible."""
    return TokenLogprob(logprob=-float(k))


def byte_id(tok: Tokenizer, raw: bytes) -> int:
    """The id of the token whose bytes are exactly `raw`."""
    return next(i for i in range(tok.vocab_size) if tok.token_raw_bytes(i) == raw)


def detok(tok: Tokenizer, stop=(), include=False, skip=True, prompt=()) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(tok, list(prompt), skip, list(stop), include)


def feed_one_by_one(det: IncrementalDetokenizer, ids: list[int], finish: bool = True) -> list[Released]:
    out = []
    for k, token_id in enumerate(ids):
        out.append(det.add([token_id], [lp(k)], finished=finish and k == len(ids) - 1))
        if out[-1].stop_str is not None:
            break
    return out


def joined(released: list[Released]) -> str:
    return "".join(r.text for r in released)


def decode_after(tok: Tokenizer, prompt: list[int], ids: list[int], skip: bool) -> str:
    """The one-shot decode of the output, in the context of the prompt."""
    head = tok.decode(prompt, skip_special_tokens=skip)
    full = tok.decode(prompt + ids, skip_special_tokens=skip)
    assert full.startswith(head)
    return full[len(head) :]


def stable_after(tok: Tokenizer, prompt: list[int], ids: list[int], skip: bool) -> str:
    """decode_after without the U+FFFDs of an unfinished character at the end (a byte-fallback
    decoder turns the whole byte run into them, possibly reaching back into the prompt)."""
    head = tok.decode(prompt, skip_special_tokens=skip)
    return tok.decode(prompt + ids, skip_special_tokens=skip).rstrip(REPLACEMENT)[len(head) :]


def decodes_monotonically(tok: Tokenizer, prompt: list[int], ids: list[int], skip: bool) -> bool:
    """Whether each prefix of prompt + ids decodes to a prefix of the whole (up to an unfinished
    character at its end)."""
    full = tok.decode(prompt + ids, skip_special_tokens=skip)
    return all(
        full.startswith(tok.decode(prompt + ids[:k], skip_special_tokens=skip).rstrip(REPLACEMENT))
        for k in range(len(ids))
    )


def first_stop(text: str, stops: list[str]) -> tuple[str, int] | None:
    """The stop string that ends first (the longest on a tie) and where it starts."""
    found = [(text.find(s) + len(s), text.find(s), s) for s in stops if s and s in text]
    if not found:
        return None
    _, start, stop = min(found)
    return stop, start


def expected_text(text: str, stops: list[str], include: bool) -> str:
    match = first_stop(text, stops)
    if match is None:
        return text
    stop, start = match
    return text[: start + len(stop)] if include else text[:start]


# ---------------------------------------------------------------- streams

CHARS = list("abcdeEND !.\n") + ["é", "ü", "ç", "你", "好", "世", "😀", "🎉", "👍🏽", "❤️"] + ["ありがとう"]


@dataclasses.dataclass
class Stream:
    prompt: list[int]
    ids: list[int]
    chunks: list[int]  # sizes of the add() calls
    stops: list[str]
    include: bool
    skip: bool

    def text_of(self, tok: Tokenizer, count: int | None = None) -> str:
        """The one-shot decode of the first `count` output ids (all by default)."""
        return decode_after(tok, self.prompt, self.ids[:count], self.skip)

    def ends_on_a_character(self, tok: Tokenizer, count: int) -> bool:
        """Whether the first `count` output ids decode without a trailing U+FFFD."""
        return not tok.decode(self.prompt + self.ids[:count], skip_special_tokens=self.skip).endswith(REPLACEMENT)

    def expected(self, tok: Tokenizer) -> str:
        return expected_text(self.text_of(tok), self.stops, self.include)


@st.composite
def streams(draw, tok: Tokenizer) -> Stream:
    """Output ids (encoded unicode text, raw ids including byte pieces and specials, or both), a
    prompt, chunk sizes, stop strings (from the decoded text and random), and flags."""
    text = st.lists(st.sampled_from(CHARS), max_size=20).map("".join)
    text_ids = text.map(lambda t: tok.encode(t, add_special_tokens=False))
    raw_ids = st.lists(st.integers(0, tok.vocab_size - 1), max_size=20)
    mixed_ids = st.tuples(text_ids, raw_ids, text_ids).map(lambda t: t[0] + t[1] + t[2])
    ids = draw(st.one_of(text_ids, raw_ids, mixed_ids))
    prompt = tok.encode(draw(st.sampled_from(["", "Hello there", "<|im_start|>assistant\n", "the end"])))
    skip = draw(st.booleans())
    # Byte-fallback decoders turn a whole byte run into U+FFFD when any byte in it is invalid,
    # so text already shown can change later; no incremental decoder can match that.
    assume(decodes_monotonically(tok, prompt, ids, skip))
    text = decode_after(tok, prompt, ids, skip)
    random_stop = st.lists(st.sampled_from(CHARS), min_size=1, max_size=3).map("".join)
    stops = draw(st.lists(st.one_of(_substrings(text), random_stop), max_size=3))
    chunks = draw(st.lists(st.integers(1, 5), min_size=1, max_size=len(ids) + 1))
    return Stream(prompt, ids, chunks, stops, draw(st.booleans()), skip)


def _substrings(text: str):
    if not text:
        return st.nothing()
    return st.integers(0, len(text) - 1).flatmap(
        lambda i: st.integers(i + 1, min(len(text), i + 6)).map(lambda j: text[i:j])
    )


@dataclasses.dataclass
class Step:
    released: Released
    fed: int  # output ids given to add() so far
    text: str  # all text released so far
    token_ids: list[int]  # all ids released so far
    last: bool  # the add() that passed finished=True


def run_stream(tok: Tokenizer, stream: Stream) -> list[Step]:
    det = detok(tok, stream.stops, stream.include, stream.skip, stream.prompt)
    steps: list[Step] = []
    text, token_ids, start = "", [], 0
    for n, size in enumerate(stream.chunks):
        last = n == len(stream.chunks) - 1 or start + size >= len(stream.ids)
        end = len(stream.ids) if last else start + size
        released = det.add(stream.ids[start:end], [lp(k) for k in range(start, end)], finished=last)
        text, token_ids, start = text + released.text, token_ids + released.token_ids, end
        steps.append(Step(released, end, text, token_ids, last))
        if last or released.stop_str is not None:
            break
    return steps


def property_test(test):
    return PROPERTY(given(data=st.data())(test))


# ---------------------------------------------------------------- properties


@property_test
def test_joined_text_is_one_shot_decode_cut_at_first_stop(tok, data):
    stream = data.draw(streams(tok))
    steps = run_stream(tok, stream)
    assert steps[-1].text == stream.expected(tok)
    match = first_stop(stream.text_of(tok), stream.stops)
    assert steps[-1].released.stop_str == (match[0] if match else None)


@property_test
def test_released_text_is_never_cut_later(tok, data):
    stream = data.draw(streams(tok))
    final = stream.expected(tok)
    for step in run_stream(tok, stream):
        assert final.startswith(step.text)


@property_test
def test_nothing_from_a_stop_string_start_is_released_before_the_match(tok, data):
    """Safety: until the stop is reported, released text ends at or before where the first match
    starts. Liveness: when the text so far ends on a whole character and no suffix of it could
    begin a stop string, all of it has been released."""
    stream = data.draw(streams(tok))
    match = first_stop(stream.text_of(tok), stream.stops)
    prefixes = {s[:k] for s in stream.stops for k in range(1, len(s))}
    for step in run_stream(tok, stream):
        if step.released.stop_str is not None or step.last:
            break
        if match is not None:
            assert len(step.text) <= match[1]
        if not stream.ends_on_a_character(tok, step.fed):
            continue
        so_far = stream.text_of(tok, step.fed)
        if not any(so_far.endswith(p) for p in prefixes):
            assert step.text == so_far


@property_test
def test_released_ids_are_a_prefix_with_aligned_logprobs(tok, data):
    stream = data.draw(streams(tok))
    steps = run_stream(tok, stream)
    for step in steps:
        assert len(step.released.logprobs) == len(step.released.token_ids)
    released_ids = steps[-1].token_ids
    logprobs = [p.logprob for step in steps for p in step.released.logprobs]
    assert logprobs == [-float(k) for k in range(len(released_ids))]
    assert released_ids == stream.ids[: len(released_ids)]
    if steps[-1].released.stop_str is None:
        assert released_ids == stream.ids
    else:
        # The last released token is the one that completed the match.
        n = len(released_ids)
        assert first_stop(stream.text_of(tok, n), stream.stops) == first_stop(stream.text_of(tok), stream.stops)
        before = stable_after(tok, stream.prompt, stream.ids[: n - 1], stream.skip)
        assert first_stop(before, stream.stops) is None


@property_test
def test_released_text_is_the_decode_of_the_released_ids(tok, data):
    """Ids, logprobs and text go out together: until a stop cuts the text, what has been released
    is exactly the one-shot decode of the ids released with it."""
    stream = data.draw(streams(tok))
    for step in run_stream(tok, stream):
        if step.released.stop_str is not None:
            break
        assert step.text == decode_after(tok, stream.prompt, step.token_ids, stream.skip)


@property_test
def test_released_text_never_ends_inside_a_character(tok, data):
    stream = data.draw(streams(tok))
    final = stream.expected(tok)
    for step in run_stream(tok, stream):
        if step.text.endswith(REPLACEMENT):
            assert final[len(step.text) - 1] == REPLACEMENT


@PROPERTY
@given(text=st.lists(st.sampled_from(CHARS), max_size=20).map("".join), chunk=st.integers(1, 4))
def test_byte_level_output_needs_no_prompt_context(byte_level, text, chunk):
    ids = byte_level.encode(text, add_special_tokens=False)
    steps = run_stream(byte_level, Stream([], ids, [chunk] * (len(ids) + 1), [], False, True))
    assert steps[-1].text == text


# ---------------------------------------------------------------- behaviours


def ids_of(tok: Tokenizer, *pieces: bytes) -> list[int]:
    return [byte_id(tok, piece) for piece in pieces]


def test_stop_string_split_across_tokens_is_not_leaked(byte_level):
    ids = ids_of(byte_level, b"a", b"E", b"N", b"D", b"b")
    out = feed_one_by_one(detok(byte_level, stop=["END"]), ids, finish=False)
    assert [r.text for r in out] == ["a", "", "", ""]
    assert [r.token_ids for r in out] == [ids[:1], [], [], ids[1:4]]
    assert out[-1].stop_str == "END"


def test_multibyte_character_held_until_complete(byte_level):
    euro = "€".encode()
    ids = ids_of(byte_level, b"x", euro[:1], euro[1:2], euro[2:])
    out = feed_one_by_one(detok(byte_level), ids, finish=False)
    assert [(r.text, r.token_ids) for r in out] == [("x", ids[:1]), ("", []), ("", []), ("€", ids[1:])]


def test_include_stop_str_in_output(byte_level):
    ids = byte_level.encode("say END now", add_special_tokens=False)
    out = feed_one_by_one(detok(byte_level, stop=["END"], include=True), ids)
    assert joined(out) == "say END"


def test_stop_str_excluded_from_output_by_default(byte_level):
    ids = byte_level.encode("say END now", add_special_tokens=False)
    out = feed_one_by_one(detok(byte_level, stop=["END"]), ids)
    assert (joined(out), out[-1].stop_str) == ("say ", "END")


def test_special_tokens_skipped(byte_level):
    ids = [byte_id(byte_level, b"a"), byte_level.hf.token_to_id("<|im_end|>"), byte_id(byte_level, b"b")]
    out = feed_one_by_one(detok(byte_level, skip=True), ids)
    assert joined(out) == "ab"
    assert [i for r in out for i in r.token_ids] == ids
    assert [p.logprob for r in out for p in r.logprobs] == [0.0, -1.0, -2.0]


def test_special_tokens_kept_when_not_skipping(byte_level):
    ids = [byte_id(byte_level, b"a"), byte_level.hf.token_to_id("<|im_end|>"), byte_id(byte_level, b"b")]
    assert joined(feed_one_by_one(detok(byte_level, skip=False), ids)) == "a<|im_end|>b"


def test_non_special_added_token_is_text_even_when_skipping(byte_level):
    ids = [byte_level.hf.token_to_id("<think>"), byte_id(byte_level, b"a")]
    assert joined(feed_one_by_one(detok(byte_level, skip=True), ids)) == "<think>a"


def test_stop_inside_one_token_cuts_within_it(byte_level):
    ids = byte_level.encode("xENDy", add_special_tokens=False)
    released = detok(byte_level, stop=["ND"]).add(ids, [lp(k) for k in range(len(ids))], finished=False)
    assert (released.text, released.stop_str) == ("xE", "ND")


def test_tokens_after_stop_in_same_call_are_dropped(byte_level):
    ids = ids_of(byte_level, b"a", b"S", b"b", b"c", b"d")
    released = detok(byte_level, stop=["S"]).add(ids, [lp(k) for k in range(5)], finished=False)
    assert (released.text, released.token_ids, len(released.logprobs)) == ("a", ids[:2], 2)


def test_add_after_stop_is_an_error(byte_level):
    det = detok(byte_level, stop=["a"])
    det.add(ids_of(byte_level, b"a"), None, finished=False)
    with pytest.raises(RuntimeError):
        det.add(ids_of(byte_level, b"b"), None, finished=False)


def test_add_after_finish_is_an_error(byte_level):
    det = detok(byte_level)
    det.add(ids_of(byte_level, b"a"), None, finished=True)
    with pytest.raises(RuntimeError):
        det.add(ids_of(byte_level, b"b"), None, finished=False)


def test_finish_flushes_held_stop_prefix(byte_level):
    ids = ids_of(byte_level, b"a", b"E")
    det = detok(byte_level, stop=["END"])
    assert det.add(ids, [lp(0), lp(1)], finished=False).text == "a"
    last = det.add([], [], finished=True)
    assert (last.text, last.token_ids, last.stop_str) == ("E", ids[1:], None)


def test_finish_flushes_incomplete_character_as_replacement(byte_level):
    ids = ids_of(byte_level, b"x", "€".encode()[:1])
    assert detok(byte_level).add(ids, None, finished=True).text == "x" + REPLACEMENT


def test_invalid_byte_is_released_without_waiting(byte_level):
    ids = ids_of(byte_level, b"a", b"\x80")
    released = detok(byte_level).add(ids, None, finished=False)
    assert (released.text, released.token_ids) == ("a" + REPLACEMENT, ids)


def test_stop_that_ends_first_wins(byte_level):
    ids = ids_of(byte_level, b"a", b"b", b"c")
    out = feed_one_by_one(detok(byte_level, stop=["abc", "b"]), ids)
    assert (joined(out), out[-1].stop_str) == ("a", "b")


def test_longer_stop_wins_when_both_end_together(byte_level):
    ids = ids_of(byte_level, b"x", b"a", b"b", b"c")
    out = feed_one_by_one(detok(byte_level, stop=["bc", "abc"]), ids)
    assert (joined(out), out[-1].stop_str) == ("x", "abc")


def test_text_before_a_possible_stop_start_is_released(byte_level):
    det = detok(byte_level, stop=["END"])
    det.add(ids_of(byte_level, b"E"), None, finished=False)
    released = det.add(ids_of(byte_level, b"E"), None, finished=False)
    assert (released.text, det.num_held_tokens) == ("E", 1)


def test_no_logprobs_in_gives_none_out(byte_level):
    assert detok(byte_level).add(ids_of(byte_level, b"a"), None, finished=False).logprobs is None


def test_logprob_count_must_match_token_count(byte_level):
    with pytest.raises(ValueError):
        detok(byte_level).add(ids_of(byte_level, b"a", b"b"), [lp(0)], finished=False)


def test_leading_space_comes_from_prompt_context(sentencepiece):
    prompt = sentencepiece.encode("hello")
    output = sentencepiece.encode("world", add_special_tokens=False)  # "▁w", "o", ...: a leading "▁"
    assert sentencepiece.decode(output) == "world"
    assert joined(feed_one_by_one(detok(sentencepiece, prompt=prompt), output)) == " world"


def test_hold_back_stays_bounded_over_10000_tokens(byte_level):
    """A stream that keeps almost matching the stop string never holds more than the stop's
    length in text, and the pending-token list does not grow."""
    det = detok(byte_level, stop=["END!"])
    cycle = ids_of(byte_level, b"E", b"N", b"E", b"E", b"N", b"D")  # never a point with no "E" pending
    for k in range(10_000):
        det.add([cycle[k % len(cycle)]], None, finished=False)
        assert len(det.held_text) <= 3 and det.num_held_tokens <= 3


class _CountingTokenizer(Tokenizer):
    """Records how many ids each decode call is given."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.decode_sizes.append(len(ids))
        return Tokenizer.decode(self, ids, skip_special_tokens)


def test_window_decoding_stays_bounded_over_10000_tokens(sentencepiece):
    """The non-byte-level path decodes a window of a few ids per token, not the growing output."""
    fields = {f.name: getattr(sentencepiece, f.name) for f in dataclasses.fields(Tokenizer) if f.init}
    counting = _CountingTokenizer(**fields)
    counting.decode_sizes = []
    ids = sentencepiece.encode("the stop end é, ", add_special_tokens=False)
    det = detok(counting, stop=["stop!"], prompt=sentencepiece.encode("hello"))
    for k in range(10_000):
        det.add([ids[k % len(ids)]], None, finished=False)
    assert len(counting.decode_sizes) <= 2 * 10_000 + 2
    assert max(counting.decode_sizes) <= 8


def test_mixing_tokens_with_and_without_logprobs_is_rejected(byte_level):
    det = detok(byte_level)
    det.add(ids_of(byte_level, b"a"), [lp(0)], finished=False)
    with pytest.raises(ValueError):
        det.add(ids_of(byte_level, b"b"), None, finished=False)


def test_empty_add_before_any_token_mirrors_the_logprobs_argument(byte_level):
    assert detok(byte_level).add([], [], finished=False).logprobs == []
    assert detok(byte_level).add([], None, finished=False).logprobs is None
