"""Decode attention's share of a step: the paged kernel alone over every layer, against the whole step.

    .venv/bin/python bench/attention_decode.py --model bench/.shapes/smollm2-135m --dtype bfloat16

For each (batch, context): a cache prefilled with `batch` sequences of `context` tokens, then the
native paged attention kernel called once per layer with random queries, and the model's decode
step (forward plus logits) on the same cache. Dummy weights (config.json is enough). Prints a
table of best-of times, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import datetime, timezone

import torch
from decode_step import forward_step, load_as_engine, prefilled_cache  # bench/ is on sys.path

from tailrace.model.attention.kv_cache import AttentionBatch, SeqSlice


def best_of(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure(model, config, batch: int, context: int, repeats: int) -> dict[str, float]:
    cache, tables = prefilled_cache(model, config, batch, context, repeats + 2)
    if getattr(cache, "kernel", None) != "tailrace":  # a slab KVCache has no such kernel
        raise SystemExit("tailrace's paged attention kernel does not run here")
    block = cache.block_size
    seqs = [SeqSlice(j, j, 1, context + 1, table) for j, table in enumerate(tables)]
    slots = [table[context // block] * block + context % block for table in tables]
    step_batch = AttentionBatch(seqs, torch.tensor(slots))
    cache.begin(step_batch)
    meta = cache.metadata
    q = torch.randn(batch, config.num_attention_heads, config.head_dim).to(model.dtype)

    def attention() -> None:
        for layer in range(config.num_hidden_layers):
            cache._native_attention(q, cache.k[layer], cache.v[layer], meta.query_start_loc, meta.seq_lens,
                                    meta.block_tables, cache.block_size, meta.num_seqs, cache.scale)

    def step() -> None:
        with torch.inference_mode():
            forward_step(model, cache, tables, [[5]] * batch, context).argmax(dim=-1).tolist()

    kv_bytes = (config.num_hidden_layers * batch * (context + 1) * config.num_key_value_heads * config.head_dim
                * 2 * cache.k.element_size())
    attention_s = best_of(attention, repeats)
    return {"batch": batch, "context": context, "attention_s": attention_s, "step_s": best_of(step, repeats),
            "kv_read_gb_s": kv_bytes / attention_s / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a model directory (config.json is enough)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cases", default="32x128,32x256,8x256,1x256", help="batch x context, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="bench/out/attention_decode.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, config = load_as_engine(args.model, args.dtype, None)
    load = os.getloadavg()[0]
    rows = [measure(model, config, *map(int, case.split("x")), args.repeats) for case in args.cases.split(",")]
    print(f"{args.model}: {args.dtype}, {args.threads} threads, load {load:.2f}")
    print(f"{'batch':>6} {'context':>8} {'attention ms':>13} {'step ms':>8} {'K/V GB/s':>9}")
    for r in rows:
        print(f"{r['batch']:>6} {r['context']:>8} {r['attention_s'] * 1e3:>13.1f} {r['step_s'] * 1e3:>8.1f} "
              f"{r['kv_read_gb_s']:>9.1f}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"date": datetime.now(timezone.utc).isoformat(), "model": args.model, "dtype": args.dtype,
                   "threads": args.threads, "load": load, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
