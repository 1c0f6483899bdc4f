"""A Hugging Face `tokenizers.Tokenizer` rebuilt from a GGUF file's tokenizer.ggml.* metadata.

Five vocabularies: "gpt2" (byte-level BPE: tokens and merges, split before merging by the regexes
its tokenizer.ggml.pre names), "gemma4" (BPE over UTF-8 with byte fallback, spaces as ▁, split
only at runs of newlines, as llama.cpp's gemma4 pre-tokenizer does), "llama" (SentencePiece: ▁-marked pieces with scores, turned into
BPE with byte fallback and merges ranked by score, as transformers' LlamaConverter does), "bert"
(WordPiece, word-initial pieces marked ▁ where BERT's own vocabulary marks the others ##; BERT's
normalizer and pre-tokenizer, [CLS] and [SEP] around a text and between a pair's two, as
llama.cpp's WPM tokenizer and BERT's tokenizer.json both split) and "t5" (SentencePiece's Unigram,
as XLM-R's tokenizer.json builds it: the precompiled character map, ▁-marked words, <s> a </s>).
"""

from __future__ import annotations

from gguf import TokenType
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from tailrace.model.loading.gguf_file import GgufFile, metadata

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen3.5: Qwen2's, but a word keeps its combining marks (\p{M}): decomposed "résumé" is one piece,
# where Qwen2's split cuts it at each mark
_QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                 r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# DeepSeek LLM's words: cased letters (Lu, Ll, Lt) of the scripts these ranges list, as llama.cpp lists
# them; Han, Hangul and all of U+0800-U+4E00 make runs of their own.
_DEEPSEEK_CASED = (
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5"
    "\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba"
    "\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45"
    "\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe"
    "\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc"
    "\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134"
    "\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee"
    "\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf"
    "\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
    "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df"
    "\U0001e900-\U0001e943")
_DEEPSEEK_PUNCTUATION = "!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002"  # ASCII's, full-width's, CJK's
_DEEPSEEK_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_DEEPSEEK_LLM = [r"[\r\n]", rf"\s?[{_DEEPSEEK_CASED}]+", rf"\s?[{_DEEPSEEK_PUNCTUATION}]+", r"\s+$",
                 _DEEPSEEK_CJK, r"\p{N}+"]
_DEEPSEEK_CODER = [r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _DEEPSEEK_CJK, r"\p{N}"]
_FALCON = [r"[\p{P}\$\+<=>\^~\|`]+", _GPT2_SPLIT, "[0-9][0-9][0-9]"]
_DIGITS_THEN_GPT2 = [r"\p{N}", _GPT2_SPLIT]  # each digit alone, then GPT-2's split
# o200k (gpt-oss, Phi-4-mini, Llama 4): the regex of the models' own tokenizer.json, which llama.cpp
# rewrites without \p{Lu}-style classes its own regex engine lacks
_O200K_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+"
                r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> (splits in order, llama.cpp's ignore_merges: a word in the vocabulary is one token).
# The splits are llama.cpp's for that name (src/llama-vocab.cpp), each splitting the pieces of the one before.
_PRE_TOKENIZERS = {
    "default": ([_GPT2_SPLIT], False),
    "gpt-2": ([_GPT2_SPLIT], False),
    "mpt": ([_GPT2_SPLIT], False),
    "smollm": (_DIGITS_THEN_GPT2, False),
    "starcoder": (_DIGITS_THEN_GPT2, False),
    "refact": (_DIGITS_THEN_GPT2, False),
    "command-r": (_DIGITS_THEN_GPT2, False),
    "falcon": (_FALCON, False),
    "phi-2": ([_GPT2_SPLIT], False),
    "llama-bpe": ([_LLAMA3_SPLIT], True),
    "llama3": ([_LLAMA3_SPLIT], True),
    "llama-v3": ([_LLAMA3_SPLIT], True),
    "falcon3": ([_LLAMA3_SPLIT], True),
    "pixtral": ([_LLAMA3_SPLIT], True),
    "lfm2": ([_LLAMA3_SPLIT], True),
    "qwen2": ([_QWEN2_SPLIT], False),
    "deepseek-r1-qwen": ([_QWEN2_SPLIT], False),
    "gpt-4o": ([_O200K_SPLIT], False),
    "llama4": ([_O200K_SPLIT], False),
    "qwen35": ([_QWEN35_SPLIT], False),
    "deepseek-llm": (_DEEPSEEK_LLM, False),
    "deepseek-coder": (_DEEPSEEK_CODER, False),
}
_SPACE = "\u2581"


def build_tokenizer(reader: GgufFile) -> Tokenizer:
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
    elif kind == "gemma4":
        tokenizer = _gemma4(tokens, metadata(reader, "tokenizer.ggml.merges"))
    elif kind == "bert":
        tokenizer = _wordpiece(reader, tokens, types)
    elif kind == "t5":
        tokenizer = _unigram(reader, tokens, types)
    else:
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r}; supported: gpt2 (byte-level BPE), "
                         "gemma4 (BPE with byte fallback), llama (SentencePiece), bert (WordPiece), t5 (Unigram)")
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
    # llama.cpp puts a space before the text and after every added token, even where one is already
    # there (" Hello" is "▁▁Hello"); Metaspace's prepend skips text that starts with ▁, so a
    # normalizer does it: it runs on each stretch of text between added tokens.
    prefix = [normalizers.Prepend(_SPACE)] if add_space_prefix else []
    tokenizer.normalizer = normalizers.Sequence([*prefix, normalizers.Replace(" ", _SPACE)])
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))  # the space the normalizer put before the text
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def _gemma4(tokens: list[str], merges: list[str]) -> Tokenizer:
    # a merge is split at its first space after its first character, as llama.cpp splits it
    pairs = [(merge[:cut], merge[cut + 1:]) for merge in merges if (cut := merge.find(" ", 1)) > 0]
    tokenizer = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, pairs, byte_fallback=True))
    tokenizer.normalizer = normalizers.Replace(" ", _SPACE)
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|[\n]+"), behavior="isolated")
    tokenizer.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    return tokenizer


def _wordpiece(reader: GgufFile, tokens: list[str], types: list[int]) -> Tokenizer:
    """BERT's WordPiece from llama.cpp's phantom-space vocabulary (control tokens as they are)."""
    pieces = [token if kind == TokenType.CONTROL else (token[1:] if token.startswith(_SPACE) else "##" + token)
              for token, kind in zip(tokens, types)]
    vocab: dict[str, int] = {}
    for i, piece in enumerate(pieces):
        vocab.setdefault(piece, i)

    def special(*keys: str) -> tuple[str, int]:
        """The first of the keys the file has (converters wrote [CLS] as cls_token_id, then bos_token_id)."""
        ids = [metadata(reader, f"tokenizer.ggml.{key}", None) for key in keys]
        token_id = next((i for i in ids if i is not None), None)
        if token_id is None:
            raise ValueError(f"GGUF metadata has no tokenizer.ggml.{keys[0]}")
        return pieces[token_id], token_id

    unk = special("unknown_token_id")
    cls, sep = special("cls_token_id", "bos_token_id"), special("seperator_token_id", "eos_token_id")
    lowercase = metadata(reader, "tokenizer.ggml.normalizer.lowercase", True)
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token=unk[0], continuing_subword_prefix="##"))
    # llama.cpp strips accents where it lowercases, unless the file says otherwise
    tokenizer.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, lowercase=lowercase,
        strip_accents=metadata(reader, "tokenizer.ggml.normalizer.strip_accents", lowercase))
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{cls[0]}:0 $A:0 {sep[0]}:0", pair=f"{cls[0]}:0 $A:0 {sep[0]}:0 $B:1 {sep[0]}:1",
        special_tokens=[cls, sep])
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    return tokenizer


def _unigram(reader: GgufFile, tokens: list[str], types: list[int]) -> Tokenizer:
    """SentencePiece's Unigram as transformers' XLM-R tokenizer.json builds it: the file's
    precompiled character map normalizes, words split at whitespace (extra whitespace removed, as
    SentencePiece removes it where the file says so) are marked ▁ and cut by the pieces' scores;
    <s> a </s>, and </s></s> between a pair's two, where the file adds them."""
    def token_id(key: str) -> int | None:
        return metadata(reader, f"tokenizer.ggml.{key}", None)

    scores = metadata(reader, "tokenizer.ggml.scores")
    tokenizer = Tokenizer(models.Unigram(list(zip(tokens, scores)), unk_id=token_id("unknown_token_id"),
                                         byte_fallback=TokenType.BYTE in types))
    charsmap = metadata(reader, "tokenizer.ggml.precompiled_charsmap", None)
    if charsmap:
        tokenizer.normalizer = normalizers.Precompiled(bytes(charsmap))
    prepend = "always" if metadata(reader, "tokenizer.ggml.add_space_prefix", True) else "never"
    words = pre_tokenizers.Metaspace(replacement=_SPACE, prepend_scheme=prepend, split=True)
    if metadata(reader, "tokenizer.ggml.remove_extra_whitespaces", True):
        words = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), words])
    tokenizer.pre_tokenizer = words
    bos, eos = token_id("bos_token_id"), token_id("eos_token_id")
    if metadata(reader, "tokenizer.ggml.add_bos_token", False) and bos is not None and eos is not None:
        b, e = tokens[bos], tokens[eos]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{b}:0 $A:0 {e}:0", pair=f"{b}:0 $A:0 {e}:0 {e}:0 $B:0 {e}:0", special_tokens=[(b, bos), (e, eos)])
    tokenizer.decoder = decoders.Metaspace(replacement=_SPACE, prepend_scheme=prepend, split=True)
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
