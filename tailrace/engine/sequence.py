"""One generated sequence as the engine core sees it: token ids in, token ids out."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

from tailrace.engine.structured_output.grammar import SequenceGrammar
from tailrace.outputs import TokenLogprob
from tailrace.sampling_params import SamplingParams


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class Sequence:
    seq_id: int
    request_id: str
    sibling: int  # which of the request's n choices this is
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # params.max_tokens, capped by the context that is left
    generator: torch.Generator | None = None
    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    block_table: list[int] = field(default_factory=list)
    table_version: int = 0  # bumped by the block manager at every change of block_table
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of the full blocks
    # A hybrid's: the chained hash of the last cached block it starts after, whose kept state it continues
    state_key: int | None = None
    # Siblings wait until the first one has computed the shared prompt, then reuse its blocks.
    waits_for: "Sequence | None" = None
    prompt_logprobs: list[TokenLogprob] | None = None  # filled chunk by chunk, then sent once
    prompt_logprobs_sent: bool = False
    finish_reason: str | None = None
    stop_reason: int | None = None
    # The structured-output matcher; it follows output_token_ids, so it survives preemption.
    grammar: SequenceGrammar | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def token_at(self, position: int) -> int:
        """token_slice(position, position + 1)'s one token, without the list."""
        p = len(self.prompt_token_ids)
        return self.prompt_token_ids[position] if position < p else self.output_token_ids[position - p]

    def token_slice(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None and not self.prompt_logprobs_sent
