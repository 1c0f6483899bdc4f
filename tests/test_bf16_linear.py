"""bfloat16 and float32 projections through tailrace's kernel: the packed layouts, the arithmetic
against a float32 (float64) reference, and the batch invariance the engine's exactness rests on."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tailrace.model.cpu import bf16_linear
from tailrace.model.cpu.bf16_linear import Bf16Linear, Float32Linear, PackedEmbedding, kernel_takes, pack, pack_float32
from tailrace.model.cpu.linear import PackedLinear, pack_linears
from tailrace.model.loading.loader import load_model

from conftest import EMBEDDED
from test_quant import _prefill_logits

needs_kernel = pytest.mark.skipif(not bf16_linear.available(), reason="no AVX512 or no tailrace CPU kernels here")


def random_linear(out_features: int, in_features: int, bias: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(out_features, in_features, generator=g) * 0.05).bfloat16()
    return weight, torch.randn(out_features, generator=g).bfloat16() if bias else None


def test_pack_puts_16_outputs_in_a_vector_and_k_in_pairs():
    weight = torch.arange(20 * 6, dtype=torch.float32).view(20, 6).bfloat16()
    packed = pack(weight)
    assert packed.shape == (2, 3, 32)
    # vector v, pair p, lane l, element e holds W[16 v + l, 2 p + e]; rows past 20 are zero
    assert packed[1, 2, 2 * 3 + 1] == weight[19, 5]
    assert packed[0, 1, 2 * 15] == weight[15, 2]
    assert not packed[1, :, 8:].any()


def test_pack_float32_puts_a_pairs_two_values_16_lanes_apart():
    weight = torch.arange(20 * 6, dtype=torch.float32).view(20, 6)
    packed = pack_float32(weight)
    assert packed.dtype == torch.float32 and packed.shape == (2, 3, 32)
    # vector v, pair p, element e, lane l holds W[16 v + l, 2 p + e]; rows past 20 are zero
    assert packed[1, 2, 16 + 3] == weight[19, 5]
    assert packed[0, 1, 15] == weight[15, 2]
    assert not packed[1, :, 4:16].any() and not packed[1, :, 20:].any()


def test_the_kernel_takes_k_in_pairs_only():
    assert kernel_takes(torch.empty(4, 64)) and not kernel_takes(torch.empty(4, 63))


@needs_kernel
@pytest.mark.parametrize("rows, out_features, in_features", [
    (1, 1728, 576), (3, 49, 576), (7, 576, 1536), (37, 100, 1152), (5, 64, 2050),
])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_a_float32_product_of_the_same_bfloat16_values(rows, out_features, in_features, bias):
    """Widths over one K block (256 pairs), outputs not a whole vector, row counts not a whole tile."""
    weight, b = random_linear(out_features, in_features, bias, seed=rows)
    x = torch.randn(rows, in_features).bfloat16()
    got = Bf16Linear(weight, b)(x)
    expected = F.linear(x.float(), weight.float(), None if b is None else b.float())
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    # float32 accumulation, then one rounding to bfloat16: within half an ulp of 2^-8 relative
    torch.testing.assert_close(got.float(), expected, rtol=2**-8, atol=1e-2)


@needs_kernel
@pytest.mark.parametrize("rows, out_features, in_features", [(1, 1728, 576), (3, 49, 576), (37, 100, 1152), (5, 64, 2050)])
@pytest.mark.parametrize("bias", [False, True])
def test_float32_matches_a_float64_product(rows, out_features, in_features, bias):
    g = torch.Generator().manual_seed(rows)
    weight, b = torch.randn(out_features, in_features, generator=g) * 0.05, torch.randn(out_features, generator=g)
    x = torch.randn(rows, in_features, generator=g)
    got = Float32Linear(weight, b if bias else None)(x)
    expected = F.linear(x.double(), weight.double(), b.double() if bias else None)
    assert got.dtype == torch.float32 and got.shape == (rows, out_features)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)


def sequential_fma(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Each output's float32 sum over k in order, one FMA a product: the product of two float32 is
    exact in float64, so adding it there and rounding to float32 rounds as the FMA does (but for a
    double rounding, about 2^-29 a step; these inputs have none)."""
    acc = torch.zeros(x.shape[0], weight.shape[0])
    for k in range(x.shape[1]):
        acc = (acc.double() + x[:, k, None].double() * weight[None, :, k].double()).float()
    return acc + bias


@needs_kernel
def test_float32_sums_each_output_over_k_in_order():
    g = torch.Generator().manual_seed(4)
    weight, bias, x = torch.randn(40, 600, generator=g), torch.randn(40, generator=g), torch.randn(6, 600, generator=g)
    assert torch.equal(Float32Linear(weight, bias)(x), sequential_fma(x, weight, bias))


@needs_kernel
def test_keeps_leading_dimensions():
    weight, _ = random_linear(48, 32, False, seed=0)
    x = torch.randn(2, 3, 32).bfloat16()
    assert torch.equal(Bf16Linear(weight, None)(x), Bf16Linear(weight, None)(x.view(6, 32)).view(2, 3, 48))


@needs_kernel
@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 70), out_features=st.integers(1, 200), pairs=st.integers(1, 600),
       threads=st.sampled_from([1, 2, 3]), seed=st.integers(0, 2**16), float32=st.booleans())
def test_a_rows_output_is_bitwise_the_same_in_any_batch_and_at_any_thread_count(rows, out_features, pairs, threads, seed,
                                                                                  float32):
    g = torch.Generator().manual_seed(seed)
    weight, bias, x = torch.randn(out_features, 2 * pairs, generator=g), torch.randn(out_features, generator=g), \
        torch.randn(rows, 2 * pairs, generator=g)
    linear = Float32Linear(weight, bias) if float32 else Bf16Linear(weight.bfloat16(), bias.bfloat16())
    x = x if float32 else x.bfloat16()
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batched = linear(x)
        torch.set_num_threads(threads)
        alone = torch.cat([linear(x[i : i + 1]) for i in range(rows)])
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(batched, alone)


@needs_kernel
def test_the_avx512_loop_and_amx_tiles_agree_and_each_keeps_rows_apart(tmp_path):
    """Where the CPU has AMX the kernel runs on its tiles (bf16_amx.cpp), a process-wide choice;
    TAILRACE_CPU_AMX=0 keeps the AVX512-BF16 loop. A child process runs the loop here."""
    weight, bias = random_linear(100, 576, True, seed=1)
    x = torch.randn(37, 576, generator=torch.Generator().manual_seed(1)).bfloat16()
    torch.save((weight, bias, x), tmp_path / "in.pt")
    child = ("import sys, torch; from tailrace.model.cpu.bf16_linear import Bf16Linear; w, b, x = torch.load(sys.argv[1]); "
             "f = Bf16Linear(w, b); torch.save((f(x), torch.cat([f(x[i:i + 1]) for i in range(len(x))])), sys.argv[2])")
    subprocess.run([sys.executable, "-c", child, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
                   env={**os.environ, "TAILRACE_CPU_AMX": "0"}, check=True)
    looped, looped_alone = torch.load(tmp_path / "out.pt")
    assert torch.equal(looped, looped_alone)
    here = Bf16Linear(weight, bias)(x)
    torch.testing.assert_close(here.float(), looped.float(), rtol=2**-7, atol=1e-2)


def pairwise_fma(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """vdpbf16ps's sums in float32: per K pair, the odd product added, then the even one. Each
    product of two bfloat16 is exact in float32, so each addition rounds as an FMA does."""
    x, weight = x.float(), weight.float()
    acc = torch.zeros(x.shape[0], weight.shape[0])
    for k in range(0, x.shape[1], 2):
        acc = acc + x[:, k + 1, None] * weight[None, :, k + 1]
        acc = acc + x[:, k, None] * weight[None, :, k]
    return (acc + bias.float()).bfloat16()


@needs_kernel
def test_without_the_bfloat16_dot_product_two_fmas_a_pair_give_its_sums(tmp_path):
    """TAILRACE_CPU_BF16_DOT=0 takes the path of CPUs without AVX512-BF16 (here in a child
    process, the choice being process-wide): bit for bit the pairwise sums, in any batch. 13 rows:
    tiles of 4, 4 and 5 rows in the AVX2 build, 6 and 7 in the AVX-512 build's wide tiles (of 12)."""
    weight, bias = random_linear(40, 600, True, seed=2)  # K over one block of 256 pairs
    x = torch.randn(13, 600, generator=torch.Generator().manual_seed(2)).bfloat16()
    torch.save((weight, bias, x), tmp_path / "in.pt")
    child = ("import sys, torch; from tailrace.model.cpu.bf16_linear import Bf16Linear; w, b, x = torch.load(sys.argv[1]); "
             "f = Bf16Linear(w, b); torch.save((f(x), torch.cat([f(x[i:i + 1]) for i in range(len(x))])), sys.argv[2])")
    subprocess.run([sys.executable, "-c", child, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
                   env={**os.environ, "TAILRACE_CPU_BF16_DOT": "0", "TAILRACE_CPU_AMX": "0"}, check=True)
    batched, alone = torch.load(tmp_path / "out.pt")
    assert torch.equal(batched, pairwise_fma(x, weight, bias)) and torch.equal(alone, batched)


@needs_kernel
@pytest.mark.parametrize("head", [Bf16Linear, Float32Linear])
def test_a_packed_embedding_looks_up_the_rows_of_the_packed_weight(head):
    weight, _ = random_linear(100, 64, False, seed=3)  # 100 rows: the last vector is partly padding
    weight = weight if head is Bf16Linear else torch.randn(100, 64, generator=torch.Generator().manual_seed(3))
    lookup = PackedEmbedding(head(weight, None))
    ids = torch.tensor([[0, 5, 17], [99, 16, 15]])
    assert lookup(ids).dtype == weight.dtype and torch.equal(lookup(ids), weight[ids])


@needs_kernel
def test_pack_linears_takes_the_kernel_at_either_dtype_and_reads_lookups_from_the_head():
    bf16, config = load_model(str(EMBEDDED), dtype="bfloat16")
    reference, _ = load_model(str(EMBEDDED), dtype="bfloat16")
    pack_linears(bf16)
    kinds = {type(m) for m in bf16.modules() if isinstance(m, (Bf16Linear, PackedLinear))}
    assert kinds == {Bf16Linear} and isinstance(bf16.lm_head, Bf16Linear)
    # the tied model's lookups read the packed head: the table is held once
    assert isinstance(bf16.model.embed_tokens, PackedEmbedding)
    tokens = list(range(300, 364))
    got, expected = _prefill_logits(bf16, config, tokens), _prefill_logits(reference, config, tokens)
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() > 0.9
    fp32, _ = load_model(str(EMBEDDED), dtype="float32")
    reference, _ = load_model(str(EMBEDDED), dtype="float32")
    pack_linears(fp32)
    kinds = {type(m) for m in fp32.modules() if isinstance(m, (Bf16Linear, Float32Linear, PackedLinear))}
    assert kinds == {Float32Linear} and isinstance(fp32.model.embed_tokens, PackedEmbedding)
    got, expected = _prefill_logits(fp32, config, tokens), _prefill_logits(reference, config, tokens)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-3)
