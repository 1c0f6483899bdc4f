"""Runs llama.cpp's convert_hf_to_gguf.py (in its own environment): TREE MODEL_DIR [converter flags].

The converter names a byte-level BPE tokenizer's pre-tokenizer by hashing how it encodes a test
string, and refuses a hash it does not know. Any tokenizer trained for this project (the embedded
model's, reused by the benchmark shapes) has an unknown hash though its pre-tokenizer is plain
GPT-2 byte-level BPE (tokenizer.json: ByteLevel with use_regex), which llama.cpp knows as "gpt-2".
So an unknown hash is declared "gpt-2" here; a known one keeps the converter's own answer.
"""

import runpy
import sys
from pathlib import Path

tree = Path(sys.argv[1])
# In place of this file's own folder, whose transformers.py would shadow the real package.
sys.path[0:1] = [str(tree), str(tree / "gguf-py")]

from conversion.base import TextModel  # noqa: E402  (importable only once the tree is on the path)

recognise = TextModel.get_vocab_base_pre


def pre_tokenizer_or_gpt2(self, tokenizer) -> str:
    try:
        return recognise(self, tokenizer)
    except NotImplementedError:
        return "gpt-2"


TextModel.get_vocab_base_pre = pre_tokenizer_or_gpt2
sys.argv = [str(tree / "convert_hf_to_gguf.py"), *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
