"""Every CPU kernel op x dtype x ISA build timed, as llama.cpp's `test-backend-ops perf` times its
ops: model/cpu/kernel_ops.py's table at a model's widths (SmolLM2-135M's), `--rows` rows at a time
(1: a decode step's row; paged_attention: sequences of one new row after ~512 cached positions):

    .venv/bin/python bench/backend_ops.py --rows 1 32 --repeats 50 --threads 2 --out bench/out/backend_ops.json
    .venv/bin/python bench/backend_ops.py --ops linear int_linear --builds avx2 --repeats 5   # a subset

Both builds (cpu_kernels.load_build) run in this one process, on the same inputs, their calls
alternating run by run so that the machine's noise falls on both; a build this CPU cannot run is
left out. Prints each call's median time in microseconds (after one warm-up call), the avx2
build's time over the avx512 build's, and whether the two builds gave the same bits (`same`;
`amx` where they differ within the AMX tiles' tolerance, `DIFFER` otherwise); --check also
compares each build's output with the op's reference at these sizes. Writes JSON with --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import datetime, timezone

import torch

from tailrace.model.cpu import kernel_ops
from tailrace.model.cpu.kernels import load_build

BUILDS = ("avx512", "avx2")


def time_op(op: kernel_ops.KernelOp, modules: dict, inputs: kernel_ops.Inputs,
            repeats: int) -> tuple[dict[str, float], dict[str, object]]:
    """Each build's median seconds a call over `repeats` calls, the builds alternating, and each
    build's last output."""
    times: dict[str, list[float]] = {isa: [] for isa in modules}
    outputs: dict[str, object] = {}
    for isa, module in modules.items():  # warm-up: first touches of the inputs, the thread pool's start
        outputs[isa] = op.run(module, inputs)
    for _ in range(repeats):
        for isa, module in modules.items():
            start = time.perf_counter()
            outputs[isa] = op.run(module, inputs)
            times[isa].append(time.perf_counter() - start)
    return {isa: statistics.median(t) for isa, t in times.items()}, outputs


def agreement(op: kernel_ops.KernelOp, dtype: str, modules: dict, outputs: dict) -> str:
    if len(outputs) < 2:
        return "-"
    first, second = outputs.values()
    if kernel_ops.same_bits(first, second) is None:
        return "same"
    tolerance = kernel_ops.build_tolerance(op, dtype, list(modules.values()))
    if not tolerance.exact and kernel_ops.mismatch(first, second, tolerance) is None:
        return "amx"
    return "DIFFER"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", nargs="+", choices=sorted(kernel_ops.BY_NAME), default=None, help="default: all")
    parser.add_argument("--builds", nargs="+", choices=BUILDS, default=list(BUILDS))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per op, dtype, rows and build")
    parser.add_argument("--threads", type=int, default=None, help="torch's threads (default: as torch has them)")
    parser.add_argument("--check", action="store_true", help="also check each output against the reference")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    modules = {isa: m for isa in args.builds if (m := load_build(isa)) is not None}
    if not modules:
        raise SystemExit("no kernel build runs here (this CPU has neither AVX-512 nor AVX2, or they did not build)")
    ops = [kernel_ops.BY_NAME[name] for name in args.ops] if args.ops else list(kernel_ops.OPS)
    names = list(modules)
    print(f"builds {', '.join(names)}; {torch.get_num_threads()} threads; load {os.getloadavg()[0]:.2f}; "
          f"median of {args.repeats} calls, microseconds")
    header = f"{'op':<22} {'dtype':<14} {'rows':>5}" + "".join(f" {isa:>10}" for isa in names)
    header += f" {'avx2/512':>9} {'bits':>6}" + (" check" if args.check else "")
    print(header)
    results = []
    with torch.inference_mode():
        for op in ops:
            for dtype in op.dtypes:
                runnable = {isa: m for isa, m in modules.items() if op.runs_on(isa)}
                for rows in args.rows:
                    inputs = kernel_ops.make_inputs(op, dtype, seed=0, rows=rows, **op.bench_shape)
                    medians, outputs = time_op(op, runnable, inputs, args.repeats)
                    bits = agreement(op, dtype, runnable, outputs)
                    row = {"op": op.name, "dtype": dtype, "rows": rows, "shape": op.bench_shape,
                           **{f"{isa}_s": s for isa, s in medians.items()}, "bits": bits}
                    line = f"{op.name:<22} {dtype:<14} {rows:>5}"
                    line += "".join(f" {medians[isa] * 1e6:>10.1f}" if isa in medians else f" {'-':>10}"
                                    for isa in names)
                    ratio = medians["avx2"] / medians["avx512"] if {"avx2", "avx512"} <= medians.keys() else None
                    line += f" {ratio:>9.2f}" if ratio is not None else f" {'-':>9}"
                    line += f" {bits:>6}"
                    if args.check:
                        expected = op.reference(inputs)
                        problems = {isa: kernel_ops.mismatch(out, expected, op.tolerance[dtype])
                                    for isa, out in outputs.items()}
                        row["check"] = problems
                        line += " ok" if not any(problems.values()) else " FAIL"
                    results.append(row)
                    print(line, flush=True)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"date": datetime.now(timezone.utc).isoformat(), "args": vars(args), "builds": names,
                       "threads": torch.get_num_threads(), "load": os.getloadavg(), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
