"""CUDA graphs for decode steps: the forward and the logits, captured once per batch size.

A decode step launches hundreds of small kernels whose launch cost can exceed their run time;
replaying a captured graph launches them all at once. A decode-only step (one new token per
sequence) of n sequences is padded to the smallest captured size >= n (see step_inputs), so a
handful of graphs serves every batch. The graph reads its inputs from the step-input and
attention-metadata buffers, whose addresses never change, and writes the logits of every row,
padding included, into its own output tensor; `StepInputBuilder.build` and
`PagedKVCache.begin` fill those buffers before each replay.
Prefill and mixed steps run eagerly.
"""

from __future__ import annotations

from bisect import bisect_left

import torch

from tailrace.engine.scheduler import ScheduledSeq
from tailrace.engine.step_inputs import StepInputBuilder, StepInputs
from tailrace.model.attention.paged import PagedKVCache
from tailrace.model.decoder.llama import LlamaForCausalLM


def decode_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, 8, every multiple of 16, and max_num_seqs. Padding
    costs little in a decode step, which reads all the weights whatever the batch."""
    return sorted({size for size in (1, 2, 4, 8, *range(16, max_num_seqs, 16)) if size < max_num_seqs}
                  | {max_num_seqs})


def decode_size(sizes: list[int], scheduled: list[ScheduledSeq]) -> int | None:
    """The graph size for this step, or None when it must run eagerly (a chunk of more than one
    token, or more sequences than the largest graph)."""
    if len(scheduled) > sizes[-1] or any(item.num_new_tokens != 1 for item in scheduled):
        return None
    return sizes[bisect_left(sizes, len(scheduled))]


def decode_logits(model: LlamaForCausalLM, cache: PagedKVCache, inputs: StepInputs) -> torch.Tensor:
    """Logits [T, vocab] of every row, padding included: what a decode graph captures.
    `cache.begin(inputs.batch)` first."""
    return model.compute_logits(model(inputs.input_ids, inputs.positions, inputs.batch, cache))


class DecodeGraphs:
    """One captured graph per decode size; capture takes a warm-up and a capture per size."""

    def __init__(self, model: LlamaForCausalLM, cache: PagedKVCache, inputs: StepInputBuilder,
                 max_num_seqs: int) -> None:
        self.sizes = decode_sizes(max_num_seqs)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):  # the largest first: the smaller ones fit in its memory
            padding = inputs.build([], pad_to=size)
            cache.begin(padding.batch)
            decode_logits(model, cache, padding)  # outside the graph: Triton compiles, cuBLAS sets up
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = decode_logits(model, cache, padding)
            self._graphs[size] = (graph, logits)
        torch.cuda.synchronize()

    def replay(self, size: int) -> torch.Tensor:
        """Run the graph of this size on the inputs `build` and `begin` have just written; its
        logits [size, vocab] stay valid until the next replay of any size."""
        graph, logits = self._graphs[size]
        graph.replay()
        return logits
