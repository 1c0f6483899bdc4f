"""Frontend cost: the serving layer alone, fed a synthetic delta stream, JSON and SSE framing included.

    .venv/bin/python bench/frontend.py --tokens 100000

One request streams --tokens deltas of one token each from a synthetic engine (no model: the
point is what serving costs per chunk). Reports the time per chunk in the first and the last
10% of the stream for completions and chat, with and without logprobs; flat means O(1) per chunk.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import statistics
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime, timezone

from tailrace.api.sse import encode_event
from tailrace.engine.config import EMBEDDED_MODEL
from tailrace.outputs import CompletionOutput, RequestOutput, TokenLogprob
from tailrace.sampling_params import SamplingParams
from tailrace.serving.chat import create_chat_completion
from tailrace.serving.completions import create_completion
from tailrace.serving.context import RequestContext
from tailrace.serving.protocol import ChatCompletionRequest, CompletionRequest
from tailrace.tokenizer import Tokenizer, load_tokenizer


@dataclass
class SyntheticEngine:
    """Yields one-token deltas of real token ids with their real text, as the engine client does."""

    tokenizer: Tokenizer
    tokens: int
    max_model_len: int
    model_path: str = EMBEDDED_MODEL
    is_ready: bool = True
    errored: bool = False

    async def add_request(self, request_id: str, prompt_token_ids: list[int],
                          params: SamplingParams) -> AsyncIterator[RequestOutput]:
        rng = random.Random(0)
        words = [t for t in range(300, 4000) if self.tokenizer.token_text(t).isascii()]
        for i in range(self.tokens):
            token = rng.choice(words)
            logprobs = None
            if params.logprobs is not None:
                logprobs = [TokenLogprob(-0.5, [(token, -0.5), *((t, -2.0) for t in words[:params.logprobs])])]
            last = i == self.tokens - 1
            yield RequestOutput(request_id, prompt_token_ids, [CompletionOutput(
                0, self.tokenizer.token_text(token), [token], logprobs,
                "length" if last else None)], finished=last, num_cached_tokens=0)

    async def abort(self, request_id: str) -> None:
        return None


async def time_stream(chunks: AsyncIterator[dict]) -> list[int]:
    """Nanoseconds per chunk: serving's work for it plus encoding it as one SSE event."""
    times = []
    clock = time.perf_counter_ns
    while True:
        start = clock()
        try:
            chunk = await chunks.__anext__()
        except StopAsyncIteration:
            return times
        encode_event(chunk)
        times.append(clock() - start)


async def run_case(engine: SyntheticEngine, endpoint: str, logprobs: bool) -> dict:
    ctx = RequestContext(request_id="req-bench", model_name="tiny", metrics=None)
    if endpoint == "completions":
        request = CompletionRequest(model="tiny", prompt="The list type", max_tokens=engine.tokens,
                                    stream=True, logprobs=2 if logprobs else None)
        chunks = await create_completion(engine, request, ctx)
    else:
        request = ChatCompletionRequest(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                        max_tokens=engine.tokens, stream=True, logprobs=logprobs,
                                        top_logprobs=2 if logprobs else None)
        chunks = await create_chat_completion(engine, request, ctx)
    gc.collect()
    times = await time_stream(chunks)
    tenth = len(times) // 10
    first, last = times[:tenth], times[-tenth:]
    return {
        "endpoint": endpoint, "logprobs": logprobs, "chunks": len(times),
        "first_10pct_us_median": statistics.median(first) / 1000,
        "last_10pct_us_median": statistics.median(last) / 1000,
        "first_10pct_us_mean": statistics.fmean(first) / 1000,
        "last_10pct_us_mean": statistics.fmean(last) / 1000,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=100_000)
    parser.add_argument("--out", default="bench/out/frontend.json")
    args = parser.parse_args()
    engine = SyntheticEngine(load_tokenizer(EMBEDDED_MODEL), args.tokens, max_model_len=args.tokens + 64)
    rows = [asyncio.run(run_case(engine, endpoint, logprobs))
            for endpoint in ("completions", "chat") for logprobs in (False, True)]
    print(f"\nserving layer + JSON + SSE framing, {args.tokens} one-token chunks per stream")
    print(f"{'endpoint':<12} {'logprobs':<9} {'first 10% us':>13} {'last 10% us':>12} {'last/first':>11}"
          f" {'(means)':>16}")
    for r in rows:
        ratio = r["last_10pct_us_median"] / r["first_10pct_us_median"]
        print(f"{r['endpoint']:<12} {str(r['logprobs']):<9} {r['first_10pct_us_median']:>13.1f} "
              f"{r['last_10pct_us_median']:>12.1f} {ratio:>10.2f}x "
              f"{r['first_10pct_us_mean']:>7.1f}/{r['last_10pct_us_mean']:.1f}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"date": datetime.now(timezone.utc).isoformat(), "args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
