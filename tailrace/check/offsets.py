"""Completions' `text_offset`: where each token starts, counted the same way streamed or not, with
echo or without, and continued across chunks."""

from __future__ import annotations

from tailrace.check.client import Exchange
from tailrace.check.compare import offset_problem, tokens_spell_text
from tailrace.check.probe import Probe, logprobs_fields
from tailrace.check.results import fail, skip
from tailrace.check.session import Check, Session
from tailrace.check.wire import Choice, read_full, read_stream

GROUP = "offsets"
TOP = 1


def _answers(session: Session, echo: bool) -> tuple[Probe, Choice, Choice, Exchange]:
    probe = session.probe("completions")
    body = {**(probe.echo_body if echo else probe.base), **logprobs_fields("completions", TOP)}
    _, full = session.full("completions", body)
    stream = session.stream("completions", body)
    full_choice = read_full("completions", full)[0]
    streamed = read_stream("completions", stream.chunks()).get(0)
    if not full_choice.tokens or streamed is None:
        skip("no logprobs in the answers to compare offsets by")
    return probe, full_choice, streamed, stream


def _base(probe: Probe, full: Choice) -> int:
    """Without echo, servers start at 0 (vLLM) or after the prompt (OpenAI's legacy API)."""
    first = full.tokens[0].offset if full.tokens else None
    return first if first in (0, len(probe.echoed)) else 0


def _starts_at_base(session: Session) -> None:
    probe, full, streamed, stream = _answers(session, echo=False)
    base = _base(probe, full)
    for name, choice in (("non-stream", full), ("stream", streamed)):
        first = choice.tokens[0].offset if choice.tokens else None
        if first != base:
            fail(f"the {name} answer's first text_offset is {first}, not {base} (0, or the prompt's "
                 f"{len(probe.echoed)} characters, the same both ways)", stream)


def _continuous(echo: bool):
    def run(session: Session) -> None:
        probe, full, streamed, stream = _answers(session, echo)
        base = 0 if echo else _base(probe, full)
        for name, choice in (("non-stream", full), ("stream", streamed)):
            reason = offset_problem(choice.tokens or [], choice.text, base)
            if reason is not None:
                fail(f"{name}: {reason}", stream)
    return run


def _chunk_starts(session: Session) -> None:
    _, _, streamed, stream = _answers(session, echo=True)
    sent = 0
    for piece in streamed.pieces:
        if piece.tokens and tokens_spell_text(piece.tokens, piece.text) and piece.tokens[0].offset != sent:
            fail(f"chunk {piece.chunk}'s first text_offset is {piece.tokens[0].offset}, but {sent} characters "
                 f"were streamed before it", stream)
        sent += len(piece.text)


def _echo_once(session: Session) -> None:
    probe, full, streamed, stream = _answers(session, echo=True)
    first = streamed.pieces[0].text if streamed.pieces else ""
    if not first.startswith(probe.echoed):
        fail(f"the first chunk does not start with the echoed prompt: {first[:80]!r}", stream)
    rest = streamed.text[len(probe.echoed):]
    if probe.echoed and probe.echoed in rest and probe.echoed not in full.text[len(probe.echoed):]:
        fail("the echoed prompt comes again after the first chunk", stream)


CHECKS = [
    Check(GROUP, "first offset", "without echo, text_offset starts at 0 (or at the prompt's length), the same "
          "streamed or not", _starts_at_base),
    Check(GROUP, "offsets continue", "each text_offset is the length of the text before its token, streamed "
          "or not", _continuous(echo=False)),
    Check(GROUP, "offsets continue with echo", "with echo, text_offset counts from the prompt's start through "
          "the prompt and the answer", _continuous(echo=True)),
    Check(GROUP, "offsets across chunks", "each chunk's first text_offset is the length of all text streamed "
          "before it, echo included", _chunk_starts),
    Check(GROUP, "echo once", "with echo, the prompt comes once, at the start of the first chunk", _echo_once),
]
