"""One engine step on the model: a flat batch of every scheduled token, logits only where needed.

A step is launched, then collected. `launch` queues everything up to the sampled token ids (on
CUDA it returns while the device still works, the results on their way to pinned host memory);
`collect` waits for them once and turns them into StepResults. On CPU, `launch` has done all the
work by the time it returns.
"""

from __future__ import annotations

import ctypes
import logging
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from tailrace.engine.config import EngineConfig, resolve_device
from tailrace.engine.cuda_graphs import DecodeGraphs, decode_size
from tailrace.engine.kv_budget import activation_bytes, fixed_kv_cache_bytes, gpu_kv_cache_bytes
from tailrace.engine.sampler import (
    PendingLogprobs, PendingSample, SamplingRow, make_generator, start_prompt_logprobs, start_sample, take_rows,
)
from tailrace.engine.scheduler import ScheduledSeq
from tailrace.engine.step_inputs import StepInputBuilder, StepInputs
from tailrace.engine.structured_output.grammar import MaskJob, MaskWorker
from tailrace.engine.threads import ThreadTuner, available_cores, thread_candidates
from tailrace.engine.tensor_parallel.step import FollowStep
from tailrace.engine.transfer import record_event
from tailrace.logs import timed
from tailrace.model import backends
from tailrace.model.attention.kv_cache import KVCache
from tailrace.model.attention.paged import PagedKVCache
from tailrace.model.attention.state_cache import StateCache
from tailrace.model.decoder.llama import state_shape
from tailrace.model.loading.loader import load_model, resolve_quantization
from tailrace.outputs import TokenLogprob

log = logging.getLogger("tailrace.engine")

if TYPE_CHECKING:
    from tailrace.engine.tensor_parallel.group import TensorParallel


@dataclass(slots=True)
class StepResult:
    # Empty: this step did not reach the end of the sequence. Otherwise one per position sampled:
    # the known tokens' end, then each guess of the draft (token j is sampled after draft[:j]).
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob | None] = field(default_factory=list)
    # A seeded sequence that verified a draft: its generator's state before the step's draws
    rng_state: torch.Tensor | None = None
    prompt_logprobs: list[TokenLogprob] | None = None  # for the prompt tokens this chunk predicted
    embedding: list[float] | None = None  # a pooling sequence's vector, once its prompt is computed


@dataclass(slots=True)
class LogitRows:
    """Which rows of the flat batch need logits, and what for."""

    rows: list[int]  # rows of the batch, ascending
    prompt_spans: list[tuple[int, int, int, int]]  # (item, first index in rows, start pos, end pos)
    samplers: list[tuple[int, int, int]]  # (item, index in rows, position in the item's draft)
    # Pooling sequences' rows whose final hidden states this step keeps (no logits): (item, rows)
    pooled: list[tuple[int, list[int]]] = field(default_factory=list)


@dataclass(slots=True)
class LaunchedStep:
    """A step whose results may still be on their way from the device."""

    num_items: int
    prompt_logprobs: list[tuple[int, PendingLogprobs]]  # (item, its prompt logprobs)
    sampled: PendingSample | None  # one row per sampled position, in order
    sampling_items: list[int]  # the item of each sampled row (an item verifying a draft has several)
    done: torch.cuda.Event | None  # recorded after the copies to the host; None on CPU
    embeddings: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (item, its pooled vector)
    rng_states: dict[int, torch.Tensor] = field(default_factory=dict)  # item -> its generator before sampling


class ModelRunner:
    def __init__(self, config: EngineConfig, tp: TensorParallel | None = None) -> None:
        """tp: this process's tensor-parallel rank (engine/tensor_parallel); None runs the whole model here."""
        self.tp = tp
        self._released: list[int] = []  # with tp: sequences released since the last step, for the workers
        self.threads = self._tune_threads(config, tp)
        self.device = self._choose_device(config, tp)
        sized_by_gpu = (self.device.type == "cuda" and config.gpu_memory_utilization is not None
                        and config.num_kv_blocks is None)
        free_before_load = torch.cuda.mem_get_info(self.device)[0] if sized_by_gpu else 0
        with timed(log, "loading the model"):
            quantization = self._load(config, tp)
        mc = self.model_config
        # Whether the cache keeps K/V. An encoder's never does, nor a causal model's on a server that
        # only pools: there each prompt runs whole, attends within its step (SDPA, which takes no
        # soft cap or sinks) and is done, so no K/V memory is held and a step's prompts are not
        # bounded by a KV budget.
        self.keeps_kv = mc.causal and not (config.pooling_only and mc.attention_softcap is None
                                           and not mc.attention_sinks)
        with timed(log, "preparing the backends (packing, huge pages, the fused forward)"):
            self.backends = backends.prepare(self.model, self.device, quantization, attention=config.attention,
                                             keeps_kv=self.keeps_kv)
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        # A prompt that keeps no K/V runs whole, so a step holds at least the longest prompt served
        self.step_tokens = (config.max_num_batched_tokens if self.keeps_kv
                            else max(config.max_num_batched_tokens, self.max_model_len))
        self.block_size = config.block_size
        self.num_blocks = self._count_kv_blocks(config, tp, free_before_load if sized_by_gpu else None)
        with timed(log, "allocating the KV cache"):
            scratch_block = self._allocate_kv_cache(config)
        self.backends.check_strict(config.strict_backends)
        if tp is None or tp.rank == 0:
            log.info("%s", self.backends.line(self.model))
        self.inputs = StepInputBuilder(max(self.step_tokens, config.max_num_seqs), config.block_size,
                                       scratch_block, self.device)
        self.graphs = None
        # Under tensor parallelism decode runs eagerly: no graphs are captured around the collectives yet.
        # An engine keeping no K/V never decodes.
        if (self.device.type == "cuda" and self.backends.attention.layout == "paged" and self.backends.attention.plain
                and not config.enforce_eager and tp is None and self.keeps_kv and not mc.gated_delta_layers):
            self.graphs = DecodeGraphs(self.model, self.cache, self.inputs, config.max_num_seqs)
        self.shared_generator = make_generator(config.seed)
        self.masks = MaskWorker(mc.vocab_size, overlap=self.asynchronous)
        self._pooling: dict[int, list[torch.Tensor]] = {}  # seq id -> the hidden states kept of its prompt so far
        _return_freed_heap()

    @staticmethod
    def _tune_threads(config: EngineConfig, tp: TensorParallel | None) -> ThreadTuner:
        """An explicit --threads stays fixed; otherwise each CPU step's thread count is measured
        (threads.py). Ranks share the cores, and all must run the step before any can go on: a
        fixed even split."""
        if config.threads:
            candidates = [config.threads]
        elif tp is not None:
            candidates = [max(1, available_cores() // tp.size)]
        else:
            candidates = thread_candidates(available_cores())
        tuner = ThreadTuner(candidates)
        torch.set_num_threads(tuner.candidates[0])
        return tuner

    @staticmethod
    def _choose_device(config: EngineConfig, tp: TensorParallel | None) -> torch.device:
        device = torch.device(resolve_device(config.device, torch.cuda.is_available()))
        if tp is not None and device.type == "cuda":
            device = torch.device("cuda", tp.rank)  # one GPU per rank, in order
        if device.type == "cuda":
            # Events, graphs and Triton launches use the current device (per thread): make it this one.
            torch.cuda.set_device(device.index or 0)
        return device

    def _load(self, config: EngineConfig, tp: TensorParallel | None) -> str | None:
        """The model and its config onto the device; the quantization it loaded with."""
        quantization = resolve_quantization(config.quantization, config.model_path, str(self.device))
        if quantization is not None and config.quantization is None:
            log.info("the GGUF file's quantized weights load as they are, the rest as int8 (--quantization none "
                     "loads them all as floats)")
        self.model, self.model_config = load_model(
            config.model_path, dtype=config.dtype, load_format=config.load_format,
            device=str(self.device), seed=config.seed, quantization=quantization,
            shard=None if tp is None else tp.shard, max_model_len=config.max_model_len,
        )
        return quantization

    def _count_kv_blocks(self, config: EngineConfig, tp: TensorParallel | None, free_before_load: int | None) -> int:
        """The KV cache's blocks: from --num-kv-blocks, the GPU's free memory (free_before_load not
        None) or --kv-cache-memory-gb; the same on every rank."""
        mc, dtype = self.model_config, self.model.dtype
        if not self.keeps_kv:  # its blocks only count the sequences' tokens
            return config.num_kv_blocks or -(-config.max_num_seqs * self.max_model_len // config.block_size)
        local = self.model.config  # this rank's KV heads, under tensor parallelism
        per_block = sum(KVCache.bytes_per_block(1, *local.attention_shape(layer), config.block_size, dtype)
                        for layer in mc.attention_layers)
        kv_bytes = (self._gpu_kv_cache_bytes(config, free_before_load, dtype.itemsize) if free_before_load is not None
                    else fixed_kv_cache_bytes(config))
        blocks = config.num_kv_blocks or kv_bytes // per_block
        if tp is not None:
            blocks = tp.agree_min(blocks)  # block ids mean the same pages on every rank
        if blocks < 1:
            raise ValueError("the KV cache memory holds no block; raise kv_cache_memory_gb")
        return blocks

    def _allocate_kv_cache(self, config: EngineConfig) -> int | None:
        """self.cache in the layout and with the kernel the backends chose; the scratch block of
        padding rows (paged only)."""
        mc, dtype = self.model_config, self.model.dtype
        layers = len(mc.attention_layers) if self.keeps_kv else 0  # a cache keeping no K/V holds no layer
        local = self.model.config  # this rank's KV heads, under tensor parallelism
        cache_args = (layers, local.num_key_value_heads, mc.head_dim)
        states = self._allocate_states(config)
        if self.backends.attention.layout == "paged":
            # One block past those the block manager hands out: the scratch block of padding rows.
            self.cache = PagedKVCache(*cache_args, self.num_blocks + 1, config.block_size, dtype, self.device,
                                      max_seqs=config.max_num_seqs, max_model_len=self.max_model_len,
                                      kernel=self.backends.attention.kernel, states=states,
                                      layer_shapes=[local.attention_shape(i) for i in mc.attention_layers][:layers])
            return self.num_blocks
        self.cache = KVCache(*cache_args, self.num_blocks, config.block_size, dtype, self.device,
                             max_seqs=config.max_num_seqs, max_model_len=self.max_model_len, states=states)
        return None

    def _allocate_states(self, config: EngineConfig) -> StateCache | None:
        """A hybrid's state cache: a slot for each sequence that may run at once (--max-num-seqs)
        and as many snapshots for the prefix cache, beside the KV cache's blocks (only the rows
        written take memory); None for a model without linear-attention layers."""
        mc = self.model_config
        if not mc.gated_delta_layers:
            return None
        states = StateCache(len(mc.gated_delta_layers), state_shape(mc), config.max_num_seqs, self.model.dtype,
                            self.device)
        per_row = states.nbytes / (2 * config.max_num_seqs) / 2**20
        log.info("state cache: %d Gated DeltaNet layers, %.2f MiB a sequence, for %d running sequences and as many "
                 "prefix-cache snapshots (at most %.1f MiB)", len(mc.gated_delta_layers), per_row,
                 config.max_num_seqs, states.nbytes / 2**20)
        return states

    def _gpu_kv_cache_bytes(self, config: EngineConfig, free_before_load: int, dtype_bytes: int) -> int:
        torch.cuda.empty_cache()  # blocks the loader freed would otherwise count as the weights'
        free_after_load, total = torch.cuda.mem_get_info(self.device)
        return gpu_kv_cache_bytes(config.gpu_memory_utilization, total, free_before_load, free_after_load,
                                  activation_bytes(config, self.model_config, dtype_bytes))

    @property
    def asynchronous(self) -> bool:
        """Whether `launch` returns before the device has finished the step."""
        return self.device.type == "cuda"

    def release(self, seq_id: int) -> None:
        self.cache.release(seq_id)
        self._pooling.pop(seq_id, None)
        if self.tp is not None:
            self._released.append(seq_id)

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks (rank 0); nothing to do without them."""
        if self.tp is not None:
            self.tp.shutdown()

    @torch.inference_mode()
    def follow(self, step: FollowStep) -> None:
        """A tensor-parallel worker's step: the forward rank 0 runs, on this rank's part of the model,
        joining its collectives; rank 0 samples."""
        for seq_id in step.released:
            self.cache.release(seq_id)
        self.cache.begin(step.inputs.batch)
        self.model.compute_logits(self.model(step.inputs.input_ids, step.inputs.positions, step.inputs.batch,
                                             self.cache, step.rows))

    @torch.inference_mode()
    def launch(self, scheduled: list[ScheduledSeq], eos_token_ids: list[int]) -> LaunchedStep:
        """Queue the step's forward and sampling; `collect` reads the results. Nothing here waits
        for the device on the common path (see sampler for the exceptions)."""
        graph_size = None if self.graphs is None else decode_size(self.graphs.sizes, scheduled)
        if graph_size is not None and any(item.seq.params.pooling for item in scheduled):
            graph_size = None  # a decode graph computes logits, not the hidden states pooling keeps
        inputs = self.inputs.build(scheduled, pad_to=graph_size or 0)
        need = _logit_rows(scheduled, inputs)
        if self.tp is not None:
            self.tp.send_step(inputs, need.rows, self._released)
            self._released = []
        tuned = not self.asynchronous and not self.threads.fixed
        if tuned:  # on CPU, launch is the whole step
            self.threads.start(inputs.input_ids.shape[0])
        self.cache.begin(inputs.batch)
        masks = self._start_masks(scheduled)
        step = LaunchedStep(len(scheduled), [], None, [i for i, _, _ in need.samplers], None)
        if graph_size is not None:
            logits = take_rows(self.graphs.replay(graph_size), need.rows)
        elif need.pooled:
            logits = self._forward_pooling(scheduled, inputs, need, step)
        else:
            logits = self.model.compute_logits(self.model(inputs.input_ids, inputs.positions, inputs.batch, self.cache,
                                                          need.rows))
        if self.tp is not None:
            self.tp.step_done()
        for i, first, start, end in need.prompt_spans:
            seq = scheduled[i].seq
            pending = start_prompt_logprobs(logits[first:first + end - start], seq.prompt_token_ids[start:end + 1],
                                            seq.params.prompt_logprobs or 0)
            step.prompt_logprobs.append((i, pending.to_host()))
        if need.samplers:
            step.sampled = self._start_sampling(scheduled, need, logits, masks, step, eos_token_ids)
        step.done = record_event(self.device)
        if tuned:
            self.threads.finish()
        return step

    def _start_sampling(self, scheduled: list[ScheduledSeq], need: LogitRows, logits: torch.Tensor,
                        masks: tuple[list[int], MaskJob] | None, step: LaunchedStep,
                        eos_token_ids: list[int]) -> PendingSample:
        """A row per sampled position, grammar masks applied. An item verifying a guess samples at
        each guessed position as plain decoding would there: after the guess's tokens before it,
        drawing from its generator in position order (whose state before is kept in the step)."""
        picked = take_rows(logits, [r for _, r, _ in need.samplers])
        constrained: list[int] = []
        if masks is not None:
            constrained, job = masks
            first_row = {i: row for row, (i, _, j) in enumerate(need.samplers) if j == 0}
            job.apply(picked, [first_row[i] + j for i in constrained for j in range(1 + len(scheduled[i].draft))])
        rows = []
        for i, _, j in need.samplers:
            item = scheduled[i]
            s = item.seq
            if j == 0 and item.draft and s.generator is not None and not s.params.greedy:
                step.rng_states[i] = s.generator.get_state()
            before = s.output_token_ids + item.draft[:j] if j else s.output_token_ids
            rows.append(SamplingRow(s.params, s.prompt_token_ids, before, s.generator, eos_token_ids,
                                    masked=i in constrained))
        return start_sample(picked, rows, self.shared_generator).to_host()

    def _forward_pooling(self, scheduled: list[ScheduledSeq], inputs: StepInputs, need: LogitRows,
                         step: LaunchedStep) -> torch.Tensor:
        """The forward of a step with pooling sequences: the hidden states of every row that needs
        logits or is pooled, logits only for the first kind. A pooling sequence keeps its rows
        until its prompt is computed, then pools them all at once, so that how the prompt was
        split into chunks changes no bit of the sum."""
        rows = sorted(set(need.rows).union(*(pooled for _, pooled in need.pooled)))
        at = {row: i for i, row in enumerate(rows)}
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.batch, self.cache, rows,
                            self._token_types(scheduled, inputs))
        logits = self.model.compute_logits(hidden[[at[r] for r in need.rows]]) if need.rows else hidden[:0]
        for i, pooled in need.pooled:
            seq = scheduled[i].seq
            kept = self._pooling.setdefault(seq.seq_id, [])
            kept.append(hidden[[at[r] for r in pooled]].float())
            if scheduled[i].samples:  # the prompt's last chunk
                vector = self.model.pooled_vector(torch.cat(self._pooling.pop(seq.seq_id)), seq.params.pooling)
                step.embeddings.append((i, vector.to("cpu", non_blocking=True)))
        return logits

    def _token_types(self, scheduled: list[ScheduledSeq], inputs: StepInputs) -> torch.Tensor | None:
        """Each row's token type where a pair is in the step (1 from its second text on), else None."""
        starts = [(sl, item.seq.params.segment_start) for item, sl in zip(scheduled, inputs.batch.seqs)]
        if not self.model_config.type_vocab_size or all(start is None for _, start in starts):
            return None
        types = torch.zeros_like(inputs.input_ids)
        for sl, start in starts:
            if start is not None:
                rows = slice(sl.q_start, sl.q_start + sl.q_len)
                types[rows] = (inputs.positions[rows] >= start).to(types.dtype)
        return types

    def collect(self, step: LaunchedStep) -> list[StepResult]:
        """The launched step's results, one per scheduled item: the step's one wait for the device."""
        if step.done is not None:
            step.done.synchronize()
        results = [StepResult() for _ in range(step.num_items)]
        for i, vector in step.embeddings:
            results[i].embedding = vector.tolist()
        for i, pending in step.prompt_logprobs:
            results[i].prompt_logprobs = pending.resolve()
        if step.sampled is not None:
            out = step.sampled.resolve()
            for j, i in enumerate(step.sampling_items):
                results[i].token_ids.append(out.token_ids[j])
                results[i].logprobs.append(out.logprobs[j])
        for i, state in step.rng_states.items():
            results[i].rng_state = state
        return results

    def _start_masks(self, scheduled: list[ScheduledSeq]) -> tuple[list[int], MaskJob] | None:
        """Grammar masks for the items that sample under a constraint this step (one per guessed
        position too), filled while the model runs; None (no work at all) when there is none."""
        constrained = [i for i, item in enumerate(scheduled)
                       if item.samples and item.seq.max_tokens > 0 and item.seq.grammar is not None
                       and item.seq.grammar.constrains_next]
        if not constrained:
            return None
        return constrained, self.masks.start([scheduled[i].seq.grammar for i in constrained],
                                             [scheduled[i].draft for i in constrained])


def _return_freed_heap() -> None:
    """Hand the C heap's free pages back to the system once the model and cache are in place.
    Loading frees many tensors under glibc's mmap threshold (float copies, packing), and glibc keeps
    that memory for later allocations that never come (tens of MB of a small model's engine RSS)."""
    if sys.platform == "linux":
        trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc's; musl has none
        if trim is not None:
            trim(0)


def _logit_rows(scheduled: list[ScheduledSeq], inputs: StepInputs) -> LogitRows:
    """The rows that need logits: the last row of each item that samples (with a draft, its
    guesses' rows too), and the rows that predict prompt tokens for prompt_logprobs; and apart,
    the rows whose hidden states pooling sequences keep."""
    need = LogitRows([], [], [])
    for i, (item, sl) in enumerate(zip(scheduled, inputs.batch.seqs)):
        seq = item.seq
        if seq.wants_prompt_logprobs:
            # Logits at position p predict prompt token p + 1.
            start = seq.num_computed_tokens
            end = min(start + item.num_new_tokens, seq.num_prompt_tokens - 1)
            if end > start:
                need.prompt_spans.append((i, len(need.rows), start, end))
                need.rows.extend(range(sl.q_start, sl.q_start + end - start))
        if item.samples and seq.max_tokens > 0:
            guesses = len(item.draft)
            for j in range(guesses + 1):
                need.samplers.append((i, len(need.rows), j))
                need.rows.append(sl.q_start + sl.q_len - 1 - guesses + j)
        if seq.params.pooling is not None:
            pooled = _pooled_rows(seq.params.pooling, seq.num_computed_tokens, sl.q_start, sl.q_len, item.samples)
            if pooled or item.samples:  # the last chunk pools what was kept, whether or not it adds rows
                need.pooled.append((i, pooled))
    return need


def _pooled_rows(method: str, computed: int, q_start: int, q_len: int, last_chunk: bool) -> list[int]:
    """The rows of a pooling sequence's chunk whose hidden states its vector is made of: every
    row for "mean", the prompt's first for "cls" and "score", its last for "last" and "logits"."""
    if method == "mean":
        return list(range(q_start, q_start + q_len))
    if method in ("cls", "score"):
        return [q_start] if computed == 0 else []
    return [q_start + q_len - 1] if last_chunk else []

