"""Offline throughput: tailrace's LLM.generate next to transformers' generate, same model, same run.

    .venv/bin/python bench/offline.py --num-prompts 256 --input-len 128 --output-len 128

Random prompt tokens, every request runs to exactly --output-len tokens (EOS ignored), greedy.
Prints a table and writes JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time
from datetime import datetime, timezone

import torch

from tailrace import LLM, SamplingParams
from tailrace.engine.config import EMBEDDED_MODEL


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def time_generate(llm: LLM, prompts: list[list[int]], output_len: int) -> tuple[float, int]:
    """(seconds, output tokens) of one greedy `generate` in which every request runs to output_len."""
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True))
    seconds = time.perf_counter() - start
    return seconds, sum(len(o.outputs[0].token_ids) for o in outs)


def bench_tailrace(model: str, prompts: list[list[int]], output_len: int, threads: int,
                   max_num_seqs: int) -> dict:
    llm = LLM(model, threads=threads, max_num_seqs=max_num_seqs, max_num_batched_tokens=4096)
    time_generate(llm, prompts[:4], 4)  # warm-up
    seconds, tokens = time_generate(llm, prompts, output_len)
    return {"system": f"tailrace LLM (max_num_seqs={max_num_seqs})", "seconds": seconds,
            "output_tokens": tokens}


def bench_transformers(model: str, prompts: list[list[int]], output_len: int, threads: int,
                       batch: int) -> dict:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    kwargs = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        hf.generate(torch.tensor(prompts[:2]), **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})
        start = time.perf_counter()
        tokens = 0
        for i in range(0, len(prompts), batch):
            out = hf.generate(torch.tensor(prompts[i:i + batch]), **kwargs)
            tokens += (out.shape[1] - len(prompts[0])) * out.shape[0]
        seconds = time.perf_counter() - start
    return {"system": f"transformers generate (batch {batch})", "seconds": seconds, "output_tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=EMBEDDED_MODEL)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--hf-batch", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench/out/offline.json")
    args = parser.parse_args()

    with open(os.path.join(args.model, "config.json"), encoding="utf-8") as f:
        vocab = json.load(f)["vocab_size"]
    prompts = random_prompts(args.num_prompts, args.input_len, vocab, args.seed)
    rows = [
        bench_tailrace(args.model, prompts, args.output_len, args.threads, args.max_num_seqs),
        bench_transformers(args.model, prompts, args.output_len, args.threads, args.hf_batch),
    ]
    for row in rows:
        row["output_tok_per_s"] = row["output_tokens"] / row["seconds"]
    base = rows[-1]["output_tok_per_s"]
    print(f"\n{args.num_prompts} requests x ({args.input_len} prompt, {args.output_len} output) tokens, "
          f"{args.threads} threads, {platform.processor() or platform.machine()}")
    print(f"{'system':<42} {'seconds':>8} {'out tok/s':>10} {'vs transformers':>16}")
    for row in rows:
        print(f"{row['system']:<42} {row['seconds']:>8.2f} {row['output_tok_per_s']:>10.1f} "
              f"{row['output_tok_per_s'] / base:>15.2f}x")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"date": datetime.now(timezone.utc).isoformat(), "args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
