"""Weight-only int8 / int4 projections on PyTorch's CPU kernels, and a quantized model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tailrace.model.attention import AttentionBatch, KVCache, SeqSlice
from tailrace.model.llama import Linear
from tailrace.model.loader import load_model
from tailrace.model.quant import (INT4_GROUP_SIZE, Int4Linear, Int8Linear, dequantize_int4, quantize_linear,
                                  quantize_model)

from conftest import EMBEDDED


def _bf16_input_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x.to(torch.bfloat16).float(), weight)


@pytest.mark.parametrize("rows", [1, 3, 16])
def test_int8_linear_multiplies_by_its_dequantized_weight(rows):
    torch.manual_seed(0)
    weight, x = torch.randn(96, 64), torch.randn(rows, 64)
    layer = Int8Linear.from_float(weight)
    dequantized = layer.weight.float() * layer.scales.float()[:, None]
    expected = _bf16_input_reference(x, dequantized)
    assert torch.allclose(layer(x), expected, rtol=2e-2, atol=5e-2)
    assert layer(x).dtype == torch.float32


def test_int8_weights_are_within_half_a_step_of_the_float_ones():
    torch.manual_seed(0)
    weight = torch.randn(32, 64)
    layer = Int8Linear.from_float(weight)
    error = (layer.weight.float() * layer.scales.float()[:, None] - weight).abs()
    # the scales are stored in bfloat16 (the kernel's type), which adds under 0.4% of a row's range
    assert (error <= layer.scales.float()[:, None] * 0.5 + weight.abs().amax(1, keepdim=True) * 4e-3).all()


@pytest.mark.parametrize("rows", [1, 5])
def test_int4_linear_multiplies_by_its_dequantized_weight(rows):
    torch.manual_seed(0)
    weight, x = torch.randn(64, 2 * INT4_GROUP_SIZE), torch.randn(rows, 2 * INT4_GROUP_SIZE)
    groups = weight.view(64, 2, INT4_GROUP_SIZE)
    low, high = groups.amin(-1), groups.amax(-1)
    scales = (high - low) / 15
    q = torch.round((groups - low[..., None]) / scales[..., None]).clamp(0, 15).view(64, -1).to(torch.int32)
    layer = Int4Linear(q, scales, low + 8 * scales, None)
    # the kernel holds scales and zeros in bfloat16: compare with the weights it really uses
    dequantized = dequantize_int4(q, scales.bfloat16().float(), (low + 8 * scales).bfloat16().float())
    assert torch.allclose(layer(x), _bf16_input_reference(x, dequantized), rtol=2e-2, atol=5e-2)


def test_int4_from_float_stays_within_a_step_of_each_group():
    torch.manual_seed(0)
    weight = torch.randn(16, 4 * INT4_GROUP_SIZE)
    x = torch.eye(4 * INT4_GROUP_SIZE)  # each output column is one weight
    recovered = Int4Linear.from_float(weight)(x).t()
    step = (weight.view(16, 4, -1).amax(-1) - weight.view(16, 4, -1).amin(-1)) / 15
    assert ((recovered - weight).abs().view(16, 4, -1) <= step[..., None] * 0.6 + 0.02).all()


def test_int4_falls_back_to_int8_for_shapes_its_kernel_cannot_take():
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
