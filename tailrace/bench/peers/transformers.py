"""`transformers serve --continuous-batching`, in a virtual environment of its own.

Its own environment keeps the peer's dependencies out of ours, and pins the version whose CLI
this module speaks (transformers 5.23): the model directory is the positional `force_model`
argument, preloaded at start, and requests must name the model by that same string.

Two settings make the match fair on a small shared CPU machine. Left alone, the peer sizes its KV
cache from free memory (about 9 GB here) and torch runs one thread per core; it gets instead the
KV memory and the compute threads that tailrace has.
"""

from __future__ import annotations

import json
from pathlib import Path

from tailrace.bench.peers import PeerServer, PeerSettings, offline_env
from tailrace.bench.peers.install import is_installed, make_venv, mark_installed, start_install

NAME = "transformers"
# torch first, from the local CPU wheel: left to resolve it as a dependency, pip pulls a CUDA build.
PINS = (("torch==2.13.0",), ("transformers[serving]==5.23.0",))
PAGE_SIZE = 256  # tokens a KV block holds for each layer (ContinuousBatchingConfig's default)


def ensure_installed(directory: Path) -> None:
    if is_installed(directory, PINS):
        return
    start_install(directory)
    make_venv(NAME, directory / "venv", PINS)
    mark_installed(directory, PINS)


def kv_blocks(model_dir: str, memory_gb: float, dtype: str) -> int:
    """How many of the peer's KV blocks fit in `memory_gb`: the shape from the model's
    config.json, the bytes per value from the dtype it is served at (not the checkpoint's)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    item_bytes = 4 if dtype == "float32" else 2
    bytes_per_token = config["num_hidden_layers"] * 2 * kv_heads * head_dim * item_bytes
    return max(1, int(memory_gb * 2**30) // (bytes_per_token * PAGE_SIZE))


def launch(directory: Path, settings: PeerSettings) -> PeerServer:
    command = [str(directory / "venv" / "bin" / "transformers"), "serve", settings.model_dir,
               "--continuous-batching", "--device", "cpu", "--dtype", settings.dtype,
               "--cb-num-blocks", str(kv_blocks(settings.model_dir, settings.kv_cache_gb, settings.dtype)),
               "--host", "127.0.0.1", "--port", str(settings.port), "--log-level", "warning"]
    # torch takes its thread count from OMP_NUM_THREADS.
    return PeerServer(command, offline_env(OMP_NUM_THREADS=str(settings.threads)), model=settings.model_dir,
                      exact_length=False, extra_body=exact_length_body())


def exact_length_body() -> dict[str, str]:
    """`transformers serve` answers 422 to fields it does not know (`ignore_eos`, `min_tokens`), but
    takes a whole `generation_config`; EOS id -1 switches stopping off, so every answer runs to
    max_tokens as tailrace's do with ignore_eos. A given config replaces the model's, so greedy
    decoding (the benchmark's temperature 0) has to be asked for again."""
    return {"generation_config": json.dumps({"eos_token_id": -1, "do_sample": False})}
