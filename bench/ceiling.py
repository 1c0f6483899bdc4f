"""Does the frontend starve the engine? Three figures for the same requests, in one run:

    .venv/bin/python bench/ceiling.py --num-prompts 256 --batch 64

1. bare forward loop: the model and KV cache alone at batch --batch (prefill, then greedy decode
   with argmax; no scheduler, sampler, detokenizer or IPC): the ceiling this machine allows;
2. offline engine: `LLM.generate` on the same prompts (everything but HTTP);
3. served: `tailrace serve` on loopback, `tailrace bench serve` at concurrency --batch.
Prints served / offline and served / bare ratios and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from decode_step import forward_step, load_as_engine, new_cache  # bench/ is on sys.path when a script here runs
from offline import random_prompts

from tailrace import LLM, SamplingParams
from tailrace.bench.servers import ServerProcess, free_port, wait_ready
from tailrace.engine.config import EMBEDDED_MODEL


def bare_loop(model_dir: str, dtype: str, prompts: list[list[int]], output_len: int, batch: int) -> float:
    """Output tokens/s of prefill + greedy decode, `batch` sequences at a time, nothing else, on the
    model and the kind of KV cache the engine would use."""
    model, config = load_as_engine(model_dir, dtype)
    block = 16
    per_seq = -(-(len(prompts[0]) + output_len) // block)
    cache = new_cache(model, config, per_seq * batch, block, batch, len(prompts[0]) + output_len)
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            group = prompts[i:i + batch]
            tables = [list(range(j * per_seq, (j + 1) * per_seq)) for j in range(len(group))]
            tokens = [p[:] for p in group]
            for step in range(output_len):
                past = len(tokens[0]) - (len(group[0]) if step == 0 else 1)
                rows = [t[past:] for t in tokens]
                next_ids = forward_step(model, cache, tables, rows, past).argmax(dim=-1).tolist()
                for t, n in zip(tokens, next_ids):
                    t.append(n)
            for j in range(len(group)):
                cache.release(j)
    return len(prompts) * output_len / (time.perf_counter() - start)


def offline(model_dir: str, dtype: str, prompts: list[list[int]], output_len: int, batch: int) -> float:
    llm = LLM(model_dir, dtype=dtype, max_num_seqs=batch, max_num_batched_tokens=4096)
    llm.generate(prompts[:2], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True))
    return len(prompts) * output_len / (time.perf_counter() - start)


def served(model_dir: str, args: argparse.Namespace) -> dict:
    """`tailrace bench serve` in its own process (as a user runs it) against a server started here."""
    port = free_port()
    command = [sys.executable, "-m", "tailrace", "serve", model_dir, "--port", str(port),
               "--max-num-seqs", str(args.batch), "--dtype", args.dtype]
    with tempfile.TemporaryDirectory() as tmp, \
            ServerProcess("tailrace", command, f"http://127.0.0.1:{port}", Path(tmp) / "server.log") as server:
        wait_ready([server], 120)
        out = Path(tmp) / "serve.json"
        subprocess.run([sys.executable, "-m", "tailrace", "bench", "serve", "--base-url", server.url,
                        "--concurrency", str(args.batch), "--num-prompts", str(args.num_prompts),
                        "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                        "--no-progress", "--out", str(out)], check=True, stdout=subprocess.DEVNULL)
        summary = next(iter(json.loads(out.read_text())["runs"].values()))[0]["summary"]
    return {"output_tok_per_s": summary["output_throughput"], "failed": summary["failed"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=EMBEDDED_MODEL)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--dtype", default="auto", help="of all three, as `tailrace serve --dtype`")
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                        help="compute threads of the bare loop and the offline engine (default: all cores but "
                             "one; the server picks its own)")
    parser.add_argument("--out", default="bench/out/ceiling.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with open(os.path.join(args.model, "config.json"), encoding="utf-8") as f:
        vocab = json.load(f)["vocab_size"]
    prompts = random_prompts(args.num_prompts, args.input_len, vocab, seed=0)
    rows = {
        "bare forward loop": bare_loop(args.model, args.dtype, prompts, args.output_len, args.batch),
        "offline engine (LLM.generate)": offline(args.model, args.dtype, prompts, args.output_len, args.batch),
    }
    serve = served(args.model, args)
    rows[f"served, concurrency {args.batch}"] = serve["output_tok_per_s"]
    bare, engine = rows["bare forward loop"], rows["offline engine (LLM.generate)"]
    print(f"\n{args.num_prompts} requests x ({args.input_len} prompt, {args.output_len} output) tokens, "
          f"batch/concurrency {args.batch}, {torch.get_num_threads()} torch thread(s)")
    print(f"{'system':<32} {'out tok/s':>10} {'/ bare':>8} {'/ offline':>10}")
    for name, value in rows.items():
        print(f"{name:<32} {value:>10.1f} {value / bare:>8.2f} {value / engine:>10.2f}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"date": datetime.now(timezone.utc).isoformat(), "args": vars(args), "rows": rows,
                   "served_failed": serve["failed"]}, f, indent=2)


if __name__ == "__main__":
    main()
