"""Pure comparisons behind the checks: each returns why two things differ, or None when they agree."""

from __future__ import annotations

from typing import Any

from tailrace.check.wire import Choice, Piece, Token

LOGPROB_TOLERANCE = 1e-3  # batches of another size may move a logprob by ~1e-6; a wrong token moves it by far more
USAGE_FIELDS = ("prompt_tokens", "completion_tokens", "total_tokens")
SHOWN = 40  # characters of context in a reason


def first_difference(streamed: str, full: str) -> str | None:
    if streamed == full:
        return None
    at = next((i for i, (a, b) in enumerate(zip(streamed, full)) if a != b), min(len(streamed), len(full)))
    return (f"the streamed text differs from the non-stream text at character {at}: "
            f"{streamed[at:at + SHOWN]!r} instead of {full[at:at + SHOWN]!r}")


def cumulative_piece(pieces: list[Piece]) -> str | None:
    """The cumulative-string rebuild: a chunk that repeats all the text sent before it."""
    sent = ""
    for piece in pieces:
        if sent and piece.text.startswith(sent):
            return (f"chunk {piece.chunk} repeats all {len(sent)} characters sent before it: cumulative text, "
                    "not a delta")
        sent += piece.text
    return None


def _close(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is b
    return abs(a - b) <= LOGPROB_TOLERANCE


def _top_differs(a: dict[str, float] | None, b: dict[str, float] | None) -> bool:
    if a is None or b is None:
        return a is not b
    return a.keys() != b.keys() or any(not _close(a[key], b[key]) for key in a)


def token_difference(streamed: list[Token] | None, full: list[Token] | None) -> str | None:
    if (streamed is None) != (full is None):
        return f"logprobs are {'missing' if streamed is None else 'present'} in the stream only"
    if streamed is None or full is None:
        return None
    if len(streamed) != len(full):
        return f"the stream's logprobs have {len(streamed)} tokens, the non-stream's {len(full)}"
    for i, (a, b) in enumerate(zip(streamed, full)):
        if a.text != b.text or a.raw != b.raw:
            return f"token {i} is {a.text!r} in the stream, {b.text!r} without"
        if a.offset != b.offset:
            return f"token {i} ({a.text!r}) has text_offset {a.offset} in the stream, {b.offset} without"
        if not _close(a.logprob, b.logprob):
            return f"token {i} ({a.text!r}) has logprob {a.logprob} in the stream, {b.logprob} without"
        if _top_differs(a.top, b.top):
            return f"token {i} ({a.text!r}) has top_logprobs {a.top} in the stream, {b.top} without"
    return None


def choice_difference(streamed: Choice, full: Choice) -> str | None:
    """Text (and why, when it is a rebuild), finish_reason, then logprobs."""
    text = first_difference(streamed.text, full.text)
    if text is not None:
        return cumulative_piece(streamed.pieces) or text
    if streamed.finish_reason != full.finish_reason:
        return f"finish_reason is {streamed.finish_reason!r} in the stream, {full.finish_reason!r} without"
    return token_difference(streamed.tokens, full.tokens)


def usage_difference(streamed: dict[str, Any] | None, full: dict[str, Any] | None) -> str | None:
    if not isinstance(streamed, dict) or not isinstance(full, dict):
        return f"usage is {streamed!r} in the stream, {full!r} without"
    for name in USAGE_FIELDS:
        if streamed.get(name) != full.get(name):
            return f"usage.{name} is {streamed.get(name)} in the stream, {full.get(name)} without"
    if streamed.get("total_tokens") != (streamed.get("prompt_tokens") or 0) + (streamed.get("completion_tokens") or 0):
        return f"usage.total_tokens is not prompt_tokens + completion_tokens: {streamed}"
    return None


def spelt(tokens: list[Token]) -> bytes | None:
    """The bytes the tokens spell; None when a token's bytes are unknown."""
    if any(token.raw is None for token in tokens):
        return None
    return b"".join(token.raw for token in tokens)  # type: ignore[misc]


def tokens_spell_text(tokens: list[Token], text: str) -> bool:
    return spelt(tokens) == text.encode()


def spells_answer(tokens: list[Token], text: str) -> bool:
    """The tokens spell the text, but maybe for a last end-of-sequence token that adds none."""
    return tokens_spell_text(tokens, text) or (bool(tokens) and tokens_spell_text(tokens[:-1], text))


def incomplete_utf8(tail: bytes) -> bool:
    """`tail` is the start of one multi-byte character that has not ended yet."""
    if not 0 < len(tail) < 4:
        return False
    try:
        tail.decode()
    except UnicodeDecodeError as exc:
        return exc.reason == "unexpected end of data"
    return False


def _agree(rest: bytes, stop: bytes) -> bool:
    """One is the start of the other: the tokens past the text are the ones that made the stop string."""
    return bool(rest) and rest[:len(stop)] == stop[:len(rest)]


def coverage_problem(tokens: list[Token], text: str, stop: str) -> str | None:
    """The logprobs cover the text sent and then only the tokens that completed the stop string."""
    covered, sent = spelt(tokens) or b"", text.encode()
    if covered == sent:
        return None
    rest, stop_bytes = covered[len(sent):], stop.encode()
    needed_last = len(covered) - len(tokens[-1].raw or b"") < len(sent + stop_bytes)  # no token past the stop
    if covered.startswith(sent) and _agree(rest, stop_bytes) and needed_last:
        return None
    return f"the logprobs spell {covered[-SHOWN:]!r}, but the text sent ends {sent[-SHOWN:]!r} before the stop {stop!r}"


def out_of_step(pieces: list[Piece], stop: str) -> str | None:
    """After every chunk the logprobs cover exactly the text sent so far, but for the bytes of a
    character not yet complete and, at the end, the tokens of the stop string: text held back
    holds its tokens back too."""
    final = "".join(piece.text for piece in pieces).encode()
    tokens: list[Token] = []
    text = ""
    for piece in pieces:
        tokens += piece.tokens
        text += piece.text
        covered, sent = spelt(tokens) or b"", text.encode()
        rest = covered[len(sent):] if covered.startswith(sent) else None
        stop_tokens = sent == final and rest is not None and _agree(rest, stop.encode())
        if rest is not None and (rest == b"" or incomplete_utf8(rest) or stop_tokens):
            continue
        return (f"after chunk {piece.chunk} the logprobs spell ...{covered[-SHOWN:]!r} but the text sent is "
                f"...{sent[-SHOWN:]!r}")
    return None


def offset_problem(tokens: list[Token], text: str, base: int) -> str | None:
    """Each text_offset is `base` plus the length of the text before its token; with tokens that
    do not spell the text, at least non-decreasing from `base`."""
    offsets = [token.offset for token in tokens]
    if not offsets:
        return None
    if any(offset is None for offset in offsets):
        return f"text_offset has {offsets.count(None)} missing entries"
    if offsets[0] != base:
        return f"the first text_offset is {offsets[0]}, not {base}"
    if any(b < a for a, b in zip(offsets, offsets[1:])):
        return f"text_offset decreases: {offsets}"
    if not tokens_spell_text(tokens, text):
        return None
    before = b""
    for i, token in enumerate(tokens):
        position = base + len(before.decode(errors="ignore"))  # a partial character is not yet a character
        if token.offset != position:
            return (f"token {i} ({token.text!r}) has text_offset {token.offset}, but {position} characters come "
                    "before it")
        before += token.raw or b""
    return None
