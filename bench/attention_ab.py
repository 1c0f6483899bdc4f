"""bfloat16 decode with the exact (matmul) attention against SDPA's, steps interleaved in one process:

    .venv/bin/python bench/attention_ab.py --model bench/.shapes/smollm2-135m --batch 1 8 32

SDPA is what bfloat16 ran before its attention was made batch-invariant (model/attention.py);
interleaving the two caches' steps puts both under the same load. Dummy weights (config.json is
enough). Prints a table of median step times, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import datetime, timezone

import torch
from decode_step import forward_step, load_as_engine, prefilled_cache  # bench/ is on sys.path when a script here runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a model directory (config.json is enough)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--context", type=int, default=192)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", default="bench/out/attention_ab.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, config = load_as_engine(args.model, "bfloat16", load_format="dummy")
    rows = []
    with torch.inference_mode():
        for batch in args.batch:
            caches = {}
            for exact in (False, True):
                # Both caches hold the same K/V; only the decode steps' attention differs.
                caches[exact], tables = prefilled_cache(model, config, batch, args.context, args.steps)
                caches[exact].exact_matmuls = exact
            times: dict[bool, list[float]] = {False: [], True: []}
            for i in range(args.steps):
                for exact, cache in caches.items():
                    start = time.perf_counter()
                    forward_step(model, cache, tables, [[5]] * batch, args.context + i).argmax(dim=-1).tolist()
                    times[exact].append(time.perf_counter() - start)
            sdpa, exact = (statistics.median(times[k][4:]) * 1e3 for k in (False, True))
            rows.append({"batch": batch, "sdpa_ms": sdpa, "matmul_ms": exact, "ratio": exact / sdpa})
    print(f"{args.model}: bfloat16, {args.threads} threads, context {args.context}, load {os.getloadavg()[0]:.2f}")
    print(f"{'batch':>6} {'SDPA ms':>9} {'matmul ms':>10} {'ratio':>6}")
    for row in rows:
        print(f"{row['batch']:>6} {row['sdpa_ms']:>9.2f} {row['matmul_ms']:>10.2f} {row['ratio']:>6.2f}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"date": datetime.now(timezone.utc).isoformat(), "args": vars(args), "load": os.getloadavg(),
                   "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
