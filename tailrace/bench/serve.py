"""The load generator behind `tailrace bench serve`: streamed requests to any OpenAI-compatible server.

Plain httpx and a hand-written SSE reader rather than the openai SDK: the SDK validates every chunk
with pydantic, which on a two-core machine makes the client, not the server, the bottleneck.
Each concurrency level sends the same prompts; arrivals are all at once or a seeded Poisson process,
and a semaphore keeps at most `concurrency` requests in flight.
"""

from __future__ import annotations

import asyncio
import math
import random
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any

import httpx
import orjson
from tqdm import tqdm

from tailrace.bench.prompts import DEFAULT_TOKENS_PER_WORD, make_prompts, random_text
from tailrace.bench.records import LevelResult, RequestRecord, StreamRecorder
from tailrace.bench.sse import SSEDecoder

ENDPOINTS = {"completions": "/completions", "chat": "/chat/completions"}
CALIBRATION_WORDS = 1000


class BenchError(Exception):
    """The benchmark cannot run: no server, no model, or a server that fails the warm-up request."""


@dataclass(slots=True)
class LoadConfig:
    base_url: str = "http://127.0.0.1:8000"  # with or without the trailing /v1
    model: str | None = None  # None: the first model the server lists
    endpoint: str = "completions"  # or "chat"
    concurrency: list[int] = field(default_factory=lambda: [1])
    num_prompts: int = 100
    input_len: int = 128
    output_len: int = 128
    request_rate: float = math.inf  # requests/s (Poisson); inf: all at once
    temperature: float = 0.0
    seed: int = 0
    api_key: str | None = None
    # Ask for exactly output_len tokens (vLLM's `ignore_eos` and `min_tokens`). Off for servers that
    # reject unknown fields, such as `transformers serve` (HTTP 422).
    exact_length: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)  # merged into every request
    timeout_s: float = 600.0  # the longest wait for any one read
    progress: bool = True
    processes: int = 1  # client processes per level (tailrace/bench/levels.py), for rates one process cannot read


@dataclass(slots=True)
class Workload:
    prompts: list[str]
    tokens_per_word: float
    calibrated: bool  # tokens_per_word was measured with the server's /tokenize


def api_roots(base_url: str) -> tuple[str, str]:
    """(server root, OpenAI root): /tokenize lives at the first, /v1/... under the second."""
    root = base_url.rstrip("/")
    root = root[: -len("/v1")] if root.endswith("/v1") else root
    return root, root + "/v1"


def open_client(config: LoadConfig) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    connections = max(config.concurrency) + 1
    return httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(config.timeout_s, connect=10.0),
                             limits=httpx.Limits(max_connections=connections,
                                                 max_keepalive_connections=connections))


def request_body(config: LoadConfig, model: str, prompt: str) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": config.output_len, "temperature": config.temperature,
                            "stream": True, "stream_options": {"include_usage": True}}
    if config.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if config.exact_length:
        body["ignore_eos"] = True
        body["min_tokens"] = config.output_len
    body.update(config.extra_body)
    return body


async def send(client: httpx.AsyncClient, url: str, body: dict[str, Any], record: RequestRecord) -> RequestRecord:
    """One streamed request, timed from the moment it is first sent; failures end up in the record.
    Where the server closed a kept-alive connection without answering (llama.cpp's server closes
    one after a few requests), the request goes once more on a new connection, as the OpenAI
    client retries a connection error: a request the server never saw is no failure of its."""
    recorder = StreamRecorder(record, perf_counter())
    for attempt in range(2):
        answered = False
        try:
            async with client.stream("POST", url, content=orjson.dumps(body),
                                     headers={"Content-Type": "application/json"}) as response:
                answered = True
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")
                    recorder.fail(f"HTTP {response.status_code}: {text[:300]}")
                else:
                    # Read to the end even after [DONE] so the connection goes back to the pool.
                    decoder = SSEDecoder()
                    async for line in response.aiter_lines():
                        if (data := decoder.feed(line)) is not None:
                            recorder.on_event(data, perf_counter())
                    if (data := decoder.flush()) is not None:
                        recorder.on_event(data, perf_counter())
        except httpx.RemoteProtocolError as exc:
            if attempt == 0 and not answered:
                continue
            recorder.fail(f"{type(exc).__name__}: {exc}")
        except httpx.HTTPError as exc:
            recorder.fail(f"{type(exc).__name__}: {exc}")
        break
    return recorder.finish(perf_counter())


async def first_model(client: httpx.AsyncClient, config: LoadConfig) -> str:
    _, v1 = api_roots(config.base_url)
    try:
        response = await client.get(v1 + "/models")
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise BenchError(f"cannot list the models at {v1}/models ({exc}); pass --model") from exc


async def calibrate(client: httpx.AsyncClient, config: LoadConfig, model: str) -> float | None:
    """Tokens per word of our word list, from the server's /tokenize; None where it has none."""
    root, _ = api_roots(config.base_url)
    sample = random_text(random.Random(config.seed), CALIBRATION_WORDS)
    try:
        response = await client.post(root + "/tokenize", json={"model": model, "prompt": sample})
        tokens = response.json()["tokens"] if response.status_code == 200 else None
    except (httpx.HTTPError, KeyError, TypeError, ValueError):
        return None
    return len(tokens) / CALIBRATION_WORDS if tokens else None


async def build_workload(client: httpx.AsyncClient, config: LoadConfig, model: str) -> Workload:
    measured = await calibrate(client, config, model)
    ratio = measured or DEFAULT_TOKENS_PER_WORD
    return Workload(make_prompts(config.num_prompts, config.input_len, config.seed, ratio), ratio, measured is not None)


async def warm_up(client: httpx.AsyncClient, config: LoadConfig, model: str, prompt: str) -> None:
    """One request before measuring, as vLLM does: it fails fast on a wrong setup and warms the server."""
    _, v1 = api_roots(config.base_url)
    record = await send(client, v1 + ENDPOINTS[config.endpoint], request_body(config, model, prompt),
                        RequestRecord(index=-1, prompt_tokens=0))
    if not record.ok:
        hint = " (a server that rejects unknown fields needs --no-exact-length)" if "HTTP 4" in record.error else ""
        raise BenchError(f"the warm-up request to {config.base_url} failed: {record.error}{hint}")


async def run_level(client: httpx.AsyncClient, config: LoadConfig, model: str, workload: Workload,
                    concurrency: int, label: str = "") -> LevelResult:
    _, v1 = api_roots(config.base_url)
    url = v1 + ENDPOINTS[config.endpoint]
    limit = asyncio.Semaphore(concurrency)
    arrivals = random.Random(config.seed)
    bar = tqdm(total=len(workload.prompts), desc=f"{label}concurrency {concurrency}", disable=not config.progress,
               leave=False)
    started = perf_counter()

    async def one(index: int, prompt: str) -> RequestRecord:
        estimate = round(len(prompt.split()) * workload.tokens_per_word)
        async with limit:
            record = RequestRecord(index=index, prompt_tokens=estimate, sent=perf_counter() - started)
            record = await send(client, url, request_body(config, model, prompt), record)
        bar.update(1)
        return record

    tasks = []
    for index, prompt in enumerate(workload.prompts):
        tasks.append(asyncio.create_task(one(index, prompt)))
        if not math.isinf(config.request_rate):
            await asyncio.sleep(arrivals.expovariate(config.request_rate))
    records = await asyncio.gather(*tasks)
    duration = perf_counter() - started
    bar.close()
    return LevelResult(concurrency=concurrency, request_rate=config.request_rate, duration=duration,
                       records=list(records))
