"""POST /v1/embeddings: each input pooled by the engine (one prefill, no decode, no KV kept), then
cut to `dimensions` and normalized here, in OpenAI's shape (vectors as floats, or as base64 of
little-endian float32, which the openai SDK decodes). POST /api/embed: the same in Ollama's shape."""

from __future__ import annotations

import base64
import time
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import Field

from tailrace.engine.client import EngineClient
from tailrace.sampling_params import SamplingParams
from tailrace.serving.choices import Generation, Prompt, check_token_ids, envelope
from tailrace.serving.context import RequestContext
from tailrace.serving.errors import OpenAIError, invalid_request
from tailrace.serving.pooling import Pooling
from tailrace.serving.protocol import Prompt as Inputs
from tailrace.serving.protocol import _OpenAIModel, prompt_list


class EmbeddingRequest(_OpenAIModel):
    model: str | None = None
    input: Inputs
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None
    # vLLM's: keep only the last N tokens of each input (-1: as many as the context holds)
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    add_special_tokens: bool = True
    # A prompt of the model's config_sentence_transformers.json, as text-embeddings-inference takes it
    prompt_name: str | None = None


class OllamaEmbedRequest(_OpenAIModel):
    model: str
    input: str | Annotated[list[str], Field(min_length=1)]
    truncate: bool = True  # cut each input's end to the context; false: a longer input is an error
    dimensions: Annotated[int, Field(ge=1)] | None = None
    # Accepted: generation options mean nothing to an embedding, and the model stays loaded.
    options: dict[str, Any] | None = None
    keep_alive: str | int | float | None = None


class OllamaError(OpenAIError):
    """An error answered on an Ollama route: the same status, Ollama's `{"error": message}` body."""

    @classmethod
    def of(cls, err: OpenAIError) -> OllamaError:
        converted = cls(err.status, err.message, err.type, err.param, err.code)
        converted.headers = err.headers
        return converted

    def body(self) -> dict[str, Any]:
        return {"error": self.message}


async def ollama_embed(engine: EngineClient, request: OllamaEmbedRequest, ctx: RequestContext,
                       pooling: Pooling) -> dict[str, Any]:
    """Ollama's /api/embed: vectors always of unit length, as Ollama returns them."""
    started = time.monotonic_ns()
    _check_embeds(pooling)
    dimensions = _check_dimensions(request.dimensions, engine.hidden_size, pooling)
    token_lists = tokenize_inputs(engine, request.input, -1 if request.truncate else None, keep_start=True)
    vectors = await pooled_vectors(engine, token_lists, ctx, pooling)
    return {"model": ctx.model_name, "embeddings": [_finish(v, dimensions, True).tolist() for v in vectors],
            "total_duration": time.monotonic_ns() - started, "load_duration": 0,
            "prompt_eval_count": sum(len(ids) for ids in token_lists)}


async def create_embeddings(engine: EngineClient, request: EmbeddingRequest, ctx: RequestContext,
                            pooling: Pooling) -> dict[str, Any]:
    """OpenAIError (400) for an input that cannot be embedded, before any is run."""
    _check_embeds(pooling)
    dimensions = _check_dimensions(request.dimensions, engine.hidden_size, pooling)
    inputs = with_prompt(request.input, request.prompt_name, pooling)
    token_lists = tokenize_inputs(engine, inputs, request.truncate_prompt_tokens, request.add_special_tokens)
    vectors = await pooled_vectors(engine, token_lists, ctx, pooling)
    data = [{"object": "embedding", "index": i, "embedding": _encode(_finish(v, dimensions, pooling.normalize),
                                                                      request.encoding_format)}
            for i, v in enumerate(vectors)]
    tokens = sum(len(ids) for ids in token_lists)
    return {"object": "list", "data": data, "model": ctx.model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


async def pooled_vectors(engine: EngineClient, token_lists: list[list[int]], ctx: RequestContext,
                         pooling: Pooling, segment_starts: list[int | None] | None = None) -> list[np.ndarray]:
    """Each input's pooled vector as the engine returns it (float32, before normalizing; a
    cross-encoder's classifier outputs), the inputs run together as one request's prompts, each
    pair's second text from its `segment_starts` entry; counted in /metrics."""
    starts = segment_starts or [None] * len(token_lists)
    prompts = [Prompt(ids, SamplingParams(max_tokens=0, pooling=pooling.method, segment_start=start))
               for ids, start in zip(token_lists, starts)]
    generation = Generation(engine, envelope("embd", "list", ctx)["id"], prompts, ctx)
    vectors: list[np.ndarray] = [np.empty(0, dtype=np.float32)] * len(token_lists)
    async for step in generation.steps():
        if step.delta.embedding is not None:
            vectors[step.choice.index] = np.asarray(step.delta.embedding, dtype=np.float32)
    if ctx.metrics is not None:
        ctx.metrics.count_pooling(sum(len(ids) for ids in token_lists))
    return vectors


def with_prompt(inputs: Inputs, prompt_name: str | None, pooling: Pooling) -> list[str | list[int]]:
    """Text inputs with the named prompt (else the model's default one) before each; token ids
    are taken as they are."""
    name = prompt_name or pooling.default_prompt
    if name is None:
        return prompt_list(inputs)
    if name not in pooling.prompts:
        known = ", ".join(pooling.prompts) or "none"
        raise invalid_request(f"prompt_name {name!r} is not a prompt of this model (its prompts: {known}).",
                              param="prompt_name")
    prompt = pooling.prompts[name]
    return [prompt + item if isinstance(item, str) else item for item in prompt_list(inputs)]


def tokenize_inputs(engine: EngineClient, inputs: Inputs | list[str | list[int]],
                    truncate_prompt_tokens: int | None = None, add_special_tokens: bool = True, param: str = "input",
                    keep_start: bool = False) -> list[list[int]]:
    """Each input's token ids, kept to the last `truncate_prompt_tokens` where asked (-1: as many
    as the context holds; `keep_start`: the first, as Ollama cuts); an input longer than the
    context is a 400 that names the limit."""
    limit = engine.max_model_len
    keep = tokens_kept(truncate_prompt_tokens, limit)
    token_lists = []
    for i, item in enumerate(prompt_list(inputs)):
        if isinstance(item, str) and not item:
            raise invalid_request(f"{param}[{i}] is empty; each input must have at least one token.", param=param)
        ids = (engine.tokenizer.encode(item, add_special_tokens=add_special_tokens) if isinstance(item, str)
               else list(item))
        check_token_ids(ids, engine.tokenizer.vocab_size, param)
        if keep is not None:
            ids = ids[:keep] if keep_start else (ids[-keep:] if keep else [])
        if not ids:
            raise invalid_request(f"{param}[{i}] has no tokens to embed.", param=param)
        if len(ids) > limit:
            raise invalid_request(f"{param}[{i}] has {len(ids)} tokens, over the model's limit of {limit} tokens; "
                                  "shorten it, or set truncate_prompt_tokens.", param=param,
                                  code="context_length_exceeded")
        token_lists.append(ids)
    return token_lists


def tokens_kept(truncate_prompt_tokens: int | None, limit: int) -> int | None:
    """The tokens an input keeps under `truncate_prompt_tokens` (-1: the context's `limit`), None
    for all; a 400 where it asks for more than the context holds."""
    keep = limit if truncate_prompt_tokens == -1 else truncate_prompt_tokens
    if keep is not None and keep > limit:
        raise invalid_request(f"truncate_prompt_tokens ({keep}) is over the model's context of {limit} tokens.",
                              param="truncate_prompt_tokens")
    return keep


def _check_embeds(pooling: Pooling) -> None:
    if pooling.score_activation is not None:
        raise invalid_request("This model is a cross-encoder: it scores pairs of texts on /v1/score and /v1/rerank, "
                              "and makes no embeddings.", param="model")


def _check_dimensions(dimensions: int | None, hidden: int, pooling: Pooling) -> int | None:
    if dimensions is None or dimensions == hidden:
        return None
    if not pooling.matryoshka:
        raise invalid_request("This model does not support 'dimensions': it is not trained for shorter "
                              "(Matryoshka) embeddings.", param="dimensions")
    if dimensions > hidden:
        raise invalid_request(f"dimensions ({dimensions}) is over the model's {hidden}.", param="dimensions")
    return dimensions


def _finish(vector: np.ndarray, dimensions: int | None, normalize: bool) -> np.ndarray:
    """The first `dimensions` values (Matryoshka), then unit length where the model normalizes."""
    values = vector[:dimensions]
    return unit_length(values) if normalize else values


def unit_length(values: np.ndarray) -> np.ndarray:
    return values / max(float(np.linalg.norm(values)), 1e-12)  # sentence-transformers' F.normalize eps


def _encode(values: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(values.astype("<f4").tobytes()).decode("ascii")
    return values.tolist()
