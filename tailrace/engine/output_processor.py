"""The client side of the engine: token ids from the core become per-choice text deltas.

Detokenizing and stop strings live here, not in the core, so the core's process spends its time
on the model. A stop-string match finishes the choice here and asks the core to drop it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from tailrace.engine.messages import SeqOutput
from tailrace.engine.detokenizer import IncrementalDetokenizer
from tailrace.outputs import CompletionOutput, RequestOutput, TokenLogprob
from tailrace.sampling_params import SamplingParams
from tailrace.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass(slots=True)
class SequenceState:
    detokenizer: IncrementalDetokenizer
    finished: bool = False
    introduced: bool = False  # the first delta (with prompt logprobs) went out
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_cached_tokens: int = 0


@dataclass(slots=True)
class RequestState:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    choices: list[SequenceState] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.choices)


@dataclass(slots=True)
class Processed:
    deltas: list[RequestOutput]
    to_abort: list[tuple[str, int]]  # (request id, sibling) that matched a stop string
    failed: list[str] = field(default_factory=list)  # requests whose processing raised; already dropped


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        state = RequestState(request_id, prompt_token_ids, params)
        for _ in range(params.n):
            detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens,
                                           params.stop, params.include_stop_str_in_output, params.thinking)
            state.choices.append(SequenceState(detok))
        self.requests[request_id] = state

    def remove(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def process(self, outputs: list[SeqOutput]) -> Processed:
        result = Processed([], [])
        for out in outputs:
            state = self.requests.get(out.request_id)
            if state is None or state.choices[out.sibling].finished:
                continue  # aborted by the caller, or already cut by a stop string
            try:
                delta = self._choice_delta(state, out, result)
            except Exception:  # a fault in one request's detokenizing must not cost the others their output
                log.exception("processing the output of request %s failed", out.request_id)
                del self.requests[out.request_id]
                result.failed.append(out.request_id)
                continue
            if delta is None:
                continue
            finished = state.finished
            if finished:
                del self.requests[out.request_id]
            result.deltas.append(self._request_output(state, out.sibling, delta, finished))
        return result

    def _choice_delta(self, state: RequestState, out: SeqOutput, result: Processed) -> CompletionOutput | None:
        choice = state.choices[out.sibling]
        if out.prompt_logprobs is not None:
            choice.prompt_logprobs = [None, *out.prompt_logprobs]
        choice.num_cached_tokens = max(choice.num_cached_tokens, out.num_cached_tokens)
        ids, logprobs = out.new_token_ids, out.new_logprobs
        # A stop token (eos or stop_token_ids) counts as generated but adds no text.
        stop_token = out.finish_reason == "stop" and bool(ids) and not state.params.include_stop_str_in_output
        held_ids = ids[:-1] if stop_token else ids
        held_lps = logprobs[:len(held_ids)] if logprobs is not None else None
        released = choice.detokenizer.add(held_ids, held_lps, finished=out.finish_reason is not None)
        delta = CompletionOutput(out.sibling, released.text, released.token_ids, released.logprobs,
                                 out.finish_reason, out.stop_reason, out.embedding)
        if stop_token and released.stop_str is None:
            delta.token_ids = [*delta.token_ids, ids[-1]]
            if logprobs is not None:
                delta.logprobs = [*(delta.logprobs or []), logprobs[-1]]
        if released.stop_str is not None:
            delta.finish_reason, delta.stop_reason = "stop", released.stop_str
            if out.finish_reason is None:
                result.to_abort.append((state.request_id, out.sibling))
        if delta.finish_reason is not None:
            choice.finished = True
        if not (delta.text or delta.token_ids or delta.finish_reason or not choice.introduced and
                choice.prompt_logprobs is not None):
            return None
        return delta

    def _request_output(self, state: RequestState, sibling: int, delta: CompletionOutput,
                        finished: bool) -> RequestOutput:
        choice = state.choices[sibling]
        out = RequestOutput(state.request_id, state.prompt_token_ids, [delta], finished=finished,
                            num_cached_tokens=choice.num_cached_tokens)
        if not choice.introduced:
            choice.introduced = True
            out.prompt_logprobs = choice.prompt_logprobs
        return out
