"""The elementwise kernels against the eager reference: bitwise at bfloat16 (the same rounding
points; with AVX512-BF16's rounding instruction, values rounded from subnormals aside), within
float32 rounding at float32; and a model that uses them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tailrace.model import backends

from tailrace.model.cpu import ops as cpu_ops
from tailrace.model.cpu.kernels import kernels
from tailrace.model.decoder.llama import (RMSNorm, apply_rotary, choose_experts, gelu_tanh_and_mul, silu_and_mul,
                                          swiglu_oai_and_mul)
from tailrace.model.loading.loader import load_model

from conftest import EMBEDDED
from test_quant import _prefill_logits

pytestmark = pytest.mark.skipif(kernels() is None, reason="tailrace's CPU kernels do not run here")

DTYPES = [pytest.param(torch.bfloat16, 0.0, id="bfloat16"), pytest.param(torch.float32, 1e-5, id="float32")]


def assert_matches(got: torch.Tensor, expected: torch.Tensor, tolerance: float) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape
    if tolerance == 0.0:
        assert torch.equal(got, expected)
    else:
        torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype, tolerance", DTYPES)
@pytest.mark.parametrize("width", [576, 64, 100])
def test_rms_norm_is_the_eager_rmsnorm(dtype, tolerance, width):
    norm = RMSNorm(width, 1e-5, dtype)
    norm.weight.copy_(torch.randn(width))
    x = (torch.randn(9, width) * 3).to(dtype)
    assert_matches(kernels().rms_norm(x, norm.weight, norm.eps), norm(x), tolerance)
    strided = torch.randn(4, 2, width).to(dtype)[:, 1]  # rows of a wider tensor, as a q/k split gives
    assert_matches(kernels().rms_norm(strided, norm.weight, norm.eps), norm(strided), tolerance)


@pytest.mark.parametrize("dtype, tolerance", DTYPES)
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_rotary_is_the_eager_rotation_of_a_view_into_the_fused_projection(dtype, tolerance, head_dim):
    rows, heads = 6, 5
    qkv = torch.randn(rows, (heads + 2) * head_dim).to(dtype)
    qk = qkv[:, : heads * head_dim].view(rows, heads, head_dim)  # rows not contiguous, as in the model
    angles = torch.outer(torch.arange(rows) * 11.0, 1 / 10000 ** (torch.arange(0, head_dim, 2) / head_dim))
    cos = torch.cat((angles.cos(), angles.cos()), -1)[:, None]
    sin = torch.cat((-angles.sin(), angles.sin()), -1)[:, None]
    assert_matches(kernels().rotary(qk, cos, sin), apply_rotary(qk, cos, sin), tolerance)


@pytest.mark.parametrize("dtype, tolerance", DTYPES)
def test_silu_mul_is_the_eager_activation(dtype, tolerance):
    gate_up = (torch.randn(3, 2 * 200) * 6).to(dtype)
    gate_up[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0])  # exp's clamps and the zeros
    assert_matches(kernels().silu_mul(gate_up), silu_and_mul(gate_up), tolerance)
    assert kernels().silu_mul(gate_up[:0]).shape == (0, 200)


@pytest.mark.parametrize("dtype, tolerance", [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)])
def test_gelu_tanh_mul_is_the_eager_activation_within_rounding(dtype, tolerance):
    """GELU's tanh approximation as g / (1 + e^-2u): not torch's tanh, so within a rounding of it
    (bfloat16: the activation may round one ulp apart before the product)."""
    gate_up = (torch.randn(3, 2 * 200) * 6).to(dtype)
    gate_up[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0])
    got, expected = kernels().gelu_tanh_mul(gate_up), gelu_tanh_and_mul(gate_up)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    torch.testing.assert_close(got.float(), expected.float(), rtol=tolerance, atol=tolerance)


def test_subnormals_are_kept_by_the_integer_rounding_and_only_they_may_differ_natively(tmp_path):
    """TAILRACE_CPU_BF16_DOT=0 rounds to bfloat16 by integer ops, as CPUs without AVX512-BF16 do
    (in a child process, the choice being process-wide): the eager bits, subnormals included.
    vcvtneps2bf16 takes a subnormal float32 as zero: with it, only what came of one may differ."""
    generator = torch.Generator().manual_seed(4)
    gate_up = (torch.randn(4, 2 * 64, generator=generator) * 3).bfloat16()
    gate_up[:, :16] = torch.tensor(2e-39).bfloat16() * torch.arange(1, 17)  # silu of these is subnormal
    x = (torch.randn(4, 64, generator=generator) * 3).bfloat16()
    x[0] = torch.tensor(1e-39).bfloat16()  # the norm's scaled row is subnormal before the weight
    weight = torch.randn(64, generator=generator).bfloat16()
    torch.save((gate_up, x, weight), tmp_path / "in.pt")
    child = ("import sys, torch; from tailrace.model.cpu.kernels import kernels; g, x, w = torch.load(sys.argv[1]); "
             "torch.save((kernels().silu_mul(g), kernels().rms_norm(x, w, 1e-5)), sys.argv[2])")
    subprocess.run([sys.executable, "-c", child, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
                   env={**os.environ, "TAILRACE_CPU_BF16_DOT": "0"}, check=True)
    norm = RMSNorm(64, 1e-5, torch.bfloat16)
    norm.weight.copy_(weight)
    expected = [silu_and_mul(gate_up), norm(x)]
    assert any((e.float().abs() < torch.finfo(torch.float32).tiny).logical_and(e != 0).any() for e in expected)
    for integer, here, eager in zip(torch.load(tmp_path / "out.pt"), [kernels().silu_mul(gate_up),
                                                                      kernels().rms_norm(x, weight, 1e-5)], expected):
        assert torch.equal(integer, eager)
        differ = here != eager  # where a value rounded on the way was subnormal: zero, not a tiny value
        assert (here[differ] == 0).all() and (eager[differ].float().abs() < 1e-30).all()


@pytest.mark.parametrize("dtype, tolerance", [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)])
def test_swiglu_oai_mul_is_gpt_oss_eager_gate_within_rounding(dtype, tolerance):
    """Its sigmoid is 1 / (1 + e^-x) by the kernels' exp, not torch's: within a rounding of the
    eager ops, each rounded at the same points; the caps bite on both sides."""
    gate_up = (torch.randn(3, 2 * 200) * 6).to(dtype)
    gate_up[0, :3] = torch.tensor([-200.0, 200.0, 0.0])
    gate_up[0, 200:203] = torch.tensor([-200.0, 200.0, -0.0])
    got = kernels().swiglu_oai_mul(gate_up, alpha=1.702, limit=7.0)
    expected = swiglu_oai_and_mul(gate_up, alpha=1.702, limit=7.0)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    torch.testing.assert_close(got.float(), expected.float(), rtol=tolerance, atol=tolerance)
    assert 55.9 < got[0, 1].item() <= 56.0  # (limit + 1) * limit * sigmoid(1.702 limit), both capped


ROUTINGS = [dict(top_k=2, topk_first=False, normalize=True, float32_weights=False),  # Qwen3-MoE
            dict(top_k=3, topk_first=False, normalize=False, float32_weights=False),
            dict(top_k=2, topk_first=False, normalize=True, float32_weights=True),  # Mixtral
            dict(top_k=4, topk_first=True, normalize=False, float32_weights=False)]  # gpt-oss


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("routing", ROUTINGS)
def test_route_experts_chooses_as_the_eager_router_does(routing, dtype):
    """The same experts in the same order (logits far enough apart that rounding cannot swap two),
    weights within a rounding, in the dtype the reference returns; a row's choice alone is its
    choice in any batch."""
    g = torch.Generator().manual_seed(0)
    logits = (torch.stack([torch.randperm(8, generator=g) for _ in range(40)]).float() * 0.3 - 1).to(dtype)
    weights, chosen = kernels().route_experts(logits, **routing)
    expected_weights, expected_chosen = choose_experts(logits, **routing)
    assert torch.equal(chosen, expected_chosen) and weights.dtype == expected_weights.dtype
    torch.testing.assert_close(weights.float(), expected_weights.float(), rtol=1e-2, atol=1e-5)
    alone = kernels().route_experts(logits[17:18], **routing)
    assert torch.equal(alone[0], weights[17:18]) and torch.equal(alone[1], chosen[17:18])


def test_route_experts_breaks_a_tie_towards_the_lower_expert():
    logits = torch.tensor([[0.5, 2.0, 0.5, 2.0, 0.5]])
    _, chosen = kernels().route_experts(logits, top_k=3, topk_first=False, normalize=True, float32_weights=True)
    assert chosen.tolist() == [[1, 3, 0]]
    with pytest.raises(RuntimeError, match="top_k"):
        kernels().route_experts(logits, top_k=6, topk_first=False, normalize=True, float32_weights=True)


def test_kernels_refuse_what_they_cannot_compute():
    with pytest.raises(RuntimeError, match="weight"):
        kernels().rms_norm(torch.randn(2, 8), torch.randn(9), 1e-5)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernels().rotary(torch.randn(2, 1, 48), torch.randn(2, 1, 48), torch.randn(2, 1, 48))
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        kernels().silu_mul(torch.randn(2, 8).half())


@pytest.mark.parametrize("dtype, min_agreement", [("float32", 1.0), ("bfloat16", 0.95)])
def test_a_model_on_the_kernels_predicts_what_the_eager_model_does(dtype, min_agreement):
    eager, config = load_model(str(EMBEDDED), dtype=dtype)
    fast, _ = load_model(str(EMBEDDED), dtype=dtype)
    assert backends.select(fast, torch.device("cpu"), None).elementwise == "tailrace"
    assert backends.select(fast, torch.device("meta"), None).elementwise == "pytorch"
    cpu_ops.use_cpu_kernels(fast)
    assert not any(type(m) is RMSNorm for m in fast.modules())
    tokens = list(range(300, 364))
    expected, got = _prefill_logits(eager, config, tokens), _prefill_logits(fast, config, tokens)
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= min_agreement
    if dtype == "float32":
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-3)
