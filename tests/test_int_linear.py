"""int8, int4 and E2M1 (MXFP4) projections through tailrace's kernel: the packed layouts, the
arithmetic against a float64 reference over the same activation codes (int16 against int8 weights,
int8 against 4-bit ones), and the batch invariance the engine's exactness rests on."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tailrace.model.cpu import int_linear
from tailrace.model.cpu.int_linear import BLOCK, IntEmbedding, IntLinear, pack_codes, pack_scales
from tailrace.model.cpu.kernel_ops import activation_codes
from tailrace.model.cpu.kernels import kernels
from tailrace.model.loading.loader import load_model
from tailrace.model.quant import E2M1_DOUBLED

from conftest import EMBEDDED
from test_quant import _prefill_logits

needs_kernel = pytest.mark.skipif(not int_linear.available(), reason="no AVX512-VNNI or no tailrace CPU kernels here")


def test_int8_codes_pack_16_outputs_to_a_vector_in_pairs_of_inputs():
    codes = torch.arange(20 * 64, dtype=torch.int32).view(20, 64).remainder(251).sub(125).to(torch.int8)
    packed = pack_codes(codes)
    assert packed.shape == (4, 32, 32)  # 2 vectors of outputs, padded to a tile of 4
    # vector v, pair p, lane l, element e holds codes[16 v + l, 2 p + e]
    assert packed[1, 31, 2 * 3 + 1] == codes[19, 63]
    assert packed[0, 5, 2 * 15] == codes[15, 10]
    assert not packed[1, :, 8:].any() and not packed[2:].any()


@needs_kernel
@given(rows=st.integers(1, 150), grouped=st.booleans(), dtype=st.sampled_from([torch.bfloat16, torch.float32]),
       seed=st.integers(0, 2**16))
@settings(max_examples=25, deadline=None)
def test_a_lookup_in_an_int8_heads_codes_gives_its_rows_dequantized_once(rows, grouped, dtype, seed):
    """IntEmbedding reads row n back out of the packed layouts: codes times the group's scale in
    float32, rounded to the dtype, as a table dequantized at load holds it."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (rows, 96), generator=g, dtype=torch.int8)
    scales = torch.rand(rows, 3 if grouped else 1, generator=g).add(0.01).to(torch.float16)
    table = (codes.float().view(rows, scales.shape[1], -1) * scales.float().unsqueeze(-1)).view(rows, 96).to(dtype)
    lookup = IntEmbedding(IntLinear(codes, scales, None, None), dtype)
    ids = torch.randint(0, rows, (2, 5), generator=g)
    assert torch.equal(lookup(ids), table[ids])
    assert torch.equal(lookup(torch.arange(rows)), table)


def test_int4_codes_pack_eight_inputs_of_a_lane_to_four_bytes():
    codes = torch.randint(0, 16, (20, 64), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    packed = pack_codes(codes)
    assert packed.shape == (4, 8, 64)  # 2 vectors of outputs, padded to a tile of 4; 8 runs of 8 inputs
    # vector v, run r, lane l, byte j: inputs 8r + j (low nibble) and 8r + 4 + j (high) of output 16v + l
    for vector, run, lane, byte in [(0, 3, 5, 1), (1, 7, 3, 3), (0, 0, 15, 0)]:
        value = int(packed[vector, run, 4 * lane + byte])
        assert value & 0x0F == codes[16 * vector + lane, 8 * run + byte]
        assert value >> 4 == codes[16 * vector + lane, 8 * run + 4 + byte]
    assert not packed[1, :, 16:].any() and not packed[2:].any()


def test_scales_pack_a_tiles_vectors_side_by_side_lanes_last_in_float16():
    scales = torch.arange(70 * 3, dtype=torch.float32).view(70, 3)
    packed = pack_scales(scales)
    assert packed.shape == (2, 3, 4, 16) and packed.dtype == torch.float16
    assert packed[0, 2, 1, 3] == scales[19, 2]  # vector 1 of tile 0, group 2, lane 3
    assert packed[1, 0, 0, 5] == scales[69, 0]  # vector 4 is tile 1's first
    assert packed[1, 1, 0, 6] == 0 and packed[1, 1, 3, 15] == 0  # padding to whole tiles


def _random_weight(bits: int, grouped: bool, zeros: bool, out_features: int, in_features: int, seed: int,
                   e2m1: bool = False):
    """Codes, scales and zeros; E2M1 codes take scales that are powers of two, as MXFP4's are."""
    g = torch.Generator().manual_seed(seed)
    if bits == 8:
        codes = torch.randint(-128, 128, (out_features, in_features), generator=g, dtype=torch.int8)
    else:
        codes = torch.randint(0, 16, (out_features, in_features), generator=g, dtype=torch.uint8)
    groups = in_features // BLOCK if grouped else 1
    if e2m1:
        scales = torch.exp2(torch.randint(-12, -5, (out_features, groups), generator=g).float())
    else:
        scales = (torch.rand(out_features, groups, generator=g) * 0.01 + 1e-3).half().float()
    zero = (torch.randn(out_features, groups, generator=g) * 0.01).half().float() if zeros else None
    return codes, scales, zero


def _reference(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
               e2m1: bool = False) -> torch.Tensor:
    out_features, in_features = codes.shape
    values = E2M1_DOUBLED[codes.long()].double() if e2m1 else codes.double()
    w = values.view(out_features, scales.shape[1], -1) * scales.double()[..., None]
    if zeros is not None:
        w = w + zeros.double()[..., None]
    bits = 8 if codes.dtype == torch.int8 else 4
    return activation_codes(x, bits) @ w.view(out_features, in_features).t()


# (bits, grouped scales, zero points, E2M1 codes)
forms = st.sampled_from([(8, False, False, False), (8, True, False, False), (4, True, True, False),
                         (4, True, False, False), (4, True, False, True)])


@needs_kernel
@settings(max_examples=30, deadline=None)
@given(form=forms, rows=st.integers(1, 11), out_features=st.integers(1, 150), blocks=st.integers(1, 40),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_kernel_multiplies_by_codes_times_scales(form, rows, out_features, blocks, dtype, seed):
    bits, grouped, zeros, e2m1 = form
    codes, scales, zero = _random_weight(bits, grouped, zeros, out_features, blocks * BLOCK, seed, e2m1)
    bias = torch.randn(out_features, generator=torch.Generator().manual_seed(seed))
    x = torch.randn(rows, blocks * BLOCK, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    actual = IntLinear(codes, scales, zero, bias, e2m1=e2m1)(x)
    assert actual.dtype == dtype and actual.shape == (rows, out_features)
    expected = _reference(x, codes, scales, zero, e2m1) + bias.double()
    # float32 sums of a block each; bfloat16 adds the output's rounding
    tolerance = 1e-5 if dtype == torch.float32 else 2**-8
    assert (actual.double() - expected).abs().max() <= tolerance * expected.abs().max()


@needs_kernel
@settings(max_examples=20, deadline=None)
@given(form=forms, rows=st.integers(2, 70), out_features=st.integers(1, 300), seed=st.integers(0, 2**16),
       threads=st.sampled_from([1, 2, 3]))
def test_a_rows_bits_do_not_depend_on_its_batch(form, rows, out_features, seed, threads):
    # a lone row takes other tiles than a batch (int_linear.cpp's run)
    bits, grouped, zeros, e2m1 = form
    codes, scales, zero = _random_weight(bits, grouped, zeros, out_features, 6 * BLOCK, seed, e2m1)
    layer = IntLinear(codes, scales, zero, None, e2m1=e2m1)
    x = torch.randn(rows, 6 * BLOCK, generator=torch.Generator().manual_seed(seed)).bfloat16()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        batch = layer(x)
    finally:
        torch.set_num_threads(before)
    for row in {0, rows // 2, rows - 1}:
        assert torch.equal(layer(x[row:row + 1])[0], batch[row])


@needs_kernel
@pytest.mark.parametrize("code", [7, 15])  # E2M1's +6 and -6: bytes 24 and 0 in the kernel
@pytest.mark.parametrize("rows", [1, 5])
def test_e2m1_codes_at_their_extremes_sum_exactly(code, rows):
    """The largest products the kernel takes, 24 x 127 each over whole blocks: AVX2's int16 pairs
    would wrap if they held a block's 16 of them (int4_block_sums)."""
    codes = torch.full((16, 4 * BLOCK), code, dtype=torch.uint8)
    scales = torch.full((16, 4), 2.0**-4)
    x = torch.ones(rows, 4 * BLOCK)
    x[:, 1::3] = -1.0
    x[-1, :BLOCK] = 1.0  # a block all at the largest activation code
    expected = _reference(x, codes, scales, None, e2m1=True)
    actual = IntLinear(codes, scales, None, None, e2m1=True)(x).double()
    assert (actual - expected).abs().max() <= 1e-6 * expected.abs().max()  # a wrapped sum is off by 2^16 x 127


@needs_kernel
def test_e2m1_codes_without_grouped_scales_are_refused():
    codes, scales, zero = _random_weight(4, True, True, 16, 2 * BLOCK, 0)
    with pytest.raises(RuntimeError, match="E2M1 codes take grouped scales and no zero points"):
        IntLinear(codes, scales, zero, None, e2m1=True)(torch.randn(1, 2 * BLOCK))


@needs_kernel
def test_a_non_finite_input_spoils_only_its_own_row():
    codes, scales, _ = _random_weight(8, False, False, 32, 2 * BLOCK, 0)
    x = torch.randn(3, 2 * BLOCK)
    x[1, 40] = math.inf
    out = IntLinear(codes, scales, None, None)(x)
    assert out[1].isnan().all() and out[[0, 2]].isfinite().all()


@needs_kernel
def test_an_all_zero_block_contributes_nothing():
    codes, scales, zero = _random_weight(4, True, True, 16, 2 * BLOCK, 0)
    x = torch.randn(1, 2 * BLOCK)
    x[0, :BLOCK] = 0
    expected = _reference(x, codes, scales, zero)
    assert torch.allclose(IntLinear(codes, scales, zero, None)(x).double(), expected, rtol=1e-5, atol=1e-6)


@needs_kernel
def test_bad_shapes_are_refused():
    codes, scales, _ = _random_weight(8, False, False, 16, 2 * BLOCK, 0)
    layer = IntLinear(codes, scales, None, None)
    with pytest.raises(RuntimeError, match="does not match the codes"):
        layer(torch.randn(1, 3 * BLOCK))
    with pytest.raises(RuntimeError, match="blocks of 32"):
        layer(torch.randn(1, 2 * BLOCK + 2))
    vector_by_vector = layer.scales.permute(0, 2, 1, 3).reshape(-1, 1, 16)  # the layout before tiles
    with pytest.raises(RuntimeError, match=r"scales must be float16 \[NV / 4"):
        kernels().int_linear(torch.randn(1, 2 * BLOCK), layer.codes, None, vector_by_vector, None, None, None, None,
                             16)
    with pytest.raises(RuntimeError, match="high bits go with 4-bit codes"):
        kernels().int_linear(torch.randn(1, 2 * BLOCK), layer.codes, torch.zeros(4, 8, 1, 2, dtype=torch.int64),
                             layer.scales, None, None, None, None, 16)
    with pytest.raises(RuntimeError, match="integer mins go with integer scales"):
        kernels().int_linear(torch.randn(1, 2 * BLOCK), layer.codes, None, layer.scales, None, None,
                             torch.zeros(1, 2, 4, 16, dtype=torch.int8), None, 16)


@needs_kernel
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_embedded_model_runs_on_the_kernel_and_stays_close_to_pytorchs(method, monkeypatch):
    ours, config = load_model(str(EMBEDDED), dtype="bfloat16", quantization=method)
    assert isinstance(ours.lm_head, IntLinear)
    monkeypatch.setattr(int_linear, "available", lambda: False)
    pytorchs, _ = load_model(str(EMBEDDED), dtype="bfloat16", quantization=method)
    assert not isinstance(pytorchs.lm_head, IntLinear)
    tokens = list(range(100, 164))
    expected, got = _prefill_logits(pytorchs, config, tokens), _prefill_logits(ours, config, tokens)
    agreement = (expected.argmax(-1) == got.argmax(-1)).float().mean().item()
    assert agreement >= 0.9


@needs_kernel
@pytest.mark.parametrize("bits", [4, 8])
def test_zero_blocks_of_activations_touch_no_other_block(bits):
    """A block of zeros gets zero codes, and only its own: int8 codes (against int4 weights) are
    32 bytes a block, and a 64-byte store once zeroed the next block too, another thread's or
    past the buffer's end (glibc then aborted: "double free or corruption")."""
    codes, scales, zero = _random_weight(bits, True, bits == 4, 48, 4 * BLOCK, seed=5)
    layer = IntLinear(codes, scales, zero, None)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for trial in range(30):
            x = torch.randn(32, 4 * BLOCK, generator=torch.Generator().manual_seed(trial))
            x[15, 3 * BLOCK:] = 0.0  # the last block of the first half of the blocks (the other thread's next)
            x[31, 3 * BLOCK:] = 0.0  # the very last block
            actual = layer(x).double()
            expected = _reference(x, codes, scales, zero)
            assert (actual - expected).abs().max() <= 1e-5 * expected.abs().max()
    finally:
        torch.set_num_threads(previous)
