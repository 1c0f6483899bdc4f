"""The tokenizer rebuilt from a GGUF file's metadata: a byte-level one encodes as the tokenizer.json
it came from; a SentencePiece one as transformers' GGUF loader builds it, but for text that starts
with a space, where it follows llama.cpp (tests/test_gguf_vocab_vectors.py checks llama.cpp's ids)."""

from __future__ import annotations

import dataclasses

import llguidance
import pytest
from gguf import TokenType
from gguf_writer import EMBEDDED, Vocab, hf_vocab, write_gguf
from tokenizer_fixtures import CORPUS
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from tailrace.model.loading.gguf_tokenizer import merges_from_scores
from tailrace.tokenizer import load_tokenizer, tokenizer_json

TEXTS = CORPUS + ["  two leading spaces", "digits 1234567 and 3.14", "a\nb\n\n\tc", "<|im_start|>user\nhi<|im_end|>",
                  "<think>why</think>"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What does len do?"}]


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory):
    return str(write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf"))


@pytest.fixture(scope="module")
def sentencepiece(tmp_path_factory):
    directory = tmp_path_factory.mktemp("spm")
    write_gguf(directory / "spm.gguf", vocab=_sentencepiece_vocab())
    return directory


def _sentencepiece_vocab() -> Vocab:
    """A SentencePiece-style vocabulary as llama.cpp lists one: unk, bos, eos, 256 byte pieces,
    then ▁-marked pieces learned from the corpus, scored by the order they were learned in."""
    learner = Tokenizer(models.BPE(byte_fallback=True))
    learner.pre_tokenizer = pre_tokenizers.Metaspace()
    learner.train_from_iterator(CORPUS * 20, trainers.BpeTrainer(vocab_size=300, show_progress=False))
    learned = [piece for piece, _ in sorted(learner.get_vocab().items(), key=lambda item: item[1])]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *learned]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL, *[TokenType.BYTE] * 256,
             *[TokenType.NORMAL] * len(learned)]
    scores = [0.0] * 259 + [-float(i) for i in range(len(learned))]
    return Vocab("llama", tokens, types, scores=scores, bos=1, eos=2, unk=0, add_bos=True,
                 chat_template="{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")


def test_byte_level_vocab_encodes_as_its_tokenizer_json(byte_level):
    ours, theirs = load_tokenizer(byte_level), load_tokenizer(str(EMBEDDED))
    assert [ours.encode(t) for t in TEXTS] == [theirs.encode(t) for t in TEXTS]


def test_byte_level_vocab_decodes_every_token_as_its_tokenizer_json(byte_level):
    ours, theirs = load_tokenizer(byte_level), load_tokenizer(str(EMBEDDED))
    ids = list(range(ours.vocab_size))
    assert [ours.token_raw_bytes(i) for i in ids] == [theirs.token_raw_bytes(i) for i in ids]


def test_byte_level_special_tokens_and_ids_are_its_tokenizer_jsons(byte_level):
    ours, theirs = load_tokenizer(byte_level), load_tokenizer(str(EMBEDDED))
    assert (ours.special_ids, ours.bos_token_id, ours.eos_token_ids[0], ours.add_bos) == (
        theirs.special_ids, theirs.bos_token_id, theirs.eos_token_ids[0], theirs.add_bos)


def test_chat_template_round_trips(byte_level):
    ours, theirs = load_tokenizer(byte_level), load_tokenizer(str(EMBEDDED))
    assert ours.apply_chat_template(MESSAGES) == theirs.apply_chat_template(MESSAGES)


def test_chat_template_argument_replaces_the_files(byte_level):
    tokenizer = load_tokenizer(byte_level, chat_template="{{ messages[-1]['content'] }}!")
    assert tokenizer.apply_chat_template(MESSAGES) == "What does len do?!"


def test_sentencepiece_vocab_encodes_as_transformers_gguf_loader(sentencepiece):
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(sentencepiece), gguf_file="spm.gguf")
    ours = load_tokenizer(str(sentencepiece / "spm.gguf"))
    texts = [t for t in TEXTS if not t.startswith(" ")]  # see the test below
    assert [ours.encode(t) for t in texts] == [reference.encode(t) for t in texts]


def test_sentencepiece_space_prefix_goes_before_a_leading_space_too(sentencepiece):
    """As in llama.cpp and Llama's own tokenizer.json (" Hello" is "▁", "▁Hello"); transformers'
    GGUF loader leaves out the prefix when the text starts with a space."""
    ours = load_tokenizer(str(sentencepiece / "spm.gguf"))
    assert ours.hf.normalizer.normalize_str("  two") == "▁▁▁two"


def test_sentencepiece_vocab_decodes_what_it_encodes(sentencepiece):
    ours = load_tokenizer(str(sentencepiece / "spm.gguf"))
    assert [ours.decode(ours.encode(t)) for t in CORPUS] == CORPUS


def test_sentencepiece_byte_pieces_give_their_bytes(sentencepiece):
    ours = load_tokenizer(str(sentencepiece / "spm.gguf"))
    assert b"".join(ours.token_raw_bytes(i) for i in ours.encode("😀", add_special_tokens=False)) == "😀".encode()


def test_sentencepiece_chat_template_and_bos_come_from_the_metadata(sentencepiece):
    ours = load_tokenizer(str(sentencepiece / "spm.gguf"))
    assert ours.encode("hi")[0] == 1
    assert ours.apply_chat_template(MESSAGES[1:]) == "[user] What does len do?\n"


def test_merges_rank_by_the_merged_pieces_score():
    vocab = {"a": 0, "b": 1, "c": 2, "ab": 3, "bc": 4, "abc": 5}
    scores = [0.0, 0.0, 0.0, -2.0, -1.0, -3.0]
    assert merges_from_scores(vocab, scores) == [("b", "c"), ("a", "b"), ("a", "bc"), ("ab", "c")]


@pytest.mark.parametrize(("pre", "pieces"), [
    ("llama-bpe", ["123", "456", "7", "Ġapples"]),  # Llama 3: digits in threes
    ("qwen2", ["1", "2", "3", "4", "5", "6", "7", "Ġapples"]),  # Qwen2: digit by digit
    ("smollm", ["1", "2", "3", "4", "5", "6", "7", "Ġapples"]),  # SmolLM: digit by digit, then GPT-2's split
    ("gpt-2", ["1234567", "Ġapples"]),
])
def test_pre_tokenizer_splits_as_its_name_says(tmp_path, pre, pieces):
    tokenizer = load_tokenizer(_embedded_vocab_file(tmp_path, pre=pre))
    assert [piece for piece, _ in tokenizer.hf.pre_tokenizer.pre_tokenize_str("1234567 apples")] == pieces


@pytest.mark.parametrize(("pre", "ids"), [("llama-bpe", [4]), ("gpt-2", [3, 2])])
def test_llama3_takes_a_word_in_the_vocabulary_whole_as_llama_cpp_does(tmp_path, pre, ids):
    vocab = Vocab("gpt2", ["a", "b", "c", "ab", "abc"], [TokenType.NORMAL] * 5, merges=["a b"], pre=pre)
    assert load_tokenizer(str(write_gguf(tmp_path / "abc.gguf", vocab=vocab))).encode("abc") == ids


def test_unknown_pre_tokenizer_is_named(tmp_path):
    with pytest.raises(ValueError, match="unsupported GGUF pre-tokenizer 'mystery'"):
        load_tokenizer(_embedded_vocab_file(tmp_path, pre="mystery"))


def test_unknown_tokenizer_model_is_named(tmp_path):
    with pytest.raises(ValueError, match="unsupported GGUF tokenizer model 'rwkv'"):
        load_tokenizer(_embedded_vocab_file(tmp_path, model="rwkv"))


def _embedded_vocab_file(tmp_path, **changes) -> str:
    """The embedded model as a GGUF file whose tokenizer.ggml.* keys differ by `changes`."""
    return str(write_gguf(tmp_path / "tiny.gguf", vocab=dataclasses.replace(hf_vocab(), **changes)))


def test_structured_output_tokenizer_builds_from_a_gguf(byte_level):
    assert llguidance.LLTokenizer(tokenizer_json(byte_level)).vocab_size == 8192
