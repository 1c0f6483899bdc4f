"""Projections, oneDNN's packed linear against tailrace's kernel, in one process, bfloat16 or
float32 (--dtype):

    .venv/bin/python bench/bf16_linear_ab.py --shape smollm2-135m --rows 1 8 32 128 --threads 1 2

Every projection of every layer plus the LM head of a benchmark shape, each with weights of its
own (so, as in a decode step, they come from memory, not cache), timed as one pass per kernel;
the kernels alternate pass by pass so that the machine's noise falls on both. Prints each
kernel's median pass and the rate it streamed the weights at; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import datetime, timezone

import torch

from tailrace.bench.shapes import SHAPES, Shape
from tailrace.model.cpu.bf16_linear import available, kernel_linear
from tailrace.model.cpu.linear import PackedLinear


def projection_shapes(shape: Shape) -> list[tuple[int, int]]:
    """(out, in) of each projection a decode step runs, in order, the head last."""
    hidden, inter = shape.hidden_size, shape.intermediate_size
    q, kv = shape.num_attention_heads * shape.head_dim, shape.num_key_value_heads * shape.head_dim
    layer = [(q + 2 * kv, hidden), (hidden, q), (2 * inter, hidden), (hidden, inter)]
    return layer * shape.num_hidden_layers + [(shape.vocab_size, hidden)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--passes", type=int, default=9)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--out", default="bench/out/bf16_linear_ab.json")
    args = parser.parse_args()
    if not available():
        raise SystemExit("tailrace's kernel is not available here (no AVX512, or it did not build)")
    dtype = getattr(torch, args.dtype)
    ours = kernel_linear(dtype)
    shapes = projection_shapes(SHAPES[args.shape])
    torch.manual_seed(0)
    weights = [torch.randn(shape, dtype=dtype) * 0.02 for shape in shapes]
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    kernels = {"onednn": [PackedLinear(w, None) for w in weights], "tailrace": [ours(w, None) for w in weights]}
    del weights
    results = []
    print(f"{args.shape}: {len(shapes)} projections, {weight_bytes / 1e6:.0f} MB of {args.dtype} weights, "
          f"load {os.getloadavg()[0]:.2f}")
    print(f"{'threads':>7} {'rows':>5} {'oneDNN ms':>10} {'GB/s':>6} {'tailrace ms':>12} {'GB/s':>6} {'ratio':>6}")
    with torch.inference_mode():
        for threads in args.threads:
            torch.set_num_threads(threads)
            for rows in args.rows:
                inputs = {width: torch.randn(rows, width, dtype=dtype) for _, width in shapes}
                times: dict[str, list[float]] = {name: [] for name in kernels}
                for _ in range(args.passes + 1):
                    for name, layers in kernels.items():
                        start = time.perf_counter()
                        for layer, (_, width) in zip(layers, shapes):
                            layer(inputs[width])
                        times[name].append(time.perf_counter() - start)
                median = {name: statistics.median(t[1:]) for name, t in times.items()}
                results.append({"threads": threads, "rows": rows, **{f"{n}_s": s for n, s in median.items()}})
                print(f"{threads:>7} {rows:>5} {median['onednn'] * 1e3:>10.2f} {weight_bytes / median['onednn'] / 1e9:>6.1f}"
                      f" {median['tailrace'] * 1e3:>12.2f} {weight_bytes / median['tailrace'] / 1e9:>6.1f}"
                      f" {median['tailrace'] / median['onednn']:>6.2f}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"date": datetime.now(timezone.utc).isoformat(), "args": vars(args), "load": os.getloadavg(),
                   "weight_bytes": weight_bytes, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
