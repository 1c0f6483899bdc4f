"""A Hugging Face `tokenizers.Tokenizer` rebuilt from a GGUF file's tokenizer.ggml.* metadata.

Two vocabularies: "gpt2" (byte-level BPE: tokens and merges, split before merging by the regex
its tokenizer.ggml.pre names) and "llama" (SentencePiece: ▁-marked pieces with scores, turned into
BPE with byte fallback and merges ranked by score, as transformers' LlamaConverter does).
"""

from __future__ import annotations

from gguf import GGUFReader, TokenType
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from tailrace.model.loading.gguf import metadata

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> (splits in order, llama.cpp's ignore_merges: a word in the vocabulary is one token)
_PRE_TOKENIZERS = {
    "default": ([_GPT2_SPLIT], False),
    "gpt-2": ([_GPT2_SPLIT], False),
    "smollm": ([r"\p{N}", _GPT2_SPLIT], False),
    "llama-bpe": ([_LLAMA3_SPLIT], True),
    "llama3": ([_LLAMA3_SPLIT], True),
    "qwen2": ([_QWEN2_SPLIT], False),
}
_SPACE = "\u2581"


def build_tokenizer(reader: GGUFReader) -> Tokenizer:
    kind = metadata(reader, "tokenizer.ggml.model")
    tokens: list[str] = metadata(reader, "tokenizer.ggml.tokens")
    types = metadata(reader, "tokenizer.ggml.token_type", [TokenType.NORMAL] * len(tokens))
    if kind == "gpt2":
        tokenizer = _byte_level(tokens, metadata(reader, "tokenizer.ggml.merges"),
                                metadata(reader, "tokenizer.ggml.pre", "default"))
    elif kind == "llama":
        unk = metadata(reader, "tokenizer.ggml.unknown_token_id", None)
        tokenizer = _sentencepiece(tokens, metadata(reader, "tokenizer.ggml.scores"),
                                   None if unk is None else tokens[unk],
                                   metadata(reader, "tokenizer.ggml.add_space_prefix", True))
    else:
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r}; supported: gpt2 (byte-level BPE), "
                         "llama (SentencePiece)")
    # Control tokens (<|im_end|>, <s>) are special; user-defined ones (<think>) are matched whole but
    # are text. Both keep their ids: they are already in the vocabulary.
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, kind in zip(tokens, types) if kind in (TokenType.CONTROL, TokenType.UNKNOWN)])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                          for t, kind in zip(tokens, types) if kind == TokenType.USER_DEFINED])
    return tokenizer


def _byte_level(tokens: list[str], merges: list[str], pre: str) -> Tokenizer:
    if pre not in _PRE_TOKENIZERS:
        raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}; supported: {', '.join(_PRE_TOKENIZERS)}")
    splits, ignore_merges = _PRE_TOKENIZERS[pre]
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    tokenizer = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, pairs, ignore_merges=ignore_merges))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated") for split in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece(tokens: list[str], scores: list[float], unk: str | None, add_space_prefix: bool) -> Tokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    model = models.BPE(vocab, merges_from_scores(vocab, scores), unk_token=unk, fuse_unk=True, byte_fallback=True)
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=_SPACE, prepend_scheme="first" if add_space_prefix else "never", split=False)
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))  # the space the pre-tokenizer put before the text
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def merges_from_scores(vocab: dict[str, int], scores: list[float]) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces of the vocabulary is a merge; merges rank by the
    merged piece's score, best first, then by its id, then by the ids of its halves."""
    ranked: list[tuple[float, int, int, int, str, str]] = []
    for piece, piece_id in vocab.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[piece_id], piece_id, vocab[left], vocab[right], left, right))
    ranked.sort(key=lambda merge: merge[:4])
    return [(left, right) for *_, left, right in ranked]
