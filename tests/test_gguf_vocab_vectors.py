"""The tokenizer rebuilt from a GGUF file gives llama.cpp's own ids: for each tokenizer-only
`ggml-vocab-NAME.gguf` in llama.cpp's models/, the inputs in NAME.gguf.inp encode to the ids in
NAME.gguf.out, as tests/test-tokenizer-0.cpp checks there (no bos or eos added, special-token text
read as plain text)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tailrace.tokenizer import load_tokenizer

ENCODED_AS_LLAMA_CPP = [
    "bert-bge", "command-r", "deepseek-coder", "deepseek-llm", "falcon", "gemma-4", "gpt-2", "llama-bpe", "llama-spm",
    "mpt", "phi-3", "qwen2", "qwen35", "refact", "starcoder",
]
_TEST_SEPARATOR = "\n__ggml_vocab_test__\n"


def _vocab(tree: Path, name: str) -> Path:
    return tree / "models" / f"ggml-vocab-{name}.gguf"


def read_vectors(vocab: Path) -> list[tuple[str, list[int]]]:
    """(input, ids) pairs as test-tokenizer-0.cpp reads them: inputs end with a separator line,
    and each output line lists one input's ids."""
    inputs = vocab.with_name(vocab.name + ".inp").read_bytes().decode().split(_TEST_SEPARATOR)
    if inputs[-1] == "":  # the text after the last separator
        inputs.pop()
    outputs = vocab.with_name(vocab.name + ".out").read_bytes().decode().splitlines()
    assert len(inputs) == len(outputs), f"{vocab.name}: {len(inputs)} inputs, {len(outputs)} outputs"
    return [(text, [int(i) for i in line.split()]) for text, line in zip(inputs, outputs)]


def test_every_vocabulary_with_vectors_is_listed(llamacpp_tree):
    with_vectors = {p.name.removeprefix("ggml-vocab-").removesuffix(".gguf.inp")
                    for p in (llamacpp_tree / "models").glob("ggml-vocab-*.gguf.inp")}
    assert with_vectors == set(ENCODED_AS_LLAMA_CPP)


@pytest.mark.parametrize("name", ENCODED_AS_LLAMA_CPP)
def test_vocabulary_encodes_as_llama_cpp(llamacpp_tree, name):
    tokenizer = load_tokenizer(str(_vocab(llamacpp_tree, name)))
    # llama.cpp's test reads special-token text as text: so must the tokenizer here.
    tokenizer.hf.encode_special_tokens = True
    vectors = read_vectors(_vocab(llamacpp_tree, name))
    assert [(text, tokenizer.encode(text, add_special_tokens=False)) for text, _ in vectors] == vectors
