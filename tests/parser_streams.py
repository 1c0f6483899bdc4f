"""Feeding a parser a recorded-format output in every way it can arrive, and what it amounts to.

Splits: the whole text in one chunk, one character per chunk, one token per chunk (the embedded
model's tokenizer, released through the real detokenizer), and every two-chunk split. Whatever
the split, the joined result must be the same, and the streamed tool-call pieces must keep the
wire rules (a call's name once, on its first piece; indices 0, 1, 2 in order of appearance).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from tailrace.engine.detokenizer import IncrementalDetokenizer
from tailrace.serving.parsers import Parsed
from tailrace.tokenizer import Tokenizer, load_tokenizer
from tokenizer_fixtures import EMBEDDED


@dataclass
class Result:
    content: str = ""
    reasoning: str = ""
    calls: list[tuple[str, str]] = field(default_factory=list)  # (name, arguments)


@functools.cache
def embedded_tokenizer() -> Tokenizer:
    return load_tokenizer(str(EMBEDDED))


def token_chunks(text: str) -> list[str]:
    """The text as the detokenizer releases it, one token at a time."""
    tokenizer = embedded_tokenizer()
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False, stop=[], include_stop_str_in_output=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    chunks = [detok.add([token], None, finished=False).text for token in ids]
    chunks.append(detok.add([], None, finished=True).text)
    assert "".join(chunks) == text
    return chunks


def splits(text: str) -> Iterator[tuple[str, list[str]]]:
    yield "whole", [text]
    yield "chars", list(text)
    yield "tokens", token_chunks(text)
    for i in range(1, len(text)):
        yield f"split@{i}", [text[:i], text[i:]]


def run(parser, chunks: list[str]) -> Result:
    """Feed the chunks, then finish; check the wire rules and join what came out."""
    pieces: list[Parsed] = [parser.feed(chunk) for chunk in chunks]
    pieces.append(parser.finish())
    result = Result()
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    for piece in pieces:
        result.content += piece.content
        result.reasoning += piece.reasoning
        for call in piece.tool_calls:
            if call.name is not None:
                assert call.index not in names, f"call {call.index} named twice"
                assert call.index == len(names), f"call {call.index} announced out of order"
                names[call.index] = call.name
                arguments[call.index] = ""
            assert call.index in names, f"arguments for call {call.index} before its name"
            arguments[call.index] += call.arguments
    result.calls = [(names[i], arguments[i]) for i in range(len(names))]
    return result


def check_every_split(make_parser: Callable[[], object], text: str, expected: Result) -> None:
    for how, chunks in splits(text):
        assert run(make_parser(), chunks) == expected, how
