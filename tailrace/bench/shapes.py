"""Model directories of public models' shapes, with seeded random weights, for benchmarks: the
tensors the loader reads for the shape's architecture (`loader.checkpoint_shapes`).

Every server of a comparison must read the same weights, and llama.cpp reads only a GGUF converted
from real files, so a shape is written out in full (config.json, generation_config.json, weights as
safetensors, in shards of about SHARD_BYTES) rather than served with `--load-format dummy`. The
tokenizer is the embedded model's, or for a family whose converter takes no byte-level BPE the
real vocabulary the shape names (Shape.vocabulary: Gemma 4's, rebuilt from the tokenizer-only GGUF
llama.cpp's tree ships). The embedded model's
its vocabulary is smaller than the shape's, which the servers accept (the converter pads the rest
with [PAD] tokens; for Gemma 3, whose converter drops embedding rows past the tokenizer's tokens,
the shape's tokenizer lists unused special tokens up to the vocabulary size). The embedding rows
past the tokenizer's last id are zero (and an untied head's), so those ids score 0 against the
spread of the real tokens' scores and greedy decoding always picks a token the tokenizer can turn
into text: a stream of undecodable ids has no content to time.
"""

from __future__ import annotations

import json
import math
import shutil
import zlib
from dataclasses import asdict, dataclass, field, replace
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tailrace.bench.disk import ensure_room
from tailrace.engine.config import EMBEDDED_MODEL
from tailrace.model.decoder import registry

SHAPES_DIR = Path(__file__).resolve().parents[2] / "bench" / ".shapes"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
STAMP = ".tailrace-shape"
INIT_STD = 0.02  # of every matrix, as Llama's initializer_range


@dataclass(frozen=True, slots=True)
class Shape:
    name: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rope_parameters: dict[str, Any]
    architecture: str = "LlamaForCausalLM"
    model_type: str = "llama"
    extra: dict[str, Any] = field(default_factory=dict)  # the architecture's own config fields
    # Too large to write in float (Qwen3-30B-A3B: 122 GB in float32): one layer is written and
    # converted, and tailrace and llama.cpp read the GGUF that repeats its quantized layer
    # (repeat_layer); vLLM, which reads no such GGUF, draws its own random weights
    # (write_shape_config).
    one_layer: bool = False
    # The precision its weights are written in: float32, or bfloat16 where float32 would not fit
    # in memory while written (Gemma 4 E2B's per-layer table alone is 9.4 GB in float32)
    dtype: str = "float32"
    # A real vocabulary as llama.cpp's tree ships it (models/ggml-vocab-NAME.gguf): the shape's
    # tokenizer, made by llamacpp.vocabulary_tokenizer; "": the embedded model's
    vocabulary: str = ""


SHAPES = {shape.name: shape for shape in (
    Shape("smollm2-135m", hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
          head_dim=64, intermediate_size=1536, vocab_size=49152, max_position_embeddings=8192,
          rope_parameters={"rope_type": "default", "rope_theta": 100000.0}),
    Shape("llama-3.2-1b", hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
          head_dim=64, intermediate_size=8192, vocab_size=128256, max_position_embeddings=131072,
          rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    # Qwen/Qwen2.5-1.5B-Instruct's shape: q/k/v biases, a tied head over a 152k vocabulary
    Shape("qwen2.5-1.5b", hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
          head_dim=128, intermediate_size=8960, vocab_size=151936, max_position_embeddings=32768,
          rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, architecture="Qwen2ForCausalLM",
          model_type="qwen2", extra={"rms_norm_eps": 1e-6, "tie_word_embeddings": True}),
    # google/gemma-4-E2B-it's text model: 35 layers, every 5th global (512-wide heads, a quarter of
    # their pairs turning); the last 20 attend over layers 13's and 14's K/V with double-wide MLPs;
    # per-layer inputs of 256 from a 262,144 x 8,960 table; Gemma 4's own vocabulary
    Shape("gemma-4-e2b", hidden_size=1536, num_hidden_layers=35, num_attention_heads=8, num_key_value_heads=1,
          head_dim=256, intermediate_size=6144, vocab_size=262144, max_position_embeddings=131072,
          rope_parameters={"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                              "rope_theta": 1_000_000.0},
                           "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
          architecture="Gemma4ForCausalLM", model_type="gemma4_text", dtype="bfloat16", vocabulary="gemma-4",
          extra={"hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6, "global_head_dim": 512,
                 "num_kv_shared_layers": 20, "use_double_wide_mlp": True, "sliding_window": 512,
                 "hidden_size_per_layer_input": 256, "vocab_size_per_layer_input": 262144,
                 "final_logit_softcapping": 30.0, "attention_k_eq_v": False, "enable_moe_block": False,
                 "num_experts": None, "top_k_experts": None, "moe_intermediate_size": None,  # as released (llama.cpp's converter reads them)
                 "layer_types": ["full_attention" if i % 5 == 4 else "sliding_attention" for i in range(35)]}),
    # Qwen/Qwen3.5-0.8B's text model: 18 Gated DeltaNet layers (16 q/k and 16 value heads of 128)
    # and 6 gated attention layers (8 heads of 256 over 2 KV heads, a quarter of each turning)
    Shape("qwen3.5-0.8b", hidden_size=1024, num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2,
          head_dim=256, intermediate_size=3584, vocab_size=248320, max_position_embeddings=262144,
          rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
          architecture="Qwen3_5ForCausalLM", model_type="qwen3_5_text",
          extra={"rms_norm_eps": 1e-6, "tie_word_embeddings": True, "linear_num_key_heads": 16,
                 "linear_num_value_heads": 16, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                 "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
                 "layer_types": ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(24)]}),
    # google/gemma-3-1b-it's shape: 5 of 6 layers see 512 positions back
    Shape("gemma-3-1b", hidden_size=1152, num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1,
          head_dim=256, intermediate_size=6912, vocab_size=262144, max_position_embeddings=32768,
          rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, architecture="Gemma3ForCausalLM",
          model_type="gemma3_text",
          extra={"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256, "sliding_window": 512,
                 "sliding_window_pattern": 6, "rope_local_base_freq": 10_000.0, "rms_norm_eps": 1e-6}),
    # microsoft/Phi-4-mini-instruct's shape: 3/4 of each head turns (its LongRoPE factors, which
    # cost nothing per step, are not the shape's); one layer written (15 GB in float32 whole)
    Shape("phi-4-mini", hidden_size=3072, num_hidden_layers=32, num_attention_heads=24, num_key_value_heads=8,
          head_dim=128, intermediate_size=8192, vocab_size=200064, max_position_embeddings=131072,
          rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                           "original_max_position_embeddings": 4096},  # llama.cpp's converter reads it
          architecture="Phi3ForCausalLM", model_type="phi3", one_layer=True),
    # Qwen/Qwen3-30B-A3B's shape: 128 experts of 768, 8 a token, in every layer; untied head
    Shape("qwen3-30b-a3b", hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
          head_dim=128, intermediate_size=6144, vocab_size=151936, max_position_embeddings=40960,
          rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, architecture="Qwen3MoeForCausalLM",
          model_type="qwen3_moe", one_layer=True,
          extra={"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True,
                 "decoder_sparse_step": 1, "mlp_only_layers": [], "rms_norm_eps": 1e-6,
                 "tie_word_embeddings": False}),
    # Qwen/Qwen3-Embedding-0.6B's shape: Qwen3-0.6B's decoder saved as its base model (no head)
    Shape("qwen3-embedding-0.6b", hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
          num_key_value_heads=8, head_dim=128, intermediate_size=3072, vocab_size=151669,
          max_position_embeddings=32768, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
          architecture="Qwen3Model", model_type="qwen3", extra={"rms_norm_eps": 1e-6}),
    # openai/gpt-oss-20b's shape: 32 experts of 2880, 4 a token; sinks, biases, YaRN, every other
    # layer a window of 128; untied head
    Shape("gpt-oss-20b", hidden_size=2880, num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8,
          head_dim=64, intermediate_size=2880, vocab_size=201088, max_position_embeddings=131072,
          rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                           "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096},
          architecture="GptOssForCausalLM", model_type="gpt_oss", one_layer=True,
          extra={"num_local_experts": 32, "num_experts_per_tok": 4, "sliding_window": 128, "attention_bias": True,
                 "swiglu_limit": 7.0, "tie_word_embeddings": False}),
)}


def layer_of(shape: Shape) -> Shape:
    """The one layer of a shape written as one layer (see Shape.one_layer), as a shape of its own."""
    return replace(shape, name=f"{shape.name}-1-layer", num_hidden_layers=1, one_layer=False)


def repeat_layer(source: Path, layers: int, target: Path) -> None:
    """A GGUF of `layers` layers, each the one layer (blk.0) of the GGUF `source`, in the source's
    own types and bytes: a shape's quantized weights without ever holding them in float."""
    import gguf

    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    if reader.fields[f"{arch}.block_count"].contents() != 1:
        raise ValueError(f"{source} has more than one layer to repeat")
    copies = {tensor.name: layers if tensor.name.startswith("blk.0.") else 1 for tensor in reader.tensors}
    ensure_room(target, sum(t.data.nbytes * copies[t.name] for t in reader.tensors), target.name)
    writer = gguf.GGUFWriter(target, arch)
    for name, entry in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = layers if name == f"{arch}.block_count" else entry.contents()
        array = entry.types[0] == gguf.GGUFValueType.ARRAY
        writer.add_key_value(name, value, entry.types[0], sub_type=entry.types[-1] if array else None)
    written = []
    for tensor in reader.tensors:
        for i in range(copies[tensor.name]):
            name = tensor.name.replace("blk.0.", f"blk.{i}.", 1)
            writer.add_tensor_info(name, tensor.data.shape, tensor.data.dtype, tensor.data.nbytes, tensor.tensor_type)
            written.append(tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in written:
        writer.write_tensor_data(tensor.data)
    writer.close()


def shape_config(shape: Shape, tokenizer_config: dict[str, Any]) -> dict[str, Any]:
    """config.json of a float32 model of `shape` with tied embeddings; special token ids come from
    the tokenizer's model."""
    fields = {k: v for k, v in asdict(shape).items()
              if k not in ("name", "architecture", "model_type", "extra", "one_layer", "dtype", "vocabulary")}
    return {
        "architectures": [shape.architecture], "model_type": shape.model_type, "dtype": shape.dtype,
        **fields, "hidden_act": "silu", "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
        "attention_bias": False, "mlp_bias": False, "initializer_range": INIT_STD, "use_cache": True,
        "bos_token_id": tokenizer_config["bos_token_id"], "eos_token_id": tokenizer_config["eos_token_id"],
        "pad_token_id": tokenizer_config.get("pad_token_id"), **shape.extra,
    }


def tensor_shapes(shape: Shape) -> dict[str, tuple[int, ...]]:
    """Every weight of the shape's model, by its Hugging Face name: what the loader reads (a model
    built on the meta device, so no memory is taken)."""
    import torch

    from tailrace.model.decoder.config import parse_model_config
    from tailrace.model.decoder.llama import LlamaForCausalLM
    from tailrace.model.loading.loader import checkpoint_shapes

    config = parse_model_config(shape_config(shape, {"bos_token_id": 0, "eos_token_id": 0}))
    with torch.device("meta"):
        return checkpoint_shapes(LlamaForCausalLM(config, torch.float32))


def tokenizer_size(tokenizer_json: Path) -> int:
    """One past the highest id the tokenizer can produce, added tokens included."""
    tokenizer = json.loads(tokenizer_json.read_text())
    ids = [*tokenizer["model"]["vocab"].values(), *(t["id"] for t in tokenizer.get("added_tokens", []))]
    return max(ids) + 1


def pad_tokenizer(tokenizer_json: Path, size: int) -> None:
    """Special added tokens `<unusedN>` for the ids from the tokenizer's size up to `size`.
    llama.cpp's Gemma 3 converter keeps only as many embedding rows as tokenizer.json lists tokens
    (vocabulary plus added), yet writes the token list padded to the config's vocab_size, and its
    server then refuses the model; a padded tokenizer keeps every row, as Gemma's own lists 6,242
    unused tokens."""
    tokenizer = json.loads(tokenizer_json.read_text())
    tokenizer["added_tokens"] += [
        {"id": i, "content": f"<unused{i}>", "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for i in range(tokenizer_size(tokenizer_json), size)]
    tokenizer_json.write_text(json.dumps(tokenizer, ensure_ascii=False))


def random_weights(shape: Shape, seed: int, known_tokens: int) -> Iterator[dict[str, Any]]:
    """The weights in groups of whole layers of about SHARD_BYTES (a larger tensor alone), each
    tensor seeded by its name, so its values do not depend on the others; norms and layer scalars
    scale by one (Gemma 2's and 3's norms are stored as the scale less one)."""
    import torch

    from tailrace.model.decoder.config import parse_model_config

    offset = parse_model_config(shape_config(shape, {"bos_token_id": 0, "eos_token_id": 0})).norm_weight_offset
    dtype = getattr(torch, shape.dtype)
    group: dict[str, Any] = {}
    for name, size in tensor_shapes(shape).items():
        if group and _layer(name) != _layer(next(reversed(group))) and _bytes(group) >= SHARD_BYTES:
            yield _released(shape, group)
            group = {}
        if name.endswith(("norm.weight", "layer_scalar")):  # Gated DeltaNet's output norm scales by its weight alone
            group[name] = torch.full(size, 1.0 - (0.0 if ".linear_attn." in name or "norm" not in name else offset),
                                     dtype=dtype)
            continue
        group[name] = _drawn(size, torch.Generator().manual_seed(seed * 2**32 + zlib.crc32(name.encode())), dtype)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):  # an untied head scores the unknown ids 0 likewise
            group[name][known_tokens:] = 0.0
    yield _released(shape, group)


SHARD_BYTES = 2 * 2**30
_DRAWN_ROWS = 2**26  # values drawn at once: a large table is filled a part at a time


def _drawn(size: tuple[int, ...], generator: Any, dtype: Any) -> Any:
    """normal(0, INIT_STD) values of `size` at `dtype`, drawn in float32 a few rows at a time."""
    import torch

    out = torch.empty(size, dtype=dtype)
    rows = out.view(-1, size[-1]) if out.dim() > 1 else out.view(1, -1)
    step = max(1, _DRAWN_ROWS // rows.shape[1])
    for start in range(0, rows.shape[0], step):
        part = rows[start:start + step]
        part.copy_(torch.randn(part.shape, generator=generator) * INIT_STD)
    return out


def _layer(name: str) -> str:
    """The layer a tensor belongs to ("" for the model's own): a shard holds whole layers."""
    return ".".join(name.split(".")[:3]) if name.startswith("model.layers.") else ""


def _bytes(group: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in group.values())


def _released(shape: Shape, group: dict[str, Any]) -> dict[str, Any]:
    return released_gpt_oss_layout(group) if registry.architecture(shape.architecture).mxfp4_experts else group


def released_gpt_oss_layout(weights: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss's tensors as its checkpoints store them (what llama.cpp's converter reads, and
    loader.gpt_oss_tensors undoes): the router as mlp.router, each layer's experts stacked
    [experts, in, out] with gate and up interleaved (gate_up_proj[..., ::2] the gates)."""
    import torch

    out, experts = {}, {}
    for name, tensor in weights.items():
        layer, _, part = name.partition(".mlp.experts.")
        if not part:
            out[name.replace(".mlp.gate.", ".mlp.router.")] = tensor
            continue
        index, projection, kind = part.split(".")
        experts.setdefault(layer, {}).setdefault((projection, kind), {})[int(index)] = tensor
    for layer, parts in experts.items():
        def stacked(projection: str, kind: str) -> Any:
            return torch.stack([parts[projection, kind][i] for i in sorted(parts[projection, kind])])
        for kind, suffix in (("weight", ""), ("bias", "_bias")):
            gate, up = stacked("gate_proj", kind), stacked("up_proj", kind)
            gate_up = torch.stack((gate, up), dim=2).flatten(1, 2)  # rows gate 0, up 0, gate 1, ...
            down = stacked("down_proj", kind)
            out[f"{layer}.mlp.experts.gate_up_proj{suffix}"] = gate_up.transpose(1, 2) if kind == "weight" else gate_up
            out[f"{layer}.mlp.experts.down_proj{suffix}"] = down.transpose(1, 2) if kind == "weight" else down
    return {name: tensor.contiguous() for name, tensor in out.items()}


def write_shape(shape: Shape, root: Path = SHAPES_DIR, seed: int = 0, tokenizer_dir: str = EMBEDDED_MODEL) -> Path:
    """The model directory of `shape` under `root`, written on first use and reused after: its
    weights in model.safetensors, or as transformers shards a larger model (model-NNNNN.safetensors
    and their index), written a shard at a time."""
    from safetensors.torch import save_file

    source = Path(tokenizer_dir)
    config = shape_config(shape, json.loads((source / "config.json").read_text()))
    stamp = json.dumps({"config": config, "seed": seed, "padded_tokenizer": _padded(shape),
                        "zero_rows": "embedding and head", **({"tokenizer": shape.vocabulary} if shape.vocabulary else {})})
    directory = root / shape.name
    if _written(directory, stamp):
        return directory
    width = 2 if shape.dtype == "bfloat16" else 4
    ensure_room(root, sum(width * math.prod(size) for size in tensor_shapes(shape).values()),
                f"the {shape.name} shape")
    print(f"writing the {shape.name} shape with random weights (seed {seed}) into {directory}", flush=True)
    partial = _start_directory(shape, root / f"{shape.name}.partial", source, config)
    weight_map: dict[str, str] = {}
    for index, group in enumerate(random_weights(shape, seed, tokenizer_size(source / "tokenizer.json")), 1):
        file = f"model-{index:05d}.safetensors"
        save_file(group, str(partial / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(group, file)
        del group  # not held while the next is drawn
    if len(set(weight_map.values())) == 1:
        (partial / "model-00001.safetensors").rename(partial / "model.safetensors")
    else:
        (partial / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return _finish_directory(partial, stamp, directory)


def write_shape_config(shape: Shape, root: Path = SHAPES_DIR, tokenizer_dir: str = EMBEDDED_MODEL) -> Path:
    """The directory of `shape` without weights (config.json and the tokenizer) under `root`, for a
    server that draws its own random weights (vLLM's --load-format dummy): how vLLM serves a shape
    written as one layer, which it cannot read from a GGUF."""
    source = Path(tokenizer_dir)
    config = shape_config(shape, json.loads((source / "config.json").read_text()))
    stamp = json.dumps({"config": config, "weights": None})
    directory = root / f"{shape.name}-config"
    if _written(directory, stamp):
        return directory
    partial = _start_directory(shape, root / f"{shape.name}-config.partial", source, config)
    return _finish_directory(partial, stamp, directory)


def _written(directory: Path, stamp: str) -> bool:
    """Whether `directory` was written whole with this stamp (see _finish_directory)."""
    return (directory / STAMP).exists() and (directory / STAMP).read_text() == stamp


def _start_directory(shape: Shape, partial: Path, source: Path, config: dict[str, Any]) -> Path:
    """An empty `partial` with the shape's config.json and the tokenizer files of `source`."""
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    for name in TOKENIZER_FILES:
        shutil.copy(source / name, partial / name)
    if shape.architecture == "Phi3ForCausalLM":  # llama.cpp converts a byte-level BPE Phi-3 (Phi-4's) by this class
        settings = json.loads((partial / "tokenizer_config.json").read_text())
        (partial / "tokenizer_config.json").write_text(json.dumps({**settings, "tokenizer_class": "GPT2Tokenizer"}))
    if _padded(shape):
        pad_tokenizer(partial / "tokenizer.json", shape.vocab_size)
    (partial / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return partial


def _padded(shape: Shape) -> bool:
    """Whether the shape's tokenizer lists a token for every embedding row (see pad_tokenizer)."""
    return shape.model_type.startswith("gemma3")


def _finish_directory(partial: Path, stamp: str, directory: Path) -> Path:
    (partial / STAMP).write_text(stamp)
    shutil.rmtree(directory, ignore_errors=True)
    partial.rename(directory)  # only a whole directory counts as written
    return directory
