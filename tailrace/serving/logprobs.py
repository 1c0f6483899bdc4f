"""Logprob objects of both endpoints, and where each token sits in the returned text.

Pure functions: they see one delta at a time plus the choice's running character offset, so the
same calls build a streamed chunk and (joined) the non-streamed response.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from tailrace.outputs import TokenLogprob

# OpenAI's floor for a logprob: JSON has no -inf, and the API reports "very unlikely" as -9999.0.
LOGPROB_FLOOR = -9999.0


class TokenNames(Protocol):
    def token_text(self, token_id: int) -> str: ...
    def token_bytes(self, token_id: int) -> list[int]: ...


def token_offsets(start: int, text: str, token_ids: Sequence[int],
                  token_bytes: Callable[[int], Sequence[int]]) -> list[int]:
    """The text_offset of each token of one delta whose tokens produced `text`, which begins at
    character `start` of the choice's returned text.

    Rule: walk the delta's UTF-8 bytes with a cursor. A token's offset is `start` plus the number
    of whole characters before the cursor, so a token that begins inside a multi-byte character
    points at that character. The cursor then moves over the token's bytes where the text has
    them (with one leading space the decoder may have dropped), or to the end of the text when the
    text ends inside the token (cut by a stop string); a token whose bytes are not there at all (a
    skipped special token) contributes no characters and does not move it. Offsets are therefore
    non-decreasing and at most `start + len(text)`, and they depend only on this delta.
    """
    if len(token_ids) <= 1:
        return [start] * len(token_ids)
    raw = text.encode()
    offsets = []
    pos = 0
    leads = 0  # UTF-8 lead bytes in raw[:pos]: characters begun before the cursor
    for token_id in token_ids:
        inside_char = pos < len(raw) and _is_continuation(raw[pos])
        offsets.append(start + leads - inside_char)
        step = _bytes_in_text(raw, pos, bytes(token_bytes(token_id)))
        leads += sum(1 for b in raw[pos:pos + step] if not _is_continuation(b))
        pos += step
    return offsets


def _is_continuation(byte: int) -> bool:
    return byte & 0xC0 == 0x80


def _bytes_in_text(raw: bytes, pos: int, piece: bytes) -> int:
    if raw.startswith(piece, pos):
        return len(piece)
    if piece[:1] == b" " and len(piece) > 1 and raw.startswith(piece[1:], pos):
        return len(piece) - 1
    if pos < len(raw) and piece.startswith(raw[pos:]):
        return len(raw) - pos
    return 0


def token_name(tokens: TokenNames, token_id: int, as_token_ids: bool) -> str:
    return f"token_id:{token_id}" if as_token_ids else tokens.token_text(token_id)


def clamp(logprob: float) -> float:
    return logprob if logprob > LOGPROB_FLOOR else LOGPROB_FLOOR  # also maps NaN and -inf


# ---- /v1/completions -------------------------------------------------------------------------

def empty_completion_logprobs() -> dict[str, list]:
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


def completion_logprobs(tokens: TokenNames, token_ids: Sequence[int],
                        entries: Sequence[TokenLogprob | None] | None, offsets: list[int],
                        as_token_ids: bool) -> dict[str, list]:
    """The legacy `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}` for some tokens.

    An entry of None (the first prompt token: nothing precedes it) gives null logprob and null
    top; the sampled token is always one of the top keys.
    """
    names = [token_name(tokens, t, as_token_ids) for t in token_ids]
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    for i, token_id in enumerate(token_ids):
        entry = entries[i] if entries is not None and i < len(entries) else None
        if entry is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        top = {token_name(tokens, t, as_token_ids): clamp(lp) for t, lp in entry.top}
        top.setdefault(names[i], clamp(entry.logprob))
        token_logprobs.append(clamp(entry.logprob))
        top_logprobs.append(top)
    return {"tokens": names, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


def extend_completion_logprobs(into: dict[str, list], part: dict[str, list]) -> None:
    for key, values in part.items():
        into[key].extend(values)


# ---- /v1/chat/completions --------------------------------------------------------------------

def chat_logprob_content(tokens: TokenNames, token_ids: Sequence[int],
                         entries: Sequence[TokenLogprob | None] | None, top_n: int,
                         as_token_ids: bool) -> list[dict[str, Any]]:
    """`logprobs.content` entries: token, logprob, bytes, and the `top_n` best alternatives."""
    content = []
    for i, token_id in enumerate(token_ids):
        entry = entries[i] if entries is not None and i < len(entries) else None
        item = _chat_token(tokens, token_id, entry.logprob if entry else -math.inf, as_token_ids)
        item["top_logprobs"] = [_chat_token(tokens, t, lp, as_token_ids) for t, lp in entry.top[:top_n]] \
            if entry else []
        content.append(item)
    return content


def _chat_token(tokens: TokenNames, token_id: int, logprob: float, as_token_ids: bool) -> dict[str, Any]:
    return {"token": token_name(tokens, token_id, as_token_ids), "logprob": clamp(logprob),
            "bytes": list(tokens.token_bytes(token_id))}
