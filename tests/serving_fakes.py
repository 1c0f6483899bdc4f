"""A scripted stand-in for the engine client, for the serving layer's unit tests only.

Each choice's generated token ids are scripted, together with how they are split into deltas.
Text is made like the real detokenizer: released a whole token at a time, a token held while it
ends inside a UTF-8 character, special tokens silent, and the text cut where a "stop string"
(`keep_chars`) matched.
"""

from __future__ import annotations

import asyncio
import functools
import codecs
import tempfile
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

from tailrace.engine.client import EngineDeadError
from tailrace.outputs import CompletionOutput, RequestOutput, TokenLogprob
from tailrace.sampling_params import SamplingParams
from tailrace.serving.context import RequestContext
from tailrace.tokenizer import Tokenizer, load_tokenizer
from tokenizer_fixtures import save_byte_level


@functools.cache
def tiny_tokenizer() -> Tokenizer:
    """A small byte-level BPE with ChatML tokens and a chat template, trained here (so the tests
    never depend on the embedded model), with merges inside multi-byte characters."""
    with tempfile.TemporaryDirectory() as directory:
        return load_tokenizer(str(save_byte_level(Path(directory))))


@dataclass
class Script:
    """What one choice generates."""

    token_ids: list[int]
    finish_reason: str = "length"
    stop_reason: str | int | None = None
    keep_chars: int | None = None  # the text is cut after this many characters (a stop string)
    sizes: list[int] | None = None  # tokens per delta (the rest one by one); default: one each


def fake_logprob(token_id: int, k: int) -> TokenLogprob:
    """Deterministic: the sampled token is in the top list for even ids and missing for odd ones."""
    logprob = -0.25 - (token_id % 7) / 8
    others = [(token_id + 1 + i, logprob - 1.0 - i) for i in range(k)]
    top = ([(token_id, logprob)] + others)[:k] if token_id % 2 == 0 else others
    return TokenLogprob(logprob, top)


@dataclass
class FakeEngine:
    """`script(prompt_index, sibling)` says what each choice generates. `order` interleaves the
    siblings of one request: "round_robin" (sibling 0 first), "reversed" (the highest sibling
    first in every round) or "last_first" (all of the highest sibling before any other)."""

    tokenizer: Tokenizer
    script: Callable[[int, int], Script]
    max_model_len: int = 4096
    order: str = "round_robin"
    num_cached_tokens: int = 0
    fail_after: int | None = None  # raise EngineDeadError after this many deltas of a request
    model_path: str = "fake"
    errored: bool = False
    is_ready: bool = True
    backends: dict[str, str] = field(default_factory=dict)
    started: list[tuple[str, list[int], SamplingParams]] = field(default_factory=list)
    closed_unfinished: list[str] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)

    async def add_request(self, request_id: str, prompt_token_ids: list[int],
                          params: SamplingParams) -> AsyncIterator[RequestOutput]:
        self.started.append((request_id, list(prompt_token_ids), params))
        prompt_index = int(request_id.rsplit("-", 1)[1])
        per_choice = [self._deltas(self.script(prompt_index, j), j, params) for j in range(params.n)]
        sequence = self._interleave(per_choice)
        introduced: set[int] = set()
        finished = False
        try:
            for count, delta in enumerate(sequence):
                await asyncio.sleep(0)
                if self.fail_after is not None and count >= self.fail_after:
                    raise EngineDeadError("the engine core process exited")
                out = RequestOutput(request_id, list(prompt_token_ids), [delta],
                                    finished=count == len(sequence) - 1, num_cached_tokens=self.num_cached_tokens)
                if delta.index not in introduced:
                    introduced.add(delta.index)
                    out.prompt_logprobs = self._prompt_logprobs(prompt_token_ids, params)
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.closed_unfinished.append(request_id)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def _interleave(self, per_choice: list[list[CompletionOutput]]) -> list[CompletionOutput]:
        if self.order == "last_first":
            return [d for deltas in reversed(per_choice) for d in deltas]
        siblings = list(range(len(per_choice)))
        if self.order == "reversed":
            siblings.reverse()
        rounds = max(len(d) for d in per_choice)
        return [per_choice[j][r] for r in range(rounds) for j in siblings if r < len(per_choice[j])]

    @staticmethod
    def _prompt_logprobs(prompt_token_ids: list[int], params: SamplingParams) -> list[TokenLogprob | None] | None:
        if params.prompt_logprobs is None:
            return None
        return [None] + [fake_logprob(t, params.prompt_logprobs) for t in prompt_token_ids[1:]]

    def _deltas(self, script: Script, sibling: int, params: SamplingParams) -> list[CompletionOutput]:
        token_ids = [] if params.max_tokens == 0 else script.token_ids
        groups = _split(token_ids, script.sizes)
        utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        silent = self.tokenizer.special_ids if params.skip_special_tokens else frozenset()
        deltas: list[CompletionOutput] = []
        held: list[int] = []
        text = ""
        emitted = 0  # characters released so far
        for g, group in enumerate(groups):
            last = g == len(groups) - 1
            text += "".join(utf8.decode(self.tokenizer.token_raw_bytes(t)) for t in group if t not in silent)
            if last:
                text += utf8.decode(b"", final=True)
            held += group
            if utf8.getstate()[0] and not last:
                continue  # ends inside a character: hold these tokens (and their text) for the next delta
            if script.keep_chars is not None:
                text = text[:max(0, script.keep_chars - emitted)]
            emitted += len(text)
            logprobs = [fake_logprob(t, params.logprobs) for t in held] if params.logprobs is not None else None
            deltas.append(CompletionOutput(sibling, text, held, logprobs))
            held, text = [], ""
        if not deltas:
            deltas.append(CompletionOutput(sibling, "", [], [] if params.logprobs is not None else None))
        deltas[-1].finish_reason = "length" if params.max_tokens == 0 else script.finish_reason
        deltas[-1].stop_reason = None if params.max_tokens == 0 else script.stop_reason
        return deltas


def _split(token_ids: list[int], sizes: list[int] | None) -> list[list[int]]:
    groups, at = [], 0
    for size in sizes or []:
        if at >= len(token_ids):
            break
        groups.append(token_ids[at:at + size])
        at += size
    groups += [[t] for t in token_ids[at:]]
    return groups


@dataclass
class RecordingMetrics:
    """ServerMetrics' observer methods, recording what they were given."""

    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    tokens: list[tuple[int, int]] = field(default_factory=list)
    finishes: list[str] = field(default_factory=list)
    sizes: list[tuple[int, int]] = field(default_factory=list)  # (prompt, generated) of each finished choice

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.append(seconds)

    def observe_itl(self, seconds: float) -> None:
        self.itl.append(seconds)

    def observe_e2e(self, seconds: float) -> None:
        self.e2e.append(seconds)

    def add_tokens(self, prompt: int, generation: int) -> None:
        self.tokens.append((prompt, generation))

    def count_finish(self, reason: str, prompt_tokens: int, generation_tokens: int) -> None:
        self.finishes.append(reason)
        self.sizes.append((prompt_tokens, generation_tokens))


def context(request_id: str = "req-abc123", metrics=None) -> RequestContext:
    return RequestContext(request_id=request_id, model_name="tiny", metrics=metrics)


def same_script(script: Script) -> Callable[[int, int], Script]:
    return lambda prompt_index, sibling: script


async def drain(result) -> list[dict]:
    """The chunks of a stream result."""
    return [chunk async for chunk in result]


def run(coro):
    return asyncio.run(coro)
