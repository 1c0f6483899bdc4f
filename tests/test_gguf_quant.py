import subprocess

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFWriter, ReaderTensor
from gguf.quants import dequantize, quantize
from gguf_writer import llama_permute, write_gguf, write_out

from tailrace.bench.peers.llamacpp import convert_command
from tailrace.model.cpu import int_linear
from tailrace.model.decoder.llama import Linear
from tailrace.model.loading import gguf as tailrace_gguf
from tailrace.model.loading.gguf_quant import (decode_blocks, quantized_linear, stacked_linear, unpermute_rotary_rows,
                                               use_gguf_blocks)
from tailrace.model.loading.loader import load_model

OUT, IN = 48, 512  # two Q4_K super-blocks per row; rows in tiles of 16 for the int4 kernel
needs_kernel = pytest.mark.skipif(not int_linear.available(), reason="MXFP4 runs on tailrace's kernel only")
# bfloat16 keeps 8 significant bits: activations, scales and outputs each round by up to 2^-9.
BF16_RTOL = 1e-2


def _raw(tensor_type: Q, shape: tuple[int, int] = (OUT, IN), seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if tensor_type != Q.Q4_K:
        return quantize((rng.standard_normal(shape) * 0.02).astype(np.float32), tensor_type)
    # gguf has no Q4_K quantizer: random super-blocks (any scale/min/code bytes are valid), with
    # fp16 d and dmin of a real weight's size.
    blocks = rng.integers(0, 256, (shape[0] * shape[1] // 256, 144), dtype=np.uint8)
    blocks[:, 0:4] = (rng.uniform(1e-5, 1e-3, (blocks.shape[0], 2)).astype(np.float16)).view(np.uint8)
    return blocks.reshape(shape[0], -1)


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).norm() / expected.norm())


@pytest.mark.parametrize("tensor_type", [Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q8_0, pytest.param(Q.MXFP4, marks=needs_kernel)])
def test_layer_matches_linear_over_gguf_dequantized_weight(tensor_type: Q) -> None:
    raw = _raw(tensor_type)
    weight = torch.from_numpy(dequantize(raw, tensor_type))
    x = torch.randn(5, IN).to(torch.bfloat16).float()
    layer = quantized_linear(tensor_type, raw, (OUT, IN))
    assert _relative_error(layer(x), F.linear(x, weight)) < BF16_RTOL


@pytest.mark.parametrize("tensor_type", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.MXFP4])
def test_codes_dequantize_bit_exactly_to_gguf(tensor_type: Q) -> None:
    raw = _raw(tensor_type)
    expected = torch.from_numpy(dequantize(raw, tensor_type)).reshape(OUT, IN)
    assert torch.equal(decode_blocks(tensor_type, raw, (OUT, IN)).dequantize(), expected)


def test_q4_k_codes_dequantize_to_gguf_within_float32_rounding() -> None:
    """Its scale is a product of two of the block's fields, which gguf may round in another order."""
    raw = _raw(Q.Q4_K)
    expected = torch.from_numpy(dequantize(raw, Q.Q4_K))
    actual = decode_blocks(Q.Q4_K, raw, (OUT, IN)).dequantize()
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-6 * float(expected.abs().max()))


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
    return {tensor.name: tensor for tensor in GGUFReader(path).tensors}


def test_reader_tensor_decodes_as_written(tmp_path) -> None:
    raw = _raw(Q.Q4_1)
    tensor = _read_back(str(tmp_path / "w.gguf"), {"w": (Q.Q4_1, raw)})["w"]
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    read, written = (decode_blocks(Q.Q4_1, data, shape) for data in (tensor.data, raw))
    assert all(torch.equal(getattr(read, field), getattr(written, field)) for field in ("codes", "scales", "zeros"))


def test_parts_of_different_types_stay_unstacked(tmp_path) -> None:
    parts = _read_back(str(tmp_path / "w.gguf"), {"blk.0.attn_k.weight": (Q.Q4_0, _raw(Q.Q4_0)),
                                                  "blk.0.attn_v.weight": (Q.Q8_0, _raw(Q.Q8_0))})
    assert stacked_linear(list(parts.values()), {}, None) is None


def test_type_without_block_mapping_returns_none() -> None:
    assert quantized_linear(Q.Q6_K, np.zeros((OUT, IN // 256 * 210), dtype=np.uint8), (OUT, IN)) is None


def test_rows_not_in_tiles_of_16_return_none_without_tailraces_kernel(monkeypatch) -> None:
    monkeypatch.setattr(int_linear, "available", lambda: False)
    assert quantized_linear(Q.Q4_0, _raw(Q.Q4_0, (40, IN)), (40, IN)) is None


def test_mxfp4_returns_none_without_tailraces_kernel(monkeypatch) -> None:
    """PyTorch's 4-bit kernel counts its codes up from zero; E2M1's index a table."""
    monkeypatch.setattr(int_linear, "available", lambda: False)
    assert quantized_linear(Q.MXFP4, _raw(Q.MXFP4), (OUT, IN)) is None


@pytest.fixture(scope="module", params=[Q.Q4_0, Q.Q8_0], ids=["Q4_0", "Q8_0"])
def tiny_gguf(request, tmp_path_factory) -> tuple[dict[str, torch.nn.Module], dict[str, torch.nn.Module], list[str]]:
    """The embedded model's GGUF: (the dequantizing loader's projections, the block-built ones, replaced names)."""
    path = str(write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", request.param))
    model, _ = load_model(path, dtype="float32")
    floats = {name: module for name, module in model.named_modules() if isinstance(module, Linear)}
    embedding = model.model.embed_tokens.weight.detach().clone()
    floats["lm_head"] = lambda x: F.linear(x, embedding)
    replaced = use_gguf_blocks(model, GGUFReader(path))
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
    tensor = next(t for t in GGUFReader(path).tensors if t.name == "blk.0.attn_output.weight")
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
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_tied_q8_0_table_is_held_once_and_looked_up_as_the_float_load_reads_it(tmp_path, dtype,
                                                                                  monkeypatch) -> None:
    """The head's codes serve the lookups (IntEmbedding), row for row the values the dequantizing
    loader puts in the table, which it neither reads nor keeps beside them."""
    path = str(write_gguf(tmp_path / "tiny.gguf", Q.Q8_0))
    floats, config = load_model(path, dtype=dtype)
    dequantized = []
    real = tailrace_gguf.dequantize
    monkeypatch.setattr(tailrace_gguf, "dequantize", lambda tensor: dequantized.append(tensor.name) or real(tensor))
    blocks, _ = load_model(path, dtype=dtype, quantization="int8")
    assert dequantized and "token_embd.weight" not in dequantized
    lookup = blocks.model.embed_tokens
    assert isinstance(lookup, int_linear.IntEmbedding) and lookup.codes is blocks.lm_head.codes
    assert not any(t.dtype == floats.dtype and t.shape == (config.vocab_size, config.hidden_size)
                   for t in blocks.state_dict().values())
    ids = torch.arange(config.vocab_size)
    assert torch.equal(lookup(ids), floats.model.embed_tokens(ids))


def test_a_quantized_load_never_dequantizes_what_the_blocks_serve(tmp_path, monkeypatch) -> None:
    """The projections built from blocks leave their float weights unread (what lets a file larger
    than its float weights load), and the model is the one a float load then use_gguf_blocks makes."""
    path = str(write_gguf(tmp_path / "tiny.gguf", Q.Q4_0))
    dequantized = []
    real = tailrace_gguf.dequantize
    monkeypatch.setattr(tailrace_gguf, "dequantize", lambda tensor: dequantized.append(tensor.name) or real(tensor))
    model, _ = load_model(path, quantization="int4")
    blocks = {t.name for t in GGUFReader(path).tensors if t.tensor_type == Q.Q4_0}
    assert blocks - {"token_embd.weight"} and not blocks & set(dequantized) - {"token_embd.weight"}
    monkeypatch.setattr(tailrace_gguf, "dequantize", real)
    whole, _ = load_model(path)
    use_gguf_blocks(whole, GGUFReader(path))
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
    reader = GGUFReader(str(path))
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


@needs_kernel
def test_gpt_oss_experts_take_their_mxfp4_blocks_from_llama_cpps_file(tmp_path, llamacpp_tree) -> None:
    """llama.cpp's converter repacks gpt-oss's MXFP4 experts into ggml's MXFP4 blocks; each
    expert's projections are then E2M1 codes on tailrace's kernel (never float weights), with
    their biases, and agree with the dequantizing loader's."""
    from e2e.test_architectures import save_checkpoint

    save_checkpoint(tmp_path / "gpt-oss", "gpt_oss")
    path = tmp_path / "gpt-oss-q8_0.gguf"
    subprocess.run(convert_command(llamacpp_tree, tmp_path / "gpt-oss", "q8_0", path), check=True, capture_output=True)
    reader = GGUFReader(str(path))
    assert {t.tensor_type for t in reader.tensors if "_exps.weight" in t.name} == {Q.MXFP4}
    model, _ = load_model(str(path), dtype="bfloat16", quantization="int4")
    floats, _ = load_model(str(path), dtype="bfloat16")
    expert, float_expert = model.model.layers[1].mlp.experts[2], floats.model.layers[1].mlp.experts[2]
    for name in ("gate_up_proj", "down_proj"):
        layer = getattr(expert, name)
        assert layer.codes.dtype == torch.float4_e2m1fn_x2 and layer.bias is not None, name
        x = torch.randn(3, getattr(float_expert, name).weight.shape[1]).to(torch.bfloat16)
        assert _relative_error(layer(x).float(), getattr(float_expert, name)(x).float()) < BF16_RTOL, name
