"""The engine's settings: one dataclass, filled from CLI flags or `LLM(**engine_args)`."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from pathlib import Path

EMBEDDED_MODEL = str(Path(__file__).resolve().parent.parent / "models" / "tiny")


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None  # None: the embedded tiny model
    dtype: str = "auto"
    load_format: str = "auto"  # "dummy": random weights from config.json alone
    device: str = "cpu"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    kv_cache_memory_gb: float = 0.5
    num_kv_blocks: int | None = None  # overrides kv_cache_memory_gb; mostly for tests
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    threads: int | None = None  # torch threads in the core; None: all cores but one
    enable_prefix_caching: bool = True
    seed: int = 0
    in_process: bool = False  # run the core on a thread of this process (tests, debugging)

    @property
    def model_path(self) -> str:
        return self.model or EMBEDDED_MODEL

    def validate(self) -> None:
        if not os.path.isdir(self.model_path):
            raise ValueError(f"model directory not found: {self.model_path}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.kv_cache_memory_gb <= 0 and self.num_kv_blocks is None:
            raise ValueError("kv_cache_memory_gb must be positive")

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kwargs: object) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine arguments: {', '.join(unknown)}")
        return cls(model=model, **kwargs)  # type: ignore[arg-type]
