"""Embedding checkpoints the tests write: a random decoder saved by transformers as its base model
(Qwen3-Embedding's layout: `Qwen3Model`, no language-model head), with the byte-level test
tokenizer, and made a sentence-transformers folder (modules.json, a Pooling module and, where
asked, a Normalize module; a query prompt as Qwen3-Embedding's) that sentence-transformers itself
loads."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from tokenizer_fixtures import save_byte_level
from tokenizers import Tokenizer

_MODES = {"last": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token"}


def save_embedding_model(directory: Path, pooling: str = "last", normalize: bool = True, seed: int = 0,
                         **config: object) -> Path:
    """A random Qwen3 base model with sentence-transformers' modules; returns the folder."""
    save_byte_level(directory)
    # transformers 5 (which sentence-transformers loads the tokenizer with) takes a special token as a string
    settings_path = directory / "tokenizer_config.json"
    tokenizer_settings = json.loads(settings_path.read_text())
    tokenizer_settings["eos_token"] = tokenizer_settings["eos_token"]["content"]
    settings_path.write_text(json.dumps(tokenizer_settings))
    vocab = Tokenizer.from_file(str(directory / "tokenizer.json")).get_vocab_size()
    settings = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                    initializer_range=0.1)
    torch.manual_seed(seed)
    model = transformers.Qwen3Model(transformers.Qwen3Config(**{**settings, **config}))
    model.float().save_pretrained(directory)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (directory / "2_Normalize").mkdir(exist_ok=True)
    (directory / "modules.json").write_text(json.dumps(modules))
    (directory / "1_Pooling").mkdir(exist_ok=True)
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": settings["hidden_size"], **{mode: name == pooling for name, mode in _MODES.items()},
         "pooling_mode_max_tokens": False, "include_prompt": True}))
    (directory / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512, "do_lower_case": False}))
    (directory / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": {"query": "Instruct: find the code\nQuery: ", "document": ""}, "default_prompt_name": None,
         "similarity_fn_name": "cosine"}))
    return directory
