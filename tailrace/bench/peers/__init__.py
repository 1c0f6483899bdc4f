"""The servers `tailrace bench compare` measures tailrace against, one module each.

Each module has the same small interface, and nothing else is shared between them:
- `NAME` and `PINS`: what it is called and the versions it installs (see `install`);
- `ensure_installed(directory)`: installs into `directory` on first use or when `PINS` change;
- `launch(directory, settings)`: the `PeerServer` (command, environment, request tweaks) that
  serves `settings.model_dir` on `settings.port`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tailrace import envs


@dataclass(slots=True)
class PeerSettings:
    """What every server of a comparison gets alike."""
    model_dir: str
    port: int
    threads: int  # compute threads
    kv_cache_gb: float  # KV cache memory
    max_num_seqs: int  # sequences in flight at once: the highest concurrency level
    max_model_len: int  # tokens of one sequence: prompt and answer, with room to spare
    dtype: str = "float32"  # weights and activations: float32 or bfloat16
    quant: str | None = None  # llama.cpp only: Q8_0 or Q4_0; None serves the weights at `dtype`
    llamacpp_args: list[str] = field(default_factory=list)  # llama.cpp only: more llama-server flags
    dummy_weights: bool = False  # vLLM only: model_dir holds no weights, it draws random ones


@dataclass(slots=True)
class PeerServer:
    command: list[str]
    env: dict[str, str]
    model: str  # the model name requests carry
    exact_length: bool = True  # whether it takes `ignore_eos` and `min_tokens`
    extra_body: dict[str, Any] = field(default_factory=dict)  # merged into every request


def offline_env(**extra: str) -> dict[str, str]:
    """Our environment, with the Hugging Face hub off (every model here is a local directory)."""
    return envs.environment(HF_HUB_OFFLINE="1", **extra)
