"""Both endpoints' responses read into one shape: per choice, its text, finish_reason and logprob
tokens, and for a stream the piece each chunk carried, so the checks compare like with like."""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field
from itertools import zip_longest
from typing import Any

PATHS = {"completions": "/completions", "chat": "/chat/completions"}


@dataclass(slots=True)
class Token:
    text: str | None
    logprob: float | None
    top: dict[str, float] | None
    raw: bytes | None  # the token's bytes: chat's `bytes`, or decoded from a completions token string
    offset: int | None = None  # completions' text_offset


@dataclass(slots=True)
class Piece:
    """What one chunk carried for one choice."""
    chunk: int
    text: str
    tokens: list[Token]
    finish_reason: str | None


@dataclass(slots=True)
class Choice:
    index: int
    text: str = ""
    finish_reason: str | None = None
    tokens: list[Token] | None = None  # None: no logprobs in the response
    pieces: list[Piece] = field(default_factory=list)  # streams only


def token_bytes(token: str) -> bytes:
    """A completions token string's bytes: `bytes:\\xe6` is how servers spell a partial character."""
    if token.startswith("bytes:"):
        return codecs.escape_decode(token[len("bytes:"):].encode())[0]
    return token.encode("utf-8", errors="surrogatepass")


def completion_tokens(logprobs: dict[str, Any] | None) -> list[Token] | None:
    if not isinstance(logprobs, dict):
        return None
    columns = [logprobs.get(name) or [] for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset")]
    return [Token(text, logprob, top, None if text is None else token_bytes(text), offset)
            for text, logprob, top, offset in zip_longest(*columns)]


def chat_tokens(logprobs: dict[str, Any] | None) -> list[Token] | None:
    if not isinstance(logprobs, dict) or logprobs.get("content") is None:
        return None
    return [Token(entry.get("token"), entry.get("logprob"),
                  {top.get("token"): top.get("logprob") for top in entry.get("top_logprobs") or []},
                  None if entry.get("bytes") is None else bytes(entry["bytes"]))
            for entry in logprobs["content"]]


def _text_of(endpoint: str, choice: dict[str, Any], streamed: bool) -> str:
    if endpoint == "completions":
        return choice.get("text") or ""
    part = choice.get("delta" if streamed else "message") or {}
    return part.get("content") or ""


def _tokens_of(endpoint: str, choice: dict[str, Any]) -> list[Token] | None:
    return (completion_tokens if endpoint == "completions" else chat_tokens)(choice.get("logprobs"))


def read_full(endpoint: str, response: dict[str, Any]) -> dict[int, Choice]:
    """A non-stream response's choices by index."""
    return {choice.get("index", 0): Choice(choice.get("index", 0), _text_of(endpoint, choice, False),
                                           choice.get("finish_reason"), _tokens_of(endpoint, choice))
            for choice in response.get("choices") or []}


def read_stream(endpoint: str, chunks: list[dict[str, Any]]) -> dict[int, Choice]:
    """A stream's choices by index, each joined from its pieces in order."""
    choices: dict[int, Choice] = {}
    for number, chunk in enumerate(chunks):
        for part in chunk.get("choices") or []:
            choice = choices.setdefault(part.get("index", 0), Choice(part.get("index", 0)))
            tokens = _tokens_of(endpoint, part)
            piece = Piece(number, _text_of(endpoint, part, True), tokens or [], part.get("finish_reason"))
            choice.pieces.append(piece)
            choice.text += piece.text
            if tokens is not None:
                choice.tokens = (choice.tokens or []) + tokens
            choice.finish_reason = piece.finish_reason or choice.finish_reason
    return choices


def usage_chunks(chunks: list[dict[str, Any]]) -> list[int]:
    """The positions of the chunks that carry a non-null usage."""
    return [number for number, chunk in enumerate(chunks) if chunk.get("usage")]
