"""Weight-only int8 / int4: quantizing float weights, PyTorch's kernels (where tailrace's cannot
run), the choice between the kernels, and a quantized model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tailrace.model.attention.kv_cache import AttentionBatch, KVCache, SeqSlice
from tailrace.model.cpu import int_linear
from tailrace.model.decoder.config import parse_model_config
from tailrace.model.decoder.llama import Linear, LlamaForCausalLM, Router
from tailrace.model.loading.loader import load_model
from tailrace.model.quant import (INT4_GROUP_SIZE, Int4Linear, Int8Linear, IntWeight, SplitInt8Linear, linear_for,
                                  quantize_int4, quantize_int8, quantize_linear, quantize_model)

from conftest import EMBEDDED


def _bf16_input_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x.to(torch.bfloat16).float(), weight)


def test_int8_codes_are_within_half_a_step_of_the_float_weights():
    torch.manual_seed(0)
    weight = torch.randn(32, 64)
    quantized = quantize_int8(weight)
    assert quantized.codes.dtype == torch.int8 and quantized.scales.shape == (32, 1)
    assert torch.equal(quantized.scales, quantized.scales.half().float())  # float16 scales, held exactly
    assert ((quantized.dequantize() - weight).abs() <= quantized.scales * 0.5 + 1e-7).all()
    assert (quantized.codes.abs().amax(1) == 127).all()


def test_int4_codes_stay_within_half_a_step_of_each_group():
    torch.manual_seed(0)
    weight = torch.randn(16, 4 * INT4_GROUP_SIZE)
    quantized = quantize_int4(weight)
    assert quantized.codes.dtype == torch.uint8 and int(quantized.codes.max()) <= 15
    step = quantized.scales.repeat_interleave(INT4_GROUP_SIZE, dim=1)
    assert ((quantized.dequantize() - weight).abs() <= step * 0.5 + 1e-3).all()


def test_constant_rows_and_groups_quantize_exactly():
    weight = torch.zeros(16, 2 * INT4_GROUP_SIZE)
    assert torch.equal(quantize_int8(weight).dequantize(), weight)
    weight[:, INT4_GROUP_SIZE:] = 1.0
    assert torch.equal(quantize_int4(weight).dequantize(), weight)


@pytest.mark.parametrize("rows", [1, 3, 16])
def test_pytorch_int8_linear_multiplies_by_its_dequantized_weight(rows):
    torch.manual_seed(0)
    weight, x = torch.randn(96, 64), torch.randn(rows, 64)
    quantized = quantize_int8(weight)
    layer = Int8Linear(quantized, None)
    # its scales are bfloat16: compare with the weight it really multiplies by
    used = IntWeight(quantized.codes, quantized.scales.bfloat16().float(), None).dequantize()
    assert torch.allclose(layer(x), _bf16_input_reference(x, used), rtol=2e-2, atol=5e-2)
    assert layer(x).dtype == torch.float32


@pytest.mark.parametrize("rows", [1, 5])
def test_pytorch_int4_linear_multiplies_by_its_dequantized_weight(rows):
    torch.manual_seed(0)
    weight, x = torch.randn(64, 2 * INT4_GROUP_SIZE), torch.randn(rows, 2 * INT4_GROUP_SIZE)
    quantized = quantize_int4(weight)
    layer = Int4Linear(quantized, None)
    expected = _bf16_input_reference(x, quantized.dequantize())
    assert torch.allclose(layer(x), expected, rtol=2e-2, atol=5e-2 * float(expected.abs().max()))


def test_split_int8_linear_takes_grouped_int8_codes_at_their_extremes():
    torch.manual_seed(0)
    codes = torch.tensor([-128, 127, 0, -1] * 16, dtype=torch.int8).repeat(16, 1)
    quantized = IntWeight(codes, torch.rand(16, 2) + 0.5, None)
    x = torch.randn(3, 64)
    expected = _bf16_input_reference(x, quantized.dequantize())
    actual = SplitInt8Linear(quantized, None)(x)
    assert torch.allclose(actual, expected, rtol=2e-2, atol=2e-2 * float(expected.abs().max()))


def test_tailraces_kernel_serves_where_it_runs_pytorchs_elsewhere(monkeypatch):
    int8, int4 = quantize_int8(torch.randn(16, 64)), quantize_int4(torch.randn(16, 64))
    grouped_int8 = IntWeight(int8.codes, int8.scales.repeat(1, 2), None)
    if int_linear.available():
        assert all(isinstance(linear_for(w, None), int_linear.IntLinear) for w in (int8, int4, grouped_int8))
    monkeypatch.setattr(int_linear, "available", lambda: False)
    assert isinstance(linear_for(int8, None), Int8Linear)
    assert isinstance(linear_for(int4, None), Int4Linear)
    assert isinstance(linear_for(grouped_int8, None), SplitInt8Linear)
    assert linear_for(quantize_int4(torch.randn(8, 64)), None) is None  # rows not in tiles of 16


def test_int4_falls_back_to_int8_for_inputs_not_in_groups(monkeypatch):
    monkeypatch.setattr(int_linear, "available", lambda: False)
    assert isinstance(quantize_linear(torch.randn(16, INT4_GROUP_SIZE + 8), None, "int4"), Int8Linear)
    assert isinstance(quantize_linear(torch.randn(8, INT4_GROUP_SIZE), None, "int4"), Int8Linear)
    assert isinstance(quantize_linear(torch.randn(16, INT4_GROUP_SIZE), None, "int4"), Int4Linear)


def test_unknown_quantization_is_refused():
    model, _ = load_model(str(EMBEDDED), dtype="float32")
    with pytest.raises(ValueError, match="unsupported quantization 'fp8'; supported: int8, int4"):
        quantize_model(model, "fp8")


def _prefill_logits(model, config, tokens: list[int]) -> torch.Tensor:
    cache = KVCache(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, 8, 16, model.dtype)
    batch = AttentionBatch([SeqSlice(0, 0, len(tokens), len(tokens), list(range(8)))], torch.arange(len(tokens)))
    cache.begin(batch)
    return model.compute_logits(model(torch.tensor(tokens), torch.arange(len(tokens)), batch, cache))


@pytest.mark.parametrize("method, min_agreement", [("int8", 0.95), ("int4", 0.75)])
def test_quantized_embedded_model_mostly_predicts_what_float32_does(method, min_agreement):
    reference, config = load_model(str(EMBEDDED), dtype="float32")
    quantized, _ = load_model(str(EMBEDDED), dtype="float32", quantization=method)
    assert not any(isinstance(m, Linear) for m in quantized.modules())
    assert quantized.lm_head is not None  # the tied head reads a quantized copy
    tokens = list(range(100, 200))
    expected, got = _prefill_logits(reference, config, tokens), _prefill_logits(quantized, config, tokens)
    agreement = (expected.argmax(-1) == got.argmax(-1)).float().mean().item()
    assert agreement >= min_agreement


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_a_mixture_of_experts_quantizes_its_experts_and_keeps_its_router_in_float(method):
    """A rounded router logit can change which experts a token takes: the projections and every
    expert's quantize, the router does not; the quantized model still computes."""
    config = parse_model_config({
        "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 64, "hidden_size": 64, "intermediate_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32})
    model = LlamaForCausalLM(config, torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.1)
    quantize_model(model, method)
    layer = model.model.layers[0]
    assert type(layer.mlp.gate) is Router and not isinstance(layer.self_attn.qkv_proj, Linear)
    assert not any(isinstance(p, Linear) for e in layer.mlp.experts for p in (e.gate_up_proj, e.down_proj))
    out = layer.mlp(torch.randn(5, 64))
    assert out.shape == (5, 64) and torch.isfinite(out).all()
