"""Every CPU kernel op x dtype x ISA build (model/cpu/kernel_ops.py's table), as llama.cpp's
test-backend-ops checks its backends: each build against the op's Python reference, within the
tolerance the op's own tests allow (test_cpu_ops, test_bf16_linear, test_int_linear,
test_paged_attention, test_greedy, test_token_mask), and the avx512 and avx2 builds against each
other bit for bit, as csrc/avx2.h says they agree (AMX tiles, where the avx512 build takes them for
bfloat16 projections, within their documented tolerance). Both builds load into this one process
(cpu_kernels.load_build), whichever the process itself runs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tailrace.model.cpu import kernel_ops
from tailrace.model.cpu.kernel_ops import EXACT, Tolerance
from tailrace.model.cpu.kernels import load_build

BUILDS = ("avx512", "avx2")
CASES = [pytest.param(op, dtype, id=f"{op.name}-{dtype.replace('/', '-')}") for op, dtype in kernel_ops.cases()]


def module(isa: str):
    m = load_build(isa)
    if m is None:
        pytest.skip(f"this CPU cannot run the {isa} build (or it did not build)")
    return m


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("op, dtype", CASES)
def test_each_build_matches_the_reference(op, dtype, isa):
    kernels = module(isa)
    if not op.runs_on(isa):
        pytest.skip(f"{op.name} does not run on this CPU's {isa} build")
    inputs = kernel_ops.make_inputs(op, dtype, seed=1)
    problem = kernel_ops.mismatch(op.run(kernels, inputs), op.reference(inputs), op.tolerance[dtype])
    assert problem is None, problem
    again = op.run(kernels, inputs)  # and the same bits on a second call
    assert kernel_ops.same_bits(again, op.run(kernels, inputs)) is None


@pytest.mark.parametrize("op, dtype", CASES)
def test_the_builds_agree(op, dtype):
    builds = [module(isa) for isa in BUILDS]
    if not all(op.runs_on(isa) for isa in BUILDS):
        pytest.skip(f"{op.name} does not run on every build here")
    inputs = kernel_ops.make_inputs(op, dtype, seed=2)
    first, second = (op.run(m, inputs) for m in builds)
    tolerance = kernel_ops.build_tolerance(op, dtype, builds)
    problem = kernel_ops.same_bits(first, second) if tolerance.exact else kernel_ops.mismatch(first, second, tolerance)
    assert problem is None, problem


def test_without_amx_tiles_the_builds_bfloat16_projections_are_the_same_bits():
    """Where AMX tiles serve the avx512 build, test_the_builds_agree allows their tolerance; with
    TAILRACE_CPU_AMX=0 (a child process: the switch is set as a build loads) its loop runs, which
    must give the avx2 build's bits, at a size where the tiles' bits differ (32 rows)."""
    builds = [module(isa) for isa in BUILDS]
    if not any(m.amx_active() for m in builds):
        pytest.skip("no AMX tiles here: test_the_builds_agree already asks for the same bits")
    child = ("from tailrace.model.cpu import kernel_ops as k; from tailrace.model.cpu.kernels import load_build; "
             "op = k.BY_NAME['linear']; i = k.make_inputs(op, 'bfloat16', seed=3, rows=32, **op.bench_shape); "
             "a, b = (op.run(load_build(isa), i) for isa in ('avx512', 'avx2')); "
             "assert not load_build('avx512').amx_active(); problem = k.same_bits(a, b); "
             "assert problem is None, problem")
    subprocess.run([sys.executable, "-c", child], env={**os.environ, "TAILRACE_CPU_AMX": "0"}, check=True,
                   timeout=300)


def test_every_op_has_a_tolerance_for_each_dtype_and_shapes_its_make_takes():
    assert len({op.name for op in kernel_ops.OPS}) == len(kernel_ops.OPS)
    for op in kernel_ops.OPS:
        assert set(op.tolerance) == set(op.dtypes) and set(op.amx_tolerance) <= set(op.dtypes)
        inputs = kernel_ops.make_inputs(op, op.dtypes[0], rows=2, **op.bench_shape)
        assert inputs and kernel_ops.make_inputs(op, op.dtypes[0])


def test_the_comparisons_catch_what_they_must():
    x = torch.tensor([1.0, 0.0, float("nan")])
    assert kernel_ops.mismatch(x, x.clone(), EXACT) is None
    assert kernel_ops.mismatch(x.nextafter(torch.tensor(2.0)), x, EXACT) is not None  # one ulp
    assert kernel_ops.mismatch(x.bfloat16(), x, EXACT) is not None  # a dtype
    assert kernel_ops.mismatch(x * (1 + 1e-6), x, Tolerance(1e-5, 1e-5)) is None
    assert kernel_ops.mismatch(x * 1.01, x, Tolerance(1e-5, 1e-5)) is not None
    largest = Tolerance(1e-2, of_largest=True)  # int_linear's: against the largest output
    assert kernel_ops.mismatch(torch.tensor([100.0, 0.5]), torch.tensor([100.0, 0.0]), largest) is None
    assert kernel_ops.mismatch(torch.tensor([100.0, 1.5]), torch.tensor([100.0, 0.0]), largest) is not None
    assert kernel_ops.mismatch(torch.tensor([1, 2]), torch.tensor([1, 3]), Tolerance(1.0, 1.0)) is not None  # ids exact
    assert kernel_ops.same_bits(x, x.clone()) is None
    assert kernel_ops.same_bits(torch.tensor([0.0]), torch.tensor([-0.0])) is not None
