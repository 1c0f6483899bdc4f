"""A GGUF file (llama.cpp's and Ollama's format): its config as Hugging Face names it, and its
tensors dequantized under Hugging Face names (the file opened and its metadata read:
model/loading/gguf_file.py).

Each tensor is dequantized on its own (`dequantize`), from its raw blocks (`GgufFile` keeps them
memory-mapped in `ReaderTensor.data`), so a quantized path can later take those blocks instead.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf import ReaderTensor
from gguf.quants import dequantize as dequantize_blocks

from tailrace.model.decoder import registry
from tailrace.model.decoder.llama import rope_inverse_frequencies
from tailrace.model.loading.gguf_file import REQUIRED, GgufFile, architecture, metadata

# llama.cpp's converter interleaves the rotary halves of these architectures' q and k rows (its
# rope pairs adjacent dims there); the others' rope is the same as here.
FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)
DEQUANTIZED_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1,
                     Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.MXFP4)

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    # an encoder's (BERT's): learned positions and token types, and the norm of their sum
    "position_embd": "model.embed_positions",
    "token_types": "model.embed_types",
    "token_embd_norm": "model.embed_norm",
    "output_norm": "model.norm",
    "output": "lm_head",
    # Gemma 4's per-layer inputs
    "per_layer_token_embd": "model.embed_tokens_per_layer",
    "per_layer_model_proj": "model.per_layer_model_projection",
    "per_layer_proj_norm": "model.per_layer_projection_norm",
}
# An embedding model's Dense modules after pooling, in order, as llama.cpp's converter names them
# (--sentence-transformers-dense-modules: EmbeddingGemma's 2_Dense and 3_Dense, without biases)
_DENSE = ("dense_2", "dense_3")
_LONGROPE_FACTORS = {"rope_factors_long.weight": "long_factor", "rope_factors_short.weight": "short_factor"}
_ROPE_FREQS = "rope_freqs.weight"


def stores_projections_quantized(reader: GgufFile) -> bool:
    """Whether every projection matrix is stored in a quantized type (Q4_K_M's, Q8_0's,
    MXFP4_MOE's), not as floats. The embedding tables (Gemma 4's per-layer one too), the experts'
    routers and the shared expert's gate (which llama.cpp keeps in float32, and tailrace never
    quantizes), Gemma 4's per-layer input projection (which llama-quantize keeps in 16 bits) and
    Gated DeltaNet's convolution (a few weights a channel, no projection) do not count."""
    projections = [t for t in reader.tensors if len(t.shape) >= 2
                   and t.name not in ("token_embd.weight", "per_layer_token_embd.weight", "per_layer_model_proj.weight")
                   and not t.name.endswith(("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight"))]
    return bool(projections) and all(t.tensor_type not in FLOAT_TYPES for t in projections)


def config_dict(reader: GgufFile) -> dict[str, Any]:
    """The model's config.json, as Hugging Face would write it, from the metadata."""
    arch = architecture(reader)
    tensors = {t.name: t for t in reader.tensors}

    def value(key: str, default: Any = REQUIRED) -> Any:
        return metadata(reader, f"{arch}.{key}", default)

    if "token_embd.weight" not in tensors:
        raise ValueError("GGUF file has no token_embd.weight tensor")
    hidden, heads = value("embedding_length"), value("attention.head_count")
    eos = [metadata(reader, f"tokenizer.ggml.{key}", None) for key in ("eos_token_id", "eot_token_id", "eom_token_id")]
    experts = _experts_config(value, tensors)
    entry = registry.gguf_architecture(arch, bool(experts))
    # an embedding model's base model attends both ways (EmbeddingGemma's: Gemma3TextModel)
    embedding = {"use_bidirectional_attention": True} if arch == entry.gguf_embedding_arch else {}
    return {**experts, **embedding, **{
        "architectures": [entry.base_name if embedding else entry.name],
        "vocab_size": int(tensors["token_embd.weight"].shape[1]),
        "hidden_size": hidden,
        "intermediate_size": value("feed_forward_length", 0),
        "num_hidden_layers": value("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": value("attention.head_count_kv", heads),
        "head_dim": value("attention.key_length", hidden // heads),
        "rms_norm_eps": value("attention.layer_norm_rms_epsilon", None if entry.encoder else REQUIRED),
        "rope_theta": value("rope.freq_base", 10000.0),
        "rope_scaling": _rope_scaling(reader, arch, entry, tensors),
        "max_position_embeddings": value("context_length"),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": metadata(reader, "tokenizer.ggml.bos_token_id", None),
        "eos_token_id": list(dict.fromkeys(i for i in eos if i is not None)),
        "torch_dtype": _stored_dtype(reader),
    }, **_architecture_config(entry, value, tensors)}


def _stored_dtype(reader: GgufFile) -> str:
    """config.json's torch_dtype for the file's matrices, which loader.resolve_dtype's "auto" reads:
    float32 or float16 as stored, and bfloat16 for BF16 and for quantized types, whose models are
    released in 16 bits (on an AVX2 CPU a Q4_K_M Gemma-3-1B decoded 6% faster in bfloat16 than in
    float32, its embedding table half the size)."""
    stored = {t.tensor_type for t in reader.tensors if len(t.shape) >= 2}
    if stored <= {Q.F32}:
        return "float32"
    return "float16" if stored <= {Q.F32, Q.F16} else "bfloat16"


def _experts_config(value: Any, tensors: dict[str, ReaderTensor]) -> dict[str, Any]:
    """A mixture of experts' config: a layer is sparse where the file has its router
    (ffn_gate_inp); llama.cpp always renormalises the top k."""
    experts = value("expert_count", 0)
    if not experts:
        return {}
    layers = value("block_count")
    return {"num_experts": experts, "num_experts_per_tok": value("expert_used_count"),
            "moe_intermediate_size": value("expert_feed_forward_length", None) or value("feed_forward_length"),
            "norm_topk_prob": True, "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors]}


def _architecture_config(entry: registry.Architecture, value: Any, tensors: dict[str, ReaderTensor]) -> dict[str, Any]:
    """What sets an architecture apart, as llama.cpp reads it from the metadata and its own fixed
    rules (src/models/*.cpp in its tree): SmolLM3's layers without rope (every 4th), Granite's
    multipliers, gpt-oss's biases and windows, Phi-3's partial rotary, Gemma's windows and scales."""
    config: dict[str, Any] = {}
    if entry.encoder:
        config |= _encoder_config(entry, value, tensors)
    if entry.nope_interval:
        config["no_rope_layer_interval"] = entry.nope_interval
    if entry.multipliers:  # as llama.cpp's converter names them
        config |= {key: value(gguf_key) for key, gguf_key in (
            ("embedding_multiplier", "embedding_scale"), ("residual_multiplier", "residual_scale"),
            ("attention_multiplier", "attention.scale"), ("logits_scaling", "logit_scale"))
            if value(gguf_key, None) is not None}
    if entry.gguf_partial_rotary:  # rope.dimension_count: the dims of a head that rotate
        head_dim = value("embedding_length") // value("attention.head_count")
        config |= {"partial_rotary_factor": value("rope.dimension_count", head_dim) / head_dim,
                   "sliding_window": value("attention.sliding_window", 0) or None}
    if entry.gemma_scaling:
        config |= _gemma_config(entry, value)
    elif entry.gemma4:
        config |= _gemma4_config(value, tensors)
    elif entry.sliding_period:  # llama.cpp's rules: layer 0 sliding, then every other
        layers = value("block_count")
        config |= {"sliding_window": value("attention.sliding_window"),
                   "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]}
    if entry.gguf_attention_bias:
        config["attention_bias"] = True
    if entry.gated_delta:
        config |= _gated_delta_config(entry, value)
    return config


def _gated_delta_config(entry: registry.Architecture, value: Any) -> dict[str, Any]:
    """A hybrid's Gated DeltaNet shape and layers as llama.cpp's converter writes them (its ssm.*
    keys), the rotating part of each attention head, and whether the value heads are tiled."""
    layers, key_heads, value_heads = value("block_count"), value("ssm.group_count"), value("ssm.time_step_rank")
    recurrent = value("attention.recurrent_layers", None)
    every = value("full_attention_interval", 4)
    if recurrent is None:
        recurrent = [(i + 1) % every != 0 for i in range(layers)]
    head_dim = value("attention.key_length")
    return {"linear_num_key_heads": key_heads, "linear_num_value_heads": value_heads,
            "linear_key_head_dim": value("ssm.state_size"), "linear_value_head_dim": value("ssm.inner_size") // value_heads,
            "linear_conv_kernel_dim": value("ssm.conv_kernel"),
            "layer_types": ["linear_attention" if r else "full_attention" for r in recurrent[:layers]],
            "partial_rotary_factor": value("rope.dimension_count", head_dim) / head_dim,
            "value_heads_tiled": entry.gguf_tiled_value_heads and key_heads != value_heads,
            "shared_expert_intermediate_size": value("expert_shared_feed_forward_length", 0)}


def _encoder_config(entry: registry.Architecture, value: Any, tensors: dict[str, ReaderTensor]) -> dict[str, Any]:
    """BERT's and NomicBERT's, as llama.cpp's converter writes them: positions from 0 (a RoBERTa
    or XLM-R table is written without its padding rows), token types where the file has their
    table; NomicBERT's SwiGLU and rotary base."""
    if value("classifier.output_labels", None) is not None:
        raise ValueError("this GGUF is a BERT classifier, which llama.cpp's converter writes without its pooler "
                         "(dense and tanh before the classifier): serve the checkpoint's folder instead")
    return {"model_type": entry.model_types[0], "hidden_act": "silu" if entry.encoder == "nomic" else "gelu",
            "layer_norm_eps": value("attention.layer_norm_epsilon"),
            "position_embedding_type": "absolute",
            "type_vocab_size": int(tensors["token_types.weight"].shape[1]) if "token_types.weight" in tensors else 0}


def _gemma_config(entry: registry.Architecture, value: Any) -> dict[str, Any]:
    """Gemma's, as llama.cpp's gemma2.cpp and gemma3.cpp rule it: the sliding-window pattern
    (every 2nd layer from the first for Gemma 2, 5 of every 6 for Gemma 3, unless the file names
    one), the local layers' rope base (Gemma 3: 10000) and the query scale (head_dim's, but
    hidden / heads on the 27B models)."""
    layers, hidden, heads = value("block_count"), value("embedding_length"), value("attention.head_count")
    head_dim = value("attention.key_length", hidden // heads)
    largest = layers == entry.gguf_largest_layers
    window = value("attention.sliding_window", entry.gguf_default_window)
    pattern = value("attention.sliding_window_pattern", entry.sliding_period)
    if isinstance(pattern, list):
        sliding = [bool(p) for p in pattern]
    else:
        sliding = [i % pattern < pattern - 1 for i in range(layers)]
    config = {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": hidden // heads if largest else head_dim,
        "sliding_window": window or None,
        "layer_types": ["sliding_attention" if s and window else "full_attention" for s in sliding],
        "final_logit_softcapping": value("final_logit_softcapping", None),
    }
    if entry.gguf_attention_softcap:
        config["attn_logit_softcapping"] = value("attn_logit_softcapping", None)
    if entry.gguf_local_rope:
        config["rope_local_base_freq"] = value("rope.freq_base_swa", 10000.0)
    return config


def _gemma4_config(value: Any, tensors: dict[str, ReaderTensor]) -> dict[str, Any]:
    """Gemma 4's, as llama.cpp's converter writes it and gemma4.cpp reads it: per-layer arrays of
    KV heads and MLP widths (double-wide ones twice the narrowest), the global layers' head dim as
    key_length and the sliding ones' as key_length_swa, values that are keys where a global layer
    has no attn_v, the proportional rope of the global layers as rope_freqs (1 for a pair that
    turns, 1e30 for one that stays), per-layer inputs, experts beside the MLP."""
    layers = value("block_count")
    sliding = [bool(s) for s in value("attention.sliding_window_pattern")]
    heads_kv, widths = value("attention.head_count_kv"), value("feed_forward_length")
    heads_kv = heads_kv if isinstance(heads_kv, list) else [heads_kv] * layers
    widths = widths if isinstance(widths, list) else [widths] * layers
    shared = value("attention.shared_kv_layers", 0)
    global_dim, local_dim = value("attention.key_length"), value("attention.key_length_swa")
    full = [i for i in range(layers) if not sliding[i]]
    storing = [i for i in full if i < layers - shared]
    turning = int((np.array(tensors[_ROPE_FREQS].data, dtype=np.float32) == 1.0).sum())
    config = {
        "hidden_activation": "gelu_pytorch_tanh", "sliding_window": value("attention.sliding_window"),
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "head_dim": local_dim, "num_key_value_heads": heads_kv[sliding.index(True)] if any(sliding) else heads_kv[0],
        "per_layer_config": {str(i): {"head_dim": global_dim, "num_key_value_heads": heads_kv[i]} for i in full},
        "attention_k_eq_v": bool(storing) and f"blk.{storing[0]}.attn_v.weight" not in tensors,
        "num_kv_shared_layers": shared, "intermediate_size": min(widths),
        "use_double_wide_mlp": max(widths) == 2 * min(widths),
        "hidden_size_per_layer_input": value("embedding_length_per_layer_input", 0),
        "final_logit_softcapping": value("final_logit_softcapping", None),
        "rope_parameters": {
            "full_attention": {"rope_type": "proportional", "rope_theta": value("rope.freq_base"),
                               "partial_rotary_factor": 2 * turning / global_dim},
            "sliding_attention": {"rope_type": "default", "rope_theta": value("rope.freq_base_swa", 10000.0)}},
    }
    if "per_layer_token_embd.weight" in tensors:
        config["vocab_size_per_layer_input"] = int(tensors["per_layer_token_embd.weight"].shape[1])
    if value("expert_count", 0):  # the 26B-A4B's experts beside each layer's MLP
        width = value("expert_feed_forward_length")
        config |= {"enable_moe_block": True, "top_k_experts": value("expert_used_count"),
                   "moe_intermediate_size": width[0] if isinstance(width, list) else width}
    return config


def _rope_scaling(reader: GgufFile, arch: str, entry: registry.Architecture,
                  tensors: dict[str, ReaderTensor]) -> dict | None:
    if entry.gemma4:  # its rope_freqs are the global layers' proportional rope (_gemma4_config)
        return None
    if _ROPE_FREQS in tensors:
        return _llama3_scaling(reader, arch, torch.from_numpy(np.array(tensors[_ROPE_FREQS].data, dtype=np.float32)))
    if all(name in tensors for name in _LONGROPE_FACTORS):  # Phi-3's LongRoPE, its factors as tensors
        scaling = {key: np.array(tensors[name].data, dtype=np.float32).tolist()
                   for name, key in _LONGROPE_FACTORS.items()}
        return {"rope_type": "longrope", **scaling,
                "original_max_position_embeddings": metadata(reader, f"{arch}.rope.scaling.original_context_length"),
                "attention_factor": metadata(reader, f"{arch}.rope.scaling.attn_factor", None)}
    kind = metadata(reader, f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    scaling = {"rope_type": kind, "factor": metadata(reader, f"{arch}.rope.scaling.factor")}
    original = metadata(reader, f"{arch}.rope.scaling.original_context_length", None)
    if original is not None:
        scaling["original_max_position_embeddings"] = original
    if kind == "yarn":
        for key in ("beta_fast", "beta_slow"):
            scaling[key] = metadata(reader, f"{arch}.rope.scaling.yarn_{key}", None)
        if not entry.gguf_yarn_truncate:  # its released config's; the file does not say
            scaling["truncate"] = False
    return scaling


# Llama 3.1 and 3.2 (factor 8 and 32 over an original context of 8192, low and high frequency
# factors 1 and 4) are the published ones; the others are there for fine-tunes that changed them.
_LLAMA3_CANDIDATES = [(low, high, context) for context in (8192, 4096, 16384, 32768)
                      for low, high in ((1.0, 4.0), (1.0, 2.0), (2.0, 4.0), (1.0, 8.0))]


def _llama3_scaling(reader: GgufFile, arch: str, rope_freqs: torch.Tensor) -> dict:
    """llama.cpp stores Llama 3.1's frequency scaling as the divisor of each frequency
    (`rope_freqs`), not as its parameters: find the parameters that give exactly those divisors,
    so the model is the one transformers runs. Divisors that match no published Llama 3 scaling
    are used as they are, as llama.cpp uses them (rope type "freq_factors")."""

    def frequencies(scaling: dict | None) -> torch.Tensor:
        rope = SimpleNamespace(head_dim=2 * rope_freqs.numel(), rotary_dim=2 * rope_freqs.numel(), rope_scaling=scaling,
                               rope_theta=metadata(reader, f"{arch}.rope.freq_base", 10000.0),
                               rope_head_dim=lambda kind: 2 * rope_freqs.numel())
        return rope_inverse_frequencies(rope)  # type: ignore[arg-type]

    wanted = frequencies(None) / rope_freqs
    for low, high, context in _LLAMA3_CANDIDATES:
        scaling = {"rope_type": "llama3", "factor": float(rope_freqs.max()), "low_freq_factor": low,
                   "high_freq_factor": high, "original_max_position_embeddings": context}
        if torch.allclose(frequencies(scaling), wanted, rtol=1e-4):
            return scaling
    return {"rope_type": "freq_factors", "factors": [float(f) for f in rope_freqs]}


def dequantize(tensor: ReaderTensor) -> torch.Tensor:
    """One GGUF tensor as float32, in PyTorch's (rows, columns) order."""
    if tensor.tensor_type not in DEQUANTIZED_TYPES:
        supported = ", ".join(t.name for t in DEQUANTIZED_TYPES)
        raise ValueError(f"{tensor.name}: unsupported GGUF tensor type {tensor.tensor_type.name}; supported: {supported}")
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    if tensor.tensor_type == Q.BF16:  # gguf-py's takes Gemma 3's 1.0G values in 3.7 s, this in 2.5 s
        return stored(tensor).float()
    values = dequantize_blocks(tensor.data, tensor.tensor_type)  # float32 already: not copied again
    return torch.from_numpy(np.asarray(values, dtype=np.float32)).reshape(shape)


_STORED_DTYPES = {Q.F32: (np.float32, torch.float32), Q.F16: (np.float16, torch.float16),
                  Q.BF16: (np.int16, torch.bfloat16)}


def stored(tensor: ReaderTensor) -> torch.Tensor:
    """One GGUF tensor in PyTorch's (rows, columns) order: a float one as the file stores it (a view
    of its mapped pages, which the loader's copy into a parameter converts as exactly as widening
    it to float32 first would, without a float32 copy: Gemma 4 E2B's BF16 per-layer table had
    peaked a load at 21 GB), any other dequantized to float32."""
    if tensor.tensor_type not in _STORED_DTYPES:
        return dequantize(tensor)
    numpy_type, torch_type = _STORED_DTYPES[tensor.tensor_type]
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    with warnings.catch_warnings():  # the pages are mapped read-only; only copies are written
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.asarray(tensor.data).view(numpy_type)).view(torch_type).reshape(shape)


def checkpoint_tensors(reader: GgufFile, skip: set[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor: `stored`'s) for every weight but those named in `skip` (GGUF
    names), which are not even dequantized; q and k rows back in Hugging Face order."""
    arch = architecture(reader)
    permuted = registry.GGUF_ARCHITECTURES[arch].gguf_permuted
    heads = metadata(reader, f"{arch}.attention.head_count")
    kv_heads = metadata(reader, f"{arch}.attention.head_count_kv", heads)
    expert_biases: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        if tensor.name == _ROPE_FREQS or tensor.name in _LONGROPE_FACTORS or tensor.name in skip:
            continue  # rope tensors are read into the config's rope scaling
        if tensor.name.partition(".")[0] in _DENSE:
            continue  # dense_weights reads them
        name = hf_name(tensor.name, arch)
        values = stored(tensor)
        if name.endswith("_exps.weight"):  # [experts, out, in]: each expert's as its own tensor
            layer, _, part = name.removesuffix("_exps.weight").rpartition(".")
            for expert, weight in enumerate(values):
                yield f"{layer}.experts.{expert}.{part}_proj.weight", weight
            continue
        if name.endswith("_exps.bias"):  # gpt-oss's [experts, out], gate's and up's stacked as one
            layer, _, part = name.removesuffix("_exps.bias").rpartition(".")
            expert_biases[f"{layer}.{part}"] = values
            if part == "down":
                yield f"{layer}.experts.down_proj_bias", expert_biases.pop(f"{layer}.down")
            elif f"{layer}.gate" in expert_biases and f"{layer}.up" in expert_biases:
                yield f"{layer}.experts.gate_up_proj_bias", torch.cat(
                    (expert_biases.pop(f"{layer}.gate"), expert_biases.pop(f"{layer}.up")), dim=1)
            continue
        if name.endswith("sinks.weight"):
            name = name.removesuffix(".weight")
        if name.endswith("linear_attn.conv1d.weight"):  # stored [channels, kernel]
            values = values.unsqueeze(1)
        if permuted and name.endswith(("q_proj.weight", "q_proj.bias")):
            values = unpermute_rotary(values, heads)
        elif permuted and name.endswith(("k_proj.weight", "k_proj.bias")):
            values = unpermute_rotary(values, kv_heads)
        yield name, values


def dense_weights(reader: GgufFile) -> list[torch.Tensor]:
    """An embedding model's Dense modules after pooling, in order: each one's weight [out, in]
    (identity activation, no bias, as EmbeddingGemma's)."""
    tensors = {t.name: t for t in reader.tensors}
    return [dequantize(tensors[f"{name}.weight"]) for name in _DENSE if f"{name}.weight" in tensors]


def hf_name(gguf_name: str, arch: str = "llama") -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; a tensor the
    architecture's names list whole (`blk.3.ssm_a`) -> its name there."""
    base, _, kind = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{kind}"
    names = registry.GGUF_ARCHITECTURES[arch].gguf_layer_names
    block, layer, rest = (gguf_name.split(".", 2) + ["", ""])[:3]
    part = rest.rpartition(".")[0]
    if block != "blk" or not layer.isdigit() or (rest not in names and part not in names):
        raise ValueError(f"unexpected GGUF tensor {gguf_name}")
    return f"model.layers.{layer}.{names[rest]}" if rest in names else f"model.layers.{layer}.{names[part]}.{kind}"


def unpermute_rotary(values: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of llama.cpp's `LlamaModel.permute`: within each head, rows (0, 2, 4, ..., 1, 3,
    5, ...) go back to (0, 1, 2, ...)."""
    half = values.shape[0] // heads // 2
    return values.reshape(heads, half, 2, *values.shape[1:]).transpose(1, 2).reshape(values.shape)
