"""Served time to first token against the prefill's FLOP bound, in one run (issue 11, part 5).

    .venv/bin/python bench/ttft_bound.py --model bench/.shapes/smollm2-135m --dtype bfloat16

Starts `tailrace serve` on the shape (dummy weights, or the directory's own with --load-format
auto), then takes --rounds rounds, each of:

  the bound: `decode_step.matmul_bound`, the prefill's projections as bare matmuls (the fastest of
  MKL, oneDNN and tailrace's own kernel, float32 included) plus the head for one row, for the served prompt's token
  count, on --threads threads, measured in this process while the server is idle;
  the requests: --requests streamed chat requests one after another (c=1), each prompt new (no
  prefix-cache hit), --output-len tokens each.

Two times per request, from sending it: the first chunk (the engine's first token: tailrace sends
the role chunk with it) and the first chunk with text (what `tailrace bench serve` and vLLM's
benchmark call TTFT; with dummy weights the first tokens may decode to no text, which adds decode
steps to it). Each round's p50 is set against the bound measured just before it, since this
host's speed moves from minute to minute; the summary is the median of the rounds' ratios.

That ratio sets a median against a best of 5, on a host whose bare matmuls move by 2x within a
run, so it leans against the server. The paired ratio sets like against like: right before each
request, one pass of the bound's fastest matmuls (each shape as many times as a prefill runs it),
and the request's time over that pass; its summary is the median over all requests. Both are
printed and written. Prints a table and writes JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx
import orjson
import torch

sys.path.insert(0, str(Path(__file__).parent))
from decode_step import bound_matmuls, bound_of, bound_pass  # noqa: E402

from tailrace.bench.prompts import make_prompts  # noqa: E402
from tailrace.bench.records import DONE, chunk_text  # noqa: E402
from tailrace.bench.serve import LoadConfig, request_body  # noqa: E402
from tailrace.bench.servers import ServerProcess, free_port, wait_ready  # noqa: E402
from tailrace.bench.sse import SSEDecoder  # noqa: E402
from tailrace.model.loading.loader import load_model_config  # noqa: E402


_SETTLE_S = 0.05


def one_request(client: httpx.Client, url: str, body: dict) -> tuple[float, float | None, int]:
    """(s to the first chunk, s to the first chunk with text or None, the server's prompt tokens)."""
    first = text = None
    prompt_tokens = 0
    decoder = SSEDecoder()
    started = time.perf_counter()
    with client.stream("POST", url, content=orjson.dumps(body), headers={"Content-Type": "application/json"}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            data = decoder.feed(line)
            if data is None or data == DONE:
                continue
            now = time.perf_counter()
            chunk = orjson.loads(data)
            if chunk.get("choices"):
                first = first if first is not None else now - started
                if text is None and chunk_text(chunk["choices"][0]):
                    text = now - started
            if chunk.get("usage"):
                prompt_tokens = chunk["usage"]["prompt_tokens"]
    return first, text, prompt_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a model directory (a shape's config.json and tokenizer)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads of the bare matmuls")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens, about, before the chat template")
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--requests", type=int, default=6, help="requests per round")
    parser.add_argument("--serve-args", default="", help="more `tailrace serve` flags, e.g. \"--threads 2\"")
    parser.add_argument("--out", default="bench/out/ttft_bound.json")
    args = parser.parse_args()

    port = free_port()
    command = [sys.executable, "-m", "tailrace", "serve", args.model, "--dtype", args.dtype, "--load-format",
               args.load_format, "--port", str(port), "--served-model-name", "m"]
    if args.quantization:
        command += ["--quantization", args.quantization]
    command += shlex.split(args.serve_args)
    config = load_model_config(args.model)
    dtype = getattr(torch, args.dtype)
    firsts: list[list[float]] = []
    texts: list[list[float | None]] = []
    bounds: list[float] = []
    passes: list[list[float]] = []
    tokens: list[int] = []
    log = Path(args.out).with_suffix(".server.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    with ServerProcess("tailrace", command, f"http://127.0.0.1:{port}", log) as server, httpx.Client(timeout=600) as client:
        wait_ready([server], 600)
        url = f"{server.url}/v1/chat/completions"
        load = LoadConfig(endpoint="chat", output_len=args.output_len)

        def request(prompt: str) -> tuple[float, float | None, int]:
            return one_request(client, url, request_body(load, "m", prompt))

        # Warm-up: the engine's first step at each thread count pays one-time costs (engine/threads.py).
        warm = [request(prompt) for prompt in make_prompts(4, args.input_len, 10_000)]
        served_tokens = round(statistics.median(tokens for _, _, tokens in warm))
        for round_ in range(args.rounds):
            torch.set_num_threads(args.threads)
            parts = bound_matmuls(config, served_tokens, dtype)
            bounds.append(bound_of(parts))
            results, round_passes = [], []
            for prompt in make_prompts(args.requests, args.input_len, seed=round_):
                # Each side's threads spin for some milliseconds after their work (libgomp's
                # default); a pause keeps them out of the other's time.
                time.sleep(_SETTLE_S)
                round_passes.append(bound_pass(parts))
                time.sleep(_SETTLE_S)
                results.append(request(prompt))
            passes.append(round_passes)
            firsts.append([first for first, _, _ in results])
            texts.append([text for _, text, _ in results])
            tokens.extend(prompt_tokens for _, _, prompt_tokens in results)
    # Each round's p50 against the bound measured just before it, so both see the same minute's load.
    first_ratios = [statistics.median(f) / b for f, b in zip(firsts, bounds)]
    texts_seen = [[t for t in round_ if t is not None] for round_ in texts]
    text_ratios = [statistics.median(t) / b for t, b in zip(texts_seen, bounds) if t]
    # Each request against the bound's one pass just before it.
    paired_first = [f / b for fs, bs in zip(firsts, passes) for f, b in zip(fs, bs)]
    paired_text = [t / b for ts, bs in zip(texts, passes) for t, b in zip(ts, bs) if t is not None]
    print(f"{args.model}: {args.dtype}{' ' + args.quantization if args.quantization else ''}, prompt "
          f"{min(tokens)}-{max(tokens)} tokens (bound at {served_tokens}), {args.rounds} x {args.requests} requests, "
          f"bound threads {args.threads}, load {os.getloadavg()[0]:.2f}")
    print(f"{'round':>5} {'bound ms':>9} {'first chunk p50':>16} {'/ bound':>8} {'TTFT p50':>9} {'/ bound':>8} "
          f"{'passes ms':>14} {'TTFT / pass p50':>16}")
    for k, (b, f, t, ps, ts) in enumerate(zip(bounds, firsts, texts_seen, passes, texts)):
        ttft = statistics.median(t) if t else math.nan
        paired = [x / p for x, p in zip(ts, ps) if x is not None]
        print(f"{k:>5} {b * 1e3:>9.1f} {statistics.median(f) * 1e3:>16.1f} {statistics.median(f) / b:>8.2f} "
              f"{ttft * 1e3:>9.1f} {ttft / b:>8.2f} {min(ps) * 1e3:>6.1f}-{max(ps) * 1e3:<7.1f} "
              f"{statistics.median(paired) if paired else math.nan:>16.2f}")
    summary = {"first_chunk_vs_bound": statistics.median(first_ratios),
               "ttft_vs_bound": statistics.median(text_ratios) if text_ratios else None,
               "paired_first_chunk_vs_pass": statistics.median(paired_first),
               "paired_ttft_vs_pass": statistics.median(paired_text) if paired_text else None}
    print(f"median of the rounds: first chunk {summary['first_chunk_vs_bound']:.2f}x the bound, TTFT "
          + (f"{summary['ttft_vs_bound']:.2f}x" if text_ratios else "-")
          + f" ({sum(map(len, texts_seen))} of {sum(map(len, texts))} requests had text)")
    print(f"paired, median over requests: first chunk {summary['paired_first_chunk_vs_pass']:.2f}x the pass "
          "before it, TTFT " + (f"{summary['paired_ttft_vs_pass']:.2f}x" if paired_text else "-"))
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"date": datetime.now(timezone.utc).isoformat(), "args": vars(args), "load": os.getloadavg(),
                   "bound_tokens": served_tokens, "bounds_s": bounds, "bound_passes_s": passes,
                   "first_chunk_s": firsts, "first_text_s": texts,
                   "prompt_tokens": tokens, **summary}, f, indent=2)

if __name__ == "__main__":
    main()
