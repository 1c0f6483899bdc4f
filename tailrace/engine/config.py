"""The engine's settings: one dataclass, filled from CLI flags or `LLM(**engine_args)`."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path

from tailrace.engine.speculation.config import SpeculativeConfig, parse_speculative_config
from tailrace.model.loading.hub import resolve_model

EMBEDDED_MODEL = str(Path(__file__).resolve().parent.parent / "models" / "tiny")
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "slab", "paged")


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None  # a directory, a .gguf file or a hub id (model/loading/hub.py); None: the embedded tiny model
    revision: str | None = None  # of a hub id: a branch, tag or commit (default: main)
    dtype: str = "auto"
    # "int8" / "int4": weight-only, quantized at load (model/quant.py); "none": float weights; None:
    # the checkpoint's own (loader.resolve_quantization: a quantized GGUF stays quantized on CPU)
    quantization: str | None = None
    load_format: str = "auto"  # "dummy": random weights from config.json alone
    device: str = "auto"  # cuda when a GPU is visible, else cpu
    attention: str = "auto"  # the KV layout: "slab" on CPU, "paged" (block tables) on CUDA
    enforce_eager: bool = False  # no CUDA graphs for decode steps
    # Refuse to start where a CPU model would run any part on PyTorch's slower paths (model/backends.py).
    strict_backends: bool = False
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    kv_cache_memory_gb: float = 0.5
    num_kv_blocks: int | None = None  # overrides kv_cache_memory_gb; mostly for tests
    # On CUDA: size the KV cache to fill this fraction of the GPU's memory, as vLLM does (overrides
    # kv_cache_memory_gb there; ignored on CPU). None: kv_cache_memory_gb.
    gpu_memory_utilization: float | None = None
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    threads: int | None = None  # torch threads in the core; None: chosen per step by measurement (threads.py)
    enable_prefix_caching: bool = True
    tensor_parallel_size: int = 1  # ranks the model is split over (engine/tensor_parallel/group.py), one process each
    seed: int = 0
    in_process: bool = False  # run the core on a thread of this process (tests, debugging)
    # The server embeds or scores and never generates: a causal model then keeps no K/V either,
    # each prompt running whole (ModelRunner.keeps_kv)
    pooling_only: bool = False
    # Guess tokens and verify them in one step (engine/speculation/); given as vLLM's JSON object
    # or dict, kept parsed. None: decode one token a step.
    speculative_config: SpeculativeConfig | dict | str | None = None
    # The local directory or GGUF file of `model`, resolved once; it travels with the config to the
    # core process, so a hub id is looked up (or downloaded) only in the process that started.
    _local_path: str | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.speculative_config = parse_speculative_config(self.speculative_config)

    @property
    def model_path(self) -> str:
        """The model's local directory or .gguf file; ValueError when it cannot be found."""
        if self._local_path is None:
            self._local_path = resolve_model(self.model or EMBEDDED_MODEL, self.revision)
        return self._local_path

    def validate(self) -> None:
        _ = self.model_path  # resolving finds the model, or raises naming it
        if self.speculative_config is not None and self.speculative_config.model is not None:
            resolve_model(self.speculative_config.model, None)  # the draft model too
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.kv_cache_memory_gb <= 0 and self.num_kv_blocks is None:
            raise ValueError("kv_cache_memory_gb must be positive")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.device.partition(":")[0] not in DEVICES:
            raise ValueError(f"unsupported device {self.device!r}; supported: {', '.join(DEVICES)} (or cuda:N)")
        if self.attention not in ATTENTION_BACKENDS:
            raise ValueError(f"unsupported attention {self.attention!r}; supported: {', '.join(ATTENTION_BACKENDS)}")

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kwargs: object) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine arguments: {', '.join(unknown)}")
        return cls(model=model, **kwargs)  # type: ignore[arg-type]


def resolve_device(device: str, cuda_available: bool) -> str:
    """"auto" is cuda when a GPU is visible, else cpu; asking for cuda without one is an error."""
    if device == "auto":
        return "cuda" if cuda_available else "cpu"
    if device.startswith("cuda") and not cuda_available:
        raise ValueError(f"device {device!r} was asked for, but no CUDA GPU is visible")
    return device
