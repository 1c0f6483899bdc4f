"""MXFP4 dequantization and E2M1 codes (model/loading/mxfp4.py), and the quantizer the tests write checkpoints with."""

from __future__ import annotations

import pytest
import torch
from mxfp4_writer import quantize_mxfp4

from tailrace.model.loading.mxfp4 import dequantize_mxfp4, e2m1_codes, e2m1_scales
from tailrace.model.quant import FP4_VALUES, IntWeight


def test_each_byte_holds_two_values_the_first_in_its_low_nibble_over_the_blocks_power_of_two():
    blocks = torch.zeros(1, 16, dtype=torch.uint8)
    blocks[0, 0] = 0x72  # 1.0, then 6.0
    blocks[0, 1] = 0x9F  # -6.0, then -0.5
    for scale, factor in ((127, 1.0), (129, 4.0), (125, 0.25)):
        values = dequantize_mxfp4(blocks, torch.tensor([scale], dtype=torch.uint8))
        assert values.shape == (32,)
        assert values[:4].tolist() == [1.0 * factor, 6.0 * factor, -6.0 * factor, -0.5 * factor]
        assert not values[4:].any()


def test_every_code_at_every_position():
    codes = torch.arange(32, dtype=torch.uint8) % 16
    blocks = (codes[0::2] | (codes[1::2] << 4)).reshape(1, 1, 16)
    values = dequantize_mxfp4(blocks, torch.full((1, 1), 127, dtype=torch.uint8))
    assert values.flatten().tolist() == [FP4_VALUES[c] for c in codes.tolist()]


def test_representable_values_survive_the_round_trip_and_others_land_within_a_step():
    exact = torch.tensor(FP4_VALUES * 2).reshape(1, 32) * 2.0**-3
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(exact)), exact)
    weights = torch.randn(3, 5, 64)
    error = (dequantize_mxfp4(*quantize_mxfp4(weights)) - weights).abs()
    # the step between E2M1 values is at most a third of the block's largest magnitude
    largest = weights.reshape(3, 5, 2, 32).abs().amax(-1, keepdim=True).expand(-1, -1, -1, 32).reshape(3, 5, 64)
    assert (error <= largest / 3 + 1e-6).all()


def test_mismatched_blocks_and_scales_are_refused():
    with pytest.raises(ValueError, match="MXFP4"):
        dequantize_mxfp4(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        dequantize_mxfp4(torch.zeros(2, 16), torch.zeros(2, dtype=torch.uint8))


def test_e2m1_codes_times_their_halved_scales_are_the_dequantized_values():
    weights = torch.randn(3, 4, 64) * 0.02
    blocks, scales = quantize_mxfp4(weights)
    codes, halves = e2m1_codes(blocks, scales)
    assert codes.shape == (3, 4, 64) and codes.dtype == torch.uint8 and int(codes.max()) <= 15
    for expert in range(3):
        weight = IntWeight(codes[expert], halves[expert], None, e2m1=True)
        assert torch.equal(weight.dequantize(), dequantize_mxfp4(blocks, scales)[expert])


def test_a_scale_past_float16_is_refused_for_the_kernel():
    assert e2m1_scales(torch.tensor([143], dtype=torch.uint8)).item() == 2.0**15
    with pytest.raises(ValueError, match="past float16's range"):
        e2m1_scales(torch.tensor([127, 144], dtype=torch.uint8))
