"""Megatron-style tensor parallelism of the Llama-family model: what part of each checkpoint tensor a
rank holds, and the three layers that join the parts again.

The split is vLLM's (and Megatron-LM's):
- column-parallel, output rows split: the fused qkv_proj by attention heads, gate_up_proj by
  intermediate rows; each rank computes its own heads and its own slice of the MLP, no communication;
- row-parallel, input columns split: o_proj and down_proj, each followed by one all-reduce;
- vocab-parallel: the embedding table and the LM head by vocabulary rows. The lookup is one
  all-reduce (a rank's rows outside its part are exact zeros, so the sum is exact), the logits one
  gather to rank 0, which samples.
KV heads are split like the query heads, so each rank's KV cache holds only its heads. When the
ranks outnumber the KV heads, each KV head is held by every rank whose query heads read it (vLLM
replicates them the same way). Norms and rotary tables are whole on every rank.

A rank reads only its part of each tensor: `take_part` indexes a safetensors slice
(`safe_open(...).get_slice(name)`) or a tensor the same way. The model itself is built from
`local_config`, so its modules have the rank's shapes and the loader fills them unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tailrace.model.decoder import registry
from tailrace.model.decoder.config import ModelConfig
from tailrace.model.decoder.llama import Linear, LlamaForCausalLM, Module


@dataclass(frozen=True, slots=True)
class Shard:
    rank: int
    size: int


def check_shardable(config: ModelConfig, size: int) -> None:
    """ValueError naming the dimension that `size` ranks cannot split."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    # what each rank cannot compute from its own heads, or what the checkpoint stores fused
    unsplit = {"a mixture of experts": config.num_experts > 0,
               "q/k norms over all heads at once": config.qk_norm_over_heads,
               "Gated DeltaNet layers": bool(config.gated_delta_layers),
               "per-layer attention shapes, shared K/V or per-layer inputs (Gemma 4's)":
                   not config.uniform_attention or config.per_layer_input_size > 0,
               "q/k/v and gate/up stored fused": registry.architecture(config.architecture).stored_fused}
    for what, present in unsplit.items():
        if present and size > 1:
            raise ValueError(f"tensor_parallel_size {size}: {config.architecture} has {what}, which is not split "
                             "across ranks yet")
    if heads % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide the model's {heads} attention heads")
    if kv_heads % size and size % kv_heads:
        raise ValueError(f"tensor_parallel_size {size} and the model's {kv_heads} KV heads do not divide one "
                         "another, so the KV heads can be neither split nor replicated evenly")
    if config.intermediate_size % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide the model's intermediate size "
                         f"{config.intermediate_size}")


def vocab_rows(vocab_size: int, size: int) -> int:
    """Vocabulary rows per rank; the last rank's part is padded with zero rows to this many."""
    return -(-vocab_size // size)


def local_config(config: ModelConfig, shard: Shard) -> ModelConfig:
    """The shape of one rank's model: its heads, its KV heads, its MLP slice and its vocabulary rows."""
    return dataclasses.replace(
        config,
        num_attention_heads=config.num_attention_heads // shard.size,
        num_key_value_heads=max(1, config.num_key_value_heads // shard.size),
        intermediate_size=config.intermediate_size // shard.size,
        vocab_size=vocab_rows(config.vocab_size, shard.size),
    )


def part(name: str, config: ModelConfig, shard: Shard) -> tuple[int, int, int] | None:
    """(dimension, start, stop) of the checkpoint tensor `name` that `shard` holds; None: all of it."""
    kind = name.rpartition(".")[2]
    projection = name.rpartition(".")[0].rpartition(".")[2]
    local = local_config(config, shard)
    d = config.head_dim
    if projection == "q_proj":
        heads = local.num_attention_heads
        return 0, shard.rank * heads * d, (shard.rank + 1) * heads * d
    if projection in ("k_proj", "v_proj"):
        first = shard.rank * config.num_key_value_heads // shard.size  # replicated ones repeat
        return 0, first * d, (first + local.num_key_value_heads) * d
    if projection == "o_proj":
        heads = local.num_attention_heads
        return 1, shard.rank * heads * d, (shard.rank + 1) * heads * d
    size = local.intermediate_size
    if projection in ("gate_proj", "up_proj"):
        return 0, shard.rank * size, (shard.rank + 1) * size
    if projection == "down_proj":
        return 1, shard.rank * size, (shard.rank + 1) * size
    if name in ("model.embed_tokens.weight", "lm_head.weight") and kind == "weight":
        rows = local.vocab_size
        return 0, shard.rank * rows, min((shard.rank + 1) * rows, config.vocab_size)
    return None


def take_part(source: Any, name: str, config: ModelConfig, shard: Shard) -> torch.Tensor:
    """`shard`'s part of `source`, a safetensors slice or a tensor (both index the same way); vocabulary
    parts are padded with zero rows, so every rank's part has one shape."""
    where = part(name, config, shard)
    if where is None:
        return source[:]
    dim, start, stop = where
    tensor = source[start:stop] if dim == 0 else source[:, start:stop]
    rows = vocab_rows(config.vocab_size, shard.size)
    if name in ("model.embed_tokens.weight", "lm_head.weight") and tensor.shape[0] < rows:
        tensor = F.pad(tensor, (0, 0, 0, rows - tensor.shape[0]))
    return tensor


def shard_tensors(tensors: Iterable[tuple[str, Any]], config: ModelConfig, shard: Shard
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """Each (name, slice or tensor) as (name, the rank's part), read one at a time."""
    for name, source in tensors:
        yield name, take_part(source, name, config, shard)


class RowParallel(Module):
    """A row-parallel projection: each rank multiplies its input columns, one all-reduce sums them."""

    def __init__(self, inner: Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)
        dist.all_reduce(out)
        return out


class VocabParallelEmbedding(Module):
    """The lookup over vocabulary rows split by rank: ids outside this rank's rows read zeros, and one
    all-reduce adds the one rank that holds each id to the zeros of the others."""

    def __init__(self, weight: torch.nn.Parameter, shard: Shard) -> None:
        super().__init__()
        self.weight = weight
        self.start = shard.rank * weight.shape[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        h = F.embedding(local.masked_fill(outside, 0), self.weight)
        h.masked_fill_(outside.unsqueeze(-1), 0.0)
        dist.all_reduce(h)
        return h


class GatheredLogits(Module):
    """The vocab-parallel LM head: each rank's logits for its rows, gathered once on rank 0 (which
    samples); the other ranks get their own part back and drop it."""

    def __init__(self, inner: Module, vocab_size: int, shard: Shard) -> None:
        super().__init__()
        self.inner = inner
        self.vocab_size = vocab_size
        self.shard = shard

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = self.inner(hidden).contiguous()
        if self.shard.rank != 0:
            dist.gather(local, None, dst=0)
            return local
        parts = [torch.empty_like(local) for _ in range(self.shard.size)]
        dist.gather(local, parts, dst=0)
        return torch.cat(parts, dim=-1)[:, : self.vocab_size]


def parallelize(model: LlamaForCausalLM, vocab_size: int, shard: Shard) -> None:
    """Put the collectives into a model built from `local_config` and loaded with its parts, in place:
    before packing or quantizing, which replace the Linear modules inside these wrappers."""
    embed = model.model.embed_tokens
    if model.lm_head is None:  # tied: the head reads this rank's rows of the embedding table
        head = Linear(embed.weight.shape[1], embed.weight.shape[0], False, embed.weight.dtype)
        head.weight = embed.weight
        model.lm_head = head
    model.lm_head = GatheredLogits(model.lm_head, vocab_size, shard)
    model.model.embed_tokens = VocabParallelEmbedding(embed.weight, shard)
    for layer in model.model.layers:
        layer.self_attn.o_proj = RowParallel(layer.self_attn.o_proj)
        layer.mlp.down_proj = RowParallel(layer.mlp.down_proj)
