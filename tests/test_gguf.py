"""GGUF files (llama.cpp's format) load as the checkpoint they were converted from: config,
weights (dequantized within each format's error), greedy tokens; bad files get one clear error."""

from __future__ import annotations

import dataclasses
import os

import gguf
import numpy as np
import pytest
import torch
from architectures import TINY
from gguf import GGMLQuantizationType as Q
from gguf_writer import EMBEDDED, add_tensor, llama_permute, write_gguf, write_out

from tailrace import LLM, SamplingParams
from tailrace.model.decoder.llama import rope_inverse_frequencies
from tailrace.model.loading.gguf import dequantize, stores_projections_quantized, unpermute_rotary
from tailrace.model.loading.gguf_file import forget_readers, open_gguf
from tailrace.model.loading.loader import load_model, load_model_config

PROMPTS = ["The list type", "json.dumps", "<|im_start|>user\nWhat does os.path.join do?<|im_end|>\n"]
# Per-block error bound, as a fraction of the block's largest |weight|: half a step of the grid
# each format rounds to, where Q4_0's clamped extreme can be off by a whole step.
_BLOCK_ERROR = {Q.Q8_0: 1 / 127, Q.Q4_0: 1 / 8, Q.Q4_1: 1 / 15}


@pytest.fixture(scope="module")
def f32_gguf(tmp_path_factory):
    return str(write_gguf(tmp_path_factory.mktemp("gguf") / "tiny-f32.gguf"))


def test_config_is_the_checkpoints(f32_gguf):
    ours, theirs = load_model_config(f32_gguf), load_model_config(str(EMBEDDED))
    theirs.eos_token_ids = theirs.eos_token_ids[:1]  # generation_config.json's extra stops are not in a GGUF
    assert ours == theirs


def test_f32_weights_are_the_checkpoints_with_rotary_rows_restored(f32_gguf):
    ours, _ = load_model(f32_gguf)
    theirs, _ = load_model(str(EMBEDDED))
    for (name, a), (_, b) in zip(ours.named_parameters(), theirs.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def test_qwen2_weights_and_biases_are_the_checkpoints(tmp_path):
    source = _qwen2_checkpoint(tmp_path / "qwen2")
    ours, config = load_model(str(write_gguf(tmp_path / "qwen2.gguf", source=source, arch="qwen2")))
    theirs, _ = load_model(str(source))
    assert config.architecture == "Qwen2ForCausalLM"
    for (name, a), (_, b) in zip(ours.named_parameters(), theirs.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def _qwen2_checkpoint(directory):
    """A random Qwen2 (q/k/v biases) with the embedded model's tokenizer files."""
    import shutil

    import transformers

    config = transformers.Qwen2Config(**{**TINY, "vocab_size": 8192, "tie_word_embeddings": True})
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(EMBEDDED / name, directory / name)
    return directory


def test_unpermute_rotary_inverts_llama_cpps_permute():
    weights = np.arange(8 * 4 * 3, dtype=np.float32).reshape(32, 3)
    permuted = torch.from_numpy(llama_permute(weights, heads=4))
    assert torch.equal(unpermute_rotary(permuted, heads=4), torch.from_numpy(weights))


def test_greedy_tokens_are_the_checkpoints(f32_gguf):
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(str(EMBEDDED), threads=1).generate(PROMPTS, params)]
    got = [o.outputs[0].token_ids for o in LLM(f32_gguf, threads=1).generate(PROMPTS, params)]
    assert got == want


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_quantized_weights_load_within_the_formats_error(tmp_path, qtype):
    ours, _ = load_model(str(write_gguf(tmp_path / "tiny.gguf", qtype)), dtype="float32")  # the values as stored
    theirs, _ = load_model(str(EMBEDDED))
    for (name, a), (_, b) in zip(ours.named_parameters(), theirs.named_parameters(), strict=True):
        if a.dim() == 2:
            blocks_a, blocks_b = a.reshape(a.shape[0], -1, 32), b.reshape(b.shape[0], -1, 32)
            bound = blocks_b.abs().amax(-1, keepdim=True) * _BLOCK_ERROR[qtype] * 1.01
            assert ((blocks_a - blocks_b).abs() <= bound).all(), name


@pytest.mark.parametrize(("qtype", "stored"), [(Q.F32, "float32"), (Q.F16, "float16"), (Q.BF16, "bfloat16"),
                                              (Q.Q8_0, "bfloat16"), (Q.Q4_0, "bfloat16")])
def test_the_config_names_the_dtype_the_matrices_are_stored_in(tmp_path, qtype, stored):
    """What --dtype auto reads (loader.resolve_dtype): quantized files come from 16-bit models."""
    assert load_model_config(str(write_gguf(tmp_path / "tiny.gguf", qtype))).torch_dtype == stored


@pytest.mark.parametrize(("types", "quantized"), [
    ({"blk.0.attn_q.weight": Q.Q8_0, "blk.0.ffn_gate_inp.weight": Q.F32}, True),  # a float router is no projection
    ({"blk.0.attn_q.weight": Q.Q8_0, "blk.0.attn_k.weight": Q.F16}, False),  # one float projection
    ({"blk.0.attn_q.weight": Q.F32}, False),
    ({}, False),  # the embedding table alone
])
def test_a_file_stores_its_projections_quantized_when_every_one_is(tmp_path, types, quantized):
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, qtype in {"token_embd.weight": Q.Q8_0, "output_norm.weight": Q.F32, **types}.items():
        add_tensor(writer, name, np.zeros(64 if name.endswith("norm.weight") else (4, 64), np.float32), qtype)
    write_out(writer)
    assert stores_projections_quantized(gguf.GGUFReader(path)) is quantized


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16])
def test_half_precision_weights_load_within_their_rounding(tmp_path, qtype):
    ours, _ = load_model(str(write_gguf(tmp_path / "tiny.gguf", qtype)), dtype="float32")  # the values as stored
    theirs, _ = load_model(str(EMBEDDED))
    rounding = 2.0 ** -11 if qtype == Q.F16 else 2.0 ** -8
    for (name, a), (_, b) in zip(ours.named_parameters(), theirs.named_parameters(), strict=True):
        assert torch.allclose(a, b, rtol=rounding, atol=1e-7), name


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K])
def test_k_quant_rows_dequantize_in_row_order(tmp_path, qtype):
    reader = _one_tensor_file(tmp_path, qtype, rows=3, columns=512)
    tensor = reader.tensors[0]
    rows = [gguf.quants.dequantize(tensor.data[i], qtype) for i in range(3)]
    assert torch.equal(dequantize(tensor), torch.from_numpy(np.stack(rows)))


def test_every_bf16_value_dequantizes_to_gguf_pys_bits(tmp_path):
    """BF16 is widened in PyTorch, not by gguf-py (2.5 s, not 3.7 s, on 2 GB): all 65,536 bit
    patterns, NaNs and infinities too, give gguf-py's float32 bits."""
    raw = np.arange(2**16, dtype=np.uint16).view(np.uint8).reshape(256, 512)
    path = tmp_path / "bf16.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.ffn_up.weight", raw, raw_dtype=Q.BF16)
    write_out(writer)
    tensor = gguf.GGUFReader(path).tensors[0]
    theirs = gguf.quants.dequantize(tensor.data, Q.BF16)
    ours = dequantize(tensor)
    assert ours.shape == (256, 256)
    assert np.array_equal(ours.numpy().view(np.uint32), np.asarray(theirs, dtype=np.float32).view(np.uint32))


def test_the_cached_reader_reads_what_gguf_pys_reads(f32_gguf):
    ours, theirs = open_gguf(str(f32_gguf)), gguf.GGUFReader(f32_gguf)
    assert ours.values.keys() == {key for key in theirs.fields if not key.startswith("GGUF.")}
    for key, value in ours.values.items():
        assert value == theirs.fields[key].contents(), key
    assert ours.float32 == {key for key, field in theirs.fields.items() if field.types == [gguf.GGUFValueType.FLOAT32]}
    assert [(t.name, t.tensor_type, t.shape.tolist()) for t in ours.tensors] == \
        [(t.name, t.tensor_type, t.shape.tolist()) for t in theirs.tensors]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(ours.tensors, theirs.tensors, strict=True))


def test_a_forgotten_reader_is_parsed_anew(f32_gguf):
    cached = open_gguf(f32_gguf)
    assert open_gguf(f32_gguf) is cached
    forget_readers()
    assert open_gguf(f32_gguf) is not cached


def test_unsupported_tensor_type_is_named(tmp_path):
    reader = _one_tensor_file(tmp_path, Q.IQ4_NL, rows=1, columns=32)
    with pytest.raises(ValueError, match="blk.0.ffn_up.weight: unsupported GGUF tensor type IQ4_NL"):
        dequantize(reader.tensors[0])


def _one_tensor_file(tmp_path, qtype: Q, rows: int, columns: int) -> gguf.GGUFReader:
    """Random blocks with their fp16 scales set small and finite (random bytes can be inf or NaN)."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(0).integers(0, 256, (rows, columns // block_size, type_size), dtype=np.uint8)
    scale_bytes = np.float16(0.01).tobytes()
    scale_at = {Q.Q4_K: [0, 2], Q.Q6_K: [type_size - 2], Q.IQ4_NL: [0]}[qtype]
    for at in scale_at:
        raw[..., at:at + 2] = np.frombuffer(scale_bytes, dtype=np.uint8)
    path = tmp_path / "one.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.ffn_up.weight", raw.reshape(rows, -1), raw_dtype=qtype)
    write_out(writer)
    return gguf.GGUFReader(path)


def test_llama3_rope_freqs_become_its_rope_scaling(tmp_path):
    factors = _llama3_rope_factors(head_dim=32, theta=10000.0, factor=8.0, low=1.0, high=4.0, context=8192)
    path = write_gguf(tmp_path / "tiny.gguf", extra_tensors={"rope_freqs.weight": factors})
    assert load_model_config(str(path)).rope_scaling == {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}


def test_rope_freqs_of_no_llama3_scaling_divide_the_frequencies_as_they_are(tmp_path):
    """llama.cpp serves any rope_freqs: each frequency divided by its factor; so does tailrace."""
    factors = np.linspace(1.0, 3.0, 16, dtype=np.float32)  # head_dim 32: 16 frequencies
    path = write_gguf(tmp_path / "tiny.gguf", extra_tensors={"rope_freqs.weight": factors})
    config = load_model_config(str(path))
    assert config.rope_scaling == {"rope_type": "freq_factors", "factors": [float(f) for f in factors]}
    plain = rope_inverse_frequencies(dataclasses.replace(config, rope_scaling=None))
    torch.testing.assert_close(rope_inverse_frequencies(config), plain / torch.from_numpy(factors), rtol=0, atol=0)
    model, _ = load_model(str(path))  # and it loads and runs
    assert model.model.rotary.cos.isfinite().all()


def _llama3_rope_factors(head_dim: int, theta: float, factor: float, low: float, high: float,
                         context: int) -> np.ndarray:
    """llama.cpp's converter's rope_freqs for Llama 3.1: each frequency's divisor."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    out = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < context / high:
            out.append(1.0)
        elif wavelen > context / low:
            out.append(factor)
        else:
            smooth = (context / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def test_corrupt_file_is_named(tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.raises(ValueError, match="broken.gguf is not a readable GGUF file"):
        load_model(str(path))


def test_unsupported_architecture_is_named(tmp_path):
    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    write_out(writer)
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'mamba'; supported: llama, qwen2, qwen3, "
                                         "smollm3, gemma2, gemma3"):
        load_model_config(str(path))


def _mapped_kilobytes(path: str) -> int:
    """Resident kB of this process's mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps", encoding="utf-8"):
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:  # a mapping's header: range perms offset dev inode [path]
            inside = len(fields) == 6 and fields[5] == path
        elif inside and fields[0] == "Rss:":
            total += int(fields[1])
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="Linux's /proc")
def test_a_loaded_gguf_leaves_none_of_its_pages_mapped_resident(tmp_path):
    """The reader stays cached (open_gguf), its mapping with it: the weights' pages read while
    loading would count as resident memory beside the weights built from them."""
    path = str(write_gguf(tmp_path / "q8_0.gguf", Q.Q8_0))
    load_model(path, quantization="int8")
    assert _mapped_kilobytes(path) == 0
