"""A snapshot of the engine's load and memory, sent with every batch of outputs."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    num_total_blocks: int = 0
    num_free_blocks: int = 0
    kv_usage: float = 0.0  # 0..1 of KV blocks in use
    prefix_cache_queries: int = 0  # prompt tokens looked up, cumulative
    prefix_cache_hits: int = 0  # of those, found cached
    num_preemptions: int = 0
    # Speculative decoding, cumulative (speculation/speculator.SpecStats)
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)
