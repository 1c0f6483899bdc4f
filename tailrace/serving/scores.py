"""POST /v1/score (vLLM's shape) and POST /v1/rerank (Cohere's and Jina's, which vLLM and llama.cpp
also serve). With a cross-encoder, each pair is one prompt, joined as its tokenizer joins a pair
(or, for a causal reranker, rendered by its chat template: serving/pair_prompts.py), and its score
the classifier's output through the model's activation, as sentence-transformers'
CrossEncoder.predict gives it. With an embedding model, each pair's score is the cosine
similarity of the two texts' pooled vectors, as vLLM scores with one, every text embedded once.
Either way all of a request's prompts go to the engine as one request."""

from __future__ import annotations

from typing import Annotated, Any

import numpy as np
from pydantic import Field

from tailrace.engine.client import EngineClient
from tailrace.serving.choices import envelope
from tailrace.serving.context import RequestContext
from tailrace.serving.embeddings import pooled_vectors, tokenize_inputs, tokens_kept, unit_length
from tailrace.serving.errors import invalid_request
from tailrace.serving.pair_prompts import PairPrompts
from tailrace.serving.pooling import Pooling
from tailrace.serving.protocol import _OpenAIModel, prompt_list

Texts = str | Annotated[list[str], Field(min_length=1)]


class ScoreRequest(_OpenAIModel):
    model: str | None = None
    text_1: Texts
    text_2: Texts
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None


class Document(_OpenAIModel):
    text: str


class RerankRequest(_OpenAIModel):
    model: str | None = None
    query: str
    documents: Annotated[list[str | Document], Field(min_length=1)]
    top_n: Annotated[int, Field(ge=1)] | None = None
    return_documents: bool = True
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None


async def create_score(engine: EngineClient, request: ScoreRequest, ctx: RequestContext,
                       pooling: Pooling) -> dict[str, Any]:
    """One score per pair: text_1 against each of text_2, or the two lists pairwise."""
    firsts, seconds = prompt_list(request.text_1), prompt_list(request.text_2)
    if len(firsts) != 1 and len(firsts) != len(seconds):
        raise invalid_request(f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: give one text_1, or as "
                              "many as text_2.", param="text_1")
    scores, tokens = await _scores(engine, (firsts, "text_1"), (seconds, "text_2"), request.truncate_prompt_tokens,
                                   ctx, pooling)
    head = envelope("score", "list", ctx)
    return {**head, "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


async def create_rerank(engine: EngineClient, request: RerankRequest, ctx: RequestContext,
                        pooling: Pooling) -> dict[str, Any]:
    """The documents by relevance to the query, best first, the first `top_n`."""
    texts = [d if isinstance(d, str) else d.text for d in request.documents]
    scores, tokens = await _scores(engine, ([request.query], "query"), (texts, "documents"),
                                   request.truncate_prompt_tokens, ctx, pooling)
    order = sorted(range(len(texts)), key=lambda i: -scores[i])[:request.top_n]
    results = [{"index": i, "relevance_score": scores[i], **({"document": {"text": texts[i]}}
                                                              if request.return_documents else {})} for i in order]
    return {"id": envelope("rerank", "list", ctx)["id"], "model": ctx.model_name, "results": results,
            "usage": {"total_tokens": tokens}}


async def _scores(engine: EngineClient, firsts: tuple[list[str], str], seconds: tuple[list[str], str],
                  truncate: int | None, ctx: RequestContext, pooling: Pooling) -> tuple[list[float], int]:
    """Each pair's score (the one first text against every second, or pairwise), and the tokens
    run. Each side is its texts and the request field that holds them (for errors)."""
    if pooling.score_activation is None:
        return await _cosines(engine, firsts, seconds, truncate, ctx, pooling)
    lefts, rights = firsts[0], seconds[0]
    if len(lefts) == 1:
        lefts = lefts * len(rights)
    limit = engine.max_model_len
    keep = tokens_kept(truncate, limit)
    token_lists, starts = [], []
    pair_prompt = PairPrompts(engine.tokenizer, pooling)
    for i, pair in enumerate(zip(lefts, rights)):
        if pooling.method == "logits":
            try:
                ids, start = pair_prompt(*pair, max_length=keep), None
            except ValueError as exc:  # the model's chat template cannot render the pair
                raise invalid_request(f"{seconds[1]}[{i}] with its {firsts[1]}: {exc}", param=seconds[1]) from exc
        else:
            ids, start = engine.tokenizer.encode_pair(*pair, max_length=keep)
        if len(ids) > limit:
            raise invalid_request(f"{seconds[1]}[{i}] with its {firsts[1]} has {len(ids)} tokens, over the model's "
                                  f"limit of {limit} tokens; shorten it, or set truncate_prompt_tokens.",
                                  param=seconds[1], code="context_length_exceeded")
        token_lists.append(ids)
        starts.append(start)
    outputs = await pooled_vectors(engine, token_lists, ctx, pooling, starts)
    scores = [float(out[0]) for out in outputs]
    if pooling.score_activation == "sigmoid":
        scores = np.exp(-np.logaddexp(0.0, -np.array(scores))).tolist()  # 1 / (1 + e^-x), without overflow
    return scores, sum(len(ids) for ids in token_lists)


async def _cosines(engine: EngineClient, firsts: tuple[list[str], str], seconds: tuple[list[str], str],
                   truncate: int | None, ctx: RequestContext, pooling: Pooling) -> tuple[list[float], int]:
    """Each pair's cosine (the one first text against every second, or pairwise), and the tokens
    embedded. Each side is its texts and the request field that holds them (for errors)."""
    left_ids = tokenize_inputs(engine, firsts[0], truncate, param=firsts[1])
    token_lists = left_ids + tokenize_inputs(engine, seconds[0], truncate, param=seconds[1])
    vectors = [unit_length(v) for v in await pooled_vectors(engine, token_lists, ctx, pooling)]
    lefts, rights = vectors[:len(left_ids)], vectors[len(left_ids):]
    if len(lefts) == 1:
        lefts = lefts * len(rights)
    return [float(np.dot(a, b)) for a, b in zip(lefts, rights)], sum(len(ids) for ids in token_lists)
