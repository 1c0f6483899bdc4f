"""A draft model's guesses: a smaller model of the same vocabulary decodes k tokens greedily for
each guessing sequence, on its own ModelRunner and KV cache, before the target verifies them.

The draft keeps a shadow of each sequence: the target's tokens, then the draft's latest guesses,
and how many of them its cache holds. At each step the shadow drops the guesses the target did
not keep, takes the target's new tokens, and computes from the first token its cache lacks, so a
guess that was kept costs the draft nothing again.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tailrace.engine.block_manager import BlockManager
from tailrace.engine.config import EngineConfig
from tailrace.engine.model_runner import ModelRunner
from tailrace.engine.scheduler import ScheduledSeq
from tailrace.engine.sequence import Sequence
from tailrace.sampling_params import SamplingParams

_GREEDY = SamplingParams(temperature=0.0, max_tokens=None)


@dataclass(slots=True)
class _Shadow:
    seq: Sequence  # the draft's own: shares the prompt list, owns its output list
    synced: int  # the target's output length at the last sync


class DraftModel:
    def __init__(self, model: str, target: EngineConfig, vocab_size: int, max_model_len: int) -> None:
        config = replace(target, model=model, speculative_config=None, enable_prefix_caching=False,
                         max_model_len=max_model_len, num_kv_blocks=None, in_process=True)
        self.runner = ModelRunner(config)
        draft_vocab = self.runner.model_config.vocab_size
        if draft_vocab != vocab_size:
            raise ValueError(f"the draft model's vocabulary has {draft_vocab} entries and the served model's "
                             f"{vocab_size}: a draft must share the served model's tokenizer")
        if self.runner.max_model_len < max_model_len:
            raise ValueError(f"the draft model's context ({self.runner.max_model_len}) is shorter than the "
                             f"served one ({max_model_len}); lower --max-model-len")
        self.blocks = BlockManager(self.runner.num_blocks, config.block_size, enable_prefix_caching=False)
        self._shadows: dict[int, _Shadow] = {}

    def propose(self, asks: list[tuple[Sequence, int]]) -> dict[int, list[int]]:
        """Up to k greedy guesses of the draft for each (sequence, k)."""
        wanted = {seq.seq_id: k for seq, k in asks}
        guesses: dict[int, list[int]] = {seq.seq_id: [] for seq, _ in asks}
        active = [self._synced(seq) for seq, _ in asks]
        while active:
            items, budget = [], self.runner.step_tokens
            for shadow in active:
                seq = shadow.seq
                n = min(seq.num_tokens - seq.num_computed_tokens, budget)
                if n == 0 or not self.blocks.allocate(seq, seq.num_computed_tokens + n):
                    continue  # no room this step: it guesses what it has
                items.append(ScheduledSeq(seq, n))
                budget -= n
            if not items:
                break
            results = self.runner.collect(self.runner.launch(items, []))
            active = []
            for item, result in zip(items, results):
                seq = item.seq
                seq.num_computed_tokens += item.num_new_tokens
                if not result.token_ids:
                    continue  # a long catch-up, cut by the budget: it goes on next step
                seq.output_token_ids.append(result.token_ids[0])
                guess = guesses[seq.seq_id]
                guess.append(result.token_ids[0])
                if len(guess) < wanted[seq.seq_id]:
                    active.append(self._shadows[seq.seq_id])
        return {seq_id: guess for seq_id, guess in guesses.items() if guess}

    def _synced(self, target: Sequence) -> _Shadow:
        """The shadow of `target`, holding its tokens and none of the draft's earlier guesses."""
        shadow = self._shadows.get(target.seq_id)
        if shadow is None:
            own = Sequence(target.seq_id, target.request_id, 0, target.prompt_token_ids, _GREEDY, max_tokens=1 << 30)
            shadow = self._shadows[target.seq_id] = _Shadow(own, 0)
        seq, made = shadow.seq, target.output_token_ids
        same = shadow.synced
        while same < min(len(made), len(seq.output_token_ids)) and seq.output_token_ids[same] == made[same]:
            same += 1
        del seq.output_token_ids[same:]
        seq.output_token_ids += made[same:]
        shadow.synced = len(made)
        # the cache holds the tokens both agree on; at least the last is computed again, to guess from
        seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens + same, seq.num_tokens - 1)
        return shadow

    def drop(self, seq_id: int) -> None:
        shadow = self._shadows.pop(seq_id, None)
        if shadow is not None:
            self.blocks.release(shadow.seq)
            self.runner.release(seq_id)
