"""Small tokenizers built inside the tests, saved in the HF layout (tokenizer.json +
tokenizer_config.json), so the tests never depend on the embedded model being present; and the
module-scoped pytest fixtures that load them (import the fixtures into a test module to use them)."""

from __future__ import annotations

import json
import string
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from tailrace.tokenizer import Tokenizer as TailraceTokenizer
from tailrace.tokenizer import load_tokenizer

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"

EMBEDDED = Path(__file__).resolve().parents[1] / "tailrace" / "models" / "tiny"
needs_embedded = pytest.mark.skipif(
    not (EMBEDDED / "tokenizer.json").is_file(), reason="tailrace/models/tiny is not trained yet"
)

CHATML_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role: ' + message['role']) }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Plain prose plus accents, CJK and emoji, so the vocabulary has merges inside multi-byte
# characters and across character boundaries.
CORPUS = [
    "The quick brown fox jumps over the lazy dog. Stop here. END of story.",
    "Héllo wörld, café crème brûlée, naïve façade, señor, Ærø.",
    "你好世界，这是一个测试。日本語のテキストも少し。한국어 문장.",
    "Emoji time 😀😃😄 🎉🎉 👍🏽 ❤️ 🚀 and more 😀 text.",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))",
    "<|im_start|> is not split by training text; \t tabs and   spaces.",
]


def train_byte_level(vocab_size: int = 400) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[ENDOFTEXT, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 20, trainer=trainer)
    # A non-special added token, as the embedded model has for <think> and <tool_call>.
    tokenizer.add_tokens([AddedToken("<think>", special=False, normalized=False)])
    return tokenizer


def save_byte_level(directory: Path, chat_template: str | None = CHATML_TEMPLATE, generation_eos: bool = True) -> Path:
    """A byte-level BPE tokenizer with ChatML special tokens; returns the directory."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = train_byte_level()
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "bos_token": ENDOFTEXT,
        "eos_token": {"content": IM_END, "special": True},
        "pad_token": ENDOFTEXT,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    _write_json(directory / "tokenizer_config.json", config)
    if generation_eos:
        ids = [tokenizer.token_to_id(IM_END), tokenizer.token_to_id(ENDOFTEXT)]
        _write_json(directory / "generation_config.json", {"eos_token_id": ids})
    return directory


def save_sentencepiece_like(directory: Path) -> Path:
    """A Llama-2-style tokenizer (Metaspace, byte fallback, leading-space strip) built from a
    hand-written vocabulary: its decode depends on the preceding tokens."""
    directory.mkdir(parents=True, exist_ok=True)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    pieces = ["▁", *string.ascii_letters, *string.digits, ".", ","]
    merges = [("▁", c) for c in string.ascii_lowercase]
    merges += [("t", "h"), ("▁t", "h"), ("▁th", "e"), ("e", "n"), ("▁e", "n")]
    merges += [("▁en", "d"), ("o", "p"), ("▁s", "t"), ("▁st", "op")]
    for piece in pieces + [a + b for a, b in merges]:
        vocab.setdefault(piece, len(vocab))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tokenizer.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"add_bos_token": True, "bos_token": "<s>", "eos_token": "</s>", "pad_token": None}
    _write_json(directory / "tokenizer_config.json", config)
    return directory


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, ensure_ascii=False, indent=2), encoding="utf-8")


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory: pytest.TempPathFactory) -> TailraceTokenizer:
    return load_tokenizer(str(save_byte_level(tmp_path_factory.mktemp("byte_level"))))


@pytest.fixture(scope="module")
def sentencepiece(tmp_path_factory: pytest.TempPathFactory) -> TailraceTokenizer:
    return load_tokenizer(str(save_sentencepiece_like(tmp_path_factory.mktemp("sentencepiece"))))


@pytest.fixture(scope="module")
def embedded() -> TailraceTokenizer:
    return load_tokenizer(str(EMBEDDED))
