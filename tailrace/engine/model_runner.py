"""One engine step on the model: a flat batch of every scheduled token, logits only where needed."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from tailrace.engine.config import EngineConfig
from tailrace.engine.sampler import SamplingRow, make_generator, prompt_logprobs, sample
from tailrace.engine.scheduler import ScheduledSeq
from tailrace.engine.structured import MaskJob, MaskWorker
from tailrace.model.attention import AttentionBatch, KVCache, SeqSlice
from tailrace.model.loader import load_model
from tailrace.outputs import TokenLogprob


@dataclass(slots=True)
class StepResult:
    token_id: int | None = None  # None: this step did not reach the end of the sequence
    logprob: TokenLogprob | None = None
    prompt_logprobs: list[TokenLogprob] | None = None  # for the prompt tokens this chunk predicted


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        # One core stays free for the API process (JSON, detokenizing); on 2 cores that is 1 thread.
        torch.set_num_threads(config.threads or max(1, (os.cpu_count() or 2) - 1))
        self.device = torch.device(config.device)
        self.model, self.model_config = load_model(
            config.model_path, dtype=config.dtype, load_format=config.load_format,
            device=config.device, seed=config.seed,
        )
        mc = self.model_config
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        self.block_size = config.block_size
        dtype = next(self.model.parameters()).dtype
        per_block = KVCache.bytes_per_block(mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim,
                                            config.block_size, dtype)
        self.num_blocks = config.num_kv_blocks or int(config.kv_cache_memory_gb * 2**30 // per_block)
        if self.num_blocks < 1:
            raise ValueError("the KV cache memory holds no block; raise kv_cache_memory_gb")
        self.cache = KVCache(mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim,
                             self.num_blocks, config.block_size, dtype, config.device,
                             max_seqs=config.max_num_seqs, max_model_len=self.max_model_len)
        self.shared_generator = make_generator(config.seed)
        self.masks = MaskWorker(mc.vocab_size)

    def release(self, seq_id: int) -> None:
        self.cache.release(seq_id)

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq], eos_token_ids: list[int]) -> list[StepResult]:
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        slices: list[SeqSlice] = []
        bs = self.block_size
        for item in scheduled:
            seq, start, n = item.seq, item.seq.num_computed_tokens, item.num_new_tokens
            slices.append(SeqSlice(seq.seq_id, len(input_ids), n, start + n, seq.block_table))
            input_ids.extend(seq.token_slice(start, start + n))
            positions.extend(range(start, start + n))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
        batch = AttentionBatch(slices, torch.tensor(slots, dtype=torch.int64, device=self.device))
        self.cache.begin(batch)
        masks = self._start_masks(scheduled)
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.int64, device=self.device),
            torch.tensor(positions, dtype=torch.int64, device=self.device),
            batch, self.cache,
        )
        return self._sample(scheduled, slices, hidden, eos_token_ids, masks)

    def _start_masks(self, scheduled: list[ScheduledSeq]) -> tuple[list[int], MaskJob] | None:
        """Grammar masks for the items that sample under a constraint this step, filled while the
        model runs; None (no work at all) when there is none."""
        constrained = [i for i, item in enumerate(scheduled)
                       if item.samples and item.seq.max_tokens > 0 and item.seq.grammar is not None
                       and item.seq.grammar.constrains_next]
        if not constrained:
            return None
        return constrained, self.masks.start([scheduled[i].seq.grammar for i in constrained])

    def _sample(self, scheduled: list[ScheduledSeq], slices: list[SeqSlice], hidden: torch.Tensor,
                eos_token_ids: list[int], masks: tuple[list[int], MaskJob] | None) -> list[StepResult]:
        results = [StepResult() for _ in scheduled]
        rows: list[int] = []  # rows of `hidden` that need logits
        prompt_spans: list[tuple[int, int, int, int]] = []  # (item, first index in rows, start pos, end pos)
        samplers: list[tuple[int, int]] = []  # (item, index in rows)
        for i, (item, sl) in enumerate(zip(scheduled, slices)):
            seq = item.seq
            if seq.wants_prompt_logprobs:
                # Logits at position p predict prompt token p + 1.
                start = seq.num_computed_tokens
                end = min(start + item.num_new_tokens, seq.num_prompt_tokens - 1)
                if end > start:
                    prompt_spans.append((i, len(rows), start, end))
                    rows.extend(range(sl.q_start, sl.q_start + end - start))
            if item.samples and seq.max_tokens > 0:
                samplers.append((i, len(rows)))
                rows.append(sl.q_start + sl.q_len - 1)
        if not rows:
            return results
        if len(rows) < hidden.shape[0]:  # else every row samples (a decode-only step), in order
            hidden = hidden[torch.tensor(rows, device=hidden.device)]
        logits = self.model.compute_logits(hidden)
        for i, first, start, end in prompt_spans:
            seq = scheduled[i].seq
            results[i].prompt_logprobs = prompt_logprobs(
                logits[first:first + end - start], seq.prompt_token_ids[start:end + 1],
                seq.params.prompt_logprobs or 0,
            )
        if samplers:
            seqs = [scheduled[i].seq for i, _ in samplers]
            picked = logits if len(samplers) == len(rows) else logits[torch.tensor([r for _, r in samplers])]
            if masks is not None:
                constrained, job = masks
                row_of = {i: j for j, (i, _) in enumerate(samplers)}
                job.apply(picked, [row_of[i] for i in constrained])
            out = sample(picked, [SamplingRow(s.params, s.prompt_token_ids, s.output_token_ids, s.generator,
                                              eos_token_ids) for s in seqs], self.shared_generator)
            for j, (i, _) in enumerate(samplers):
                results[i].token_id = out.token_ids[j]
                results[i].logprob = out.logprobs[j]
        return results
