"""A test-side HF -> GGUF converter, as llama.cpp's convert_hf_to_gguf.py writes Llama files: the
metadata keys it sets, q/k rows permuted for its rotary layout, 2-D weights quantized and norms
kept in float32. Small and only for tests: it handles what the embedded model has."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import TokenType
from safetensors.numpy import load_file

EMBEDDED = Path(__file__).resolve().parents[1] / "tailrace" / "models" / "tiny"

_LAYER_PARTS = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


@dataclass
class Vocab:
    """What the tokenizer.ggml.* keys hold."""

    model: str  # "gpt2" or "llama"
    tokens: list[str]
    types: list[int]
    merges: list[str] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    pre: str = "gpt-2"
    bos: int | None = None
    eos: int | None = None
    unk: int | None = None
    add_bos: bool = False
    chat_template: str | None = None


def hf_vocab(source: Path = EMBEDDED) -> Vocab:
    """The byte-level vocabulary of an HF tokenizer.json, as llama.cpp's converter lists it."""
    spec = json.loads((source / "tokenizer.json").read_text())
    config = json.loads((source / "tokenizer_config.json").read_text())
    by_id = {i: t for t, i in spec["model"]["vocab"].items()}
    types = {}
    for added in spec["added_tokens"]:
        by_id[added["id"]] = added["content"]
        types[added["id"]] = TokenType.CONTROL if added["special"] else TokenType.USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    tokens = [by_id[i] for i in range(len(by_id))]
    return Vocab("gpt2", tokens, [types.get(i, TokenType.NORMAL) for i in range(len(tokens))], merges=merges,
                 bos=_token_id(tokens, config.get("bos_token")), eos=_token_id(tokens, config.get("eos_token")),
                 add_bos=config.get("add_bos_token", False),
                 chat_template=config.get("chat_template"))


def _token_id(tokens: list[str], content: str | dict | None) -> int | None:
    content = content.get("content") if isinstance(content, dict) else content
    return tokens.index(content) if content in tokens else None


def llama_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute`: each head's two rotary halves interleaved."""
    return (weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def gguf_name(hf_name: str) -> str:
    base, _, kind = hf_name.rpartition(".")
    if base in _GLOBAL:
        return f"{_GLOBAL[base]}.{kind}"
    _, _, layer, part = base.split(".", 3)
    return f"blk.{layer}.{_LAYER_PARTS[part]}.{kind}"


def write_gguf(path: Path, qtype: Q = Q.F32, vocab: Vocab | None = None, source: Path = EMBEDDED,
               extra_tensors: dict[str, np.ndarray] | None = None, arch: str = "llama") -> Path:
    """`source` as `arch`: q/k rows are permuted only for llama (Qwen's rotary is not interleaved)."""
    config = json.loads((source / "config.json").read_text())
    vocab = vocab or hf_vocab(source)
    writer = gguf.GGUFWriter(str(path), arch)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(config.get("head_dim") or config["hidden_size"] // heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    _write_vocab(writer, vocab)
    tensors = load_file(str(source / "model.safetensors"))
    for name, values in tensors.items():
        if name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        if arch == "llama" and name.endswith("q_proj.weight"):
            values = llama_permute(values, heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            values = llama_permute(values, kv_heads)
        add_tensor(writer, gguf_name(name), values.astype(np.float32), qtype if values.ndim == 2 else Q.F32)
    for name, values in (extra_tensors or {}).items():
        add_tensor(writer, name, values, Q.F32)
    write_out(writer)
    return path


def write_out(writer: gguf.GGUFWriter) -> None:
    """Header, metadata and tensors written out, in the order GGUFWriter requires, and the file closed."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def add_tensor(writer: gguf.GGUFWriter, name: str, values: np.ndarray, qtype: Q) -> None:
    if qtype in (Q.F32, Q.F16):
        writer.add_tensor(name, values.astype(np.float32 if qtype == Q.F32 else np.float16))
    else:
        writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)


def _write_vocab(writer: gguf.GGUFWriter, vocab: Vocab) -> None:
    writer.add_tokenizer_model(vocab.model)
    if vocab.model == "gpt2":
        writer.add_tokenizer_pre(vocab.pre)
        writer.add_token_merges(vocab.merges)
    else:
        writer.add_token_scores(vocab.scores)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    for add, token_id in ((writer.add_bos_token_id, vocab.bos), (writer.add_eos_token_id, vocab.eos),
                          (writer.add_unk_token_id, vocab.unk)):
        if token_id is not None:
            add(token_id)
    writer.add_add_bos_token(vocab.add_bos)
    if vocab.chat_template is not None:
        writer.add_chat_template(vocab.chat_template)
