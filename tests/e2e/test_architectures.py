"""Each architecture beyond Llama's, proven through the real server against `transformers`: a
random checkpoint of a small config (written here by transformers itself, with what sets the
architecture apart switched on and mattering: windows shorter than the prompts, NoPE layers, soft
caps that bite, experts each token picks among), served at float32 from its safetensors and from
the GGUF llama.cpp's own converter makes of it.

- greedy tokens are transformers' greedy tokens, and each token's logprob is within LOGPROB_ATOL
  of transformers' log-softmax (float32 on both sides: the sums differ only in order), from
  either file;
- a streamed answer is the non-streamed one, token for token;
- a prompt's answer does not change when others share its batch.
Where tailrace's CPU kernels run, the last two hold bit for bit; on PyTorch's paths float32 SDPA
may move a logprob's last bit (SAME_ATOL).

The configs keep to what a GGUF can say: llama.cpp fixes SmolLM3's NoPE layers at every 4th, Gemma
3's sliding pattern at 5 of 6, Gemma's query scale at head_dim's and gpt-oss's SwiGLU limit at 7
(tests/test_llama.py covers the other settings against transformers).
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import sentencepiece
import torch
import transformers
from mxfp4_writer import write_mxfp4_experts
from tokenizer_fixtures import CORPUS, IM_END, save_byte_level, save_sentencepiece_like
from tokenizers import Tokenizer

from tailrace.bench.peers import llamacpp

from e2e.conftest import REPO_ROOT, free_port, serving

LOGPROB_ATOL = 1e-4
SAME_ATOL = 1e-5
MAX_TOKENS = 12
WINDOW = 8
SMALL = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=128,
             max_position_embeddings=256, initializer_range=0.1)
_LINEAR = dict(linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4)
# Architecture -> (config class, model class, what sets it apart).
ARCHITECTURES = {
    "smollm3": (transformers.SmolLM3Config, transformers.SmolLM3ForCausalLM,
                dict(num_hidden_layers=4, tie_word_embeddings=False)),  # layer 3 without rope
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM,  # layer 0 sliding, 1 full
               dict(num_hidden_layers=2, sliding_window=WINDOW, query_pre_attn_scalar=32, attn_logit_softcapping=2.0,
                    final_logit_softcapping=3.0)),
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM,  # layers 0-4 sliding, 5 full
               dict(num_hidden_layers=6, sliding_window=WINDOW, query_pre_attn_scalar=32)),
    # Phi-4-mini's shape of rope: 3/4 of each head turns, LongRoPE; served within the pretrained
    # context (SERVE_ARGS), so by its short factors, as transformers runs a short sequence.
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM,
             dict(num_hidden_layers=2, hidden_size=128, max_position_embeddings=512,
                  original_max_position_embeddings=128,
                  rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                                   "long_factor": [1.0 + i / 4 for i in range(12)],
                                   "short_factor": [1.0 + i / 16 for i in range(12)]})),
    # every layer sparse and the top k renormalised, as llama.cpp takes them
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  dict(num_hidden_layers=2, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=64,
                       norm_topk_prob=True)),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                dict(num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2)),
    "granite": (transformers.GraniteConfig, transformers.GraniteForCausalLM,  # head_dim is hidden / heads
                dict(num_hidden_layers=2, hidden_size=128, embedding_multiplier=3.0, residual_multiplier=0.3,
                     attention_multiplier=0.1, logits_scaling=2.5)),
    "olmo2": (transformers.Olmo2Config, transformers.Olmo2ForCausalLM, dict(num_hidden_layers=2)),
    # experts shipped as MXFP4 blocks (written by mxfp4_writer), sinks, YaRN, alternate windows
    "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM,
                dict(num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
                     max_position_embeddings=1024,
                     rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                      "truncate": False, "original_max_position_embeddings": 128,
                                      "rope_theta": 150000.0})),
    # hybrids: layers 0-2 Gated DeltaNet (value heads twice the q/k heads, which llama.cpp's
    # converter tiles for Qwen3.5), layer 3 gated attention with a quarter of each head turning;
    # Qwen3-Next's Gated DeltaNet projections stored per head group, experts beside a shared one;
    # Qwen3.5-MoE's experts with Qwen3.5's layers (tiled in the GGUF too)
    "qwen3_5": (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM, dict(num_hidden_layers=4, **_LINEAR)),
    "qwen3_next": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM,
                   dict(num_hidden_layers=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                        shared_expert_intermediate_size=64, **_LINEAR)),
    "qwen3_5_moe": (transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM,
                    dict(num_hidden_layers=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                         shared_expert_intermediate_size=64, **_LINEAR)),
    # Gemma 4: layers 2 and 5 global (heads twice as wide with a quarter of their pairs turning,
    # values that are their keys, one KV head), the others sliding; layers 4 and 5 attend over
    # layers 3's and 2's K/V with double-wide MLPs; per-layer inputs; a soft cap that bites
    "gemma4": (transformers.Gemma4TextConfig, transformers.Gemma4ForCausalLM,
               dict(num_hidden_layers=6, global_head_dim=64, attention_k_eq_v=True, num_global_key_value_heads=1,
                    num_kv_shared_layers=2, use_double_wide_mlp=True, hidden_size_per_layer_input=16,
                    sliding_window=WINDOW, final_logit_softcapping=3.0,
                    layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2)),
    # Gemma 4 26B-A4B's layout: experts beside each layer's MLP, no per-layer inputs
    "gemma4_moe": (transformers.Gemma4TextConfig, transformers.Gemma4ForCausalLM,
                   dict(num_hidden_layers=2, global_head_dim=64, attention_k_eq_v=True, num_global_key_value_heads=1,
                        enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=64,
                        hidden_size_per_layer_input=0, sliding_window=WINDOW, final_logit_softcapping=3.0,
                        layer_types=["sliding_attention", "full_attention"])),
}
SERVE_ARGS = {"phi3": ["--max-model-len", "128"]}
PROMPTS = [
    [5, 17, 200, 3, 99, 42, 7, 128, 64, 11, 250, 33, 12, 9],
    [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50],
    [300, 2, 301, 3, 302, 4, 303, 5, 304, 6, 305, 7, 306, 8, 307, 9, 308],
    [77, 78],
]


@dataclass
class Served:
    name: str
    model: transformers.PreTrainedModel
    url: str  # serving the safetensors
    gguf_url: str  # serving llama.cpp's GGUF of them


def save_checkpoint(directory: Path, name: str) -> transformers.PreTrainedModel:
    """A random `name` model with a byte-level tokenizer, norms and biases drawn too (defaults of
    0 or 1 would hide a loading mistake); the model, in float32, as transformers runs it."""
    config_class, model_class, extra = ARCHITECTURES[name]
    if name.startswith("gemma4"):  # llama.cpp's converter takes Gemma 4's BPE with byte fallback, not byte-level BPE
        save_sentencepiece_like(directory)
    else:
        save_byte_level(directory)
    # transformers 5 (which llama.cpp's converter loads the tokenizer with) takes a special token
    # as a string or an AddedToken, not the plain dict older configs hold
    settings = json.loads((directory / "tokenizer_config.json").read_text())
    if not name.startswith("gemma4"):  # its tokenizer's own </s> is a string already
        settings["eos_token"] = IM_END
    if name == "phi3":  # what llama.cpp's converter takes for a byte-level BPE Phi-3 (Phi-4's)
        settings["tokenizer_class"] = "GPT2Tokenizer"
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))
    if name == "gemma2":  # llama.cpp converts Gemma 2's SentencePiece vocabulary only
        save_sentencepiece_model(directory / "tokenizer.model")
    vocab = Tokenizer.from_file(str(directory / "tokenizer.json")).get_vocab_size()
    if name == "gemma4":
        extra = {**extra, "vocab_size_per_layer_input": vocab}
    config = config_class(vocab_size=vocab, pad_token_id=0, bos_token_id=1, eos_token_id=2, **{**SMALL, **extra})
    config._attn_implementation = "eager"  # the soft cap's reference
    torch.manual_seed(0)
    model = model_class(config).float().eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" in param_name or param_name.endswith(("router.scale", "per_expert_scale")):
                # Gemma 2's and 3's norms store their scales less 1
                param.uniform_(-0.5, 0.5) if name in ("gemma2", "gemma3") else param.uniform_(0.5, 1.5)
            elif param_name.endswith(("bias", "sinks")):
                param.normal_(0.0, 0.1 if param_name.endswith("bias") else 1.0)
        for buffer_name, buffer in model.named_buffers():
            if buffer_name.endswith("layer_scalar"):  # Gemma 4's, 1 unless drawn
                buffer.uniform_(0.5, 1.5)
    model.save_pretrained(directory)
    if name == "gpt_oss":
        write_mxfp4_experts(directory, model)
    return model


def save_sentencepiece_model(path: Path) -> None:
    """A small SentencePiece BPE model (byte fallback) trained on the test corpus."""
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 4), model_writer=model, vocab_size=380, model_type="bpe", byte_fallback=True,
        hard_vocab_limit=False, character_coverage=1.0, pad_id=0, eos_id=1, bos_id=2, unk_id=3, minloglevel=2)
    path.write_bytes(model.getvalue())


def reference(model: transformers.PreTrainedModel, prompt: list[int]) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and their logprobs, every step a whole forward of the sequence."""
    ids, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            row = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
            token = int(row.argmax())
            ids.append(token)
            logprobs.append(float(row[token]))
    return ids[len(prompt):], logprobs


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def served(request, tmp_path_factory: pytest.TempPathFactory, llamacpp_tree: Path) -> Iterator[Served]:
    """The checkpoint served from its safetensors and from llama.cpp's GGUF of it."""
    directory = tmp_path_factory.mktemp(request.param)
    model = save_checkpoint(directory / "model", request.param)
    gguf = directory / f"{request.param}.gguf"
    subprocess.run(llamacpp.convert_command(llamacpp_tree, directory / "model", "f32", gguf), check=True,
                   capture_output=True)
    common = ["--dtype", "float32", "--max-num-seqs", "8", "--served-model-name", request.param,
              *SERVE_ARGS.get(request.param, [])]
    servers = [serving([str(path), *common], directory / log)
               for path, log in ((directory / "model", "server.log"), (gguf, "gguf-server.log"))]
    try:
        with ThreadPoolExecutor(len(servers)) as pool:  # both start at once
            urls = list(pool.map(next, servers))
        yield Served(request.param, model, *urls)
    finally:
        for server in servers:
            server.close()


@dataclass
class Answer:
    text: str
    tokens: list[int]
    logprobs: list[float]


def complete(url: str, name: str, prompt: list[int], stream: bool = False) -> Answer:
    """A greedy completion of `prompt`, its tokens named by id (vLLM's return_tokens_as_token_ids)."""
    body = {"model": name, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "return_tokens_as_token_ids": True, "stream": stream}
    answer = Answer("", [], [])
    if not stream:
        choices = [httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"][0]]
    else:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
            choices = [choice for line in response.iter_lines() if line.startswith("data: {")
                       for choice in json.loads(line[6:])["choices"]]
    for choice in choices:
        answer.text += choice["text"]
        logprobs = choice.get("logprobs") or {"tokens": [], "token_logprobs": []}
        answer.tokens += [int(name.removeprefix("token_id:")) for name in logprobs["tokens"]]
        answer.logprobs += logprobs["token_logprobs"]
    return answer


@pytest.mark.parametrize("source", ["safetensors", "gguf"])
def test_greedy_tokens_and_logprobs_are_transformers(served, source):
    url = served.url if source == "safetensors" else served.gguf_url
    for prompt in PROMPTS:
        tokens, expected = reference(served.model, prompt)
        answer = complete(url, served.name, prompt)
        assert answer.tokens == tokens
        assert answer.logprobs == pytest.approx(expected, abs=LOGPROB_ATOL)


def test_stream_is_the_non_streamed_answer(served):
    for prompt in PROMPTS[:2]:
        assert_same(complete(served.url, served.name, prompt, stream=True), complete(served.url, served.name, prompt))


def test_answers_do_not_depend_on_the_batch(served):
    url, name = served.url, served.name
    alone = [complete(url, name, prompt) for prompt in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS) * 2) as pool:
        together = list(pool.map(lambda p: complete(url, name, p), PROMPTS * 2))
    for got, want in zip(together, alone * 2):
        assert_same(got, want)


def assert_same(got: Answer, want: Answer) -> None:
    assert (got.text, got.tokens) == (want.text, want.tokens)
    assert got.logprobs == pytest.approx(want.logprobs, abs=SAME_ATOL)


def test_an_unsupported_architecture_stops_the_server_naming_it_and_the_supported(tmp_path):
    directory = tmp_path / "deepseek"
    save_byte_level(directory)
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 64, "hidden_size": 64, "intermediate_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 2}))
    result = subprocess.run([sys.executable, "-m", "tailrace", "serve", str(directory), "--port", str(free_port())],
                            capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "unsupported architecture DeepseekV3ForCausalLM; supported: " in output
    assert all(name in output for name in ("Gemma3ForCausalLM", "GptOssForCausalLM", "Qwen3MoeForCausalLM"))
