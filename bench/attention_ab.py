"""Attention on the CPU, the slot slab against tailrace's paged kernel, steps interleaved in one process:

    .venv/bin/python bench/attention_ab.py --model bench/.shapes/smollm2-135m --dtype bfloat16 --batch 1 8 32

The slab (`--attention slab`: SDPA at float32, batch-invariant matmuls at bfloat16) is what the
CPU ran before csrc/paged_attention.cpp; the paged kernel reads the pages in place. Both caches
hold the same K/V and run the same model, one step each in turn, so both see the same load.
Decode steps at a context of --context tokens, then single-sequence prefills of --prefill tokens.
Dummy weights (config.json is enough). Prints a table of median times, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import datetime, timezone

import torch
from decode_step import forward_step, load_as_engine, prefilled_cache, sequence_cache  # bench/ is on sys.path

KINDS = ("slab", "paged")


def interleaved(steps: int, run: dict[str, callable]) -> dict[str, float]:
    """Median seconds of each callable, called in turn `steps` times (the first two not counted)."""
    times: dict[str, list[float]] = {name: [] for name in run}
    for _ in range(steps):
        for name, fn in run.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t[2:]) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a model directory (config.json is enough)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--context", type=int, default=192)
    parser.add_argument("--prefill", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--out", default="bench/out/attention_ab.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, config = load_as_engine(args.model, args.dtype, load_format="dummy")
    rows = []
    with torch.inference_mode():
        for batch in args.batch:
            caches = {kind: prefilled_cache(model, config, batch, args.context, args.steps, kind) for kind in KINDS}
            position = {kind: args.context for kind in KINDS}

            def step(kind: str) -> None:
                cache, tables = caches[kind]
                forward_step(model, cache, tables, [[5]] * batch, position[kind]).argmax(dim=-1).tolist()
                position[kind] += 1

            rows.append({"what": f"decode batch {batch}", **interleaved(args.steps, {k: lambda k=k: step(k) for k in KINDS})})
        for tokens in args.prefill:
            def prefill(kind: str) -> None:
                cache, table = sequence_cache(model, config, tokens, attention=kind)
                forward_step(model, cache, [table], [list(range(3, 3 + tokens))], 0).argmax(dim=-1).tolist()

            rows.append({"what": f"prefill {tokens}", **interleaved(5, {k: lambda k=k: prefill(k) for k in KINDS})})
    print(f"{args.model}: {args.dtype}, {args.threads} threads, context {args.context}, load {os.getloadavg()[0]:.2f}")
    print(f"{'':>16} {'slab ms':>9} {'paged ms':>9} {'ratio':>6}")
    for row in rows:
        print(f"{row['what']:>16} {row['slab'] * 1e3:>9.2f} {row['paged'] * 1e3:>9.2f} {row['paged'] / row['slab']:>6.2f}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"date": datetime.now(timezone.utc).isoformat(), "args": vars(args), "load": os.getloadavg(),
                   "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
