"""What tensor parallelism adds to one engine step on this CPU, in one run:

    flock /tmp/tailrace-bench.lock .venv/bin/python bench/tp_step.py [--shape smollm2-135m]

For each model and batch (1 and 32 decoding sequences), the median decode step (`EngineCore.step`:
schedule, broadcast, forward, sample) of TP=1 on 1 and on 2 threads and of TP=2 over gloo with each
rank on 1 thread, measured one after another in the same run. For TP=2, the time rank 0 spends
inside collectives during the step (the two broadcasts of the step, the embedding's and each layer's
two all-reduces, the gather of the logits; this includes waiting for rank 1 to finish its half), and
the same collectives alone, on the same sizes, in a group of two bare processes: what communication
costs with no model around it. `--shape` adds a public model's shape with dummy weights
(tailrace/bench/shapes.py); one whose heads two ranks cannot split is reported as refused.
Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tailrace.bench.shapes import SHAPES, shape_config
from tailrace.engine.config import EMBEDDED_MODEL, EngineConfig
from tailrace.engine.core import EngineCore, EngineRequest
from tailrace.engine.step_inputs import StepInputs
from tailrace.engine.tensor_parallel.step import encode_step
from tailrace.model.attention.kv_cache import AttentionBatch, SeqSlice
from tailrace.model.loading.loader import load_model_config
from tailrace.model.loading.tp_shard import check_shardable, vocab_rows
from tailrace.sampling_params import SamplingParams

BATCHES = (1, 32)
RUNS = (("TP=1, 1 thread", 1, 1), ("TP=1, 2 threads", 1, 2), ("TP=2, 1 thread/rank", 2, 1))
_COLLECTIVES = ("broadcast", "all_reduce", "gather")


class CollectiveClock:
    """Time spent in torch.distributed's collectives by this process, while `on`."""

    def __init__(self) -> None:
        self.on = False
        self.seconds = 0.0
        self.calls = 0
        for name in _COLLECTIVES:
            setattr(dist, name, self._timed(getattr(dist, name)))

    def _timed(self, fn):
        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1
        return timed


def decode_steps(core: EngineCore, batch: int, args: argparse.Namespace, vocab: int, clock: CollectiveClock) -> dict:
    """Median decode step of `batch` sequences after their prefill, and rank 0's collective time per step."""
    params = SamplingParams(max_tokens=args.warmup + args.steps + 1, temperature=0, ignore_eos=True)
    for i in range(batch):
        prompt = [(31 * i + 7 * j + 3) % vocab for j in range(args.prompt_tokens)]
        core.add_request(EngineRequest(f"b{batch}-{i}", prompt, params))
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in [*core.scheduler.waiting, *core.scheduler.running]):
        core.step()  # the prefill chunks
    for _ in range(args.warmup):
        core.step()
    times, in_collectives, calls = [], [], 0
    for _ in range(args.steps):
        clock.seconds, clock.calls, clock.on = 0.0, 0, True
        start = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - start)
        clock.on = False
        in_collectives.append(clock.seconds)
        calls = clock.calls
    while core.has_work():
        core.step()
    return {"step_ms": 1e3 * statistics.median(times), "collectives_ms": 1e3 * statistics.median(in_collectives),
            "collectives_per_step": calls}


def bare_collectives(model_dir: str, batch: int, args: argparse.Namespace) -> dict:
    """The collectives of one TP=2 decode step, alone, in two processes of 1 thread each (gloo)."""
    config = load_model_config(model_dir)
    with tempfile.TemporaryDirectory() as rendezvous:
        results = mp.get_context("spawn").Manager().dict()
        mp.spawn(_bare_rank, args=(config.hidden_size, config.num_hidden_layers, vocab_rows(config.vocab_size, 2),
                                   batch, args.steps, args.prompt_tokens, f"{rendezvous}/store", results),
                 nprocs=2)
        return dict(results)


def _bare_rank(rank: int, hidden: int, layers: int, vocab_part: int, batch: int, steps: int, context: int,
               store_path: str, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    seqs = [SeqSlice(i, i, 1, context + 1, list(range(-(-(context + 1) // 16)))) for i in range(batch)]
    ids = torch.zeros(batch, dtype=torch.int64)
    body = encode_step(StepInputs(ids, ids, AttentionBatch(seqs, ids)), list(range(batch)), [])
    header = torch.zeros(2, dtype=torch.int64)
    activations = torch.randn(batch, hidden)
    logits = torch.randn(batch, vocab_part)
    parts = [torch.empty_like(logits) for _ in range(2)] if rank == 0 else None
    times = []
    for _ in range(steps + 5):
        start = time.perf_counter()
        dist.broadcast(header, 0)
        dist.broadcast(body, 0)
        for _ in range(2 * layers + 1):
            dist.all_reduce(activations)
        dist.gather(logits, parts, dst=0)
        times.append(time.perf_counter() - start)
    if rank == 0:
        results["bare_ms"] = 1e3 * statistics.median(times[5:])
        results["step_bytes"] = body.numel() * 8
        results["all_reduce_bytes"] = activations.numel() * 4
        results["gather_bytes"] = logits.numel() * 4
    dist.destroy_process_group()


def dummy_shape_dir(name: str, root: Path) -> str:
    """config.json of a public model's shape, for --load-format dummy."""
    directory = root / name
    directory.mkdir()
    tokenizer_config = json.loads((Path(EMBEDDED_MODEL) / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(shape_config(SHAPES[name], tokenizer_config)))
    return str(directory)


def measure_model(label: str, model_dir: str, load_format: str, args: argparse.Namespace,
                  clock: CollectiveClock) -> list[dict]:
    config = load_model_config(model_dir)
    try:
        check_shardable(config, 2)
    except ValueError as err:
        print(f"{label}: TP=2 refused: {err}")
        return [{"model": label, "refused": str(err)}]
    rows = {b: {"model": label, "batch": b} for b in BATCHES}
    for name, tp, threads in RUNS:
        core = EngineCore(EngineConfig(model=model_dir, load_format=load_format, tensor_parallel_size=tp,
                                       threads=threads, max_num_seqs=max(BATCHES), dtype="float32"))
        try:
            for b in BATCHES:
                result = decode_steps(core, b, args, config.vocab_size, clock)
                rows[b][name] = result["step_ms"]
                if tp == 2:
                    rows[b]["collectives_ms"] = result["collectives_ms"]
                    rows[b]["collectives_per_step"] = result["collectives_per_step"]
        finally:
            core.shutdown()
    for b in BATCHES:
        rows[b].update(bare_collectives(model_dir, b, args))
    return list(rows.values())


def print_table(rows: list[dict]) -> None:
    names = [name for name, _, _ in RUNS]
    print(f"{'model':<14} {'batch':>5} " + " ".join(f"{n:>20}" for n in names)
          + f" {'in collectives':>15} {'collectives alone':>18} {'calls':>6}")
    for r in rows:
        if "refused" in r:
            print(f"{r['model']:<14} refused: {r['refused']}")
            continue
        print(f"{r['model']:<14} {r['batch']:>5} " + " ".join(f"{r[n]:>17.2f} ms" for n in names)
              + f" {r['collectives_ms']:>12.2f} ms {r['bare_ms']:>15.2f} ms {r['collectives_per_step']:>6}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", action="append", default=[], choices=sorted(SHAPES),
                        help="also a public model's shape, dummy weights (repeatable)")
    parser.add_argument("--steps", type=int, default=30, help="decode steps timed per batch")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=64, help="each sequence's prompt (its context)")
    parser.add_argument("--out", default="bench/out/tp_step.json")
    args = parser.parse_args()
    clock = CollectiveClock()
    rows = measure_model("embedded", EMBEDDED_MODEL, "auto", args, clock)
    with tempfile.TemporaryDirectory() as root:
        for name in args.shape:
            rows += measure_model(name, dummy_shape_dir(name, Path(root)), "dummy", args, clock)
    print_table(rows)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "loadavg": Path("/proc/loadavg").read_text().split()[:3], "cores": os.cpu_count(),
            "steps": args.steps, "prompt_tokens": args.prompt_tokens}
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
