"""Parity with `transformers` for each supported architecture, through the paged KV cache."""

from __future__ import annotations

import pytest
import torch
import transformers

from tailrace.model.attention.kv_cache import AttentionBatch, KVCache, SeqSlice, plain_attention
from tailrace.model.attention.paged import PagedKVCache
from tailrace.model.attention.state_cache import StateCache
from tailrace.model.decoder.llama import state_shape
from tailrace.model.loading.loader import load_model

BLOCK_SIZE = 4
NUM_BLOCKS = 64
ATOL = 1e-4
SMALL = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=256,
    max_position_embeddings=256,
    head_dim=16,
)
_HYBRID = dict(layer_types=["linear_attention", "full_attention"], linear_key_head_dim=16, linear_value_head_dim=8,
               linear_num_key_heads=2, linear_num_value_heads=4)
ARCHITECTURES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "llama3_rope": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
            rope_theta=500000.0,
        ),
    ),
    "llama_tied": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(tie_word_embeddings=True)),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {}),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {}),
    # What a GGUF cannot say (tests/e2e/test_architectures.py serves the rest): NoPE layers other
    # than every 4th, a query scale other than head_dim's, any sliding pattern, a window for every
    # layer of a Mistral.
    "smollm3": (transformers.SmolLM3Config, transformers.SmolLM3ForCausalLM,
                dict(no_rope_layers=[0, 1], pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM,
               dict(sliding_window=5, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                    final_logit_softcapping=3.0)),
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM,
               dict(sliding_window=5, query_pre_attn_scalar=24, layer_types=["full_attention", "sliding_attention"])),
    "gemma3_multimodal": (lambda **kwargs: _gemma3_multimodal(**kwargs), transformers.Gemma3ForConditionalGeneration,
                          dict(sliding_window=5, query_pre_attn_scalar=24,
                               layer_types=["sliding_attention", "full_attention"])),
    "mistral_window": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(sliding_window=6)),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM,  # half of each head turns; a window
             dict(partial_rotary_factor=0.5, sliding_window=7, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,  # layer 1 dense
                  dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[1],
                       norm_topk_prob=True)),
    "qwen3_moe_unnormalised": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                               dict(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=32,
                                    norm_topk_prob=False)),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                dict(num_local_experts=4, num_experts_per_tok=2)),
    "granite": (transformers.GraniteConfig, transformers.GraniteForCausalLM,
                dict(embedding_multiplier=3.0, residual_multiplier=0.3, attention_multiplier=0.1, logits_scaling=2.5)),
    "olmo2": (transformers.Olmo2Config, transformers.Olmo2ForCausalLM,  # norms after, q/k normed over all heads
              dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # sinks, biases everywhere, YaRN, alternate windows, the top k's own softmax, a capped SwiGLU
    "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM,
                dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=5, swiglu_limit=0.5,
                     rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                      "truncate": False, "original_max_position_embeddings": 32,
                                      "rope_theta": 150000.0})),
    # Gated DeltaNet layers (v heads twice the q/k heads) beside gated attention with a quarter of
    # each head turning; Qwen3-Next and Qwen3.5-MoE add a shared expert to the experts
    "qwen3_5": (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM, _HYBRID),
    # Qwen3.5 as its checkpoints ship: the text model inside an image-text one (model.visual not read)
    "qwen3_5_multimodal": (lambda **kwargs: _qwen3_5_multimodal(**kwargs), transformers.Qwen3_5ForConditionalGeneration,
                           _HYBRID),
    "qwen3_5_moe": (transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM,
                    dict(_HYBRID, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                         shared_expert_intermediate_size=48)),
    "qwen3_next": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM,
                   dict(_HYBRID, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        shared_expert_intermediate_size=48, mlp_only_layers=[1])),
}


def _gemma3_multimodal(**text) -> transformers.Gemma3Config:
    """Gemma 3 as its 4B-27B checkpoints ship: the text model inside an image-text one."""
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    return transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                     image_token_index=255, boi_token_index=253, eoi_token_index=254)


def _qwen3_5_multimodal(initializer_range: float, **text) -> transformers.Qwen3_5Config:
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16)
    return transformers.Qwen3_5Config(text_config=dict(text, initializer_range=initializer_range), vision_config=vision,
                                      image_token_id=250, video_token_id=251, vision_start_token_id=252,
                                      vision_end_token_id=253)


def _randomize(model: torch.nn.Module) -> None:
    """Default init leaves biases at 0 and norm scales at 1 (Gemma's at 0: it scales by 1 + w),
    which would hide loading mistakes."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
                if model.config.model_type.startswith(("gemma", "qwen3_5", "qwen3_next")):  # scales by 1 + w
                    param.sub_(1.0)
            elif name.endswith("bias") or name.endswith("sinks"):
                param.normal_(0.0, 0.1 if name.endswith("bias") else 1.0)


def _save_checkpoint(root, name: str):
    config_cls, model_cls, extra = ARCHITECTURES[name]
    torch.manual_seed(0)
    config = config_cls(**SMALL, **extra, initializer_range=0.1)
    config._attn_implementation = "eager"  # Gemma 2's soft cap is eager's alone
    model = model_cls(config).float().eval()
    _randomize(model)
    path = root / name
    model.save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {name: _save_checkpoint(root, name) for name in ARCHITECTURES}


class Runner:
    """Drives the model the way the engine does: sequential block tables, one flat batch per step;
    through the slab (KVCache) where the model's attention is plain, else over the pages."""

    def __init__(self, path) -> None:
        self.model, self.config = load_model(str(path), dtype="float32")
        c = self.config
        plain = all(plain_attention(layer.self_attn.how, c.head_dim) for layer in self.model.model.layers
                    if layer.self_attn is not None)
        self.cache = (KVCache if plain else PagedKVCache)(
            len(c.attention_layers), c.num_key_value_heads, c.head_dim, NUM_BLOCKS, BLOCK_SIZE, torch.float32,
            states=state_cache(c))
        self.next_block = 0
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}

    def adopt(self, key: int, block_table: list[int], kv_len: int) -> None:
        """Start `key` with K/V already in the pages (a prefix-cache hit or a resume)."""
        self.tables[key] = list(block_table)
        self.lengths[key] = kv_len

    def step(self, work: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        seqs, slots, positions, ids = [], [], [], []
        for key, tokens in work:
            past = self.lengths.get(key, 0)
            kv_len = past + len(tokens)
            table = self.tables.setdefault(key, [])
            while len(table) * BLOCK_SIZE < kv_len:
                table.append(self.next_block)
                self.next_block += 1
            seqs.append(SeqSlice(key, len(ids), len(tokens), kv_len, list(table)))
            for pos in range(past, kv_len):
                slots.append(table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
            positions += range(past, kv_len)
            ids += tokens
            self.lengths[key] = kv_len
        batch = AttentionBatch(seqs, torch.tensor(slots, dtype=torch.int64))
        self.cache.begin(batch)
        hidden = self.model(torch.tensor(ids), torch.tensor(positions), batch, self.cache)
        logits = self.model.compute_logits(hidden)
        return [logits[s.q_start : s.q_start + s.q_len] for s in seqs]

    def release(self, key: int) -> None:
        self.cache.release(key)
        del self.lengths[key]
        del self.tables[key]


def state_cache(c, max_seqs: int = 64) -> StateCache | None:
    """A hybrid's state cache, as the runner makes it; None for a model without one."""
    if not c.gated_delta_layers:
        return None
    return StateCache(len(c.gated_delta_layers), state_shape(c), max_seqs, torch.float32, torch.device("cpu"))


def reference_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].float()


PROMPT = [5, 17, 200, 3, 99, 42, 7, 128, 64, 1, 250, 33, 12]
CONTINUATION = [8, 77, 150, 2, 31, 190]


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_prefill_then_decode_matches_transformers(checkpoints, name):
    path, hf_model = checkpoints[name]
    expected = reference_logits(hf_model, PROMPT + CONTINUATION)
    runner = Runner(path)
    got = [runner.step([(0, PROMPT)])[0]]
    for token in CONTINUATION:
        got.append(runner.step([(0, [token])])[0])
    torch.testing.assert_close(torch.cat(got), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma3", "gemma2", "qwen3_5"])
def test_chunked_prefill_matches_transformers(checkpoints, name):
    path, hf_model = checkpoints[name]
    expected = reference_logits(hf_model, PROMPT + CONTINUATION[:1])
    runner = Runner(path)
    chunks = [PROMPT[:5], PROMPT[5:11], PROMPT[11:]]
    got = [runner.step([(0, chunk)])[0] for chunk in chunks]
    got.append(runner.step([(0, CONTINUATION[:1])])[0])
    torch.testing.assert_close(torch.cat(got), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["llama", "qwen3_5"])  # a hybrid: each sequence's state is its own
def test_prefill_and_decode_in_one_batch_match_running_alone(checkpoints, name):
    path, _ = checkpoints[name]
    other_prompt = [9, 8, 7, 6, 5, 4, 3]
    alone = Runner(path)
    alone.step([(0, PROMPT)])
    decode_alone = alone.step([(0, CONTINUATION[:1])])[0]
    prefill_alone = alone.step([(1, other_prompt)])[0]

    mixed = Runner(path)
    mixed.step([(0, PROMPT)])
    decode_mixed, prefill_mixed = mixed.step([(0, CONTINUATION[:1]), (1, other_prompt)])
    torch.testing.assert_close(decode_mixed, decode_alone, atol=ATOL, rtol=0)
    torch.testing.assert_close(prefill_mixed, prefill_alone, atol=ATOL, rtol=0)


def test_hybrid_refuses_to_resume_without_its_state(checkpoints):
    """The state of a prefix is not in the K/V pages: a sequence cannot start past position 0
    without the slot it computed in."""
    path, _ = checkpoints["qwen3_5"]
    runner = Runner(path)
    runner.step([(0, PROMPT)])
    table, kv_len = runner.tables[0], runner.lengths[0]
    runner.release(0)
    runner.adopt(0, table, kv_len)
    with pytest.raises(RuntimeError, match="without its recurrent state"):
        runner.step([(0, CONTINUATION[:1])])


def test_prefix_cache_hit_reads_shared_blocks_from_pages(checkpoints):
    path, hf_model = checkpoints["llama"]
    shared = 2 * BLOCK_SIZE
    tail = [60, 61, 62]
    expected = reference_logits(hf_model, PROMPT[:shared] + tail + CONTINUATION[:1])
    runner = Runner(path)
    runner.step([(0, PROMPT)])
    runner.adopt(1, runner.tables[0][:2], shared)
    got = [runner.step([(1, tail)])[0], runner.step([(1, CONTINUATION[:1])])[0]]
    torch.testing.assert_close(torch.cat(got), expected[shared:], atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["llama", "qwen3_5"])  # a hybrid's released slot starts from zero
def test_release_then_prefill_again_gives_same_logits(checkpoints, name):
    path, _ = checkpoints[name]
    runner = Runner(path)
    first = runner.step([(0, PROMPT)])[0]
    runner.step([(0, CONTINUATION[:2])])
    runner.release(0)
    again = runner.step([(0, PROMPT)])[0]
    torch.testing.assert_close(again, first, atol=ATOL, rtol=0)


def test_resume_after_release_continues_from_pages(checkpoints):
    path, hf_model = checkpoints["llama"]
    expected = reference_logits(hf_model, PROMPT + CONTINUATION)
    runner = Runner(path)
    runner.step([(0, PROMPT)])
    runner.step([(0, CONTINUATION[:1])])
    table, kv_len = runner.tables[0], runner.lengths[0]
    runner.release(0)
    runner.adopt(0, table, kv_len)
    got = runner.step([(0, CONTINUATION[1:3])])[0]
    torch.testing.assert_close(got, expected[kv_len : kv_len + 2], atol=ATOL, rtol=0)


def test_decode_past_initial_mirror_capacity_matches_transformers(checkpoints):
    path, hf_model = checkpoints["llama"]
    tokens = [(i * 37) % 256 for i in range(40)]
    expected = reference_logits(hf_model, tokens)
    runner = Runner(path)
    got = [runner.step([(0, tokens[:3])])[0]]
    got += [runner.step([(0, [t])])[0] for t in tokens[3:]]
    torch.testing.assert_close(torch.cat(got), expected, atol=ATOL, rtol=0)
