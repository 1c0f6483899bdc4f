"""The whole forward in one kernel call (cpu_ops.FusedForward, csrc/decoder.cpp) against the
per-module path it replaces: the same bits, hidden states and stored K/V, for prefills, decode
rows and mixed batches, and the cases where it must not run."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from architectures import tiny
from gguf_writer import write_gguf
from hypothesis import given, settings
from hypothesis import strategies as st

from tailrace.model import backends

from tailrace.model.attention.kv_cache import AttentionBatch, KVCache, SeqSlice
from tailrace.model.attention.paged import PagedKVCache
from tailrace.model.cpu import bf16_linear, int_linear, ops as cpu_ops
from tailrace.model.decoder.config import parse_model_config
from tailrace.model.decoder.layer_plan import NORMS, Step
from tailrace.model.decoder.llama import LlamaForCausalLM
from tailrace.model.loading.loader import load_model
from tailrace.model.quant import linear_for, quantize_int4, quantize_int8, quantize_model

pytestmark = pytest.mark.skipif(not bf16_linear.available(), reason="no tailrace CPU kernels here")

needs_int_kernel = pytest.mark.skipif(not int_linear.available(), reason="no integer kernel here")

BLOCK_SIZE, NUM_BLOCKS = 16, 24
CPU = torch.device("cpu")

# (sequence, tokens already cached, new tokens) per step: prefills of several sequences, their
# decode rows, then chunks after cached tokens batched with decode rows.
STEPS = [
    [(0, 0, 20), (1, 0, 35), (2, 0, 7)],
    [(0, 20, 1), (1, 35, 1), (2, 7, 1)],
    [(0, 21, 1), (3, 0, 18), (1, 36, 1), (2, 8, 9)],
    [(3, 18, 5), (0, 22, 1), (2, 17, 1)],
]


# What sets each architecture apart, where it bites in STEPS (sequences of up to 41 tokens).
FEATURES = {
    "smollm3": {"no_rope_layers": [1, 0, 1]},
    "gemma2": {"sliding_window": 12, "query_pre_attn_scalar": 48, "attn_logit_softcapping": 2.0,
               "hidden_activation": "gelu_pytorch_tanh"},
    "gemma3": {"sliding_window": 17, "query_pre_attn_scalar": 64, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
                    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                    "hidden_activation": "gelu_pytorch_tanh"},
    "mistral": {"sliding_window": 9},
    "phi3": {"partial_rotary_factor": 0.5},
    "granite": {"embedding_multiplier": 3.0, "residual_multiplier": 0.3, "attention_multiplier": 0.1},
    "olmo2": {},  # norms after each block, q/k normed over all heads
    "qwen3_moe": {"num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "mlp_only_layers": [1],
                  "norm_topk_prob": True},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},  # float32 weights
    "gpt_oss": {"num_local_experts": 5, "num_experts_per_tok": 2, "sliding_window": 11, "swiglu_limit": 0.5,
                "attention_bias": True},  # sinks, biases, the top k's own softmax, gpt-oss's gate
}


def random_model(model_type: str, seed: int = 0, quantization: str | None = None, tied: bool = False,
                 huge_pages: bool = True, dtype: torch.dtype = torch.bfloat16) -> LlamaForCausalLM:
    """A 3-layer model of `model_type` (qwen2: q/k/v biases, qwen3: q/k norms, the others' FEATURES)
    with random weights, its norms and biases away from 1 and 0, quantized and prepared as the
    engine does. Tied and unquantized, its lookups read the packed head (PackedEmbedding)."""
    config = parse_model_config({
        **tiny(model_type), "vocab_size": 300, "hidden_size": 256, "intermediate_size": 320,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "tie_word_embeddings": tied,
        **FEATURES.get(model_type, {}),
    })
    model = LlamaForCausalLM(config, dtype)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(torch.rand(param.shape, generator=g) + 0.5)
            elif name.endswith("bias"):
                param.copy_(torch.randn(param.shape, generator=g) * 0.1)
            else:
                param.copy_(torch.randn(param.shape, generator=g) * 0.06)
    if quantization is not None:
        quantize_model(model, quantization)
    backends.prepare(model, CPU, quantization, huge_pages)
    return model


def new_cache(model: LlamaForCausalLM) -> PagedKVCache:
    c = model.config
    return PagedKVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, NUM_BLOCKS, BLOCK_SIZE,
                        model.dtype, max_seqs=8, kernel="tailrace")


def run_step(model: LlamaForCausalLM, cache: PagedKVCache, step: list[tuple[int, int, int]],
             rows: list[int] | None = None) -> torch.Tensor:
    """The hidden states of one flat batch (of `rows` only, if given); sequence s owns every 4th
    block from s, so no table is in physical order, and token ids follow from the sequence and
    position."""
    seqs, slots, ids, positions = [], [], [], []
    for seq, past, new in step:
        table = list(range(seq, NUM_BLOCKS, 4))
        seqs.append(SeqSlice(seq, len(ids), new, past + new, table))
        for pos in range(past, past + new):
            slots.append(table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
            ids.append((37 * seq + 11 * pos) % model.config.vocab_size)
            positions.append(pos)
    batch = AttentionBatch(seqs, torch.tensor(slots))
    cache.begin(batch)
    return model(torch.tensor(ids), torch.tensor(positions), batch, cache, rows)


@pytest.mark.parametrize("model_type, quantization, tied, dtype", [
    ("llama", None, False, torch.bfloat16), ("qwen2", None, False, torch.bfloat16),
    ("qwen3", None, False, torch.bfloat16), ("llama", None, True, torch.bfloat16),
    ("llama", None, False, torch.float32), ("qwen2", None, False, torch.float32), ("qwen3", None, True, torch.float32),
    pytest.param("llama", "int8", False, torch.bfloat16, marks=needs_int_kernel),
    pytest.param("qwen2", "int4", False, torch.bfloat16, marks=needs_int_kernel),
    pytest.param("llama", "int4", True, torch.bfloat16, marks=needs_int_kernel),
    ("smollm3", None, False, torch.bfloat16), ("smollm3", None, True, torch.float32),
    ("gemma2", None, True, torch.bfloat16), ("gemma2", None, True, torch.float32),
    ("gemma3", None, True, torch.bfloat16), ("gemma3", None, False, torch.float32),
    ("mistral", None, False, torch.float32), ("phi3", None, False, torch.bfloat16),
    pytest.param("gemma3", "int4", True, torch.bfloat16, marks=needs_int_kernel),
    ("granite", None, False, torch.bfloat16), ("granite", None, True, torch.float32),
    ("olmo2", None, False, torch.bfloat16), ("olmo2", None, False, torch.float32),
    ("qwen3_moe", None, False, torch.bfloat16), ("qwen3_moe", None, True, torch.float32),
    ("mixtral", None, False, torch.bfloat16), ("gpt_oss", None, False, torch.bfloat16),
    ("gpt_oss", None, False, torch.float32),
    pytest.param("qwen3_moe", "int4", False, torch.bfloat16, marks=needs_int_kernel),
    pytest.param("gpt_oss", "int8", False, torch.bfloat16, marks=needs_int_kernel),
])
def test_one_call_gives_the_per_module_bits_for_prefill_decode_and_mixed_batches(model_type, quantization, tied, dtype):
    model = random_model(model_type, quantization=quantization, tied=tied, dtype=dtype)
    assert isinstance(model.model.embed_tokens, bf16_linear.PackedEmbedding) == (tied and quantization is None)
    assert_one_call_gives_the_per_module_bits(model)


def assert_one_call_gives_the_per_module_bits(model: LlamaForCausalLM) -> None:
    fused = model.model.fused_forward
    assert isinstance(fused, cpu_ops.FusedForward)
    fused_cache, module_cache = new_cache(model), new_cache(model)
    for step in STEPS:
        got = run_step(model, fused_cache, step)
        model.model.fused_forward = None
        expected = run_step(model, module_cache, step)
        model.model.fused_forward = fused
        assert torch.equal(got, expected)
        assert torch.equal(fused_cache.k, module_cache.k) and torch.equal(fused_cache.v, module_cache.v)


@needs_int_kernel
@pytest.mark.parametrize("grouped", [False, True], ids=["per row", "per 32 inputs"])
def test_lookups_in_a_tied_int8_heads_codes_give_the_per_module_bits(grouped):
    """The table held only as its head's codes (int_linear.IntEmbedding: a GGUF's Q8_0 has a scale
    per 32 inputs, --quantization int8 one per row), Gemma's multiplier applied after the lookup."""
    model = random_model("gemma3", quantization="int8", tied=True)
    if grouped:
        table = model.model.embed_tokens.weight.float().view(model.config.vocab_size, -1, int_linear.BLOCK)
        scales = table.abs().amax(-1, keepdim=True).div(127).to(torch.float16).float()
        codes = table.div(scales).round().to(torch.int8).flatten(1)
        model.lm_head = int_linear.IntLinear(codes, scales.squeeze(-1), None, None)
    model.model.embed_tokens = int_linear.IntEmbedding(model.lm_head, model.dtype)
    model.model.fused_forward = cpu_ops.FusedForward(model)
    assert_one_call_gives_the_per_module_bits(model)


@needs_int_kernel
def test_a_projection_in_parts_of_different_forms_gives_the_per_module_bits():
    """IntLinearParts (a Q4_K_M file's Q4_K q and k beside its Q6_K v): each part's outputs in its
    own columns of the one call's rows, biases included."""
    model = random_model("qwen2", quantization="int4")
    g = torch.Generator().manual_seed(5)
    for layer in model.model.layers:
        attn = layer.self_attn
        weight, bias = torch.randn(attn.qkv_proj.out_features, attn.qkv_proj.in_features, generator=g) * 0.06, \
            attn.qkv_proj.bias
        attn.qkv_proj = int_linear.IntLinearParts([linear_for(quantize_int4(weight[:256]), bias[:256]),
                                                   linear_for(quantize_int8(weight[256:]), bias[256:])])
    model.model.fused_forward = cpu_ops.FusedForward(model)
    assert_one_call_gives_the_per_module_bits(model)


@needs_int_kernel
def test_a_tied_q8_0_gguf_runs_in_one_call_reading_its_table_from_the_moved_head(tmp_path):
    model, _ = load_model(str(write_gguf(tmp_path / "tiny.gguf", Q.Q8_0)), dtype="bfloat16", quantization="int8")
    backends.prepare(model, CPU, "int8")
    assert isinstance(model.model.embed_tokens, int_linear.IntEmbedding)
    assert model.model.embed_tokens.codes is model.lm_head.codes  # gather_weights moved them: no second copy
    assert_one_call_gives_the_per_module_bits(model)


# A block's steps (layer_plan.Step): its input norm or none, its output norm or none, its multiplier
# (1: none), and whether the multiplier comes before the output norm.
BLOCK = st.tuples(st.sampled_from((None,) + NORMS), st.sampled_from((None,) + NORMS),
                  st.sampled_from((1.0, 0.3, 2.5)), st.booleans())


@given(blocks=st.tuples(BLOCK, BLOCK), model_type=st.sampled_from(["llama", "qwen3_moe"]),
       dtype=st.sampled_from([torch.bfloat16, torch.float32]))
@settings(max_examples=12, deadline=None)
def test_any_order_of_norms_and_multipliers_gives_the_per_module_bits(blocks, model_type, dtype):
    """A layer is described once (layer_plan.py): orders of steps that no released architecture
    has, run by both paths, give the same bits, so a new architecture built of them needs no code
    in either."""
    steps = []
    for block, (read, output_norm, factor, scale_first) in zip(("attention", "feed_forward"), blocks):
        after = [Step("norm_output", output_norm)] if output_norm else []
        scale = [Step("scale", factor=factor)] if factor != 1.0 else []
        steps += [Step("read", read), Step(block), *(scale + after if scale_first else after + scale), Step("add")]
    with mock.patch("tailrace.model.decoder.llama.layer_steps", return_value=tuple(steps)):
        model = random_model(model_type, dtype=dtype)
    assert all(layer.steps == tuple(steps) for layer in model.model.layers)
    assert_one_call_gives_the_per_module_bits(model)


@pytest.mark.parametrize("steps, message", [
    ((Step("attention"), Step("add"), Step("read", "input_layernorm"), Step("feed_forward"), Step("add")),
     "comes after a read"),
    ((Step("read", "input_layernorm"), Step("attention"), Step("attention"), Step("add")), "attend once"),
    ((Step("read"), Step("attention"), Step("norm_output"), Step("add")), "needs its norm"),
])
def test_the_one_call_refuses_steps_it_cannot_run(steps, message):
    with mock.patch("tailrace.model.decoder.llama.layer_steps", return_value=steps):
        with pytest.raises(RuntimeError, match=message):
            random_model("llama")


@pytest.mark.parametrize("quantization, tied, dtype", [
    (None, True, torch.bfloat16), (None, True, torch.float32),
    pytest.param("int4", False, torch.bfloat16, marks=needs_int_kernel),
])
def test_weights_gathered_onto_huge_pages_in_reading_order_change_no_bit(quantization, tied, dtype):
    gathered = random_model("llama", quantization=quantization, tied=tied, dtype=dtype)
    scattered = random_model("llama", quantization=quantization, tied=tied, huge_pages=False, dtype=dtype)
    kinds = (bf16_linear.Bf16Linear, bf16_linear.Float32Linear, int_linear.IntLinear)
    projections = [m for m in gathered.modules() if isinstance(m, kinds)]
    assert projections[-1] is gathered.lm_head and len(projections) == 4 * 3 + 1
    weights = [t for m in projections for t in ([m.packed] if quantization is None else [m.codes, m.scales, m.zeros])]
    assert len({t.untyped_storage().data_ptr() for t in weights}) == 1
    assert [t.data_ptr() for t in weights] == sorted(t.data_ptr() for t in weights)
    if tied:
        assert gathered.model.embed_tokens.packed is gathered.lm_head.packed
    caches = {model: new_cache(model) for model in (gathered, scattered)}
    for step in STEPS:
        got, expected = (run_step(model, cache, step) for model, cache in caches.items())
        assert torch.equal(got, expected)
        assert torch.equal(gathered.compute_logits(got), scattered.compute_logits(expected))
    for model in caches:  # the per-module path reads the same moved buffers
        model.model.fused_forward = None
    got, expected = (run_step(model, cache, [(0, 23, 1), (3, 23, 1)]) for model, cache in caches.items())
    assert torch.equal(got, expected)


@pytest.mark.parametrize("quantization, dtype", [
    (None, torch.bfloat16), (None, torch.float32), pytest.param("int4", torch.bfloat16, marks=needs_int_kernel),
])
def test_the_last_layer_computes_only_the_wanted_rows_with_their_bits_and_every_rows_kv(quantization, dtype):
    """The rows that need logits (each sequence's last, a few for prompt logprobs, or none) come out
    with the bits the whole step gives them, and the stored K/V is every row's."""
    model = random_model("qwen3", quantization=quantization, dtype=dtype)
    for rows in ([19, 54, 61], [0, 1, 2, 40, 61], [], list(range(62))):
        whole_cache, rows_cache = new_cache(model), new_cache(model)
        whole = run_step(model, whole_cache, STEPS[0])
        assert torch.equal(run_step(model, rows_cache, STEPS[0], rows), whole[rows])
        assert torch.equal(rows_cache.k, whole_cache.k) and torch.equal(rows_cache.v, whole_cache.v)
        model.model.fused_forward, fused = None, model.model.fused_forward
        assert torch.equal(run_step(model, new_cache(model), STEPS[0], rows), whole[rows])
        model.model.fused_forward = fused
    with pytest.raises(RuntimeError, match="ascending"):
        run_step(model, new_cache(model), STEPS[0], [5, 3])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_decode_row_has_the_same_bits_alone_and_in_a_mixed_batch(dtype):
    model = random_model("llama", dtype=dtype)
    together, alone = new_cache(model), new_cache(model)
    for step in STEPS[:2]:
        run_step(model, together, step)
        run_step(model, alone, step)
    mixed = run_step(model, together, STEPS[2])
    row = run_step(model, alone, [STEPS[2][2]])
    assert torch.equal(mixed[19:20], row)  # sequence 1's row follows sequence 0's and 3's 1 + 18


def test_steps_on_a_cache_without_tailrace_attention_run_module_by_module():
    model = random_model("llama")
    c = model.config
    slab = KVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, NUM_BLOCKS, BLOCK_SIZE, torch.bfloat16)
    fused = model.model.fused_forward
    assert not fused.takes(slab) and fused.takes(new_cache(model))
    float32 = PagedKVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, NUM_BLOCKS, BLOCK_SIZE,
                           torch.float32, kernel="tailrace")
    assert not fused.takes(float32)  # pages of another dtype than the model's


def test_only_a_model_on_kernel_projections_at_its_dtype_is_fused_and_the_choice_says_why_not():
    config = random_model("llama").config
    float32 = LlamaForCausalLM(config, torch.float32)
    chosen = backends.prepare(float32, CPU, None)
    assert float32.model.fused_forward.dtype == torch.float32 and chosen.fused
    assert "fused forward" not in chosen.not_taken
    quantized = LlamaForCausalLM(config, torch.bfloat16)  # asked for int8 but never quantized: plain Linear
    chosen = backends.prepare(quantized, CPU, "int8")
    assert quantized.model.fused_forward is None and not chosen.fused
    assert chosen.not_taken["fused forward"] == "layer 0's qkv_proj is Linear"
    half = LlamaForCausalLM(config, torch.float16)
    chosen = backends.prepare(half, CPU, None)
    assert half.model.fused_forward is None
    assert chosen.not_taken["elementwise kernels"].startswith("dtype torch.float16")
