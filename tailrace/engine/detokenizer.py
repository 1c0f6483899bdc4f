"""Token ids to text for one sequence, released a whole token at a time.

A token is held while it ends inside a UTF-8 character or while the text could still be the
start of a stop string; held tokens go out together with their ids and logprobs as soon as
neither holds. All work per token is bounded by the token and the longest stop string, never
by the length generated so far.
"""

from __future__ import annotations

import codecs
from bisect import bisect_right
from dataclasses import dataclass

from tailrace.engine.thinking import ThinkGate
from tailrace.outputs import TokenLogprob
from tailrace.sampling_params import ThinkTokens
from tailrace.tokenizer import Tokenizer

_REPLACEMENT_CHAR = "\ufffd"
# Prompt ids kept in front of the first output ids, so that a leading space comes out as in the
# one-shot decode of prompt + output (sentencepiece-style decoders strip it at the start).
_CONTEXT_TOKENS = 4


@dataclass(slots=True)
class Released:
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None  # aligned 1:1 with token_ids when logprobs were given
    # Set when a stop string matched: the caller finishes the sequence (finish_reason "stop",
    # stop_reason = stop_str) and aborts it in the engine.
    stop_str: str | None = None


class _ByteLevelText:
    """Byte-level BPE text is the lossy UTF-8 decode of the concatenated token bytes, so an
    incremental UTF-8 decoder reproduces the one-shot decode exactly and without context. It also
    emits U+FFFD as soon as a byte sequence is known to be invalid, so garbage bytes from the
    model are not held."""

    __slots__ = ("_token_bytes", "_utf8")

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._token_bytes = tokenizer.token_raw_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def step(self, token_id: int) -> tuple[str, bool]:
        """The new text and whether it ends on a character boundary."""
        text = self._utf8.decode(self._token_bytes(token_id))
        return text, not self._utf8.getstate()[0]

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


class _WindowText:
    """Any other decoder: decode a short window (context ids, then the undecided ones) and take
    what it adds to the context's text. The context is the ids of the previous emission, which
    start on a character boundary; byte-fallback decoders turn a whole byte run into U+FFFD when
    it starts inside a character. A run of ids that keeps ending in U+FFFD widens the window
    until the character completes, as in vLLM and tokenizers' DecodeStream."""

    __slots__ = ("_tokenizer", "_skip_special_tokens", "_ids", "_num_context", "_context_len")

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids = self._prompt_context(prompt_ids)
        self._num_context = len(self._ids)
        self._context_len = len(self._decode())

    def _decode(self) -> str:
        return self._tokenizer.decode(self._ids, skip_special_tokens=self._skip_special_tokens)

    def _prompt_context(self, prompt_ids: list[int]) -> list[int]:
        """The prompt's last few ids, moved back (a little) until they start on a character."""
        start = max(0, len(prompt_ids) - _CONTEXT_TOKENS)
        while start > 0 and len(prompt_ids) - start < 2 * _CONTEXT_TOKENS:
            head = self._tokenizer.decode(prompt_ids[start:], skip_special_tokens=self._skip_special_tokens)
            if not head.startswith(_REPLACEMENT_CHAR):
                break
            start -= 1
        return list(prompt_ids[start:])

    def step(self, token_id: int) -> tuple[str, bool]:
        self._ids.append(token_id)
        text = self._decode()
        if len(text) <= self._context_len or text.endswith(_REPLACEMENT_CHAR):
            return "", False
        new_text = text[self._context_len :]
        del self._ids[: self._num_context]
        self._num_context = len(self._ids)
        self._context_len = len(self._decode())
        return new_text, True

    def flush(self) -> str:
        return self._decode()[self._context_len :]


class IncrementalDetokenizer:
    """One per sequence (per choice), created when it starts."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        skip_special_tokens: bool,
        stop: list[str],
        include_stop_str_in_output: bool,
        thinking: ThinkTokens | None = None,
    ) -> None:
        self._text_source = (
            _ByteLevelText(tokenizer)
            if tokenizer.byte_level
            else _WindowText(tokenizer, prompt_token_ids, skip_special_tokens)
        )
        self._silent_ids = tokenizer.special_ids if skip_special_tokens else frozenset()
        self._stops = [s for s in dict.fromkeys(stop) if s]
        self._stop_prefixes = frozenset(s[:k] for s in self._stops for k in range(1, len(s)))
        self._longest_prefix = max((len(s) - 1 for s in self._stops), default=0)
        self._include_stop = include_stop_str_in_output
        # Stop strings are looked for in the answer only: from this index of the held text on,
        # None while the model is still thinking.
        self._gate = ThinkGate(thinking) if thinking is not None else None
        self._stop_from: int | None = None if thinking is not None else 0
        self._with_logprobs: bool | None = None
        self._done = False
        # Held tokens, oldest first. _held_ends[i] is where token i's text ends in _held_text;
        # tokens past len(_held_ends) end inside a character whose bytes are not all here yet.
        self._held_ids: list[int] = []
        self._held_logprobs: list[TokenLogprob | None] = []
        self._held_ends: list[int] = []
        self._held_text = ""

    @property
    def num_held_tokens(self) -> int:
        return len(self._held_ids)

    @property
    def held_text(self) -> str:
        return self._held_text

    def add(self, token_ids: list[int], logprobs: list[TokenLogprob] | None, finished: bool) -> Released:
        """Take the sequence's next tokens; return what can be shown now. `finished`: the engine
        ended the sequence, so everything held goes out."""
        if self._done:
            raise RuntimeError("add() after the sequence finished or matched a stop string")
        self._check_logprobs(token_ids, logprobs)
        for i, token_id in enumerate(token_ids):
            searched = len(self._held_text)
            self._take(token_id, logprobs[i] if logprobs is not None else None)
            if self._stop_from is None:
                in_answer = self._gate.feed(token_id)
                if self._gate.answering:  # the answer starts at this token, or after the closing tag
                    self._stop_from = searched if in_answer else len(self._held_text)
            match = self._find_stop(searched)
            if match is not None:
                return self._release_stopped(*match)
        if finished:
            searched = len(self._held_text)
            self._held_text += self._text_source.flush()
            self._mark_ended()
            match = self._find_stop(searched)
            if match is not None:
                return self._release_stopped(*match)
            self._done = True
            return self._release(len(self._held_ids), logprobs is not None)
        limit = len(self._held_text) - self._viable_stop_prefix_len()
        return self._release(bisect_right(self._held_ends, limit), logprobs is not None)

    def _check_logprobs(self, token_ids: list[int], logprobs: list[TokenLogprob] | None) -> None:
        if logprobs is not None and len(logprobs) != len(token_ids):
            raise ValueError(f"{len(token_ids)} token ids but {len(logprobs)} logprobs")
        if not token_ids:
            return
        if self._with_logprobs is None:
            self._with_logprobs = logprobs is not None
        elif self._with_logprobs != (logprobs is not None):
            raise ValueError("logprobs must come with every token of a sequence or with none")

    def _take(self, token_id: int, logprob: TokenLogprob | None) -> None:
        self._held_ids.append(token_id)
        self._held_logprobs.append(logprob)
        if token_id in self._silent_ids:
            # No text of its own, but it cannot overtake a token still inside a character.
            if len(self._held_ends) == len(self._held_ids) - 1:
                self._held_ends.append(len(self._held_text))
            return
        text, on_boundary = self._text_source.step(token_id)
        self._held_text += text
        if on_boundary:
            self._mark_ended()

    def _mark_ended(self) -> None:
        """Every held token's character is complete: they all end at the current text end."""
        end = len(self._held_text)
        self._held_ends.extend([end] * (len(self._held_ids) - len(self._held_ends)))

    def _find_stop(self, searched: int) -> tuple[str, int] | None:
        """The stop string that ends first in the held text (the longest on a tie) and its start.
        Released text never holds the start of a match, and text before `searched` held none."""
        if self._stop_from is None:
            return None
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            start = self._held_text.find(stop, max(self._stop_from, searched - len(stop) + 1))
            if start >= 0:
                candidate = (start + len(stop), start, stop)
                best = candidate if best is None else min(best, candidate)
        return None if best is None else (best[2], best[1])

    def _viable_stop_prefix_len(self) -> int:
        """Length of the longest suffix of the held text that a stop string starts with."""
        if self._stop_from is None:
            return 0
        text = self._held_text
        for k in range(min(self._longest_prefix, len(text) - self._stop_from), 0, -1):
            if text[-k:] in self._stop_prefixes:
                return k
        return 0

    def _release(self, count: int, logprobs_given: bool) -> Released:
        end = self._held_ends[count - 1] if count else 0
        # Before the first token, whether logprobs are wanted is only known from this call.
        with_logprobs = logprobs_given if self._with_logprobs is None else self._with_logprobs
        released = Released(
            text=self._held_text[:end],
            token_ids=self._held_ids[:count],
            logprobs=self._held_logprobs[:count] if with_logprobs else None,
        )
        del self._held_ids[:count], self._held_logprobs[:count]
        self._held_ends = [e - end for e in self._held_ends[count:]]
        self._held_text = self._held_text[end:]
        if self._stop_from is not None:
            self._stop_from = max(0, self._stop_from - end)
        return released

    def _release_stopped(self, stop: str, start: int) -> Released:
        cut = start + len(stop) if self._include_stop else start
        released = Released(
            text=self._held_text[:cut],
            token_ids=self._held_ids,
            logprobs=self._held_logprobs if self._with_logprobs else None,
            stop_str=stop,
        )
        self._done = True
        self._held_ids, self._held_logprobs, self._held_ends, self._held_text = [], [], [], ""
        return released
