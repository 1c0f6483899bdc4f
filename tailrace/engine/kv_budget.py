"""How many bytes the KV cache gets: `kv_cache_memory_gb`, or on CUDA with `gpu_memory_utilization`
what vLLM's flag of that name means: that fraction of the whole GPU, less this process's weights and
what one engine step needs for activations. Other processes' memory is not this server's to count,
but the fraction must be free when the server starts."""

from __future__ import annotations

from tailrace.engine.config import EngineConfig
from tailrace.model.decoder.config import ModelConfig

_GIB = 2**30
# CUDA graphs' memory pool, the Triton kernels' and the sampler's scratch, allocator slack: an
# allowance, not a measurement (vLLM profiles a dummy step instead).
_FIXED_RESERVE = 1 * _GIB


def activation_bytes(config: EngineConfig, mc: ModelConfig, dtype_bytes: int) -> int:
    """An upper estimate of one step's activations: every token's hidden states through attention
    and the MLP, and float32 logits (with the sampler's sorted copy) for every token, which prompt
    logprobs may ask for."""
    tokens = max(config.max_num_batched_tokens, config.max_num_seqs)
    per_token = (4 * mc.hidden_size + 3 * mc.intermediate_size) * dtype_bytes + 2 * mc.vocab_size * 4
    return tokens * per_token + _FIXED_RESERVE


def gpu_kv_cache_bytes(utilization: float, total: int, free_before_load: int, free_after_load: int,
                       activations: int) -> int:
    """The KV cache's share of `utilization * total`, given the GPU's free memory before and after
    this process loaded its weights. A clear error where the share is not free or holds nothing."""
    budget = utilization * total
    if budget > free_before_load:
        raise ValueError(f"--gpu-memory-utilization {utilization} asks for {budget / _GIB:.1f} GiB of the GPU's "
                         f"{total / _GIB:.1f} GiB, but only {free_before_load / _GIB:.1f} GiB were free at start; "
                         "lower it, or free the GPU")
    weights = free_before_load - free_after_load
    kv_bytes = int(budget - weights - activations)
    if kv_bytes <= 0:
        raise ValueError(f"--gpu-memory-utilization {utilization} ({budget / _GIB:.1f} GiB) leaves no room for the "
                         f"KV cache: the weights take {weights / _GIB:.1f} GiB and one step's activations about "
                         f"{activations / _GIB:.1f} GiB; raise it, or lower --max-num-batched-tokens")
    return kv_bytes


def fixed_kv_cache_bytes(config: EngineConfig) -> int:
    return int(config.kv_cache_memory_gb * _GIB)
