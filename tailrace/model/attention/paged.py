"""Attention read straight from the paged KV cache through block tables: the cache of CUDA and of
CPUs with AVX512 or AVX2.

`PagedKVCache` has the public interface of `attention.KVCache`, without its slot slab: nothing
is copied out of the pages. Each step, `begin` sends the batch's metadata (where each sequence's
rows start, its K/V length, its block table) to the device in one copy, into tensors that keep
their addresses for CUDA graphs. Attention then runs the kernel model/backends.py chose: the
Triton kernel on CUDA, tailrace's own kernel on CPUs with AVX512 or AVX2
(csrc/paged_attention.cpp: each position's attention is one fixed computation, the same bits in any
batch, chunking or thread count), or `paged_attention_reference` (plain PyTorch, one SDPA call per
sequence).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F

from tailrace.model.attention.kv_cache import (AttentionBatch, KVCache, LayerAttention, PagedAttentionMetadata,
                                               SeqSlice, SequenceStates, new_pages, plain_attention)
from tailrace.model.cpu.kernels import kernels


def _triton_attention() -> ModuleType:
    """The Triton kernel's module, imported only where it may run: importing triton alone added
    52 MB to a CPU engine's RSS (VmRSS of a fresh process before and after the import)."""
    from tailrace.model.attention import triton_paged as triton_attention

    return triton_attention


ATTENTION_KERNELS = ("tailrace", "triton", "pytorch")


def native_takes(dtype: torch.dtype, head_dim: int) -> bool:
    """The shapes tailrace's CPU attention kernel is built for."""
    return dtype in (torch.float32, torch.bfloat16) and head_dim % 16 == 0 and (head_dim <= 256 or head_dim == 512)


def _native_kernel(device: torch.device, dtype: torch.dtype, head_dim: int) -> Callable[..., torch.Tensor]:
    ops = kernels() if device.type == "cpu" else None
    if ops is None or not native_takes(dtype, head_dim):
        raise ValueError(f"tailrace's attention kernel does not run {dtype} with head_dim {head_dim} on {device}")
    return ops.paged_attention


def paged_attention_reference(
    q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, meta: PagedAttentionMetadata,
    how: LayerAttention, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, H, D] against k_pages/v_pages [num_blocks * block_size, kvH, D] -> [T, H, D].

    Each sequence's new rows attend to its pages, causal aligned lower-right: row i of a chunk of
    q_len rows sees positions <= seq_len - q_len + i (and, with a window, > that - window). Rows
    that belong to no sequence are zero. `sinks` [H]: each head's logit that joins its softmax.
    """
    out = q.new_zeros(q.shape)
    starts = meta.query_start_loc.tolist()
    for seq, kv_len in enumerate(meta.seq_lens[: meta.num_seqs].tolist()):
        q_start, q_end = starts[seq], starts[seq + 1]
        if q_end > q_start:
            rows = _page_rows(meta.block_tables[seq], kv_len, meta.block_size)
            out[q_start:q_end] = _chunk_attention(q[q_start:q_end], k_pages[rows], v_pages[rows], how, sinks)
    return out


def _page_rows(block_table: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """Rows of the paged tensors that hold positions [0, length) of a sequence."""
    positions = torch.arange(length, device=block_table.device)
    return block_table[positions // block_size].long() * block_size + positions % block_size


def _chunk_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, how: LayerAttention,
                     sinks: torch.Tensor | None) -> torch.Tensor:
    """q [L, H, D], the last L positions of keys/values [S, kvH, D] -> [L, H, D]."""
    length = keys.shape[0]
    query_positions = torch.arange(length - q.shape[0], length, device=q.device)[:, None]
    key_positions = torch.arange(length, device=q.device)[None, :]
    visible = key_positions <= query_positions
    if how.window is not None:
        visible &= key_positions > query_positions - how.window
    q, keys, values = q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1)
    if how.softcap is None and sinks is None:
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, scale=how.scale, enable_gqa=True)
        return out.transpose(0, 1)
    # SDPA has neither soft cap nor sinks: the reference's eager attention, in float32
    group = q.shape[0] // keys.shape[0]
    keys, values = keys.repeat_interleave(group, 0).float(), values.repeat_interleave(group, 0).float()
    scores = q.float() @ keys.transpose(1, 2) * how.scale
    if how.softcap is not None:
        scores = (scores / how.softcap).tanh() * how.softcap
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:  # a column of each head's sink, dropped after the softmax
        sink = sinks.float()[:, None, None].expand(-1, scores.shape[1], 1)
        weights = torch.cat((scores, sink), dim=-1).softmax(-1)[..., :-1]
    else:
        weights = scores.softmax(-1)
    return (weights @ values).to(q.dtype).transpose(0, 1)


class PagedKVCache:
    """The paged K/V, read in place by attention through each step's block tables.

    Memory: `num_blocks * bytes_per_block(...)`, plus int32 metadata for max_seqs sequences of up
    to max_model_len tokens (twice, pinned on the host and on the device, when on CUDA).
    kernel: what attends, as model/backends.py chose it: "tailrace" (the CPU kernel,
    csrc/paged_attention.cpp, for what `native_takes`), "triton" (CUDA; on CPU it needs
    TRITON_INTERPRET=1 set before tailrace imports triton) or "pytorch" (the reference, any attention).
    """

    bytes_per_block = staticmethod(KVCache.bytes_per_block)  # the same pages, and no slab on top

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
        max_seqs: int = 64,
        max_model_len: int | None = None,  # None: as many tokens as the pages hold
        kernel: str = "pytorch",
        states: SequenceStates | None = None,  # a hybrid's linear-attention states, kept beside the K/V
        layer_shapes: list[tuple[int, int]] | None = None,  # per layer (kv_heads, head_dim), where they differ
    ) -> None:
        self.states = states
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.device = torch.device(device)
        self.max_seqs = max_seqs
        self.max_model_len = max_model_len or num_blocks * block_size
        # A table never holds more blocks than the cache has, however long the context may be.
        self.max_blocks_per_seq = min(-(-self.max_model_len // block_size), num_blocks)
        self.kernel = kernel
        self._triton_kernel = _triton_attention().paged_attention_triton if kernel == "triton" else None
        shapes = layer_shapes or [(num_kv_heads, head_dim)] * num_layers
        widest = max((dim for _, dim in shapes), default=head_dim)
        self._native_attention = _native_kernel(self.device, dtype, widest) if kernel == "tailrace" else None
        if kernel not in ATTENTION_KERNELS:
            raise ValueError(f"unknown attention kernel {kernel!r}; known: {', '.join(ATTENTION_KERNELS)}")
        self.scale = head_dim**-0.5
        if len(set(shapes)) <= 1:
            self.k, self.v = new_pages(num_layers, num_blocks * block_size, num_kv_heads, head_dim, dtype, self.device)
        else:  # each layer its own pages (Gemma 4's global layers' wider heads): indexed by layer alike
            pages = [new_pages(1, num_blocks * block_size, heads, dim, dtype, self.device) for heads, dim in shapes]
            self.k, self.v = [k[0] for k, _ in pages], [v[0] for _, v in pages]
        self._allocate_metadata()
        self._batch: AttentionBatch | None = None
        self.metadata: PagedAttentionMetadata | None = None  # the current step's, read by every layer
        self._narrowed: tuple[AttentionBatch, PagedAttentionMetadata] | None = None  # narrow's, this step

    def _allocate_metadata(self) -> None:
        """One flat int32 buffer [loc | lens | tables] per side, so a step's metadata is one copy;
        the device side keeps its address for CUDA graphs. On CPU both sides are one tensor. The
        tables are stored block-major (entry j of every sequence, then entry j + 1), so a step
        sends the first (its longest table) x max_seqs entries, not max_model_len's worth."""
        size = 2 * self.max_seqs + 1 + self.max_seqs * self.max_blocks_per_seq
        on_cuda = self.device.type == "cuda"
        self._meta_device = torch.zeros(size, dtype=torch.int32, device=self.device)
        self._meta_host = torch.zeros(size, dtype=torch.int32, pin_memory=True) if on_cuda else self._meta_device
        self._host_views = [t.numpy() for t in self._split(self._meta_host)]  # written per step without tensors
        # Per row of the host tables: the (sequence, table version, blocks) written there, so an
        # unchanged row is not written again (most rows of most steps: a table grows a block every
        # block_size tokens).
        self._written: list[tuple[int, int | None, int] | None] = [None] * self.max_seqs
        # The device side's views, made once: three fewer ops in every step, each run cold after the
        # last step's weights went through the caches.
        self._device_views = self._split(self._meta_device)
        self._copied = torch.cuda.Event() if on_cuda else None

    @torch.inference_mode()
    def begin(self, batch: AttentionBatch) -> None:
        """Send the step's metadata to the device once; every layer's `attend` reads it."""
        if self.states is not None:
            self.states.begin(batch)
        seqs = batch.seqs
        if len(seqs) > self.max_seqs:
            raise RuntimeError(f"more than max_seqs={self.max_seqs} sequences in one step")
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copy may still be reading the host buffer
        used = self._fill_host_metadata(seqs)
        if self._copied is not None:
            self._meta_device[:used].copy_(self._meta_host[:used], non_blocking=True)
            self._copied.record()
        loc, lens, tables = self._device_views
        max_query_len = max((seq.q_len for seq in seqs), default=0)
        self.metadata = PagedAttentionMetadata(loc, lens, tables, self.block_size, max_query_len, len(seqs))
        self._batch, self._narrowed = batch, None

    @torch.inference_mode()
    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: AttentionBatch,
        how: LayerAttention | None = None, sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [T, H, D], k/v [T, kvH, D] -> [T, H, D]: store the new K/V, attend causally per sequence
        as `how` says (default: every position, at head_dim ** -0.5), with `sinks` [H] where it has
        them. k and v None: attend over the K/V a layer stored earlier in this step."""
        how = how or LayerAttention(self.scale)
        meta = self.step_metadata(batch)
        if k is not None:
            self.k[layer].index_copy_(0, batch.slot_mapping, k)
            self.v[layer].index_copy_(0, batch.slot_mapping, v)
        if self._native_attention is not None:
            return self._native_attention(q, self.k[layer], self.v[layer], meta.query_start_loc, meta.seq_lens,
                                          meta.block_tables, self.block_size, meta.num_seqs, how.scale,
                                          how.window or 0, how.softcap or 0.0, sinks)
        if self._triton_kernel is None:
            return paged_attention_reference(q, self.k[layer], self.v[layer], meta, how, sinks)
        if not plain_attention(how, self.head_dim):
            raise ValueError(f"the Triton attention kernel does not take {how}")
        out = q.new_empty(q.shape)
        self._triton_kernel(q, self.k[layer], self.v[layer], meta, out, self.scale)
        return out

    def step_metadata(self, batch: AttentionBatch) -> PagedAttentionMetadata:
        """The metadata `begin(batch)` sent, which every layer of this batch's forward reads (or
        that of the part of it `narrow` made)."""
        if self._narrowed is not None and batch is self._narrowed[0]:
            return self._narrowed[1]
        if self.metadata is None or batch is not self._batch:
            raise RuntimeError("PagedKVCache.begin(batch) must be called with this batch before the forward")
        return self.metadata

    def narrow(self, batch: AttentionBatch, rows: list[int]) -> AttentionBatch | None:
        """The step's batch with only `rows` (ascending) querying, for layers that read K/V
        stored earlier in the step and store none; None unless the rows each sequence keeps are
        the last of its chunk (a query's position is its place from its sequence's end)."""
        step = self.step_metadata(batch)
        kept, seqs, at = set(rows), [], 0
        for seq in batch.seqs:
            count = sum(1 for r in range(seq.q_start, seq.q_start + seq.q_len) if r in kept)
            if any(r not in kept for r in range(seq.q_start + seq.q_len - count, seq.q_start + seq.q_len)):
                return None
            seqs.append(dataclasses.replace(seq, q_start=at, q_len=count))
            at += count
        if at != len(rows):
            return None
        starts = torch.tensor([0] + [seq.q_start + seq.q_len for seq in seqs], dtype=torch.int32, device=self.device)
        part = AttentionBatch(seqs, batch.slot_mapping[torch.tensor(rows, dtype=torch.long, device=self.device)])
        self._narrowed = (part, dataclasses.replace(step, query_start_loc=starts,
                                                    max_query_len=max((seq.q_len for seq in seqs), default=0)))
        return part

    def release(self, key: int) -> None:
        """The sequence's state slot, where the model keeps states; no K/V is kept per sequence
        (its block table comes with every step)."""
        if self.states is not None:
            self.states.release(key)

    def _split(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        loc, lens, tables = flat.split([self.max_seqs + 1, self.max_seqs, self.max_seqs * self.max_blocks_per_seq])
        return loc, lens, tables.view(self.max_blocks_per_seq, self.max_seqs).t()

    def _fill_host_metadata(self, seqs: list[SeqSlice]) -> int:
        """Write the batch's metadata into the host buffer; returns how many leading entries are used."""
        loc, lens, tables = self._host_views
        ends = [0]
        longest = 0  # blocks in the longest table
        for i, seq in enumerate(seqs):
            if seq.q_start != ends[-1]:
                raise ValueError("the sequences' rows must be contiguous and in batch order")
            if seq.kv_len > self.max_model_len:
                raise ValueError(f"a sequence of {seq.kv_len} tokens is over max_model_len={self.max_model_len}")
            ends.append(seq.q_start + seq.q_len)
            blocks = -(-seq.kv_len // self.block_size)
            written = (seq.key, seq.table_version, blocks)
            if seq.table_version is None or self._written[i] != written:
                tables[i, :blocks] = seq.block_table[:blocks]
                self._written[i] = written
            longest = max(longest, blocks)
        # Slots past the batch are padding: no query rows (their start is the end) and no K/V.
        loc[: len(ends)] = ends
        loc[len(ends) :] = ends[-1]
        lens[: len(seqs)] = [seq.kv_len for seq in seqs]
        lens[len(seqs) :] = 0
        return 2 * self.max_seqs + 1 + longest * self.max_seqs
