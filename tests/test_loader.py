"""Loading Hugging Face safetensors checkpoints (single and sharded) and dummy weights."""

from __future__ import annotations

import pytest
import torch
import transformers
from safetensors.torch import save_file

from tailrace.model.attention.kv_cache import AttentionBatch, KVCache, SeqSlice
from tailrace.model.cpu import int_linear
from tailrace.model.cpu.int_linear import IntLinear
from tailrace.model.loading import loader
from tailrace.model.loading.loader import load_model, resolve_dtype
from tailrace.model.quant import quantize_model

SMALL = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=256,
    max_position_embeddings=128,
)


@pytest.fixture(scope="module")
def hf_model():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)).eval()


@pytest.fixture(scope="module")
def single(hf_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("single")
    hf_model.save_pretrained(path)
    return path


def write_state(path, hf_model, state: dict[str, torch.Tensor]) -> str:
    hf_model.config.save_pretrained(path)
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    return str(path)


def prefill_logits(model, config, tokens: list[int]) -> torch.Tensor:
    cache = KVCache(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, 8, 16, model.dtype)
    batch = AttentionBatch([SeqSlice(0, 0, len(tokens), len(tokens), [0])], torch.arange(len(tokens)))
    cache.begin(batch)
    hidden = model(torch.tensor(tokens), torch.arange(len(tokens)), batch, cache)
    return model.compute_logits(hidden)


def test_sharded_checkpoint_loads_the_same_weights_as_single_file(hf_model, single, tmp_path):
    hf_model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    sharded, _ = load_model(str(tmp_path))
    whole, _ = load_model(str(single))
    for (name, a), (_, b) in zip(sharded.named_parameters(), whole.named_parameters()):
        assert torch.equal(a, b), name


def test_fused_qkv_projection_holds_q_then_k_then_v(hf_model, single):
    model, _ = load_model(str(single))
    hf_attn = hf_model.model.layers[1].self_attn
    expected = torch.cat([hf_attn.q_proj.weight, hf_attn.k_proj.weight, hf_attn.v_proj.weight])
    assert torch.equal(model.model.layers[1].self_attn.qkv_proj.weight, expected)


def test_missing_tensor_is_named_in_the_error(hf_model, tmp_path):
    state = dict(hf_model.state_dict())
    del state["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"missing 1 \(model\.layers\.1\.mlp\.up_proj\.weight\)"):
        load_model(write_state(tmp_path, hf_model, state))


def test_unexpected_tensor_is_named_in_the_error(hf_model, tmp_path):
    state = {**hf_model.state_dict(), "model.layers.0.self_attn.extra.weight": torch.zeros(2)}
    with pytest.raises(ValueError, match=r"unexpected 1 \(model\.layers\.0\.self_attn\.extra\.weight\)"):
        load_model(write_state(tmp_path, hf_model, state))


def test_wrong_shape_is_named_in_the_error(hf_model, tmp_path):
    state = {**hf_model.state_dict(), "model.norm.weight": torch.ones(3)}
    with pytest.raises(ValueError, match="model.norm.weight"):
        load_model(write_state(tmp_path, hf_model, state))


def test_directory_without_weights_raises_file_not_found(hf_model, tmp_path):
    hf_model.config.save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model(str(tmp_path))


def test_dummy_weights_need_only_config_and_follow_the_seed(hf_model, tmp_path):
    hf_model.config.save_pretrained(tmp_path)
    first, _ = load_model(str(tmp_path), load_format="dummy", seed=3)
    again, _ = load_model(str(tmp_path), load_format="dummy", seed=3)
    other, _ = load_model(str(tmp_path), load_format="dummy", seed=4)
    weight = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(first.get_parameter(weight), again.get_parameter(weight))
    assert not torch.equal(first.get_parameter(weight), other.get_parameter(weight))


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_dummy_weights_quantized_as_drawn_equal_quantizing_after(hf_model, tmp_path, method):
    """Each projection quantized right after its draw (what lets a model larger than memory load)
    holds what quantizing the whole float model would, and the other weights are the same draws."""
    hf_model.config.save_pretrained(tmp_path)
    streamed, _ = load_model(str(tmp_path), load_format="dummy", seed=3, quantization=method)
    whole, _ = load_model(str(tmp_path), load_format="dummy", seed=3)
    quantize_model(whole, method)
    ours, theirs = streamed.state_dict(), whole.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)
    assert not any(type(module) is loader.Linear for module in streamed.modules())
    with pytest.raises(ValueError, match="unsupported quantization"):
        load_model(str(tmp_path), load_format="dummy", quantization="fp3")


def test_bfloat16_load_runs_close_to_float32(single):
    tokens = [3, 14, 15, 92, 65, 35]
    model, config = load_model(str(single), dtype="bfloat16")
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    low = prefill_logits(model, config, tokens)
    full = prefill_logits(*load_model(str(single), dtype="float32"), tokens)
    assert low.dtype == torch.float32
    torch.testing.assert_close(low, full, atol=0.05, rtol=0)


def test_auto_dtype_is_bfloat16_on_cuda_and_the_checkpoints_16_bits_on_a_cpu_that_computes_them(monkeypatch):
    assert resolve_dtype("auto", "cuda") == torch.bfloat16
    assert resolve_dtype("auto", "cuda", "float32") == torch.bfloat16
    for native in (True, False):
        monkeypatch.setattr(loader, "fast_cpu_bfloat16", lambda native=native: native)
        assert resolve_dtype("auto", "cpu", "float32") == torch.float32
        assert resolve_dtype("auto", "cpu", "bfloat16") == (torch.bfloat16 if native else torch.float32)
        assert resolve_dtype("auto", "cpu", "float16") == (torch.bfloat16 if native else torch.float32)
        assert resolve_dtype("float32", "cpu", "bfloat16") == torch.float32


def test_unknown_dtype_is_rejected(single):
    with pytest.raises(ValueError, match="float64"):
        load_model(str(single), dtype="float64")


def test_unknown_load_format_is_rejected(single):
    with pytest.raises(ValueError, match="'pt'"):
        load_model(str(single), load_format="pt")


@pytest.mark.skipif(not int_linear.available(), reason="E2M1 codes run on tailrace's kernel only")
def test_quantized_gpt_oss_takes_its_mxfp4_experts_as_they_are(tmp_path):
    """Each expert's projections are the checkpoint's E2M1 codes (gate rows first), never float
    weights requantized, with their biases; everything else is quantized as usual."""
    from e2e.test_architectures import save_checkpoint

    save_checkpoint(tmp_path, "gpt_oss")
    model, _ = load_model(str(tmp_path), dtype="bfloat16", quantization="int4")
    floats, _ = load_model(str(tmp_path), dtype="bfloat16")
    for layer, float_layer in zip(model.model.layers, floats.model.layers):
        for expert, float_expert in zip(layer.mlp.experts, float_layer.mlp.experts):
            for name in ("gate_up_proj", "down_proj"):
                projection, reference = getattr(expert, name), getattr(float_expert, name)
                assert projection.codes.dtype == torch.float4_e2m1fn_x2, name
                assert torch.equal(projection.bias, reference.bias.float())
                x = torch.randn(2, reference.weight.shape[1]).bfloat16()
                expected = torch.nn.functional.linear(x.float(), reference.weight.float(), reference.bias.float())
                # the activations' int8 codes and the bfloat16 output round: well within a percent
                assert (projection(x).float() - expected).norm() <= 1e-2 * expected.norm(), name
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, IntLinear)


def test_a_gguf_stored_quantized_stays_quantized_on_cpu_unless_floats_are_asked_for(tmp_path):
    from gguf import GGMLQuantizationType as Q
    from gguf_writer import write_gguf

    from tailrace.engine.config import EMBEDDED_MODEL

    quantized, floats = str(write_gguf(tmp_path / "q.gguf", Q.Q8_0)), str(write_gguf(tmp_path / "f.gguf", Q.F16))
    assert loader.resolve_quantization(None, quantized, "cpu") == "int8"
    assert loader.resolve_quantization(None, floats, "cpu") is None
    assert loader.resolve_quantization(None, quantized, "cuda") is None  # tailrace's integer kernels are CPU ones
    assert loader.resolve_quantization(None, EMBEDDED_MODEL, "cpu") is None
    assert loader.resolve_quantization("int4", floats, "cpu") == "int4"
    assert loader.resolve_quantization("none", quantized, "cpu") is None


def test_an_encoders_tensorflow_names_and_base_model_pooler_load(tmp_path):
    """BERT checkpoints converted from TensorFlow name LayerNorm's scale and shift gamma and beta; a
    base model's pooler is not read (its embeddings do not use it)."""
    config = transformers.BertConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=2, max_position_embeddings=16)
    hf = transformers.BertModel(config).eval()
    hf.save_pretrained(tmp_path)
    state = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
             for k, v in hf.state_dict().items()}
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    model, _ = load_model(str(tmp_path), dtype="float32")
    assert torch.equal(model.model.embed_norm.bias, hf.embeddings.LayerNorm.bias)
    assert torch.equal(model.model.layers[0].post_feedforward_layernorm.weight, hf.encoder.layer[0].output.LayerNorm.weight)
    assert model.score is None
