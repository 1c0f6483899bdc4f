"""The peer server, `transformers serve --continuous-batching`, in a virtual environment of its own.

Its own environment keeps the peer's dependencies out of ours, and pins the version whose CLI
this module speaks (transformers 5.23): the model directory is the positional `force_model`
argument, preloaded at start, and requests must name the model by that same string.

Two settings make the match fair on a small shared CPU machine. Left alone, the peer sizes its KV
cache from free memory (about 9 GB here) and torch runs one thread per core; it gets instead the
KV memory and the compute threads that tailrace has.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

# torch first, from the local CPU wheel: left to resolve it as a dependency, pip pulls a CUDA build.
PEER_REQUIREMENTS = (("torch==2.13.0",), ("transformers[serving]==5.23.0",))
DEFAULT_PEER_VENV = Path(__file__).resolve().parents[2] / "bench" / ".peer-venv"
PEER_NAME = "transformers"


def ensure_peer_venv(venv: Path) -> Path:
    """The peer's `transformers` executable, installing the environment on first use."""
    executable = venv / "bin" / "transformers"
    stamp = venv / ".tailrace-peer"
    wanted = json.dumps(PEER_REQUIREMENTS)
    if executable.exists() and stamp.exists() and stamp.read_text() == wanted:
        return executable
    print(f"installing the peer ({', '.join(r for step in PEER_REQUIREMENTS for r in step)}) into {venv}",
          flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    for step in PEER_REQUIREMENTS:
        subprocess.run([*pip, *step], check=True)
    stamp.write_text(wanted)  # last: an interrupted install is redone next time
    return executable


PEER_PAGE_SIZE = 256  # tokens a KV block holds for each layer (ContinuousBatchingConfig's default)


def peer_kv_blocks(model_dir: str, memory_gb: float) -> int:
    """How many of the peer's KV blocks fit in `memory_gb`, from the model's config.json."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    item_bytes = 4 if config.get("dtype", config.get("torch_dtype")) in (None, "float32") else 2
    bytes_per_token = config["num_hidden_layers"] * 2 * kv_heads * head_dim * item_bytes
    return max(1, int(memory_gb * 2**30) // (bytes_per_token * PEER_PAGE_SIZE))


def peer_command(executable: Path, model_dir: str, port: int, kv_blocks: int) -> list[str]:
    return [str(executable), "serve", model_dir, "--continuous-batching", "--device", "cpu",
            "--cb-num-blocks", str(kv_blocks), "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]


def peer_env(threads: int) -> dict[str, str]:
    """torch takes its thread count from OMP_NUM_THREADS; the model is local, so the hub stays off."""
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}


def peer_exact_length_body(temperature: float) -> dict[str, str]:
    """`transformers serve` answers 422 to fields it does not know (`ignore_eos`, `min_tokens`), but
    takes a whole `generation_config`; EOS id -1 switches stopping off, so every answer runs to
    max_tokens as tailrace's do with ignore_eos. A given config replaces the model's, so sampling
    has to be asked for again."""
    return {"generation_config": json.dumps({"eos_token_id": -1, "do_sample": temperature > 0})}
