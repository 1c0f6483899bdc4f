"""Which part of each checkpoint tensor a tensor-parallel rank holds: the parts put back together
are the whole tensor, and KV heads are replicated when the ranks outnumber them."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from architectures import tiny
from tailrace.model.decoder.config import parse_model_config
from tailrace.model.loading.tp_shard import Shard, check_shardable, local_config, part, take_part

RAW = tiny("llama", vocab_size=259, head_dim=16)  # a vocabulary that 2 and 4 ranks do not divide
CONFIG = parse_model_config(RAW)
L0 = "model.layers.0"


def parts(name: str, whole: torch.Tensor, size: int, config=CONFIG) -> list[torch.Tensor]:
    return [take_part(whole, name, config, Shard(rank, size)) for rank in range(size)]


@pytest.mark.parametrize("name, dim", [(f"{L0}.self_attn.q_proj.weight", 0), (f"{L0}.self_attn.k_proj.weight", 0),
                                       (f"{L0}.self_attn.v_proj.weight", 0), (f"{L0}.mlp.gate_proj.weight", 0),
                                       (f"{L0}.mlp.up_proj.weight", 0), (f"{L0}.self_attn.o_proj.weight", 1),
                                       (f"{L0}.mlp.down_proj.weight", 1)])
def test_column_and_row_parallel_parts_join_into_the_whole(name, dim):
    rows = {"q_proj": 64, "k_proj": 32, "v_proj": 32, "gate_proj": 128, "up_proj": 128, "o_proj": 64,
            "down_proj": 64}[name.split(".")[-2]]
    cols = {"o_proj": 64, "down_proj": 128}.get(name.split(".")[-2], 64)
    whole = torch.randn(rows, cols)
    assert torch.equal(torch.cat(parts(name, whole, 2), dim=dim), whole)


def test_norms_are_whole_on_every_rank():
    whole = torch.randn(64)
    assert all(torch.equal(p, whole) for p in parts(f"{L0}.input_layernorm.weight", whole, 2))


def test_vocabulary_parts_are_padded_to_one_shape_and_join_into_the_whole():
    whole = torch.randn(259, 64)
    embed = parts("model.embed_tokens.weight", whole, 2)
    assert [p.shape[0] for p in embed] == [130, 130]
    assert torch.equal(torch.cat(embed)[:259], whole)
    assert not embed[1][-1].any()  # the padding row is zeros


def test_kv_heads_are_replicated_when_the_ranks_outnumber_them():
    config = dataclasses.replace(CONFIG, num_key_value_heads=1)
    whole = torch.randn(16, 64)
    k = parts(f"{L0}.self_attn.k_proj.weight", whole, 2, config)
    assert torch.equal(k[0], whole) and torch.equal(k[1], whole)
    assert local_config(config, Shard(1, 2)).num_key_value_heads == 1


def test_each_rank_reads_the_kv_head_its_query_heads_use():
    config = dataclasses.replace(CONFIG, num_attention_heads=8, num_key_value_heads=2)  # groups of 4
    assert [part(f"{L0}.self_attn.k_proj.weight", config, Shard(r, 4))[1:] for r in range(4)] == \
        [(0, 16), (0, 16), (16, 32), (16, 32)]


def test_a_safetensors_slice_reads_the_same_part_as_a_tensor(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    name = f"{L0}.self_attn.o_proj.weight"
    whole = torch.randn(64, 64)
    save_file({name: whole}, tmp_path / "m.safetensors")
    with safe_open(tmp_path / "m.safetensors", framework="pt") as f:
        assert torch.equal(take_part(f.get_slice(name), name, CONFIG, Shard(1, 2)), whole[:, 32:])


def test_local_config_holds_the_ranks_share():
    local = local_config(CONFIG, Shard(0, 2))
    assert (local.num_attention_heads, local.num_key_value_heads, local.intermediate_size, local.vocab_size) == \
        (2, 1, 64, 130)
    assert local.head_dim == CONFIG.head_dim


@pytest.mark.parametrize("changes, word", [(dict(num_attention_heads=6, num_key_value_heads=6, head_dim=16),
                                            "attention heads"),
                                           (dict(num_attention_heads=12, num_key_value_heads=3), "KV heads"),
                                           (dict(intermediate_size=130), "intermediate")])
def test_a_size_the_model_cannot_split_is_named(changes, word):
    with pytest.raises(ValueError, match=word):
        check_shardable(dataclasses.replace(CONFIG, **changes), 4)


@pytest.mark.parametrize("changes, word", [(dict(num_experts=8), "mixture of experts"),
                                           (dict(qk_norm_over_heads=True), "norms over all heads"),
                                           (dict(architecture="Phi3ForCausalLM"), "stored fused")])
def test_what_ranks_cannot_split_yet_is_named_with_the_architecture(changes, word):
    config = dataclasses.replace(CONFIG, **changes)
    with pytest.raises(ValueError, match=f"{config.architecture} has .*{word}"):
        check_shardable(config, 2)
    check_shardable(config, 1)
