"""The CPU kernels' ops as a table, as llama.cpp's tests/test-backend-ops.cpp has them: for each op
the dtypes it takes, seeded random inputs of a given shape, the call into a kernel build (either
ISA's module, cpu_kernels.load_build) and the Python reference it must match, within the
tolerance its own tests allow. tests/test_backend_ops.py checks every op x dtype x build against
its reference and the two builds against each other; bench/backend_ops.py times them.

A dtype is a label: the tensors' dtype ("bfloat16", "float32"), or for int_linear the weight's
codes and the activations' dtype ("int8/bfloat16"). Integer outputs (token and expert ids) must
always match exactly; floating ones by the op's `Tolerance` for the dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from tailrace.model.attention import gated_delta
from tailrace.model.attention.kv_cache import LayerAttention, PagedAttentionMetadata
from tailrace.model.attention.paged import paged_attention_reference
from tailrace.model.attention.state_cache import StateStep
from tailrace.model.cpu.bf16_linear import pack, pack_float32, padded
from tailrace.model.cpu.int_linear import BLOCK, pack_codes, pack_scales
from tailrace.model.decoder.llama import (GatedRMSNorm, RMSNorm, apply_rotary, choose_experts, gelu_tanh_and_mul,
                                          sigmoid_mul, silu_and_mul, swiglu_oai_and_mul)
from tailrace.model.quant import quantize_int4, quantize_int8

Inputs = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Tolerance:
    """How close a floating output must be to the reference: rtol = atol = 0 is the same values
    (torch.equal, NaN matching NaN); `of_largest`: |got - expected| <= rtol * max|expected| over
    the whole output (int_linear's bound); else torch.testing.assert_close's rtol and atol."""

    rtol: float = 0.0
    atol: float = 0.0
    of_largest: bool = False

    @property
    def exact(self) -> bool:
        return self.rtol == 0.0 and self.atol == 0.0


EXACT = Tolerance()


@dataclass(frozen=True, slots=True)
class KernelOp:
    """One kernel op. make(dtype, generator, **shape) -> inputs, already in the kernel's layout
    (packing is not timed); run(module, inputs) -> the kernel's output(s); reference(inputs) ->
    the same from the project's Python reference. test_shape is small and reaches the tails (widths
    not a whole vector); bench_shape is a model's (SmolLM2-135M's widths), `rows` given apart.
    The in-place ops (mask_tokens, exp_skipping_neg_inf_) run on a copy of their input, whose
    making their time includes."""

    name: str
    dtypes: tuple[str, ...]
    make: Callable[..., Inputs]
    run: Callable[[ModuleType, Inputs], Any]
    reference: Callable[[Inputs], Any]
    tolerance: dict[str, Tolerance]
    test_shape: dict[str, Any]
    bench_shape: dict[str, Any]
    # where AMX tiles serve the avx512 build (module.amx_active()) its bits differ from the AVX2
    # build's loop by this much (csrc/bf16_amx.cpp: another instruction); None: never used
    amx_tolerance: dict[str, Tolerance] = field(default_factory=dict)
    # whether `isa`'s build can run this op on this CPU (int_linear's avx512 build wants VNNI)
    runs_on: Callable[[str], bool] = lambda isa: True


def _dtype(label: str) -> torch.dtype:
    return getattr(torch, label.split("/")[-1])


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# rms_norm
def _make_rms_norm(dtype: str, g: torch.Generator, rows: int, width: int) -> Inputs:
    dt = _dtype(dtype)
    return {"x": (torch.randn(rows, width, generator=g) * 3).to(dt), "weight": torch.randn(width, generator=g).to(dt),
            "eps": 1e-5}


def _rms_norm_reference(i: Inputs) -> torch.Tensor:
    norm = RMSNorm(i["weight"].shape[0], i["eps"], i["weight"].dtype)
    norm.weight.copy_(i["weight"])
    return norm(i["x"])


# rotary: q and k heads as a view into the fused qkv projection's rows, as the model rotates them
def _make_rotary(dtype: str, g: torch.Generator, rows: int, heads: int, head_dim: int) -> Inputs:
    qkv = torch.randn(rows, (heads + 2) * head_dim, generator=g).to(_dtype(dtype))
    qk = qkv[:, : heads * head_dim].view(rows, heads, head_dim)
    angles = torch.outer(torch.arange(rows) * 11.0, 1 / 10000 ** (torch.arange(0, head_dim, 2) / head_dim))
    cos = torch.cat((angles.cos(), angles.cos()), -1)[:, None]
    sin = torch.cat((-angles.sin(), angles.sin()), -1)[:, None]
    return {"qk": qk, "cos": cos, "sin": sin}


# silu_mul, gelu_tanh_mul, swiglu_oai_mul: [rows, 2 * width] -> [rows, width]
def _make_gate_up(dtype: str, g: torch.Generator, rows: int, width: int) -> Inputs:
    gate_up = torch.randn(rows, 2 * width, generator=g) * 6
    if width >= 4:  # exp's clamps and signed zeros, in the gate and in the up half
        gate_up[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0])
        gate_up[0, width:width + 4] = torch.tensor([-200.0, 200.0, -0.0, 0.0])
    return {"gate_up": gate_up.to(_dtype(dtype)), "alpha": 1.702, "limit": 7.0}


# linear: weights packed as Bf16Linear / Float32Linear pack them, bias float32 padded to whole vectors
def _make_linear(dtype: str, g: torch.Generator, rows: int, out_features: int, in_features: int) -> Inputs:
    dt = _dtype(dtype)
    weight = (torch.randn(out_features, in_features, generator=g) * 0.05).to(dt)
    bias = torch.randn(out_features, generator=g).to(dt)
    packed = pack(weight) if dt == torch.bfloat16 else pack_float32(weight)
    return {"x": torch.randn(rows, in_features, generator=g).to(dt), "weight": weight, "bias": bias, "packed": packed,
            "packed_bias": padded(bias.float(), packed.shape[0] * 16)}


def _linear_reference(i: Inputs) -> torch.Tensor:
    """bfloat16: the float32 product of the same bfloat16 values; float32: the float64 one."""
    wide = torch.float32 if i["x"].dtype == torch.bfloat16 else torch.float64
    return F.linear(i["x"].to(wide), i["weight"].to(wide), i["bias"].to(wide))


# int_linear: a float weight through quant.py's quantize_int8 (per row) or quantize_int4 (groups of
# 32, zero points), packed as IntLinear packs it
def _make_int_linear(dtype: str, g: torch.Generator, rows: int, out_features: int, in_features: int) -> Inputs:
    bits = 8 if dtype.startswith("int8") else 4
    quantized = (quantize_int8 if bits == 8 else quantize_int4)(torch.randn(out_features, in_features, generator=g))
    bias = torch.randn(out_features, generator=g)
    return {"x": torch.randn(rows, in_features, generator=g).to(_dtype(dtype)), "bits": bits, "weight": quantized,
            "bias": bias, "codes": pack_codes(quantized.codes), "scales": pack_scales(quantized.scales),
            "zeros": None if quantized.zeros is None else pack_scales(quantized.zeros)}


def activation_codes(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x as the integer kernel rounds it against `bits`-bit weights, in float64: per block of 32,
    int16 codes times max|x| / 32767 (int8 weights) or int8 codes times max|x| / 127 (4-bit)."""
    top = 32767 if bits == 8 else 127
    blocks = x.float().view(x.shape[0], -1, BLOCK)
    largest = blocks.abs().amax(-1, keepdim=True)
    codes = torch.where(largest > 0, torch.round(blocks * (top / largest)), 0)  # a zero block stays 0
    return (codes * (largest / top)).view(x.shape).double()


def _int_linear_reference(i: Inputs) -> torch.Tensor:
    """In float64 over the activation codes the kernel rounds x to."""
    w = i["weight"]
    activations = activation_codes(i["x"], i["bits"])
    out_features, in_features = w.codes.shape
    weight = w.codes.double().view(out_features, w.scales.shape[1], -1) * w.scales.double()[..., None]
    if w.zeros is not None:
        weight = weight + w.zeros.double()[..., None]
    return activations @ weight.view(out_features, in_features).t() + i["bias"].double()


# paged_attention: sequences of `chunk` new rows each (1: decode) after about `context` cached
# positions, their blocks drawn at random from the pages
def _make_paged_attention(dtype: str, g: torch.Generator, rows: int, context: int, chunk: int, kv_heads: int,
                          group: int, head_dim: int, block_size: int) -> Inputs:
    dt = _dtype(dtype)
    q_lens = [min(chunk, rows - start) for start in range(0, rows, chunk)]
    specs = [(context + 5 * s, q_len) for s, q_len in enumerate(q_lens)]  # lengths apart, across block bounds
    counts = [-(-(past + q_len) // block_size) for past, q_len in specs]
    free = torch.randperm(sum(counts) + 3, generator=g).tolist()
    tables = torch.zeros(len(specs), max(counts), dtype=torch.int32)
    for seq, count in enumerate(counts):
        tables[seq, :count] = torch.tensor([free.pop() for _ in range(count)])
    loc = torch.zeros(len(specs) + 1, dtype=torch.int32)
    loc[1:] = torch.tensor(q_lens).cumsum(0)
    seq_lens = torch.tensor([past + q_len for past, q_len in specs], dtype=torch.int32)
    meta = PagedAttentionMetadata(loc, seq_lens, tables, block_size, max(q_lens), len(specs))
    slots = (sum(counts) + 3) * block_size
    return {"q": torch.randn(rows, kv_heads * group, head_dim, generator=g).to(dt),
            "k_pages": torch.randn(slots, kv_heads, head_dim, generator=g).to(dt),
            "v_pages": torch.randn(slots, kv_heads, head_dim, generator=g).to(dt), "meta": meta,
            "scale": head_dim**-0.5}


def _run_paged_attention(module: ModuleType, i: Inputs) -> torch.Tensor:
    m = i["meta"]
    return module.paged_attention(i["q"], i["k_pages"], i["v_pages"], m.query_start_loc, m.seq_lens, m.block_tables,
                                  m.block_size, m.num_seqs, i["scale"])


def _paged_attention_reference(i: Inputs) -> torch.Tensor:
    """paged_attention.py's reference (itself checked against a row-by-row softmax in
    tests/test_paged_attention.py) over the float32 values of the dtype's inputs."""
    return paged_attention_reference(i["q"].float(), i["k_pages"].float(), i["v_pages"].float(), i["meta"],
                                     LayerAttention(i["scale"]))


# greedy_tokens: float32 logit rows with ties, a -inf row and a NaN, as a view of wider rows
def _make_greedy(dtype: str, g: torch.Generator, rows: int, vocab: int) -> Inputs:
    wide = torch.randn(rows, vocab + 5, generator=g)
    wide[0, vocab // 2] = wide[0, :vocab].max()  # a tie with the maximum, or a new one
    if rows > 2:
        wide[1] = float("-inf")
        wide[2, vocab - 1] = float("nan")
    return {"logits": wide[:, :vocab]}


# route_experts: each routing the models use; logits far enough apart that rounding cannot swap two
ROUTINGS = (dict(top_k=2, topk_first=False, normalize=True, float32_weights=False),  # Qwen3-MoE
            dict(top_k=3, topk_first=False, normalize=False, float32_weights=False),
            dict(top_k=2, topk_first=False, normalize=True, float32_weights=True),  # Mixtral
            dict(top_k=4, topk_first=True, normalize=False, float32_weights=False))  # gpt-oss


def _make_route_experts(dtype: str, g: torch.Generator, rows: int, experts: int) -> Inputs:
    logits = torch.stack([torch.randperm(experts, generator=g) for _ in range(rows)]).float() * 0.3 - 1
    return {"logits": logits.to(_dtype(dtype))}


# mask_tokens: grammar bitmasks (bit j of word w allows token 32 w + j) applied to some rows in place
def _make_mask_tokens(dtype: str, g: torch.Generator, rows: int, vocab: int) -> Inputs:
    masked = list(range(0, rows, 2))
    allowed = torch.rand(len(masked), -(-vocab // 32) * 32, generator=g) < 0.1
    allowed[:, vocab:] = False  # llguidance never allows a column past the model's vocabulary
    words = np.packbits(allowed.numpy(), axis=1, bitorder="little").view(np.int32)
    return {"logits": torch.randn(rows, vocab, generator=g) * 3, "rows": masked,
            "bitmask": torch.from_numpy(words.copy()), "allowed": allowed[:, :vocab]}


def _run_mask_tokens(module: ModuleType, i: Inputs) -> torch.Tensor:
    logits = i["logits"].clone()
    module.mask_tokens(logits, i["bitmask"], i["rows"])
    return logits


def _mask_tokens_reference(i: Inputs) -> torch.Tensor:
    logits = i["logits"].clone()
    logits[i["rows"]] = logits[i["rows"]].masked_fill(~i["allowed"], float("-inf"))
    return logits


# exp_skipping_neg_inf_: x.exp_() where some rows are mostly -inf (masked rows before sampling)
def _make_exp(dtype: str, g: torch.Generator, rows: int, vocab: int) -> Inputs:
    x = torch.randn(rows, vocab, generator=g) * 20 - 10
    skipped = list(range(1, rows, 2))
    for row in skipped:
        x[row, torch.rand(vocab, generator=g) < 0.9] = float("-inf")
    x[0, 0] = float("nan")
    return {"x": x, "rows": skipped}


def _run_exp(module: ModuleType, i: Inputs) -> torch.Tensor:
    x = i["x"].clone()
    module.exp_skipping_neg_inf_(x, i["rows"])
    return x


# causal_conv and delta_rule: sequences of 1 to 5 rows in state rows drawn at random, each
# continuing a random state, every other one capturing the state after some of its rows into a row
# of its own; the output and the states after, from copies of the states
def _sequences(g: torch.Generator, rows: int, slots: int) -> StateStep:
    lengths, start = [], 0
    while start < rows:
        lengths.append(min(rows - start, 1 + len(lengths) % 5))
        start += lengths[-1]
    starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    chosen = torch.randperm(slots, generator=g)[:2 * len(lengths)].tolist()
    captures = [1 + i % n if i % 2 else 0 for i, n in enumerate(lengths)]
    bounds = [(starts[i], starts[i + 1], chosen[i], captures[i], chosen[len(lengths) + i]) for i in range(len(lengths))]
    return StateStep(torch.tensor(starts), *(torch.tensor([bound[i] for bound in bounds]) for i in (2, 3, 4)), bounds)


def _make_causal_conv(dtype: str, g: torch.Generator, rows: int, channels: int, kernel: int) -> Inputs:
    dt, slots = _dtype(dtype), 2 * rows + 2
    return {"x": torch.randn(rows, channels, generator=g).to(dt), "weight": (torch.randn(channels, kernel, generator=g)
            * 0.5).to(dt), "states": torch.randn(slots, kernel - 1, channels, generator=g).to(dt),
            "step": _sequences(g, rows, slots)}


def _make_delta_rule(dtype: str, g: torch.Generator, rows: int, key_heads: int, value_heads: int, key: int,
                     value: int) -> Inputs:
    dt, slots = _dtype(dtype), 2 * rows + 2
    # q, k and v views of one row, and a, b of another, as the model has them
    q, k, v = torch.randn(rows, 2 * key_heads * key + value_heads * value, generator=g).to(dt).split(
        [key_heads * key, key_heads * key, value_heads * value], dim=1)
    a, b = (torch.randn(rows, 2 * value_heads, generator=g) * 2).to(dt).split(value_heads, dim=1)
    return {"q": q.view(rows, key_heads, key), "k": k.view(rows, key_heads, key), "v": v.view(rows, value_heads, value),
            "a": a, "b": b, "decay_rate": -torch.rand(value_heads, generator=g) * 4, "dt_bias": torch.randn(value_heads,
            generator=g).to(dt), "states": torch.randn(slots, value_heads, key, value, generator=g) * 0.1,
            "step": _sequences(g, rows, slots)}


def _step_args(i: Inputs) -> list[torch.Tensor]:
    step = i["step"]
    return [step.starts, step.slots, step.captures, step.capture_slots]


def _rule_args(i: Inputs, tiled: bool) -> list[Any]:
    return [*(i[name] for name in ("q", "k", "v", "a", "b", "decay_rate", "dt_bias")), tiled]


def _make_gated_norm(dtype: str, g: torch.Generator, rows: int, heads: int, width: int) -> Inputs:
    dt = _dtype(dtype)
    z = torch.randn(rows, 3 * heads * width, generator=g).to(dt)[:, heads * width:2 * heads * width]  # a view
    return {"x": torch.randn(rows, heads, width, generator=g), "z": z.view(rows, heads, width),
            "weight": torch.rand(width, generator=g).to(dt) + 0.5, "eps": 1e-6}


def _make_sigmoid_mul(dtype: str, g: torch.Generator, rows: int, width: int) -> Inputs:
    dt = _dtype(dtype)
    return {"x": torch.randn(rows, width, generator=g).to(dt), "gate": torch.randn(rows, width, generator=g).to(dt) * 3,
            "row_gate": torch.randn(rows, 1, generator=g).to(dt) * 3}


def _gated_norm_reference(i: Inputs) -> torch.Tensor:
    norm = GatedRMSNorm(i["weight"].shape[0], i["eps"], i["weight"].dtype)
    norm.weight.data.copy_(i["weight"])
    return norm(i["x"], i["z"])


def _with_states(run: Callable[[torch.Tensor], torch.Tensor], i: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    states = i["states"].clone()
    return run(states), states


BF16_F32 = ("bfloat16", "float32")
SMOLLM = dict(hidden=576, intermediate=1536, heads=9, kv_heads=3, head_dim=64, vocab=49152)
QWEN35 = dict(key_heads=16, value_heads=16, conv_channels=6144)  # Qwen3.5-0.8B's Gated DeltaNet

OPS: tuple[KernelOp, ...] = (
    KernelOp("rms_norm", BF16_F32, _make_rms_norm,
             lambda m, i: m.rms_norm(i["x"], i["weight"], i["eps"]), _rms_norm_reference,
             {"bfloat16": EXACT, "float32": Tolerance(1e-5, 1e-5)},
             dict(rows=9, width=100), dict(width=SMOLLM["hidden"])),
    KernelOp("rotary", BF16_F32, _make_rotary,
             lambda m, i: m.rotary(i["qk"], i["cos"], i["sin"]), lambda i: apply_rotary(i["qk"], i["cos"], i["sin"]),
             {"bfloat16": EXACT, "float32": Tolerance(1e-5, 1e-5)},
             dict(rows=6, heads=5, head_dim=32), dict(heads=SMOLLM["heads"] + SMOLLM["kv_heads"], head_dim=64)),
    KernelOp("silu_mul", BF16_F32, _make_gate_up,
             lambda m, i: m.silu_mul(i["gate_up"]), lambda i: silu_and_mul(i["gate_up"]),
             {"bfloat16": EXACT, "float32": Tolerance(1e-5, 1e-5)},
             dict(rows=3, width=200), dict(width=SMOLLM["intermediate"])),
    # GELU's tanh as g / (1 + e^-2u), not torch's tanh: within a rounding (bfloat16: one ulp apart before the product)
    KernelOp("gelu_tanh_mul", BF16_F32, _make_gate_up,
             lambda m, i: m.gelu_tanh_mul(i["gate_up"]), lambda i: gelu_tanh_and_mul(i["gate_up"]),
             {"bfloat16": Tolerance(1e-2, 1e-2), "float32": Tolerance(1e-5, 1e-5)},
             dict(rows=3, width=200), dict(width=SMOLLM["intermediate"])),
    # its sigmoid by the kernels' exp, not torch's: within a rounding
    KernelOp("swiglu_oai_mul", BF16_F32, _make_gate_up,
             lambda m, i: m.swiglu_oai_mul(i["gate_up"], alpha=i["alpha"], limit=i["limit"]),
             lambda i: swiglu_oai_and_mul(i["gate_up"], alpha=i["alpha"], limit=i["limit"]),
             {"bfloat16": Tolerance(1e-2, 1e-2), "float32": Tolerance(1e-5, 1e-5)},
             dict(rows=3, width=200), dict(width=SMOLLM["intermediate"])),
    # bfloat16: float32 sums rounded once, within half an ulp of 2^-8; float32 against float64
    KernelOp("linear", BF16_F32, _make_linear,
             lambda m, i: m.linear(i["x"], i["packed"], i["packed_bias"], i["weight"].shape[0]), _linear_reference,
             {"bfloat16": Tolerance(2**-8, 1e-2), "float32": Tolerance(1e-5, 1e-4)},
             dict(rows=13, out_features=100, in_features=576),
             dict(out_features=SMOLLM["intermediate"], in_features=SMOLLM["hidden"]),
             amx_tolerance={"bfloat16": Tolerance(2**-7, 1e-2)}),
    # float32 sums of a block each (bfloat16 adds the output's rounding), against the largest output
    KernelOp("int_linear", ("int8/bfloat16", "int8/float32", "int4/bfloat16", "int4/float32"), _make_int_linear,
             lambda m, i: m.int_linear(i["x"], i["codes"], None, i["scales"], i["zeros"], None, None, i["bias"],
                                       i["weight"].codes.shape[0]),
             _int_linear_reference,
             {label: Tolerance(1e-5 if label.endswith("float32") else 2**-8, 0.0, of_largest=True)
              for label in ("int8/bfloat16", "int8/float32", "int4/bfloat16", "int4/float32")},
             dict(rows=7, out_features=100, in_features=6 * BLOCK),
             dict(out_features=SMOLLM["intermediate"], in_features=SMOLLM["hidden"]),
             runs_on=lambda isa: isa != "avx512" or torch.cpu._is_vnni_supported()),
    KernelOp("paged_attention", BF16_F32, _make_paged_attention, _run_paged_attention, _paged_attention_reference,
             {"bfloat16": Tolerance(2e-2, 2e-2), "float32": Tolerance(1e-5, 1e-5)},
             dict(rows=12, context=37, chunk=5, kv_heads=2, group=3, head_dim=32, block_size=16),
             dict(context=512, chunk=1, kv_heads=SMOLLM["kv_heads"], group=SMOLLM["heads"] // SMOLLM["kv_heads"],
                  head_dim=SMOLLM["head_dim"], block_size=16)),
    # the index torch.max(dim=1) gives, ties, -inf rows and NaN included
    KernelOp("greedy_tokens", ("float32",), _make_greedy,
             lambda m, i: m.greedy_tokens(i["logits"]), lambda i: i["logits"].max(dim=1).indices,
             {"float32": EXACT}, dict(rows=5, vocab=1003), dict(vocab=SMOLLM["vocab"])),
    # the same experts in the same order, weights within a rounding
    KernelOp("route_experts", BF16_F32, _make_route_experts,
             lambda m, i: [m.route_experts(i["logits"], **r) for r in ROUTINGS],
             lambda i: [choose_experts(i["logits"], **r) for r in ROUTINGS],
             {"bfloat16": Tolerance(1e-2, 1e-5), "float32": Tolerance(1e-2, 1e-5)},
             dict(rows=40, experts=8), dict(experts=128)),
    KernelOp("mask_tokens", ("float32",), _make_mask_tokens, _run_mask_tokens, _mask_tokens_reference,
             {"float32": EXACT}, dict(rows=5, vocab=1003), dict(vocab=SMOLLM["vocab"])),
    KernelOp("exp_skipping_neg_inf", ("float32",), _make_exp, _run_exp, lambda i: i["x"].exp(),
             {"float32": EXACT}, dict(rows=5, vocab=1003), dict(vocab=SMOLLM["vocab"])),
    # SiLU by the kernels' exp, not torch's: within a rounding of the dtype (the states are copies)
    KernelOp("causal_conv", BF16_F32, _make_causal_conv,
             lambda m, i: _with_states(lambda s: m.causal_conv(i["x"], i["weight"], s, *_step_args(i)), i),
             lambda i: _with_states(lambda s: gated_delta.causal_conv(i["x"], i["weight"], s, i["step"]), i),
             {"bfloat16": Tolerance(1e-2, 1e-2), "float32": Tolerance(1e-5, 1e-5)},
             dict(rows=13, channels=100, kernel=4), dict(channels=QWEN35["conv_channels"], kernel=4)),
    # float32 throughout, the sums in another order than torch's reductions; value heads grouped and tiled
    KernelOp("delta_rule", BF16_F32, _make_delta_rule,
             lambda m, i: [_with_states(lambda s: m.delta_rule(*_rule_args(i, tiled), s, *_step_args(i)), i)
                           for tiled in (False, True)],
             lambda i: [_with_states(lambda s: gated_delta.delta_rule(*_rule_args(i, tiled), s, i["step"]), i)
                        for tiled in (False, True)],
             {"bfloat16": Tolerance(1e-4, 1e-4), "float32": Tolerance(1e-4, 1e-4)},
             dict(rows=13, key_heads=2, value_heads=4, key=16, value=24),
             dict(key_heads=QWEN35["key_heads"], value_heads=QWEN35["value_heads"], key=128, value=128)),
    # SiLU by the kernels' exp, not torch's: within a rounding
    KernelOp("gated_norm", BF16_F32, _make_gated_norm,
             lambda m, i: m.gated_norm(i["x"], i["z"], i["weight"], i["eps"]),
             lambda i: _gated_norm_reference(i),
             {"bfloat16": Tolerance(1e-2, 1e-2), "float32": Tolerance(1e-5, 1e-5)},
             dict(rows=5, heads=3, width=40), dict(heads=QWEN35["value_heads"], width=128)),
    # the sigmoid by the kernels' exp: within a rounding; a gate per element and one per row
    KernelOp("sigmoid_mul", BF16_F32, _make_sigmoid_mul,
             lambda m, i: [m.sigmoid_mul(i["x"], i["gate"]), m.sigmoid_mul(i["x"], i["row_gate"])],
             lambda i: [sigmoid_mul(i["x"], i["gate"]), sigmoid_mul(i["x"], i["row_gate"])],
             {"bfloat16": Tolerance(1e-2, 1e-2), "float32": Tolerance(1e-5, 1e-5)},
             dict(rows=7, width=100), dict(width=SMOLLM["hidden"])),
)

BY_NAME = {op.name: op for op in OPS}


def cases() -> list[tuple[KernelOp, str]]:
    """Every op x dtype."""
    return [(op, dtype) for op in OPS for dtype in op.dtypes]


def make_inputs(op: KernelOp, dtype: str, seed: int = 0, **shape: Any) -> Inputs:
    """op's inputs at `shape` (its test_shape where none is given), seeded."""
    return op.make(dtype, _gen(seed), **(shape or op.test_shape))


def flat(outputs: Any) -> list[torch.Tensor]:
    """An op's output(s) as a flat list of tensors."""
    if isinstance(outputs, torch.Tensor):
        return [outputs]
    return [t for o in outputs for t in flat(o)]


def mismatch(got: Any, expected: Any, tolerance: Tolerance) -> str | None:
    """None where `got` matches `expected` (integer outputs exactly, floating ones within
    `tolerance`), else what differs."""
    got, expected = flat(got), flat(expected)
    if len(got) != len(expected):
        return f"{len(got)} outputs, {len(expected)} expected"
    for n, (a, b) in enumerate(zip(got, expected)):
        if a.shape != b.shape:
            return f"output {n}: shape {tuple(a.shape)}, {tuple(b.shape)} expected"
        if not a.is_floating_point() or tolerance.exact:
            if a.dtype != b.dtype:
                return f"output {n}: dtype {a.dtype}, {b.dtype} expected"
            same = (a == b) | (a.isnan() & b.isnan()) if a.is_floating_point() else a == b
            if not bool(same.all()):
                return f"output {n}: {int((~same).sum())} of {a.numel()} values differ"
            continue
        a64, b64 = a.double(), b.double()
        if tolerance.of_largest:
            error, bound = (a64 - b64).abs().max().item(), tolerance.rtol * b64.abs().max().item()
            if not error <= bound:
                return f"output {n}: largest error {error:.3g} over {bound:.3g}"
            continue
        try:
            torch.testing.assert_close(a64, b64, rtol=tolerance.rtol, atol=tolerance.atol, equal_nan=True)
        except AssertionError as error:
            return f"output {n}: {error}"
    return None


def same_bits(got: Any, other: Any) -> str | None:
    """None where two builds' outputs are the same bits (NaN payloads aside), else what differs."""
    for n, (a, b) in enumerate(zip(flat(got), flat(other), strict=True)):
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"output {n}: {a.dtype} {tuple(a.shape)} against {b.dtype} {tuple(b.shape)}"
        if a.is_floating_point():
            as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
            same = (a.contiguous().view(as_int) == b.contiguous().view(as_int)) | (a.isnan() & b.isnan())
        else:
            same = a == b
        if not bool(same.all()):
            return f"output {n}: {int((~same).sum())} of {a.numel()} values differ"
    return None


def build_tolerance(op: KernelOp, dtype: str, modules: Sequence[ModuleType]) -> Tolerance:
    """How far the builds in `modules` may part on op at dtype: the same bits (csrc/avx2.h), but
    for AMX tiles serving one of them where the op takes them."""
    amx = dtype in op.amx_tolerance and any(m.amx_active() for m in modules)
    return op.amx_tolerance[dtype] if amx else EXACT
