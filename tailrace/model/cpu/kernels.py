"""tailrace's own CPU kernels (csrc/), compiled once per environment and loaded on first use.

- `linear`: bfloat16 projections over weights packed at load (AVX512-BF16, AMX tiles where
  the CPU has them: bf16_amx.cpp, float32 FMAs where it has neither), and float32 ones on the same
  tiles, see bf16_linear.py.
- `paged_attention`: causal attention read from the paged KV cache, bfloat16 or float32.
- `int_linear`: int8 and 4- to 6-bit projections over integer codes and float16 scales (VNNI's dot
  products, or AVX2's), see int_linear.py; `int_rows`, lookups in their codes; `pack_gguf`, GGUF's
  blocks straight into their layout, see loading/gguf_quant.py.
- `rms_norm`, `rotary`, `silu_mul`, `gelu_tanh_mul`, `swiglu_oai_mul`: a decoder layer's
  elementwise steps, one call each, see cpu_ops.py.
- `mask_tokens`: a grammar's allowed-token bitmasks applied to logit rows, see engine/structured_output/grammar.py.
- `greedy_tokens`: each logit row's greedy pick, as torch.max(dim=1).indices gives it, see
  engine/sampler.py.
- `route_experts`: a mixture of experts' choice of experts and their weights for each row, see
  llama.MoE.
- `causal_conv`, `delta_rule`: a Gated DeltaNet layer's convolution and recurrence over each
  sequence of a step, continuing its slot's state, see attention/gated_delta.py.
- `DecoderForward`, `DecoderForwardFloat32`: a bfloat16 forward (bfloat16 or integer projections)
  or a float32 one, token ids to the final norm, in one call to the kernels above, see
  cpu_ops.FusedForward.

Each gives every row the same bits whatever the batch, chunking or thread count, which the
engine's exactness rests on. torch.utils.cpp_extension builds them with ninja and the system's
C++ compiler (about a minute on a Zen 4, seven on a 2-core Zen 1; kept in the environment's
tailrace-cpu-kernels/) for one of two targets (`target`): AVX-512, or x86-64-v3 (AVX2, FMA, F16C:
every AMD before Zen 4, Intel's client chips since Alder Lake), where csrc/avx2.h gives the same
sources the same bits on two AVX2 halves of each vector. Where neither builds, or the CPU has
neither, `kernels()` is None and the model keeps the oneDNN/SDPA paths.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from tailrace import envs

logger = logging.getLogger(__name__)

_SOURCES = [Path(__file__).with_name("csrc") / name
            for name in ("module.cpp", "bf16_linear.cpp", "paged_attention.cpp", "elementwise.cpp", "int_linear.cpp",
                         "decoder.cpp", "bf16_amx.cpp", "token_mask.cpp", "greedy.cpp", "experts.cpp",
                         "gguf_blocks.cpp", "gated_delta.cpp")]
# -ffp-contract=off: a float a + b * c stays two roundings, as the reference's eager ops round it
# (GCC would fuse it into one FMA; the kernels' own FMAs are explicit).
_COMMON_FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off"]
# One build per instruction set: AVX-512 (with BF16, VNNI and AMX instructions, each used only where
# the CPU has it) or x86-64-v3 (AVX2, FMA, F16C), where csrc/avx2.h gives the same kernels.
_TARGETS = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni", "-mamx-tile", "-mamx-bf16"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
}


def target() -> str | None:
    """The build this CPU runs, as torch detects its instruction sets: "avx512" (F, BW, VL and DQ),
    "avx2", or None (no kernels). TAILRACE_CPU_KERNELS=0 turns them off, =avx2 takes the AVX2 build
    on an AVX-512 CPU too."""
    asked = envs.get("TAILRACE_CPU_KERNELS")
    if asked == "0":
        return None
    if asked != "avx2" and torch.cpu._is_avx512_supported():
        return "avx512"
    return "avx2" if torch.cpu._is_avx2_supported() else None


def _build_directory(name: str) -> str | None:
    """One build per environment (.venv and .venv-ray each have theirs) and target: in a shared
    directory each would find the other's build flags (its torch's include paths) and rebuild.
    None: torch's default directory, where the environment is not writable."""
    directory = Path(sys.prefix) / "tailrace-cpu-kernels" / name
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return str(directory)


@contextlib.contextmanager
def _building(directory: str | None) -> Iterator[None]:
    """Held while torch builds or loads the kernels in `directory`. torch's own lock there is a file
    (`lock`) that only the process that made it deletes: one killed while building (a first start
    stopped with Ctrl+C) left it, and every later start then waited for it, silently and for ever.
    This lock is an flock, which the OS drops with its holder, so whoever holds it knows no build
    is running and clears a `lock` file left behind."""
    if directory is None:  # torch's default directory: its lock as it is
        yield
        return
    with open(Path(directory) / "tailrace.lock", "w") as held:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process building tailrace's CPU kernels in %s", directory)
            fcntl.flock(held, fcntl.LOCK_EX)
        left = Path(directory) / "lock"
        if left.exists():
            logger.warning("removing %s, left by a kernel build that was stopped", left)
            left.unlink(missing_ok=True)
        yield


@dataclass(frozen=True, slots=True)
class Build:
    """The kernels as this process has them: the module, or why there is none."""

    module: ModuleType | None
    isa: str | None
    missing: str | None  # why module is None


@functools.cache
def _loaded(isa: str) -> Build:
    """Build (once per environment) and load the `isa` build, whatever `target()` chose: the one
    place that compiles, loads and configures a build, for `build()` and `load_build()` alike."""
    from torch.utils import cpp_extension

    name = "tailrace_cpu_kernels" if isa == "avx512" else f"tailrace_cpu_kernels_{isa}"
    try:
        import ninja  # the pip package's binary: a venv's bin/ need not be on PATH

        directory = _build_directory(name)
        with envs.path_prepended(ninja.BIN_DIR), _building(directory):
            module = cpp_extension.load(name=name, sources=[str(s) for s in _SOURCES],
                                        extra_cflags=_COMMON_FLAGS + _TARGETS[isa], extra_ldflags=["-fopenmp"],
                                        verbose=False, build_directory=directory)
    except Exception as error:  # no compiler or ninja: the PyTorch paths serve instead
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return Build(None, isa, f"the {isa} build failed: {first_line}")
    # The kernels read no environment of their own: their process-wide switches come from here.
    module.configure(amx=envs.enabled("TAILRACE_CPU_AMX"), bf16_dot=envs.enabled("TAILRACE_CPU_BF16_DOT"))
    return Build(module, isa, None)


def load_build(isa: str) -> ModuleType | None:
    """The `isa` build ("avx512" or "avx2") loaded into this process whatever `target()` and
    TAILRACE_CPU_KERNELS chose, built first if need be; None where this CPU cannot run it or it
    does not build. Both builds load side by side (each its own module), which is how
    tests/test_backend_ops.py and bench/backend_ops.py compare them on one machine; where `isa` is
    the process's target, this is `kernels()`'s module."""
    if isa not in _TARGETS:
        raise ValueError(f"no kernel build {isa!r}: one of {', '.join(_TARGETS)}")
    runs = torch.cpu._is_avx512_supported() if isa == "avx512" else torch.cpu._is_avx2_supported()
    if not runs:
        return None
    loaded = _loaded(isa)
    if loaded.module is None:
        logger.warning("%s", loaded.missing)
    return loaded.module


@functools.cache
def build() -> Build:
    """Build (once per environment) and load the kernels for this CPU."""
    asked, isa = envs.get("TAILRACE_CPU_KERNELS"), target()
    if isa is None:
        why = "TAILRACE_CPU_KERNELS=0" if asked == "0" else "this CPU has neither AVX-512 nor AVX2"
        return Build(None, None, why)
    return _loaded(isa)


def kernels() -> ModuleType | None:
    """The compiled module, or None where it cannot run here (`build().missing` says why)."""
    return build().module
