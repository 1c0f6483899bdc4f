"""Build a model from a Hugging Face checkpoint directory (safetensors), a GGUF file, or with dummy weights."""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tailrace.model.cpu import bf16_linear, int_linear

from tailrace.model.decoder import registry

from tailrace.heap import release_freed
from tailrace.logs import timed
from tailrace.model.decoder.config import ModelConfig, as_id_list, limit_context, parse_model_config
from tailrace.model.decoder.llama import (DecoderLayer, GatedDeltaNet, GatedRMSNorm, LayerNorm, Linear,
                                          LlamaForCausalLM, MoE, PooledDense, RMSNorm, in_proj_split,
                                          reorder_rotary_dims)
from tailrace.model.loading import gguf, gguf_file
from tailrace.model.loading.gguf_quant import block_projections, lookup_table, use_gguf_blocks
from tailrace.model.loading.hub import is_gguf
from tailrace.model.loading.mxfp4 import dequantize_mxfp4, e2m1_codes
from tailrace.model.loading.st_modules import dense_modules, logit_score_tokens
from tailrace.model.loading.tp_shard import Shard, check_shardable, local_config, parallelize, shard_tensors
from tailrace.model.options import LOAD_FORMATS
from tailrace.model.quant import IntWeight, check_quantization, linear_for, quantize_linear, quantize_model

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DUMMY_STD = 0.02
_SHOWN_KEYS = 10

# Checkpoint projection -> (fused model projection, index of its part)
_FUSED_PARTS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    # Gated DeltaNet's: its convolved q/k/v, output gate, beta's and the decay's inputs
    "in_proj_qkv": ("in_proj", 0),
    "in_proj_z": ("in_proj", 1),
    "in_proj_b": ("in_proj", 2),
    "in_proj_a": ("in_proj", 3),
}


def load_model_config(path: str) -> ModelConfig:
    """Read `path/config.json`; stop tokens from `generation_config.json` are added when present.
    A .gguf `path` is read from its metadata instead."""
    if is_gguf(path):
        return parse_model_config(gguf.config_dict(gguf_file.open_gguf(path)))
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        raw = json.load(f)
    config = parse_model_config(raw)
    generation_path = os.path.join(path, "generation_config.json")
    if os.path.exists(generation_path):
        with open(generation_path, encoding="utf-8") as f:
            extra = as_id_list(json.load(f).get("eos_token_id"))
        config.eos_token_ids += [t for t in extra if t not in config.eos_token_ids]
    return config


def load_model(
    path: str, dtype: str = "auto", load_format: str = "auto", device: str = "cpu", seed: int = 0,
    quantization: str | None = None, shard: Shard | None = None, max_model_len: int | None = None,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """`path`: a checkpoint directory or a .gguf file (its tensors dequantized to `dtype`). dtype "auto":
    see resolve_dtype; load_format "dummy" needs only the config; quantization
    "int8" / "int4" quantizes the projections after loading (see quant). With a `shard`, the model is
    that tensor-parallel rank's part (tp_shard), read from the checkpoint alone; the config returned
    is the whole model's. `max_model_len` caps the context served (config.limit_context)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unsupported load_format {load_format!r}; supported: {', '.join(LOAD_FORMATS)}")
    config = load_model_config(path)
    limit_context(config, max_model_len)
    torch_dtype = resolve_dtype(dtype, device, config.torch_dtype)
    if shard is not None:
        check_shardable(config, shard.size)
    with torch.device(device):
        model = LlamaForCausalLM(config if shard is None else local_config(config, shard), torch_dtype)
    with torch.no_grad():
        if load_format == "dummy":
            if quantization is not None:
                check_quantization(model, quantization)
            init_dummy_weights(model, seed, quantization if shard is None else None)
        elif is_gguf(path):
            _load_gguf(model, config, path, quantization, shard)
        elif shard is None:
            _load_safetensors(model, path, quantization)
        else:
            _load_safetensors_shard(model, config, path, shard)
    if os.path.isdir(path):
        model.dense.extend(_pooled_dense(path, torch_dtype, device))
        model.logit_score = logit_score_tokens(path)
    elif is_gguf(path):
        model.dense.extend(_dense_module(weight, None, "identity", torch_dtype, device)
                           for weight in gguf.dense_weights(gguf_file.open_gguf(path)))
    if shard is not None:
        parallelize(model, config.vocab_size, shard)
    if quantization is not None:
        quantize_model(model, quantization)
        release_freed()  # the float weights it replaced, which glibc would keep resident
    return model.eval(), config


def _pooled_dense(path: str, dtype: torch.dtype, device: str) -> list[PooledDense]:
    """A sentence-transformers folder's Dense modules (st_modules.dense_modules), at `dtype`."""
    modules = []
    for module in dense_modules(path):
        weights = load_file(str(module.weights))
        modules.append(_dense_module(weights["linear.weight"], weights.get("linear.bias"), module.activation, dtype,
                                     device))
    return modules


def _dense_module(weight: torch.Tensor, bias: torch.Tensor | None, activation: str, dtype: torch.dtype,
                  device: str) -> PooledDense:
    out_features, in_features = weight.shape
    with torch.device(device):
        linear = Linear(in_features, out_features, bias is not None, dtype)
    with torch.no_grad():
        linear.weight.copy_(weight)
        if bias is not None:
            linear.bias.copy_(bias)
    return PooledDense(linear, activation)


def _load_gguf(model: LlamaForCausalLM, config: ModelConfig, path: str, quantization: str | None,
               shard: Shard | None) -> None:
    """The GGUF file's weights into `model` (`config`: the whole model's); unsharded and quantized,
    the file's own codes where they map, their float weights never read (quantize_model does the rest)."""
    reader = gguf_file.open_gguf(path)
    from_blocks = quantization is not None and shard is None
    blocks = block_projections(model, reader) if from_blocks else []
    table = lookup_table(reader) if from_blocks else None
    supplied = {f"{p.path}.weight" for p in blocks}
    unread = {part.name for p in blocks for part in p.parts}
    if table is not None:  # the lookups read its codes
        supplied.add("model.embed_tokens.weight")
        unread.add(table.name)
    else:
        unread.discard("token_embd.weight")  # the table the lookups read
    per_layer = lookup_table(reader, "per_layer_token_embd.weight") if from_blocks else None
    if per_layer is not None:  # Gemma 4's per-layer inputs, looked up in their codes too
        supplied.add("model.embed_tokens_per_layer.weight")
        unread.add(per_layer.name)
    with timed(log, "reading the GGUF's other tensors"):
        tensors = gguf.checkpoint_tensors(reader, skip=unread)
        load_tensors(model, tensors if shard is None else shard_tensors(tensors, config, shard), supplied=supplied)
        reorder_rotary_dims(model)
    with timed(log, "packing the GGUF's blocks"):
        use_gguf_blocks(model, reader, blocks, table, per_layer)
    gguf_file.release_pages(reader)


def _load_safetensors(model: LlamaForCausalLM, path: str, quantization: str | None) -> None:
    """The checkpoint's weights into `model`. A GGUF file holds the norms' scales; a Gemma
    checkpoint holds them less 1 (llama.cpp's converter adds it, as this does)."""
    config = model.config
    files = checkpoint_files(path)
    tensors = safetensors_tensors(files)
    # MXFP4 experts as they are, on the integer kernel, where the projections are quantized
    mxfp4: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None
    if registry.architecture(config.architecture).mxfp4_experts:
        mxfp4 = {} if quantization is not None and int_linear.available() else None
        tensors = gpt_oss_tensors(tensors, mxfp4)
    supplied = _mxfp4_expert_weights(model, files) if mxfp4 is not None else set()
    load_tensors(model, tensors, config.norm_weight_offset, supplied)
    if mxfp4:
        use_mxfp4_experts(model, mxfp4)
    reorder_rotary_dims(model)


def _load_safetensors_shard(model: LlamaForCausalLM, config: ModelConfig, path: str, shard: Shard) -> None:
    """`shard`'s part of the checkpoint's weights into `model` (`config`: the whole model's), each
    read as a slice, named as the model names them before their parts are taken (Gemma 3's
    image-text ones)."""
    lazy = safetensors_tensors(checkpoint_files(path), lazy=True)
    named = ((_canonical(name), part) for name, part in lazy)
    load_tensors(model, shard_tensors(named, config, shard), config.norm_weight_offset)
    reorder_rotary_dims(model)


def resolve_quantization(quantization: str | None, path: str, device: str) -> str | None:
    """`quantization` as asked ("none": float weights), or unasked, the checkpoint's own: a GGUF
    file whose projections are all stored quantized loads quantized on CPU, as llama.cpp and vLLM
    keep it. Its blocks go to the kernel as they are where they map (gguf_quant.MAPPED_TYPES);
    the others (IQ types) become int8, 8 bits a weight, above their precision, where float32
    would take 32 (an 8B model: 32 GB, not 5). A file with
    projections in float too (a converter's MXFP4 experts beside float32 attention) loads as
    floats: int8 would lose what it stores exactly."""
    if quantization is not None:
        return None if quantization == "none" else quantization
    if torch.device(device).type != "cpu" or not is_gguf(path):
        return None
    return "int8" if gguf.stores_projections_quantized(gguf_file.open_gguf(path)) else None


def resolve_dtype(dtype: str, device: str, checkpoint_dtype: str = "float32") -> torch.dtype:
    """"auto" is bfloat16 on CUDA. On CPU it is bfloat16 for a checkpoint stored in 16 bits (as
    released models are) when the CPU computes bfloat16 natively: there it halves the bytes every
    decode step streams and is as exact as float32 (model.attention); with int8 / int4 weights it
    costs about what bfloat16 weights do (bench/quality.py) and lets the whole forward run in one
    call. Otherwise float32, so a float32 checkpoint (the embedded model's) keeps its own precision."""
    if dtype == "auto":
        if torch.device(device).type == "cuda":
            return torch.bfloat16
        if checkpoint_dtype in ("bfloat16", "float16") and fast_cpu_bfloat16():
            return torch.bfloat16
        return torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; supported: auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def fast_cpu_bfloat16() -> bool:
    """AVX512-BF16 or AMX, or tailrace's CPU kernels, which run a bfloat16 layer on any AVX512 or
    AVX2 CPU with float32 FMAs in the hardware instruction's order. Without them PyTorch converts bfloat16
    matmuls through float32 op by op, several times slower than float32, while tailrace's
    bfloat16 decode step is several times faster than float32's (bench/decode_step.py)."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported() or bf16_linear.available()


def checkpoint_files(path: str) -> list[str]:
    """The safetensors files of a single-file or sharded checkpoint."""
    index_path = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index_path):
        with open(index_path, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, shard) for shard in shards]
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(single):
        return [single]
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")


def init_dummy_weights(model: LlamaForCausalLM, seed: int, quantization: str | None = None) -> None:
    """Seeded normal(0, 0.02) weights, norm scales at 1, for benchmarks without a checkpoint.

    Drawn on the parameters' device: on CPU, 1e8 values took 0.7 s on 2 cores, so an 8B model's
    would take about a minute before its copy to the GPU. The same seed gives other weights on
    CUDA than on CPU.

    With a `quantization`, each projection is quantized as soon as its weights are drawn (the same
    values as quantize_model would take): a tensor from torch.empty holds no memory until written,
    and the quantized projection frees the float one, so a model whose float weights would not fit
    in memory (Qwen3-30B-A3B's 61 GB in bfloat16) loads in about its quantized size.
    """
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    parent_of = {id(child): (parent, name) for parent in model.modules() for name, child in parent.named_children()}
    for module in list(model.modules()):  # the order of model.parameters(): the same draws
        for param in module.parameters(recurse=False):
            param.copy_(torch.randn(param.shape, generator=generator, device=device) * _DUMMY_STD)
        if isinstance(module, GatedDeltaNet):  # decaying heads, whatever the draw
            module.A.fill_(-1.0)
        if isinstance(module, (RMSNorm, LayerNorm, GatedRMSNorm)):
            module.weight.fill_(1.0)
        if isinstance(module, DecoderLayer) and module.layer_scalar is not None:
            module.layer_scalar.fill_(1.0)
        if isinstance(module, MoE) and module.router_scale is not None:
            module.router_scale.fill_(1.0)
            module.expert_scale.fill_(1.0)
        if isinstance(module, LayerNorm) and module.bias is not None:
            module.bias.zero_()
        elif quantization is not None and type(module) is Linear:
            parent, name = parent_of[id(module)]
            setattr(parent, name, quantize_linear(module.weight, module.bias, quantization))


def safetensors_tensors(files: list[str], lazy: bool = False) -> Iterator[tuple[str, Any]]:
    """Each (name, tensor); lazy: each a safetensors slice instead, which reads only the part indexed."""
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_slice(name) if lazy else f.get_tensor(name)


def checkpoint_shapes(model: LlamaForCausalLM) -> dict[str, tuple[int, ...]]:
    """The Hugging Face checkpoint tensors `model` loads from, with their shapes: fused projections
    as their parts (q/k/v, gate/up), but for an architecture whose checkpoints store them fused
    (Phi-3); what bench/shapes.py writes random weights for."""
    fused_stored = registry.architecture(model.config.architecture).stored_fused
    shapes = {}
    for name, param in model.named_parameters():
        if name.endswith(".linear_attn.A"):  # stored as A_log (_linear_attention_tensors)
            shapes[f"{name}_log"] = tuple(param.shape)
            continue
        parts = _fused_parts(name, model.config)
        if not parts or fused_stored:
            shapes[name] = tuple(param.shape)
            continue
        for part_name, fused, index in parts:
            shapes[part_name] = (_part_rows(fused, index, model.config, param, _layer_of(name))[1], *param.shape[1:])
    return shapes


def gpt_oss_tensors(tensors: Iterable[tuple[str, torch.Tensor]],
                    mxfp4: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """gpt-oss's checkpoint in transformers 5's layout (load_tensors splits it by expert): the
    router as mlp.gate; the experts stacked [experts, in, out] with gate and up interleaved
    (gate_up_proj[..., ::2] the gates), turned [experts, out, in] with the gates first; or the same
    as MXFP4 blocks and scales ([experts, out, ...]), dequantized when both have come, or where
    `mxfp4` is given put there as they are (by their stacked weight's name, for use_mxfp4_experts)."""
    pending: dict[str, torch.Tensor] = {}
    for name, tensor in tensors:
        name = name.replace(".mlp.router.", ".mlp.gate.")
        layer, _, part = name.rpartition(".mlp.experts.")
        if not layer:
            yield name, tensor
            continue
        if part.endswith(("_blocks", "_scales")):
            pending[name] = tensor
            stem = name.rsplit("_", 1)[0]
            if f"{stem}_blocks" not in pending or f"{stem}_scales" not in pending:
                continue
            blocks, scales = pending.pop(f"{stem}_blocks"), pending.pop(f"{stem}_scales")
            if mxfp4 is not None:
                mxfp4[stem] = blocks, scales
                continue
            weight = dequantize_mxfp4(blocks, scales)
            part = part.rsplit("_", 1)[0]
        elif part in ("gate_up_proj", "down_proj"):
            weight = tensor.transpose(1, 2)
        else:  # the biases, [experts, out]
            weight = tensor
        if part.startswith("gate_up_proj"):
            weight = torch.cat((weight[:, 0::2], weight[:, 1::2]), dim=1)
        yield f"{layer}.mlp.experts.{part}", weight
    if pending:
        raise ValueError(f"MXFP4 tensors without their blocks or scales: {', '.join(sorted(pending))}")


def _mxfp4_expert_weights(model: LlamaForCausalLM, files: list[str]) -> set[str]:
    """Every expert weight whose stacked tensor the checkpoint holds as MXFP4 blocks (read from
    the files' headers): what use_mxfp4_experts builds, so load_tensors neither reads nor misses it."""
    stems = set()
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            stems |= {name.removesuffix("_blocks") for name in f.keys() if name.endswith("_blocks")}
    return {f"{layer}.mlp.experts.{expert}.{part}.weight" for layer, _, part in
            (stem.rpartition(".mlp.experts.") for stem in stems) for expert in range(model.config.num_experts)}


def use_mxfp4_experts(model: LlamaForCausalLM, mxfp4: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Each expert's projection from its rows of the stacked MXFP4 blocks (gate_up's rows
    interleaved gate, up, gate, ..., put gates first as the model holds them), E2M1 codes on
    tailrace's kernel with the bias loaded; their float weights were never written."""
    for stem, (blocks, scales) in mxfp4.items():
        layer, _, part = stem.rpartition(".mlp.experts.")
        codes, halves = e2m1_codes(blocks, scales)
        if part == "gate_up_proj":
            codes, halves = (torch.cat((t[:, 0::2], t[:, 1::2]), dim=1) for t in (codes, halves))
        for index, expert in enumerate(model.get_submodule(f"{layer}.mlp.experts")):
            current = getattr(expert, part)
            bias = None if current.bias is None else current.bias.detach()
            setattr(expert, part, linear_for(IntWeight(codes[index], halves[index], None, e2m1=True), bias))
        release_freed()  # the layer's decoding temporaries


def load_tensors(model: LlamaForCausalLM, tensors: Iterable[tuple[str, torch.Tensor]],
                 norm_offset: float = 0.0, supplied: set[str] = frozenset()) -> None:
    """Copy every (Hugging Face name, tensor) into its (possibly fused) parameter, casting to the
    model dtype; each norm's weight first has `norm_offset` added (in float32). The `supplied`
    parameters come from elsewhere (GGUF blocks): neither read nor missing."""
    params = dict(model.named_parameters())
    sources = {name: options for name, options in _checkpoint_names(params, model.config).items()
               if name not in supplied}
    expected = {name for options in sources.values() for names in options for name in names}
    loaded: set[str] = set()
    unexpected: list[str] = []
    encoder = registry.architecture(model.config.architecture).encoder
    for name, tensor in _linear_attention_tensors(_each_expert(tensors), model.config):
        name = _encoder_name(name) if encoder else _canonical(name)
        if _ignored(name, model.config):
            continue
        if name not in expected:
            unexpected.append(name)
            continue
        if norm_offset and name.endswith("norm.weight") and ".linear_attn." not in name:  # not the gated norm
            tensor = tensor[...].float() + norm_offset
        _copy_into(params, name, tensor, model.config)
        loaded.add(name)
    # each parameter from one of its sources, whole (Phi-3's qkv_proj) or in parts (q/k/v_proj)
    missing = sorted(name for options in sources.values() if not any(set(names) <= loaded for names in options)
                     for name in options[-1] if name not in loaded)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint does not match {model.config.architecture}: "
            f"missing {_listing(missing)}; unexpected {_listing(sorted(unexpected))}"
        )


def _checkpoint_names(params: dict[str, torch.nn.Parameter], config: ModelConfig) -> dict[str, list[list[str]]]:
    """For each parameter, the sets of checkpoint tensors it may come from: itself, or for a fused
    projection also its parts (listed last: what a missing parameter is reported as)."""
    sources = {}
    for name in params:
        parts = [part_name for part_name, _, _ in _fused_parts(name, config)]
        sources[name] = [[name], parts] if parts else [[name]]
    return sources


_LAYER = re.compile(r"layers\.(\d+)\.")


def _layer_of(name: str) -> int | None:
    found = _LAYER.search(name)
    return None if found is None else int(found.group(1))


def _fused_parts(name: str, config: ModelConfig) -> list[tuple[str, str, int]]:
    """For a fused projection's parameter (qkv_proj, gate_up_proj), each part's checkpoint name,
    the projection and the part's index in it; [] for any other parameter. A layer reading
    another's K/V has q_proj alone, one whose values are its keys q_proj and k_proj (Gemma 4's)."""
    module, _, kind = name.rpartition(".")
    prefix, _, projection = module.rpartition(".")
    parts = [(f"{prefix}.{part}.{kind}", fused, index) for part, (fused, index) in _FUSED_PARTS.items()
             if fused == projection]
    layer = _layer_of(name)
    if projection == "qkv_proj" and layer is not None and layer < config.num_hidden_layers:
        parts = parts[:config.projected_parts(layer)]
    return parts


def _each_expert(tensors: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """transformers 5's stacked experts (mlp.experts.gate_up_proj [experts, 2 * I, in], down_proj,
    and gpt-oss's biases; Gemma 4's experts.* beside its mlp) as each expert's projection; every
    other tensor as it is."""
    for name, tensor in tensors:
        block, _, part = name.rpartition(".experts.")
        if not block or part not in _STACKED_EXPERTS:
            yield name, tensor
            continue
        for expert in range(tensor.shape[0]):
            yield f"{block}.experts.{expert}.{_STACKED_EXPERTS[part]}", tensor[expert]


def _linear_attention_tensors(tensors: Iterable[tuple[str, Any]], config: ModelConfig) -> Iterator[tuple[str, Any]]:
    """Gated DeltaNet's tensors as the model holds them: A_log as the decay rate A = -exp(A_log)
    (float32); Qwen3-Next's projections, stored per q/k head group (in_proj_qkvz: each group's q,
    k, then its value heads' v and z; in_proj_ba: its heads' b then a), as Qwen3.5 stores them:
    in_proj_qkv (all q, all k, all v), in_proj_z, in_proj_b, in_proj_a."""
    groups, per = config.linear_key_heads, config.linear_value_heads // max(config.linear_key_heads, 1)
    key, value = config.linear_key_dim, config.linear_value_dim
    for name, tensor in tensors:
        if name.endswith(".linear_attn.in_proj_qkvz.weight"):
            q, k, v, z = tensor[...].view(groups, -1, tensor.shape[-1]).split([key, key, per * value, per * value], 1)
            flat = [part.reshape(-1, tensor.shape[-1]) for part in (q, k, v, z)]
            yield name.replace("in_proj_qkvz", "in_proj_qkv"), torch.cat(flat[:3])
            yield name.replace("in_proj_qkvz", "in_proj_z"), flat[3]
        elif name.endswith(".linear_attn.A_log"):
            yield name.removesuffix("_log"), -tensor[...].float().exp()
        elif name.endswith(".linear_attn.in_proj_ba.weight"):
            b, a = tensor[...].view(groups, 2 * per, tensor.shape[-1]).split([per, per], 1)
            yield name.replace("in_proj_ba", "in_proj_b"), b.reshape(-1, tensor.shape[-1])
            yield name.replace("in_proj_ba", "in_proj_a"), a.reshape(-1, tensor.shape[-1])
        else:
            yield name, tensor


_BASE_MODEL_PARTS = ("embed_tokens.", "layers.", "norm.")
_GEMMA4_EXPERT_PARTS = {"experts.": "experts.", "router.proj.": "gate.", "router.scale": "router_scale",
                        "router.per_expert_scale": "expert_scale"}
_GEMMA4_EXPERTS = re.compile(r"(\.layers\.\d+)\.(experts\.|router\.proj\.|router\.scale$|router\.per_expert_scale$)")


def _canonical(name: str) -> str:
    """A checkpoint name as the loader knows it: a multimodal checkpoint's language model's as a
    text model's (Gemma 3's language_model.model.* or model.language_model.*); Mixtral's experts
    named as Qwen3-MoE's (block_sparse_moe -> mlp, w1 / w3 / w2 -> gate_proj / up_proj /
    down_proj)."""
    for prefix, text in (("language_model.", ""), ("model.language_model.", "model.")):
        if name.startswith(prefix):
            name = text + name[len(prefix):]
    if name.startswith(_BASE_MODEL_PARTS):  # a base model's (Qwen3Model): its parts are the causal model's model.*
        name = "model." + name
    # Gemma 4's experts beside its mlp, and their router: the layer's `moe`
    name = _GEMMA4_EXPERTS.sub(lambda m: f"{m[1]}.moe.{_GEMMA4_EXPERT_PARTS[m[2]]}", name)
    if ".block_sparse_moe." in name:
        name = name.replace(".block_sparse_moe.", ".mlp.")
        for old, new in ((".w1.", ".gate_proj."), (".w3.", ".up_proj."), (".w2.", ".down_proj.")):
            name = name.replace(old, new)
    return name


# BERT's, RoBERTa's, XLM-R's, NomicBERT's and ModernBERT's checkpoint names (after a classifier's
# bert. or roberta.) -> the model's; NomicBERT's both as nomic's own code and as transformers names them
_ENCODER_PREFIXES = ("bert.", "roberta.")
_ENCODER_PARTS = {
    "embeddings.word_embeddings.": "model.embed_tokens.",
    "embeddings.position_embeddings.": "model.embed_positions.",
    "embeddings.token_type_embeddings.": "model.embed_types.",
    "embeddings.LayerNorm.": "model.embed_norm.",
    "emb_ln.": "model.embed_norm.",
    "embeddings.tok_embeddings.": "model.embed_tokens.",
    "embeddings.norm.": "model.embed_norm.",
    "final_norm.": "model.norm.",
    # a classifier's head: BERT's pooler and classifier, RoBERTa's classification head
    "pooler.dense.": "score.dense.",
    "classifier.dense.": "score.dense.",
    "classifier.out_proj.": "score.out_proj.",
    "classifier.": "score.out_proj.",
}
_ENCODER_LAYER_PARTS = {
    "attention.self.query.": "self_attn.q_proj.",
    "attention.self.key.": "self_attn.k_proj.",
    "attention.self.value.": "self_attn.v_proj.",
    "attention.output.dense.": "self_attn.o_proj.",
    "attention.output.LayerNorm.": "post_attention_layernorm.",
    "intermediate.dense.": "mlp.up_proj.",
    "output.dense.": "mlp.down_proj.",
    "output.LayerNorm.": "post_feedforward_layernorm.",
    "attn.Wqkv.": "self_attn.qkv_proj.",
    "attn.out_proj.": "self_attn.o_proj.",
    "mlp.fc11.": "mlp.up_proj.",
    "mlp.fc12.": "mlp.gate_proj.",
    "mlp.fc2.": "mlp.down_proj.",
    "norm1.": "post_attention_layernorm.",
    "norm2.": "post_feedforward_layernorm.",
    "post_mlp_layernorm.": "post_feedforward_layernorm.",
    "attn_norm.": "input_layernorm.",
    "attn.Wo.": "self_attn.o_proj.",
    "mlp_norm.": "post_attention_layernorm.",  # the MLP's input norm, by Llama's name for it
    "mlp.Wi.": "mlp.gate_up_proj.",
    "mlp.Wo.": "mlp.down_proj.",
}
_ENCODER_LAYERS = re.compile(r"(?:encoder\.)?layers?\.(\d+)\.")


def _encoder_name(name: str) -> str:
    """An encoder checkpoint's name as the model's (LayerNorm's gamma and beta as weight and bias,
    as checkpoints converted from TensorFlow name them)."""
    for prefix in _ENCODER_PREFIXES:
        name = name.removeprefix(prefix)
    if name.endswith(".gamma") or name.endswith(".beta"):
        name = name.rsplit(".", 1)[0] + (".weight" if name.endswith(".gamma") else ".bias")
    layer = _ENCODER_LAYERS.match(name)
    parts = _ENCODER_PARTS
    if layer is not None:
        name, parts = name[layer.end():], _ENCODER_LAYER_PARTS
    for old, new in parts.items():
        if name.startswith(old):
            name = new + name[len(old):]
            break
    return name if layer is None else f"model.layers.{layer.group(1)}.{name}"


def _ignored(name: str, config: ModelConfig) -> bool:
    # Old checkpoints store RoPE frequencies (an encoder's its position ids); tied checkpoints
    # sometimes still store lm_head; a multimodal one its image tower and projector, which serve
    # no text; an encoder's base model its pooler, which its embeddings do not use; Qwen3.5's
    # its multi-token-prediction layers, which only speculative decoding would read.
    return (name.endswith(("rotary_emb.inv_freq", "embeddings.position_ids"))
            or (config.tie_word_embeddings and name == "lm_head.weight")
            or name.removeprefix("model.").split(".")[0] in _IMAGE_PARTS
            or name.startswith("mtp.")
            or (not config.num_labels and name.startswith("score.")))


def _copy_into(params: dict[str, torch.nn.Parameter], name: str, tensor: torch.Tensor, config: ModelConfig) -> None:
    module, _, kind = name.rpartition(".")
    prefix, _, projection = module.rpartition(".")
    if projection == "q_proj" and config.attention_output_gate:  # each head's q then its gate
        target = params[f"{prefix}.qkv_proj.{kind}"]
        q_size = config.num_attention_heads * config.head_dim
        if tensor.shape != (2 * q_size, *target.shape[1:]):
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)}, model expects "
                             f"{(2 * q_size, *target.shape[1:])}")
        q, gate = tensor[...].view(config.num_attention_heads, 2, config.head_dim, -1).unbind(1)
        target[:q_size].copy_(q.reshape(q_size, *target.shape[1:]))
        target[-q_size:].copy_(gate.reshape(q_size, *target.shape[1:]))
        return
    if projection in _FUSED_PARTS and name not in params:  # an ungated MLP's up_proj is its own
        fused, part = _FUSED_PARTS[projection]
        target = params[f"{prefix}.{fused}.{kind}"]
        start, size = _part_rows(fused, part, config, target, _layer_of(name))
        target = target.narrow(0, start, size)
    else:
        target = params[name]
    if target.shape != tensor.shape:
        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)}, model expects {tuple(target.shape)}")
    target.copy_(tensor)


_IMAGE_PARTS = {"vision_tower", "multi_modal_projector", "visual", "embed_vision", "audio_tower", "embed_audio"}
_STACKED_EXPERTS = {"gate_up_proj": "gate_up_proj.weight", "down_proj": "down_proj.weight",
                    "gate_up_proj_bias": "gate_up_proj.bias", "down_proj_bias": "down_proj.bias"}


def _part_rows(fused: str, part: int, config: ModelConfig, target: torch.Tensor,
               layer: int | None = None) -> tuple[int, int]:
    """(first row, rows) of one part inside a fused projection's output dimension (`target`, of
    layer `layer`)."""
    if fused == "gate_up_proj":  # halves: an MLP's or an expert's
        half = target.shape[0] // 2
        return part * half, half
    if fused == "in_proj":  # Gated DeltaNet's: q/k/v, z, b, a
        sizes = in_proj_split(config)
        return sum(sizes[:part]), sizes[part]
    kv_heads, dim = (config.num_key_value_heads, config.head_dim) if layer is None else config.attention_shape(layer)
    q_size, kv_size = config.num_attention_heads * dim, kv_heads * dim
    if part == 0 and config.attention_output_gate:  # q_proj holds each head's gate too (_copy_into)
        return 0, 2 * q_size
    return [(0, q_size), (q_size, kv_size), (q_size + kv_size, kv_size)][part]


def _listing(names: list[str]) -> str:
    if not names:
        return "none"
    shown = ", ".join(names[:_SHOWN_KEYS])
    more = len(names) - _SHOWN_KEYS
    return f"{len(names)} ({shown}{f', and {more} more' if more > 0 else ''})"
