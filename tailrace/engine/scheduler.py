"""Continuous batching under a per-step token budget.

Running sequences get their next tokens first (a decode is one token, an unfinished prefill
a chunk; a decode may add the speculator's guesses where the budget and memory leave room for
them after every running sequence's own token); waiting sequences are admitted with what is left
(chunked prefill; an encoder's prompts only whole). When KV blocks run out, the newest running sequence is preempted: its blocks are
freed and it is computed again later (its prefix may still be cached then).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tailrace.engine.block_manager import BlockManager
from tailrace.engine.sequence import Sequence, Status


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # the draft's tokens included
    draft: list[int] = field(default_factory=list)  # guessed tokens after the known ones, to verify
    capture: tuple[int, int] | None = None  # a hybrid's: the block boundary whose state to keep (BlockManager)

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the sequence's known tokens, so it yields a token."""
        return self.seq.num_computed_tokens + self.num_new_tokens - len(self.draft) == self.seq.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    preempted: list[Sequence]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 whole_prompts: bool = False) -> None:
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # An encoder's: a prompt is admitted only where the step has room for all of it (its
        # attention sees the whole sequence at once), so no prompt is chunked.
        self.whole_prompts = whole_prompts
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, drafts: dict[int, list[int]] | None = None) -> SchedulerOutput:
        """The step: `drafts` are guesses by seq id (speculator.propose), kept where they fit."""
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted: list[Sequence] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            draft = self._fitting_draft(drafts, seq, n, budget - n - (len(self.running) - i - 1))
            n += len(draft)
            while not self.blocks.allocate(seq, seq.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                break
            scheduled.append(ScheduledSeq(seq, n, draft, self.blocks.state_boundary(seq, n)))
            budget -= n
            i += 1
        if not preempted:
            budget = self._admit(budget, scheduled)
        return SchedulerOutput(scheduled, preempted)

    def _fitting_draft(self, drafts: dict[int, list[int]] | None, seq: Sequence, n: int, spare: int) -> list[int]:
        """The part of seq's guess that fits the budget left after every running sequence's own
        token, in memory free now: a guess never preempts anyone."""
        draft = drafts.get(seq.seq_id) if drafts and n == 1 else None
        if not draft or spare <= 0:
            return []
        draft = draft[:spare]
        return draft if self.blocks.allocate(seq, seq.num_computed_tokens + n + len(draft)) else []

    def _admit(self, budget: int, scheduled: list[ScheduledSeq]) -> int:
        deferred: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.waits_for is not None and seq.waits_for.status is not Status.FINISHED and (
                seq.waits_for.num_computed_tokens < seq.waits_for.num_prompt_tokens
            ):
                deferred.append(self.waiting.popleft())
                continue
            seq.waits_for = None
            fresh = not seq.block_table
            if fresh:
                self.blocks.match_prefix(seq)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if self.whole_prompts and n < seq.num_tokens - seq.num_computed_tokens:
                break  # the next step has room for it
            if not self.blocks.allocate(seq, seq.num_computed_tokens + n):
                # Hold no memory while waiting; its cached prefix stays findable in the free list.
                self.blocks.release(seq)
                seq.num_cached_tokens = 0
                break
            self.waiting.popleft()
            if fresh:
                self.blocks.record_lookup(seq)
            seq.status = Status.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, n, capture=self.blocks.state_boundary(seq, n)))
            budget -= n
        self.waiting.extendleft(reversed(deferred))
        return budget

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.release(seq)
        seq.status = Status.WAITING
        seq.num_cached_tokens = 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        """Drop a sequence wherever it is and free its memory at once."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self.blocks.release(seq)
        seq.status = Status.FINISHED
