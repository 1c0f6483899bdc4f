"""n>1: every choice is there, introduced in order, and each is its own answer: sampled apart
from its siblings, with its own text, logprobs and offsets, the same streamed or not."""

from __future__ import annotations

from typing import Any

from tailrace.check.client import Exchange
from tailrace.check.compare import offset_problem, spells_answer
from tailrace.check.equivalence import assert_stream_equals_full
from tailrace.check.probe import logprobs_fields
from tailrace.check.results import IGNORED, Verdict, fail, skip
from tailrace.check.session import SEED, SEEDED_MAX_TOKENS, Check, Session
from tailrace.check.wire import read_full, read_stream

GROUP = "n"
N = 2
ALIKE_DRAWS = 3


def sampled(session: Session, endpoint: str) -> dict[str, Any]:
    """n choices at temperature 1 with logprobs: seeded where seeds count, so runs repeat."""
    fields = {"n": N, **logprobs_fields(endpoint, 1)}
    try:
        return session.seeded(endpoint, **fields)
    except Verdict as verdict:
        if verdict.status != IGNORED:
            raise
    return {**session.probe(endpoint).base, "temperature": 1.0, "max_tokens": SEEDED_MAX_TOKENS, **fields}


def _indices(endpoint: str):
    def run(session: Session) -> None:
        stream = session.stream(endpoint, sampled(session, endpoint))
        parts = [part for chunk in stream.chunks() for part in chunk.get("choices") or []]
        seen = list(dict.fromkeys(part.get("index") for part in parts))
        if seen != list(range(N)):
            fail(f"choices appear with indices {seen}; {list(range(N))} in that order", stream)
    return run


def _equal(endpoint: str):
    def run(session: Session) -> None:
        assert_stream_equals_full(session, endpoint, session.seeded(endpoint, n=N, **logprobs_fields(endpoint, 1)))
    return run


def _independent(endpoint: str):
    def run(session: Session) -> None:
        stream = session.stream(endpoint, sampled(session, endpoint))
        choices = [choice for _, choice in sorted(read_stream(endpoint, stream.chunks()).items())]
        if len(choices) < N:
            skip(f"the stream has {len(choices)} choice(s), not n={N}: nothing to compare")
        texts = [choice.text for choice in choices]
        if len(set(texts)) < len(texts):
            _alike(session, endpoint, stream, texts[0])
        first = choices[0].tokens or []
        if not spells_answer(first, texts[0]):
            return  # token strings that do not spell the text: nothing more to compare
        base = first[0].offset if first else 0
        for index, choice in enumerate(choices[1:], start=1):
            if not spells_answer(choice.tokens or [], choice.text):
                fail(f"choice {index}'s logprobs do not spell its own text", stream)
            reason = offset_problem(choice.tokens or [], choice.text, base or 0) if endpoint == "completions" else None
            if reason is not None:
                fail(f"choice {index}: {reason}", stream)
    return run


def _alike(session: Session, endpoint: str, stream: Exchange, text: str) -> None:
    """Siblings that say the same: shared state, unless the model says it whatever the draw (a
    sure answer), which a few single requests with other seeds tell."""
    for draw in range(1, ALIKE_DRAWS + 1):
        single = {**stream.body, "n": 1, "stream": False, "seed": SEED + 100 + draw}
        single.pop("stream_options", None)
        _, other = session.full(endpoint, single)
        if read_full(endpoint, other)[0].text != text:
            fail(f"the choices of one request have the same text, though other draws differ: {text[:60]!r}",
                 stream)
    skip(f"the model gives the same {len(text)} characters whatever the draw: choices cannot differ")


CHECKS = [
    check
    for endpoint in ("completions", "chat")
    for check in (
        Check(GROUP, f"{endpoint} indices", f"with n={N} every index appears, the first time in order",
              _indices(endpoint)),
        Check(GROUP, f"{endpoint} n={N} stream", f"with n={N} and a seed, each streamed choice is the non-stream "
              "answer's choice of that index", _equal(endpoint)),
        Check(GROUP, f"{endpoint} choices apart", "sampled choices differ, and each one's logprobs and offsets "
              "are its own", _independent(endpoint)),
    )
]
