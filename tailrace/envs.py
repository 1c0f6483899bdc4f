"""Every environment variable tailrace reads, read here and nowhere else.

Each is read when asked for (not at import), so a test or a child process that sets one sees it.
The C++ kernels read none: `model/cpu/kernels.py` passes theirs in as arguments. The table in
docs/architecture.md ("Environment variables") is `table()`'s output, and a test keeps the two
equal.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Variable:
    name: str
    default: str
    choices: tuple[str, ...]  # empty: any text
    meaning: str


VARIABLES = {v.name: v for v in (
    Variable("TAILRACE_CPU_KERNELS", "1", ("1", "0", "avx2"),
             "tailrace's C++ CPU kernels: 1 the build for this CPU (AVX-512 or AVX2), avx2 the AVX2 build on an "
             "AVX-512 CPU too, 0 none (PyTorch's kernels serve, several times slower)"),
    Variable("TAILRACE_CPU_AMX", "1", ("1", "0"),
             "0: bfloat16 projections on the AVX512-BF16 loop where the CPU also has AMX tiles"),
    Variable("TAILRACE_CPU_BF16_DOT", "1", ("1", "0"),
             "0: bfloat16 products as two float32 FMAs a pair where the CPU has AVX512-BF16, as CPUs "
             "without it compute them (same bits; for tests)"),
    Variable("TAILRACE_TRITON_OPS", "1", ("1", "0"),
             "0: on CUDA, PyTorch's RMSNorm, rotary and SiLU-and-multiply instead of the Triton kernels"),
    Variable("TAILRACE_API_KEY", "", (), "the bearer key `tailrace serve` requires when --api-key is not given"),
    Variable("OPENAI_API_KEY", "", (), "the bearer key `tailrace check` and `tailrace bench` send by default"),
)}


def get(name: str) -> str:
    """The variable's value, or its default when unset; ValueError for a value it does not take."""
    variable = VARIABLES[name]
    value = os.environ.get(name, variable.default)
    if variable.choices and value not in variable.choices:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(variable.choices)}")
    return value


def enabled(name: str) -> bool:
    """A 1/0 switch: anything but 0 is on."""
    return get(name) != "0"


def optional(name: str) -> str | None:
    """The value, None when unset or empty (a default for a flag)."""
    return get(name) or None


def environment(**extra: str) -> dict[str, str]:
    """This process's environment with `extra` on top, for a child process."""
    return {**os.environ, **extra}


@contextlib.contextmanager
def path_prepended(directory: str) -> Iterator[None]:
    """PATH with `directory` first while the block runs (a tool a venv ships, whose bin/ need not
    be on PATH)."""
    path = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([directory, path])
    try:
        yield
    finally:
        os.environ["PATH"] = path


def table() -> str:
    """The variables as a Markdown table."""
    rows = ["| variable | default | values | what it does |", "| --- | --- | --- | --- |"]
    for v in VARIABLES.values():
        values = ", ".join(v.choices) if v.choices else "text"
        rows.append(f"| `{v.name}` | {v.default or '(unset)'} | {values} | {v.meaning} |")
    return "\n".join(rows)
