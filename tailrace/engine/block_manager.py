"""KV memory accounted in fixed-size blocks, with prefix caching by chained block hashes.

A freed block keeps its hash and contents until it is handed out again, so a later request
with the same prefix finds it (least recently freed blocks are reused first). For a model whose
layers also keep a state per sequence (a hybrid's Gated DeltaNet), a cached prefix is only as
long as the last of its blocks whose end state the state cache keeps (`state_kept`), and each
step asks it to keep the state at the last block boundary a sequence's chunk reaches
(`state_boundary`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from tailrace.engine.sequence import Sequence


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = ()


def chain_hash(parent: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent, token_ids))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 state_kept: Callable[[int], bool] | None = None) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.state_kept = state_kept  # a hybrid's: whether the state at a block's end (by its hash) is kept
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks that `seq` must gain to hold `num_tokens` tokens in total."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def match_prefix(self, seq: Sequence) -> None:
        """Give a sequence that starts from nothing the cached blocks of its longest cached prefix."""
        # Prompt logprobs and pooling need every prompt row computed, so neither reuses cached ones.
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None or seq.params.pooling is not None:
            return
        bs = self.block_size
        # Keep at least one token to compute: the step that finishes the prompt must produce logits.
        full = (seq.num_tokens - 1) // bs
        parent: int | None = None
        found: list[tuple[int, int]] = []  # (block id, hash) of each block of the longest cached prefix
        for i in range(full):
            tokens = tuple(seq.token_slice(i * bs, (i + 1) * bs))
            h = chain_hash(parent, tokens)
            block_id = self.cached.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            found.append((block_id, h))
            parent = h
        if self.state_kept is not None:  # back to the last block whose end state is kept
            while found and not self.state_kept(found[-1][1]):
                found.pop()
            seq.state_key = found[-1][1] if found else None
        for block_id, h in found:
            self._take(block_id)
            seq.block_table.append(block_id)
            seq.table_version += 1
            seq.block_hashes.append(h)
        seq.num_computed_tokens = len(seq.block_table) * bs
        seq.num_cached_tokens = seq.num_computed_tokens

    def state_boundary(self, seq: Sequence, num_new_tokens: int) -> tuple[int, int] | None:
        """For a hybrid with prefix caching: the last block boundary that `seq`'s next
        `num_new_tokens` reach (a position past its computed ones), with the chained hash of the
        block ending there, whose state the step keeps; None where there is none."""
        if not self.enable_prefix_caching or self.state_kept is None:
            return None
        bs = self.block_size
        end = (seq.num_computed_tokens + num_new_tokens) // bs
        if end * bs <= seq.num_computed_tokens:
            return None
        h = seq.block_hashes[-1] if seq.block_hashes else None
        for i in range(len(seq.block_hashes), end):
            h = chain_hash(h, tuple(seq.token_slice(i * bs, (i + 1) * bs)))
        return end * bs, h

    def record_lookup(self, seq: Sequence) -> None:
        self.prefix_cache_queries += seq.num_prompt_tokens
        self.prefix_cache_hits += min(seq.num_cached_tokens, seq.num_prompt_tokens)

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow `seq`'s block table to hold `num_tokens` tokens; False (and no change) if memory is short."""
        need = self.blocks_needed(seq, num_tokens)
        if need > len(self.free):
            return False
        for _ in range(need):
            block_id = next(iter(self.free))
            block = self.blocks[block_id]
            if block.hash is not None and self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]
            block.hash, block.token_ids = None, ()
            self._take(block_id)
            seq.block_table.append(block_id)
            seq.table_version += 1
        return True

    def register_full_blocks(self, seq: Sequence) -> None:
        """Publish the hashes of blocks that the last step filled, so later requests can reuse them."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        full = seq.num_computed_tokens // bs
        while len(seq.block_hashes) < full:
            i = len(seq.block_hashes)
            tokens = tuple(seq.token_slice(i * bs, (i + 1) * bs))
            h = chain_hash(seq.block_hashes[-1] if seq.block_hashes else None, tokens)
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if block.hash is None:
                block.hash, block.token_ids = h, tokens
                self.cached.setdefault(h, block.block_id)

    def release(self, seq: Sequence) -> None:
        # Tail blocks go to the free list first, so they are reused before the shared prefixes.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
        seq.block_table.clear()
        seq.table_version += 1
        seq.block_hashes.clear()
        seq.num_computed_tokens = 0
        seq.state_key = None

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1
