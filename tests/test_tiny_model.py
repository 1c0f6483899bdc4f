"""The embedded model directory is complete, self-consistent and loads unchanged in transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from architectures import ARCHITECTURES
from conftest import EMBEDDED

REQUIRED_FILES = [
    "__init__.py", "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "generation_config.json", "README.md",
]
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEXT_MARKERS = ["<tool_call>", "</tool_call>", "<think>", "</think>"]
MAX_BYTES = 25 * 1024 * 1024


def _json(name: str) -> dict:
    return json.loads((EMBEDDED / name).read_text())


@pytest.fixture(scope="module")
def hf_tokenizer(embedded_model: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_model)


@pytest.fixture(scope="module")
def hf_model(embedded_model: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(embedded_model).eval()


@pytest.mark.parametrize("name", REQUIRED_FILES)
def test_required_file_is_shipped(name: str) -> None:
    assert (EMBEDDED / name).is_file()


def test_directory_fits_the_size_limit() -> None:
    assert sum(p.stat().st_size for p in EMBEDDED.iterdir() if p.is_file()) <= MAX_BYTES


def test_config_is_a_plain_llama_with_long_enough_context() -> None:
    config = _json("config.json")
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == ARCHITECTURES["llama"]["model_type"]
    assert config["max_position_embeddings"] >= 2048
    assert config["tie_word_embeddings"] is True


def test_tokenizer_vocab_matches_config_vocab() -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(EMBEDDED / "tokenizer.json"))
    assert tok.get_vocab_size() == _json("config.json")["vocab_size"]


def test_tokenizer_adds_no_bos_automatically() -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(EMBEDDED / "tokenizer.json"))
    assert tok.encode("Return a new list.").ids[0] != 0
    assert _json("tokenizer_config.json")["add_bos_token"] is False


@pytest.mark.parametrize("token", SPECIAL + TEXT_MARKERS)
def test_marker_token_is_a_single_id(token: str) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(EMBEDDED / "tokenizer.json"))
    token_id = tok.token_to_id(token)
    assert token_id is not None
    assert tok.encode(f"a{token}b").ids.count(token_id) == 1


def test_special_token_ids_agree_across_configs() -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(EMBEDDED / "tokenizer.json"))
    tok_config, gen = _json("tokenizer_config.json"), _json("generation_config.json")
    assert tok.token_to_id(tok_config["bos_token"]) == gen["bos_token_id"] == 0
    assert tok.token_to_id(tok_config["pad_token"]) == gen["pad_token_id"] == 0
    assert tok.token_to_id(tok_config["eos_token"]) in gen["eos_token_id"]
    assert tok_config["eos_token"] == "<|im_end|>"
    assert tok_config["model_max_length"] >= 2048
    decoder = {entry["content"]: entry["special"] for entry in tok_config["added_tokens_decoder"].values()}
    assert decoder == {**{t: True for t in SPECIAL}, **{t: False for t in TEXT_MARKERS}}


def test_chat_template_renders_chatml_with_generation_prompt(hf_tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_chat_template_renders_tools_calls_and_responses(hf_tokenizer) -> None:
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "developer", "content": [{"type": "text", "text": "Use tools."}]},
        {"role": "user", "content": "Time?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}},
            {"type": "function", "function": {"name": "get_time", "arguments": {"tz": "CET"}}},
        ]},
        {"role": "tool", "content": "12:00"},
    ]
    text = hf_tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    assert text.startswith("<|im_start|>system\nUse tools.\n\n# Tools")
    assert '\n{"type": "function", "function": {"name": "get_time"' in text
    assert '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>' in text
    assert '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>' in text
    assert text.endswith("<|im_start|>user\n<tool_response>\n12:00\n</tool_response><|im_end|>\n")


def test_model_vocab_matches_tokenizer(hf_model, hf_tokenizer) -> None:
    assert hf_model.get_input_embeddings().num_embeddings == len(hf_tokenizer)


def test_greedy_generation_produces_text(hf_model, hf_tokenizer) -> None:
    ids = hf_tokenizer("The list type", return_tensors="pt").input_ids
    out = hf_model.generate(ids, max_new_tokens=12, do_sample=False)
    assert hf_tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


def test_chat_prompt_generation_produces_text(hf_model, hf_tokenizer) -> None:
    prompt = hf_tokenizer.apply_chat_template(
        [{"role": "user", "content": "What does `len` do?"}], tokenize=False, add_generation_prompt=True
    )
    ids = hf_tokenizer(prompt, return_tensors="pt").input_ids
    out = hf_model.generate(ids, max_new_tokens=12, do_sample=False)
    assert hf_tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
