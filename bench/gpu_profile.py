"""Where the GPU backend's step time goes, beside bench/gpu_bench.py's figures (bench/README.md, the
H200's table): the same model and engine arguments, then

  graphs    each decode graph's device time alone (CUDA events around back-to-back replays), the
            floor of a decode step of that size;
  steps     the wall time of a decode step in LLM.generate at batch 1 and at max_num_seqs, so the
            gap to the floor is the host's share (scheduling, inputs, sampling, output handling);
  host      the host's pieces of that full-batch decode step, each timed around its Python call
            (scheduling, step inputs, attention metadata, sampling, the wait and the tokens' apply,
            output processing): where the gap between the step and its graph goes;
  profile   torch.profiler over a batch-1 generate and over a full batch's prefill and decode: the
            top kernels by device time and the top operators by host time.

    python3 bench/gpu_profile.py --out $OUT          # on the lent H200 (bench/gpu.sh --profile)
    .venv/bin/python bench/gpu_profile.py --smoke    # here, on the CPU: no graphs, host time only
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType
from gpu_bench import REPO, make_model_dir, make_setup, prompts_for  # bench/ is on sys.path
from offline import time_generate
from torch.profiler import ProfilerActivity, profile

from tailrace import LLM
from tailrace import llm as llm_module
from tailrace.engine import core, model_runner, scheduler, step_inputs
from tailrace.model.attention import paged as paged_attention


def graph_ms(llm: LLM, size: int, reps: int = 20) -> float:
    """Device milliseconds of one replay of the decode graph of this size, its inputs all padding."""
    runner = llm.core.runner
    runner.cache.begin(runner.inputs.build([], pad_to=size).batch)
    runner.graphs.replay(size)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        runner.graphs.replay(size)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


# (owner, attribute, label) of each host piece `decode_step_ms` can time.
HOST_PIECES = [
    (scheduler.Scheduler, "schedule", "schedule"),
    (step_inputs.StepInputBuilder, "build", "step inputs"),
    (paged_attention.PagedKVCache, "begin", "attention metadata"),
    (model_runner, "start_sample", "sampling (launch)"),
    (model_runner.ModelRunner, "launch", "ModelRunner.launch (all of it)"),
    (core.EngineCore, "collect", "wait + apply tokens"),
    (llm_module.LLM, "_process", "output processing (overlaps the device)"),
]


def decode_step_ms(llm: LLM, prompts: list[list[int]], output_len: int,
                   pieces: Sequence[tuple[Any, str, str]] = ()) -> dict[str, float]:
    """Milliseconds of one decode step ("step", wall) and of each host piece in it, each timed
    around its call: two generates that differ only in output length, so the prefill and the first
    token cancel out. A first run leaves out one-time costs (a kernel compiled for a new shape)."""
    totals: dict[str, float] = {}
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in pieces]

    def timed(function: Any, label: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                totals[label] = totals.get(label, 0.0) + time.perf_counter() - start
        return call

    time_generate(llm, prompts, 2)
    runs = []
    try:
        for owner, name, label in pieces:
            setattr(owner, name, timed(getattr(owner, name), label))
        for length in (2, output_len):
            totals.clear()
            totals["step"], _ = time_generate(llm, prompts, length)
            runs.append(dict(totals))
    finally:
        for owner, name, function in originals:
            setattr(owner, name, function)
    short, long = runs
    return {label: (long.get(label, 0.0) - short.get(label, 0.0)) * 1000 / (output_len - 2)
            for label in ["step", *(label for _, _, label in pieces)]}


def profiled(llm: LLM, prompts: list[list[int]], output_len: int, rows: int) -> str:
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        seconds, tokens = time_generate(llm, prompts, output_len)
    events = prof.key_averages()
    parts = [f"{len(prompts)} prompts x {output_len} output tokens: {seconds * 1000:.1f} ms wall, "
             f"{tokens} tokens (under the profiler)"]
    if torch.cuda.is_available():
        device_us = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA)  # kernels only
        parts += [f"device time, all kernels: {device_us / 1000:.1f} ms ({device_us / 1e4 / seconds:.1f}% of wall)",
                  events.table(sort_by="self_cuda_time_total", row_limit=rows, max_name_column_width=70)]
    parts.append(events.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=70))
    return "\n".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="the embedded model's shape on the CPU")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "out")
    args = parser.parse_args()
    setup = make_setup(args.smoke)
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict = {"setup": setup.title}
    with tempfile.TemporaryDirectory() as tmp:
        make_model_dir(setup.config, Path(tmp))
        start = time.perf_counter()
        llm = LLM(tmp, **setup.engine)
        result["load_s"] = time.perf_counter() - start
        time_generate(llm, prompts_for(setup, 8, seed=1), 8)  # warm-up
        full = setup.engine["max_num_seqs"]
        if llm.core.runner.graphs is not None:
            result["graph_ms"] = {size: graph_ms(llm, size) for size in llm.core.runner.graphs.sizes}
            print("decode graph, device ms a replay:", json.dumps(result["graph_ms"]), flush=True)
        batch1 = decode_step_ms(llm, prompts_for(setup, 1, seed=2), 66)
        pieces = decode_step_ms(llm, prompts_for(setup, full, seed=3), 34, HOST_PIECES)
        result["decode_step_ms"] = {1: batch1["step"], full: pieces.pop("step")}
        print("decode step, wall ms in LLM.generate:", json.dumps(result["decode_step_ms"]), flush=True)
        result["host_ms_per_decode_step"] = pieces
        print(f"host pieces of a decode step at {full}, ms:", json.dumps(pieces), flush=True)
        text = [f"{setup.title}\n{json.dumps(result)}",
                "--- batch 1, decode", profiled(llm, prompts_for(setup, 1, seed=4), 32, rows=25),
                f"--- batch {full}, prefill and decode", profiled(llm, prompts_for(setup, full, seed=5), 16, rows=30)]
    (args.out / "profile.txt").write_text("\n\n".join(text))
    (args.out / "profile.json").write_text(json.dumps(result, indent=1))
    print("\n\n".join(text))


if __name__ == "__main__":
    main()
