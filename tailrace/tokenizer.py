"""The model's tokenizer: encode, decode, per-token text and bytes, and the chat template."""

from __future__ import annotations

import datetime
import functools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import tokenizers
from tokenizers import decoders

from tailrace.model.loading import gguf_file
from tailrace.model.loading.gguf_tokenizer import build_tokenizer
from tailrace.model.loading.hub import is_gguf

_BYTE_FALLBACK_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level map read backwards: printable bytes stand for themselves, the rest are
    shifted past 255 in byte order, so every byte has a visible one-character stand-in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    char_to_byte = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            char_to_byte[chr(256 + shifted)] = b
            shifted += 1
    return char_to_byte


_BYTE_LEVEL_CHARS = _byte_level_alphabet()


@dataclass(slots=True)
class Tokenizer:
    hf: tokenizers.Tokenizer = field(repr=False)
    eos_token_ids: list[int]
    bos_token_id: int | None
    pad_token_id: int | None
    special_ids: frozenset[int]  # special added tokens: no text when skip_special_tokens
    chat_template: str | None = field(repr=False)
    add_bos: bool  # prepend bos when encoding a plain prompt
    _text_cache: dict[int, str] = field(default_factory=dict, init=False, repr=False)
    _bytes_cache: dict[int, bytes] = field(default_factory=dict, init=False, repr=False)

    @property
    def byte_level(self) -> bool:
        """True when the decoder is plain byte-level BPE: output text is then the lossy UTF-8
        decode of the concatenated token bytes, so it can be decoded without context."""
        return isinstance(self.hf.decoder, decoders.ByteLevel)

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.hf.encode(text, add_special_tokens=add_special_tokens).ids
        # The post-processor may already add bos (Llama-style tokenizer.json); never add it twice.
        if add_special_tokens and self.add_bos and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids

    def encode_pair(self, first: str, second: str, max_length: int | None = None) -> tuple[list[int], int | None]:
        """A pair's ids as the tokenizer's post-processor joins them (BERT's [CLS] a [SEP] b [SEP]),
        cut to `max_length` longest text first as sentence-transformers' CrossEncoder cuts them;
        and the position where the second text's token type begins (None: all of type 0)."""
        if max_length is not None:
            self.hf.enable_truncation(max_length, strategy="longest_first")
        try:
            encoding = self.hf.encode(first, second)
        finally:
            self.hf.no_truncation()
        return encoding.ids, next((i for i, kind in enumerate(encoding.type_ids) if kind), None)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The display string of one token (logprobs `tokens`); a lone byte of a multi-byte
        character shows as U+FFFD, as in vLLM."""
        text = self._text_cache.get(token_id)
        if text is None:
            text = self._text_cache[token_id] = self.hf.decode([token_id], skip_special_tokens=False)
        return text

    def token_bytes(self, token_id: int) -> list[int]:
        """The raw UTF-8 bytes this token contributes (chat logprobs `bytes`)."""
        return list(self.token_raw_bytes(token_id))

    def token_raw_bytes(self, token_id: int) -> bytes:
        raw = self._bytes_cache.get(token_id)
        if raw is None:
            raw = self._bytes_cache[token_id] = self._compute_token_bytes(token_id)
        return raw

    def _compute_token_bytes(self, token_id: int) -> bytes:
        piece = self.hf.id_to_token(token_id)
        if piece is None:
            # A row of the model's embedding that the tokenizer has no piece for (vocab sizes
            # padded to a multiple, or a dummy-weight shape): it writes no text.
            return b""
        if self.byte_level:
            # The ByteLevel decoder's own rule: map every char back to its byte, and a piece with a
            # char outside the alphabet (an added token such as "<x y>") passes through as UTF-8.
            if all(c in _BYTE_LEVEL_CHARS for c in piece):
                return bytes(_BYTE_LEVEL_CHARS[c] for c in piece)
            return piece.encode()
        match = _BYTE_FALLBACK_PIECE.fullmatch(piece)
        if match:
            return bytes([int(match.group(1), 16)])
        return self.token_text(token_id).encode()

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        continue_final_message: bool = False,
        **kwargs,
    ) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template; use the completions API or pass a chat template")
        if add_generation_prompt and continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be set")
        variables = {
            "bos_token": self._special_text(self.bos_token_id),
            "eos_token": self._special_text(self.eos_token_ids[0] if self.eos_token_ids else None),
            "pad_token": self._special_text(self.pad_token_id),
            **kwargs,
            "messages": messages,
            "tools": tools,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            template = _compile_template(self.chat_template)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"the chat template does not parse: {exc}") from exc
        try:
            rendered = template.render(**variables)
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError) as exc:
            raise ValueError(f"the chat template failed: {exc}") from exc
        if continue_final_message:
            rendered = _cut_after_final_message(rendered, messages)
        return rendered

    def _special_text(self, token_id: int | None) -> str:
        return "" if token_id is None else self.hf.id_to_token(token_id) or ""


def load_tokenizer(path: str, generation_config_eos: list[int] | None = None,
                   chat_template: str | None = None) -> Tokenizer:
    """Read an HF-layout directory (tokenizer.json, tokenizer_config.json, and the chat template
    and generation_config.json eos ids when present) or a GGUF file's tokenizer metadata.
    `chat_template` replaces the model's own."""
    tokenizer = _load_gguf_tokenizer(path) if is_gguf(path) else _load_hf_tokenizer(path)
    tokenizer.eos_token_ids = list(dict.fromkeys(tokenizer.eos_token_ids + (generation_config_eos or [])))
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def read_chat_template(file_or_template: str) -> str:
    """vLLM's --chat-template: the text of a file when one is there, else the template itself."""
    if Path(file_or_template).is_file():
        return Path(file_or_template).read_text(encoding="utf-8")
    if "{" not in file_or_template:
        raise ValueError(f"--chat-template {file_or_template!r}: no such file, and not a template")
    return file_or_template


def tokenizer_json(path: str) -> str:
    """The tokenizer as a tokenizer.json string (for llguidance), a GGUF file's rebuilt."""
    if is_gguf(path):
        return build_tokenizer(gguf_file.open_gguf(path)).to_str()
    return (Path(path) / "tokenizer.json").read_text(encoding="utf-8")


def _load_hf_tokenizer(path: str) -> Tokenizer:
    root = Path(path)
    try:
        hf = tokenizers.Tokenizer.from_file(str(root / "tokenizer.json"))
    except Exception as exc:  # the tokenizers library raises a bare Exception
        raise ValueError(f"{root / 'tokenizer.json'} is not a readable tokenizer: {exc}") from exc
    # A saved truncation would cut a prompt silently and a saved padding would add tokens: the
    # serving layer decides both per request.
    hf.no_truncation()
    hf.no_padding()
    config = read_json(root / "tokenizer_config.json")

    def token_id(key: str) -> int | None:
        content = config.get(key)
        if isinstance(content, dict):
            content = content.get("content")
        return hf.token_to_id(content) if content else None

    eos_ids = [token_id("eos_token")]
    eos_ids += _as_list(read_json(root / "generation_config.json").get("eos_token_id"))
    special_ids = frozenset(i for i, tok in hf.get_added_tokens_decoder().items() if tok.special)
    return Tokenizer(
        hf=hf,
        eos_token_ids=list(dict.fromkeys(i for i in eos_ids if i is not None)),
        bos_token_id=token_id("bos_token"),
        pad_token_id=token_id("pad_token"),
        special_ids=special_ids,
        chat_template=_read_chat_template(root, config),
        add_bos=bool(config.get("add_bos_token", False)),
    )


def _load_gguf_tokenizer(path: str) -> Tokenizer:
    reader = gguf_file.open_gguf(path)
    hf = build_tokenizer(reader)

    def token_id(key: str) -> int | None:
        return gguf_file.metadata(reader, f"tokenizer.ggml.{key}", None)

    # llama.cpp ends generation at eot (Llama 3's <|eot_id|>) and eom as well as at eos.
    eos_ids = [token_id("eos_token_id"), token_id("eot_token_id"), token_id("eom_token_id")]
    return Tokenizer(
        hf=hf,
        eos_token_ids=list(dict.fromkeys(i for i in eos_ids if i is not None)),
        bos_token_id=token_id("bos_token_id"),
        pad_token_id=token_id("padding_token_id"),
        special_ids=frozenset(i for i, tok in hf.get_added_tokens_decoder().items() if tok.special),
        chat_template=gguf_file.metadata(reader, "tokenizer.chat_template", None),
        # SentencePiece vocabularies add bos unless told not to; byte-level ones do not.
        add_bos=bool(gguf_file.metadata(reader, "tokenizer.ggml.add_bos_token",
                                        gguf_file.metadata(reader, "tokenizer.ggml.model") == "llama")),
    )


def read_json(path: Path) -> Any:
    """A JSON file of a model folder; {} where the folder has none."""
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _as_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def _read_chat_template(root: Path, config: dict) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default")
    if template is None and (root / "chat_template.jinja").is_file():
        template = (root / "chat_template.jinja").read_text(encoding="utf-8")
    return template


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in
    transformers; for rendering a prompt it is just its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    # transformers' filter: unlike jinja's own, it keeps non-ASCII and does not HTML-escape.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _final_message_text(messages: list[dict]) -> str:
    content = messages[-1].get("content") if messages else None
    if isinstance(content, (list, tuple)):
        texts = [part["text"] for part in content if isinstance(part, dict) and "text" in part]
        content = texts[-1] if texts else None
    if not isinstance(content, str):
        raise ValueError("continue_final_message is set but the final message has no text to continue")
    return content


def _cut_after_final_message(rendered: str, messages: list[dict]) -> str:
    """Drop what the template appends after the final message (its end-of-turn marker), so
    generation continues that message; the same rule as transformers."""
    final = _final_message_text(messages)
    stripped = final.strip()
    at = rendered.rfind(stripped)
    if at < 0:
        raise ValueError("continue_final_message is set but the final message does not appear in the rendered chat")
    if rendered[at : at + len(final.lstrip())] == final.lstrip():
        return rendered[: at + len(final.lstrip())]
    return rendered[: at + len(stripped)]
