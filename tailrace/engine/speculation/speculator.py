"""Which tokens each decoding sequence guesses this step, which of them stand, and the counts.

A guess stands only where the model, sampling at its position exactly as plain decoding would
(same logits bits, same penalties over the tokens before it, the same random draw), picks that
very token. So the tokens kept are plain decoding's tokens, and the first token that differs is
plain decoding's too: each verified step yields one token more than it accepted.

How many to guess adapts per sequence: one more than the last step accepted, up to
num_speculative_tokens; after a guess with nothing accepted the sequence stops guessing for a
number of steps that doubles with each such miss (up to MAX_PAUSE) and resets on a hit. A guess
that misses costs its rows in the step; this keeps that cost rare where guesses do not land.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from tailrace.engine.sequence import Sequence
from tailrace.engine.speculation.config import SpeculativeConfig

MAX_PAUSE = 16


@dataclass(slots=True)
class SpecStats:
    """Cumulative counts, named as vLLM's vllm:spec_decode_* counters."""

    num_drafts: int = 0  # sequence-steps that verified a guess
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [j]: guesses accepted at position j


class Proposer(Protocol):
    """Where guesses come from: ngram.NgramProposer or draft_model.DraftModel."""

    def propose(self, asks: list[tuple[Sequence, int]]) -> dict[int, list[int]]:
        """Up to k guessed tokens for each (sequence, k), by seq id; none for some is fine."""

    def drop(self, seq_id: int) -> None:
        """The sequence finished: forget it."""


@dataclass(slots=True)
class _Guessing:
    k: int  # how many to guess next
    pause: int = 0  # steps left without guessing
    backoff: int = 1  # the pause after the next miss


def accepted_count(sampled: list[int], draft: list[int]) -> int:
    """How many of the draft's tokens plain decoding produces: the longest prefix in which each
    equals the token sampled at its position (`sampled[j]` is sampled after draft[:j])."""
    m = 0
    while m < len(draft) and sampled[m] == draft[m]:
        m += 1
    return m


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, proposer: Proposer) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = proposer
        self.stats = SpecStats(accepted_per_position=[0] * config.num_speculative_tokens)
        self._seqs: dict[int, _Guessing] = {}

    def propose(self, running: list[Sequence]) -> dict[int, list[int]]:
        """The guesses of the running sequences that decode this step, by seq id, cut where a
        sequence's grammar refuses a token. A sequence pooling, thinking under a grammar, or with
        one token left to make guesses nothing."""
        asks = []
        for seq in running:
            if (seq.num_tokens - seq.num_computed_tokens != 1 or seq.params.pooling
                    or seq.grammar is not None and not seq.grammar.takes_guesses):
                continue
            # the guesses and the token after them must fit max_tokens and the context
            room = min(seq.max_tokens - len(seq.output_token_ids), self.max_model_len - seq.num_tokens + 1) - 1
            state = self._seqs.get(seq.seq_id)
            if state is None:
                state = self._seqs[seq.seq_id] = _Guessing(self.config.num_speculative_tokens)
            if state.pause:
                state.pause -= 1
                continue
            if room > 0:
                asks.append((seq, min(state.k, room)))
        drafts = self.proposer.propose(asks) if asks else {}
        for seq, _ in asks:
            if seq.grammar is not None and seq.seq_id in drafts:
                draft = drafts[seq.seq_id][:seq.grammar.guess_prefix(drafts[seq.seq_id])]
                if draft:
                    drafts[seq.seq_id] = draft
                else:
                    del drafts[seq.seq_id]
        return drafts

    def record(self, seq: Sequence, proposed: int, accepted: int) -> None:
        """What the step made of a sequence's guess of `proposed` tokens."""
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += proposed
        s.num_accepted_tokens += accepted
        for j in range(accepted):
            s.accepted_per_position[j] += 1
        state = self._seqs.get(seq.seq_id)
        if state is None:
            return
        state.k = min(self.config.num_speculative_tokens, accepted + 1)
        if accepted:
            state.backoff = 1
        else:
            state.pause, state.backoff = state.backoff, min(2 * state.backoff, MAX_PAUSE)

    def drop(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)
        self.proposer.drop(seq_id)
