"""A causal reranker's prompt for one (query, document) pair, as sentence-transformers' CrossEncoder
builds it for a Transformer of text-generation: the pair becomes the messages
[{"role": "query"}, {"role": "document"}] (after a system message holding the default prompt,
where the model names one), rendered by the model's chat template with its Transformer module's
template settings and tokenized without special tokens. A prompt cut to a length keeps its
template's tail (the assistant's turn, which the score is read after): the tail's tokens overwrite
the kept prompt's last ones, as sentence-transformers restores them."""

from __future__ import annotations

from functools import cached_property

from tailrace.serving.pooling import Pooling
from tailrace.tokenizer import Tokenizer

# Two fillers that tokenize differently: the renders' common token suffix is the template's tail
_FILLERS = ("0", "1 2 3 4")


class PairPrompts:
    """The pair prompts of one request: the template's tail is found once, for the first pair cut."""

    def __init__(self, tokenizer: Tokenizer, pooling: Pooling) -> None:
        self.tokenizer = tokenizer
        self.pooling = pooling

    def __call__(self, query: str, document: str, max_length: int | None = None) -> list[int]:
        """The pair's token ids, at most `max_length` of them (None: all)."""
        ids = self._render(query, document)
        if max_length is None or len(ids) <= max_length:
            return ids
        tail = self.tail[-max_length:] if max_length else []
        return ids[:max_length - len(tail)] + tail

    def _render(self, query: str, document: str) -> list[int]:
        pooling = self.pooling
        system = pooling.prompts.get(pooling.default_prompt) if pooling.default_prompt else None
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "query", "content": query}, {"role": "document", "content": document}]
        settings = {"add_generation_prompt": False, **pooling.template_settings}
        text = self.tokenizer.apply_chat_template(messages, **settings)
        return self.tokenizer.encode(text, add_special_tokens=False)

    @cached_property
    def tail(self) -> list[int]:
        """The template's tokens after the document: the longest common token suffix of two renders
        with different fillers (none where the renders never differ)."""
        first, second = (self._render(filler, filler) for filler in _FILLERS)
        count = 0
        for a, b in zip(reversed(first), reversed(second)):
            if a != b:
                break
            count += 1
        return first[len(first) - count:] if count < min(len(first), len(second)) else []
