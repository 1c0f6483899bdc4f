import json
import subprocess

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter, ReaderTensor
from gguf.quants import dequantize, quantize
from gguf_writer import EMBEDDED, llama_permute, write_gguf, write_out

from tailrace.bench.peers.llamacpp import convert_command
from tailrace.model.cpu import int_linear
from tailrace.model.cpu.kernel_ops import activation_codes, same_bits
from tailrace.model.cpu.kernels import load_build
from tailrace.model.decoder.llama import Linear
from tailrace.model.loading import gguf as tailrace_gguf
from tailrace.model.loading.gguf_file import GgufFile
from tailrace.model.loading.gguf_quant import (PACKED_IN_ONE_PASS, decode_blocks, describe_blocks, lookup_table, quantized_linear, stacked_linear,
                                               unpermute_rotary_rows, use_gguf_blocks)
from tailrace.model.loading.loader import load_model

OUT, IN = 48, 512  # two K-quant super-blocks per row; rows in tiles of 16 for the int4 kernel
needs_kernel = pytest.mark.skipif(not int_linear.available(), reason="runs on tailrace's kernel only")
# bfloat16 keeps 8 significant bits: activations, scales and outputs each round by up to 2^-9.
BF16_RTOL = 1e-2
# Where each K-quant's blocks keep their float16 fields (d, and dmin).
FLOAT16_FIELDS = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
# Where the others' blocks keep theirs (d, and m; MXFP4's exponent byte at 0).
SCALE_FIELDS = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,), Q.MXFP4: (0,),
                **FLOAT16_FIELDS}
PORTABLE = [Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q8_0]  # PyTorch's kernels take them too
KERNEL_ONLY = [Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q5_K, Q.Q6_K, Q.MXFP4]
MAPPED = PORTABLE + [pytest.param(t, marks=needs_kernel) for t in KERNEL_ONLY]


def _raw(tensor_type: Q, shape: tuple[int, int] = (OUT, IN), seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if tensor_type not in FLOAT16_FIELDS:
        return quantize((rng.standard_normal(shape) * 0.02).astype(np.float32), tensor_type)
    # gguf has no K-quant quantizer: random super-blocks (any code, scale and min bytes are valid),
    # with float16 fields of a real weight's size.
    block_size, type_size = GGML_QUANT_SIZES[tensor_type]
    blocks = rng.integers(0, 256, (shape[0] * shape[1] // block_size, type_size), dtype=np.uint8)
    for at in FLOAT16_FIELDS[tensor_type]:
        blocks[:, at:at + 2] = rng.uniform(1e-5, 1e-3, (blocks.shape[0], 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(shape[0], -1)


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).norm() / expected.norm())


@pytest.mark.parametrize("tensor_type", MAPPED)
def test_layer_matches_linear_over_gguf_dequantized_weight(tensor_type: Q) -> None:
    raw = _raw(tensor_type)
    weight = torch.from_numpy(dequantize(raw, tensor_type))
    x = torch.randn(5, IN).to(torch.bfloat16).float()
    layer = quantized_linear(tensor_type, raw, (OUT, IN))
    assert _relative_error(layer(x), F.linear(x, weight)) < BF16_RTOL


@pytest.mark.parametrize("tensor_type", PORTABLE + KERNEL_ONLY)
def test_codes_dequantize_bit_exactly_to_gguf(tensor_type: Q) -> None:
    raw = _raw(tensor_type)
    expected = torch.from_numpy(dequantize(raw, tensor_type)).reshape(OUT, IN)
    assert torch.equal(decode_blocks(tensor_type, raw, (OUT, IN)).dequantize(), expected)


def _one_hot_rows(layer: torch.nn.Module, count: int) -> torch.Tensor:
    """The weights a layer multiplies by, as it multiplies them: its outputs for the first `count`
    unit inputs (an input's one block of codes is then 127 at one place, times 1/127)."""
    return layer(torch.eye(IN)[:count]).t()


@needs_kernel
@pytest.mark.parametrize("tensor_type", PORTABLE + KERNEL_ONLY)
def test_the_kernel_multiplies_by_the_files_own_weights(tensor_type: Q) -> None:
    """Exact, as llama.cpp's reference dequantization (gguf's) defines the weights: each product
    within float32 rounding of it, for the extreme codes, scales and mins as for random ones."""
    for fill in (None, 0x00, 0x80, 0xFF):
        raw = _raw(tensor_type)
        if fill is not None:  # every code, scale and min byte at one extreme, the float16 fields kept
            blocks = raw.reshape(-1, GGML_QUANT_SIZES[tensor_type][1])
            kept = {at: blocks[:, at:at + 2].copy() for at in SCALE_FIELDS[tensor_type]}
            blocks[:] = fill
            for at, field in kept.items():
                blocks[:, at:at + 2] = field
        expected = torch.from_numpy(dequantize(raw, tensor_type)).reshape(OUT, IN)[:, :64]
        got = _one_hot_rows(quantized_linear(tensor_type, raw, (OUT, IN)), 64)
        ulps = (got - expected).abs() / torch.finfo(torch.float32).eps
        assert bool((ulps <= 2 * expected.abs().clamp(min=torch.finfo(torch.float32).tiny)).all()), fill


@needs_kernel
@pytest.mark.parametrize("tensor_type", PACKED_IN_ONE_PASS)
def test_one_pass_packing_gives_the_decoders_buffers(tensor_type: Q) -> None:
    """csrc/gguf_blocks.cpp against decode_blocks then IntLinear's packing, buffer for buffer, with
    rows not in whole vectors (the padding) and the extreme bytes as random ones."""
    rows = 40
    for fill in (None, 0xFF):
        raw = _raw(tensor_type, (rows, IN), seed=6)
        if fill is not None:
            blocks = raw.reshape(-1, GGML_QUANT_SIZES[tensor_type][1])
            kept = {at: blocks[:, at:at + 2].copy() for at in SCALE_FIELDS[tensor_type]}
            blocks[:] = fill
            for at, field in kept.items():
                blocks[:, at:at + 2] = field
        packed = quantized_linear(tensor_type, raw, (rows, IN))
        weight = decode_blocks(tensor_type, raw, (rows, IN))
        reference = int_linear.IntLinear(weight.codes, weight.scales, weight.zeros, None, sub=weight.sub,
                                         mins=weight.mins, width=weight.width)
        for name in ("codes", "high", "scales", "zeros", "sub", "mins"):
            ours, theirs = getattr(packed, name), getattr(reference, name)
            assert (ours is None) == (theirs is None), name
            assert ours is None or torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8)), name


@pytest.mark.parametrize("tensor_type", KERNEL_ONLY)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_kernel_build_gives_the_same_bits_and_the_dequantized_product(tensor_type: Q, dtype) -> None:
    """The avx512 and avx2 builds (tests/test_backend_ops.py's, for the types only GGUF's blocks
    make) against the product of gguf's weights with the activations as the kernel rounds them,
    and against each other bit for bit, at 1 row (a decode step's tiles) and at 7."""
    builds = [load_build(isa) for isa in ("avx512", "avx2")]
    if None in builds or not torch.cpu._is_vnni_supported():
        pytest.skip("this CPU does not run both builds")
    raw = _raw(tensor_type, seed=4)
    layer = quantized_linear(tensor_type, raw, (OUT, IN), torch.randn(OUT))
    weight = torch.from_numpy(dequantize(raw, tensor_type)).reshape(OUT, IN).double()
    for rows in (1, 7):
        x = torch.randn(rows, IN).to(dtype)
        first, second = (build.int_linear(x, layer.codes, layer.high, layer.scales, layer.zeros, layer.sub,
                                          layer.mins, layer.bias, OUT) for build in builds)
        assert same_bits(first, second) is None
        expected = activation_codes(x, 4) @ weight.t() + layer.bias.double()
        assert float((first.double() - expected).abs().max()) <= (2**-8 if dtype == torch.bfloat16 else 1e-5) * float(
            expected.abs().max())


def test_q8_0_codes_at_int8_extremes_decode_exactly() -> None:
    raw = _raw(Q.Q8_0).reshape(-1, 34).copy()
    raw[:, 2:] = np.array([-128, 127, 0, -1] * 8, dtype=np.int8).view(np.uint8)
    expected = torch.from_numpy(dequantize(raw, Q.Q8_0)).reshape(OUT, IN)
    assert torch.equal(decode_blocks(Q.Q8_0, raw, (OUT, IN)).dequantize(), expected)


@needs_kernel
def test_mxfp4_scales_past_float16_are_refused_and_below_it_give_zeros() -> None:
    raw = _raw(Q.MXFP4).reshape(-1, 17).copy()
    raw[0, 0] = 103  # 2^-25: below float16's subnormals
    weight = decode_blocks(Q.MXFP4, raw, (OUT, IN))
    assert weight.e2m1 and weight.zeros is None
    assert quantized_linear(Q.MXFP4, raw, (OUT, IN)).scales.view(-1)[0] == 0
    raw[1, 0] = 144  # 2^16
    with pytest.raises(ValueError, match="past float16's range"):
        decode_blocks(Q.MXFP4, raw, (OUT, IN))


def test_unpermuting_raw_rows_undoes_llama_cpp_rotary_permute() -> None:
    heads, weight = 3, np.random.default_rng(1).standard_normal((OUT, IN)).astype(np.float32)
    assert np.array_equal(unpermute_rotary_rows(quantize(llama_permute(weight, heads), Q.Q4_0), heads),
                          quantize(weight, Q.Q4_0))


def _read_back(path: str, tensors: dict[str, tuple[Q, np.ndarray]]) -> dict[str, ReaderTensor]:
    writer = GGUFWriter(path, "llama")
    for name, (tensor_type, raw) in tensors.items():
        writer.add_tensor(name, raw, raw_dtype=tensor_type)
    write_out(writer)
    return {tensor.name: tensor for tensor in GgufFile.read(str(path)).tensors}


def test_reader_tensor_decodes_as_written(tmp_path) -> None:
    raw = _raw(Q.Q4_1)
    tensor = _read_back(str(tmp_path / "w.gguf"), {"w": (Q.Q4_1, raw)})["w"]
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    read, written = (decode_blocks(Q.Q4_1, data, shape) for data in (tensor.data, raw))
    assert all(torch.equal(getattr(read, field), getattr(written, field)) for field in ("codes", "scales", "zeros"))


@needs_kernel
def test_parts_of_different_types_give_their_outputs_side_by_side(tmp_path) -> None:
    """A Q4_K_M file's qkv_proj: q and k in Q4_K stacked, v in Q6_K beside them, each the file's
    own weights; parts of other types than the last in whole tiles of rows only."""
    q, k, v = _raw(Q.Q4_K, (64, IN), 1), _raw(Q.Q4_K, (64, IN), 2), _raw(Q.Q6_K, (OUT, IN), 3)
    parts = _read_back(str(tmp_path / "w.gguf"), {"blk.0.attn_q.weight": (Q.Q4_K, q), "blk.0.attn_k.weight": (Q.Q4_K, k),
                                                  "blk.0.attn_v.weight": (Q.Q6_K, v)})
    bias = torch.randn(128 + OUT)
    layer = stacked_linear(list(parts.values()), {}, bias)
    assert isinstance(layer, int_linear.IntLinearParts) and [p.out_features for p in layer.parts] == [128, OUT]
    weight = torch.cat([torch.from_numpy(dequantize(raw, t)).reshape(-1, IN) for raw, t in
                        ((q, Q.Q4_K), (k, Q.Q4_K), (v, Q.Q6_K))])
    x = torch.randn(3, IN)
    expected = activation_codes(x, 4) @ weight.double().t() + bias.double()
    assert float((layer(x).double() - expected).abs().max()) <= 1e-5 * float(expected.abs().max())
    ragged = _read_back(str(tmp_path / "r.gguf"), {"blk.0.attn_k.weight": (Q.Q4_K, q[:OUT]),
                                                   "blk.0.attn_v.weight": (Q.Q6_K, v)})
    assert stacked_linear(list(ragged.values()), {}, None) is None


def test_type_without_block_mapping_returns_none() -> None:
    assert quantized_linear(Q.IQ4_XS, np.zeros((OUT, IN // 256 * 136), dtype=np.uint8), (OUT, IN)) is None


def test_rows_not_in_tiles_of_16_return_none_without_tailraces_kernel(monkeypatch) -> None:
    monkeypatch.setattr(int_linear, "available", lambda: False)
    assert quantized_linear(Q.Q4_0, _raw(Q.Q4_0, (40, IN)), (40, IN)) is None


@pytest.mark.parametrize("tensor_type", KERNEL_ONLY)
def test_types_only_tailraces_kernel_takes_return_none_without_it(monkeypatch, tensor_type: Q) -> None:
    """PyTorch's 4-bit kernel counts its codes up from zero over 4 bits with a float scale per 32:
    E2M1's index a table, Q5's have 5 bits, Q6_K's, Q3_K's and Q2_K's scales are per 16."""
    monkeypatch.setattr(int_linear, "available", lambda: False)
    assert quantized_linear(tensor_type, _raw(tensor_type), (OUT, IN)) is None


def test_q4_k_without_tailraces_kernel_takes_pytorchs_with_its_scale_products(monkeypatch) -> None:
    monkeypatch.setattr(int_linear, "available", lambda: False)
    raw = _raw(Q.Q4_K)
    x = torch.randn(5, IN).to(torch.bfloat16).float()
    expected = F.linear(x, torch.from_numpy(dequantize(raw, Q.Q4_K)))
    assert _relative_error(quantized_linear(Q.Q4_K, raw, (OUT, IN))(x), expected) < BF16_RTOL


@pytest.fixture(scope="module", params=[Q.Q4_0, Q.Q8_0], ids=["Q4_0", "Q8_0"])
def tiny_gguf(request, tmp_path_factory) -> tuple[dict[str, torch.nn.Module], dict[str, torch.nn.Module], list[str]]:
    """The embedded model's GGUF: (the dequantizing loader's projections, the block-built ones, replaced names)."""
    path = str(write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", request.param))
    model, _ = load_model(path, dtype="float32")
    floats = {name: module for name, module in model.named_modules() if isinstance(module, Linear)}
    embedding = model.model.embed_tokens.weight.detach().clone()
    floats["lm_head"] = lambda x: F.linear(x, embedding)
    replaced = use_gguf_blocks(model, GgufFile.read(str(path)))
    return floats, dict(model.named_modules()), replaced


def test_every_projection_and_the_tied_head_come_from_blocks(tiny_gguf) -> None:
    floats, _, replaced = tiny_gguf
    assert sorted(replaced) == sorted(floats)


def test_block_built_projections_match_the_dequantizing_loaders(tiny_gguf) -> None:
    """Fused q/k/v and gate/up rows stack in the loader's order, q and k rows unpermuted."""
    floats, modules, replaced = tiny_gguf
    torch.manual_seed(0)  # the int4 kernel's int8 activations put an unlucky draw near the bound
    for name in replaced:
        x = torch.randn(3, modules[name].in_features).to(torch.bfloat16).float()
        assert _relative_error(modules[name](x), floats[name](x)) < BF16_RTOL, name


def test_quantized_load_of_a_gguf_takes_the_files_codes(tmp_path) -> None:
    """Not a requantization of the dequantized weights: the same packed codes, scales and zeros."""
    path = str(write_gguf(tmp_path / "tiny.gguf", Q.Q4_0))
    model, _ = load_model(path, quantization="int4")
    tensor = next(t for t in GgufFile.read(str(path)).tensors if t.name == "blk.0.attn_output.weight")
    expected = quantized_linear(Q.Q4_0, tensor.data, (int(tensor.shape[1]), int(tensor.shape[0])))
    loaded = dict(model.model.layers[0].self_attn.o_proj.named_buffers())
    assert loaded.keys() == dict(expected.named_buffers()).keys()
    assert all(torch.equal(loaded[name], buffer) for name, buffer in expected.named_buffers())


def test_a_quantized_gguf_is_served_from_its_blocks_unless_floats_are_asked_for(tmp_path) -> None:
    """No --quantization: the file's own (loader.resolve_quantization), the engine's model the one
    `--quantization int8` loads; `none` loads floats."""
    from tailrace import LLM, SamplingParams

    path = str(write_gguf(tmp_path / "tiny.gguf", Q.Q4_0))
    unasked, int8, floats = (LLM(path, threads=1, dtype="float32", **extra)
                             for extra in ({}, {"quantization": "int8"}, {"quantization": "none"}))
    models = [llm.core.runner.model for llm in (unasked, int8, floats)]
    ours, theirs = models[0].state_dict(), models[1].state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[name], theirs[name]) for name in ours)
    sizes = [sum(t.nbytes for t in model.state_dict().values()) for model in models]
    assert sizes[0] == sizes[1] < 0.6 * sizes[2]  # the embedding table is float in all three
    params = SamplingParams(max_tokens=8, temperature=0)
    assert [o.outputs[0].token_ids for o in unasked.generate(["Once upon a time"], params)] == \
        [o.outputs[0].token_ids for o in int8.generate(["Once upon a time"], params)]


@needs_kernel
@pytest.mark.parametrize("tensor_type", PORTABLE + KERNEL_ONLY)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_lookups_in_codes_give_gguf_dequantized_rows_rounded_once(tensor_type: Q, dtype) -> None:
    """IntEmbedding over a table's blocks: each row the float32 values gguf's dequantization
    gives, rounded to the dtype, as a table dequantized at load holds them."""
    raw = _raw(tensor_type)
    table = torch.from_numpy(dequantize(raw, tensor_type)).reshape(OUT, IN).to(dtype)
    lookup = int_linear.IntEmbedding(quantized_linear(tensor_type, raw, (OUT, IN)), dtype)
    ids = torch.tensor([[0, 17, OUT - 1], [5, 5, 40]])
    assert torch.equal(lookup(ids), table[ids])
    assert torch.equal(lookup(torch.arange(OUT)), table)


@needs_kernel
@pytest.mark.parametrize("tensor_type", [Q.Q8_0, Q.Q4_0, Q.Q5_1])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_tied_table_is_held_once_and_looked_up_as_the_float_load_reads_it(tmp_path, tensor_type, dtype,
                                                                            monkeypatch) -> None:
    """The head's codes serve the lookups (IntEmbedding), row for row the values the dequantizing
    loader puts in the table, which it neither reads nor keeps beside them."""
    path = str(write_gguf(tmp_path / "tiny.gguf", tensor_type))
    floats, config = load_model(path, dtype=dtype)
    dequantized = []
    real = tailrace_gguf.stored
    monkeypatch.setattr(tailrace_gguf, "stored", lambda tensor: dequantized.append(tensor.name) or real(tensor))
    blocks, _ = load_model(path, dtype=dtype, quantization="int8")
    assert dequantized and "token_embd.weight" not in dequantized
    lookup = blocks.model.embed_tokens
    assert isinstance(lookup, int_linear.IntEmbedding) and lookup.codes is blocks.lm_head.codes
    assert not any(t.dtype == floats.dtype and t.shape == (config.vocab_size, config.hidden_size)
                   for t in blocks.state_dict().values())
    ids = torch.arange(config.vocab_size)
    assert torch.equal(lookup(ids), floats.model.embed_tokens(ids))


@needs_kernel
def test_an_untied_table_is_looked_up_in_its_own_codes(tmp_path, monkeypatch) -> None:
    """With a head of its own (here float32), the table's blocks serve the lookups and are never
    dequantized whole."""
    config = json.loads((EMBEDDED / "config.json").read_text())
    head = np.random.default_rng(0).standard_normal((config["vocab_size"], config["hidden_size"])).astype(np.float32)
    path = str(write_gguf(tmp_path / "tiny.gguf", Q.Q8_0, extra_tensors={"output.weight": head}))
    floats, _ = load_model(path, dtype="float32")
    dequantized = []
    real = tailrace_gguf.stored
    monkeypatch.setattr(tailrace_gguf, "stored", lambda tensor: dequantized.append(tensor.name) or real(tensor))
    blocks, _ = load_model(path, dtype="float32", quantization="int8")
    assert "token_embd.weight" not in dequantized
    lookup = blocks.model.embed_tokens
    assert isinstance(lookup, int_linear.IntEmbedding) and lookup.codes is not getattr(blocks.lm_head, "codes", None)
    ids = torch.arange(config["vocab_size"])
    assert torch.equal(lookup(ids), floats.model.embed_tokens(ids))


def test_a_quantized_load_never_dequantizes_what_the_blocks_serve(tmp_path, monkeypatch) -> None:
    """The projections built from blocks leave their float weights unread (what lets a file larger
    than its float weights load), and the model is the one a float load then use_gguf_blocks makes."""
    path = str(write_gguf(tmp_path / "tiny.gguf", Q.Q4_0))
    dequantized = []
    real = tailrace_gguf.stored
    monkeypatch.setattr(tailrace_gguf, "stored", lambda tensor: dequantized.append(tensor.name) or real(tensor))
    model, _ = load_model(path, quantization="int4")
    blocks = {t.name for t in GgufFile.read(str(path)).tensors if t.tensor_type == Q.Q4_0}
    assert blocks and not blocks & set(dequantized) - ({"token_embd.weight"} if lookup_table(GgufFile.read(str(path))) is None else set())
    monkeypatch.setattr(tailrace_gguf, "stored", real)
    whole, _ = load_model(path)
    reader = GgufFile.read(str(path))
    use_gguf_blocks(whole, reader, table=lookup_table(reader))
    ours, theirs = model.state_dict(), whole.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)


def test_a_mixture_of_experts_takes_each_experts_codes_from_llama_cpps_q8_0_file(tmp_path, llamacpp_tree) -> None:
    """llama.cpp's converter stacks a layer's experts [experts, rows, blocks]; each expert's
    projections come from its own rows of blocks, as the dense ones do, and agree with the
    dequantizing loader's."""
    from e2e.test_architectures import save_checkpoint

    save_checkpoint(tmp_path / "moe", "qwen3_moe")
    path = tmp_path / "moe-q8_0.gguf"
    subprocess.run(convert_command(llamacpp_tree, tmp_path / "moe", "q8_0", path), check=True, capture_output=True)
    model, config = load_model(str(path), dtype="float32", quantization="int8")
    floats, _ = load_model(str(path), dtype="float32")
    reader = GgufFile.read(str(path))
    down = next(t for t in reader.tensors if t.name == "blk.1.ffn_down_exps.weight")
    assert down.tensor_type == Q.Q8_0
    expert = model.model.layers[1].mlp.experts[3]
    expected = quantized_linear(Q.Q8_0, np.asarray(down.data)[3], (config.hidden_size, config.moe_intermediate_size))
    loaded = dict(expert.down_proj.named_buffers())
    assert all(torch.equal(loaded[name], buffer) for name, buffer in expected.named_buffers())
    float_expert = floats.model.layers[1].mlp.experts[3]
    for name in ("gate_up_proj", "down_proj"):
        x = torch.randn(3, getattr(float_expert, name).weight.shape[1]).to(torch.bfloat16).float()
        assert _relative_error(getattr(expert, name)(x), getattr(float_expert, name)(x)) < BF16_RTOL, name


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_next", "qwen3_5_moe"])
def test_a_hybrids_projections_take_their_rows_from_llama_cpps_q8_0_file(tmp_path, llamacpp_tree, name) -> None:
    """Gated DeltaNet's in_proj stacks attn_qkv, attn_gate and b and a (Qwen3-Next's ssm_ba, per
    head group, put in order), gated attention's qkv_proj the gates after v; each projection built
    from the file's blocks agrees with the dequantizing loader's."""
    from e2e.test_architectures import save_checkpoint

    save_checkpoint(tmp_path / name, name)
    path = tmp_path / f"{name}-q8_0.gguf"
    subprocess.run(convert_command(llamacpp_tree, tmp_path / name, "q8_0", path), check=True, capture_output=True)
    model, _ = load_model(str(path), dtype="float32", quantization="int8")
    floats, _ = load_model(str(path), dtype="float32")
    served = {"model.layers.0.linear_attn.in_proj", "model.layers.0.linear_attn.out_proj",
              "model.layers.3.self_attn.qkv_proj", "model.layers.3.self_attn.o_proj"}
    if name != "qwen3_5":
        served |= {"model.layers.0.mlp.shared_expert.gate_up_proj", "model.layers.0.mlp.experts.1.down_proj"}
    modules, float_modules = dict(model.named_modules()), dict(floats.named_modules())
    for path_name in sorted(served):
        assert type(modules[path_name]).__name__.startswith("Int"), path_name
        x = torch.randn(3, float_modules[path_name].weight.shape[1]).to(torch.bfloat16).float()
        assert _relative_error(modules[path_name](x), float_modules[path_name](x)) < BF16_RTOL, path_name


@pytest.mark.parametrize("name", ["gemma4", "gemma4_moe"])
def test_gemma4s_projections_take_their_rows_from_llama_cpps_q8_0_file(tmp_path, llamacpp_tree, name) -> None:
    """Gemma 4's qkv_proj stacks q alone where a layer reads another's K/V and q and k where its
    values are its keys; the 26B-A4B's experts beside the MLP come from one stacked tensor of gate
    and up: each agrees with the dequantizing loader's."""
    from e2e.test_architectures import save_checkpoint

    save_checkpoint(tmp_path / name, name)
    path = tmp_path / f"{name}-q8_0.gguf"
    subprocess.run(convert_command(llamacpp_tree, tmp_path / name, "q8_0", path), check=True, capture_output=True)
    model, _ = load_model(str(path), dtype="float32", quantization="int8")
    floats, _ = load_model(str(path), dtype="float32")
    served = ({"model.layers.1.moe.experts.2.gate_up_proj", "model.layers.1.moe.experts.3.down_proj",
               "model.layers.1.self_attn.qkv_proj", "model.layers.0.mlp.gate_up_proj"} if name == "gemma4_moe" else
              {"model.layers.2.self_attn.qkv_proj", "model.layers.4.self_attn.qkv_proj", "model.layers.5.mlp.down_proj"})
    modules, float_modules = dict(model.named_modules()), dict(floats.named_modules())
    for path_name in sorted(served):
        assert type(modules[path_name]).__name__.startswith("Int"), path_name
        x = torch.randn(3, float_modules[path_name].weight.shape[1]).to(torch.bfloat16).float()
        assert _relative_error(modules[path_name](x), float_modules[path_name](x)) < BF16_RTOL, path_name


@needs_kernel
def test_gpt_oss_experts_take_their_mxfp4_blocks_from_llama_cpps_file(tmp_path, llamacpp_tree) -> None:
    """llama.cpp's converter repacks gpt-oss's MXFP4 experts into ggml's MXFP4 blocks; each
    expert's projections are then E2M1 codes on tailrace's kernel (never float weights), with
    their biases, and agree with the dequantizing loader's."""
    from e2e.test_architectures import save_checkpoint

    save_checkpoint(tmp_path / "gpt-oss", "gpt_oss")
    path = tmp_path / "gpt-oss-q8_0.gguf"
    subprocess.run(convert_command(llamacpp_tree, tmp_path / "gpt-oss", "q8_0", path), check=True, capture_output=True)
    reader = GgufFile.read(str(path))
    assert {t.tensor_type for t in reader.tensors if "_exps.weight" in t.name} == {Q.MXFP4}
    model, _ = load_model(str(path), dtype="bfloat16", quantization="int4")
    floats, _ = load_model(str(path), dtype="bfloat16")
    expert, float_expert = model.model.layers[1].mlp.experts[2], floats.model.layers[1].mlp.experts[2]
    for name in ("gate_up_proj", "down_proj"):
        layer = getattr(expert, name)
        assert layer.codes.dtype == torch.float4_e2m1fn_x2 and layer.bias is not None, name
        x = torch.randn(3, getattr(float_expert, name).weight.shape[1]).to(torch.bfloat16)
        assert _relative_error(layer(x).float(), getattr(float_expert, name)(x).float()) < BF16_RTOL, name


def test_the_log_names_the_types_served_as_stored_and_what_the_others_became(tmp_path) -> None:
    path = tmp_path / "w.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.attn_q.weight", _raw(Q.Q4_K), raw_dtype=Q.Q4_K)
    writer.add_tensor("blk.0.attn_k.weight", np.zeros((OUT, IN // 32 * 18), dtype=np.uint8), raw_dtype=Q.IQ4_NL)
    write_out(writer)
    text = describe_blocks(GgufFile.read(str(path)), ["model.layers.0.self_attn.qkv_proj"], None)
    assert "1 projections from the file's 1 Q4_K matrices" in text and "dequantized table" in text
    assert "no kernel for 1 IQ4_NL: dequantized, then int8 per row" in text
