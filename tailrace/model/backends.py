"""Which code runs a loaded model, decided here once per load and said in one start-up record.

`prepare` is the one entry: `select` decides, from the device, the CPU, the model's dtype and
shape and how its weights loaded: the kernel build (ISA), whether projections are packed for
tailrace's kernels (or oneDNN), the elementwise kernels (tailrace's on CPU, Triton's on CUDA),
the routers, huge pages, and the KV layout and attention kernel (`choose_attention`).
`cpu_ops.apply` carries that out and decides nothing; `settle_fused` then says whether every part
the whole-forward loop calls ended up on its kernels, naming the first part that did not. The
runner allocates the KV cache as chosen. Each choice short of the best this machine could run
carries its reason in `not_taken`, which `record()` and `line()` put in the log, /metrics and
/v1/models.

With `strict` (`--strict-backends`), a CPU model that would run any part on PyTorch's slower
paths does not start: the error names each reason.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass, field, replace

import torch

from tailrace import envs
from tailrace.model.attention.kv_cache import plain_attention
from tailrace.model.attention.paged import native_takes
from tailrace.model.cpu import bf16_linear, int_linear, kernels as cpu_kernels, ops as cpu_ops
from tailrace.model.cpu.bf16_linear import Bf16Linear, Float32Linear, PackedEmbedding, kernel_linear
from tailrace.model.cpu.int_linear import IntEmbedding, IntLinear, IntLinearParts
from tailrace.model.cpu.linear import packable
from tailrace.model.cpu.ops import is_kernel_norm, runs_kernel
from tailrace.model.decoder.layer_plan import norms_of
from tailrace.model.decoder.llama import DecoderLayer, Embedding, LlamaForCausalLM, MoE

log = logging.getLogger("tailrace.backends")

KERNEL_DTYPES = (torch.float32, torch.bfloat16)
TRITON_OPS_DTYPES = (torch.bfloat16, torch.float16)  # a float32 CUDA model keeps PyTorch's reference ops
KERNEL_NAMES = {"tailrace": "tailrace", "triton": "Triton", "pytorch": "PyTorch"}
# The projections the whole-forward loop runs at each dtype.
FUSED_PROJECTIONS = {torch.bfloat16: (Bf16Linear, IntLinear, IntLinearParts), torch.float32: (Float32Linear,)}


class BackendError(RuntimeError):
    """--strict-backends refused a model that would run on PyTorch's slower paths."""


@dataclass(slots=True)
class Backends:
    device: str
    dtype: str
    isa: str  # the kernel build: "avx512", "avx2" or "none"
    pack_linears: bool  # float projections packed (tailrace's kernel, else oneDNN)
    pack_routers: bool
    huge_pages: bool
    elementwise: str  # norms, rotary, activations (and on CPU expert routing): "tailrace", "triton" or "pytorch"
    attention: Attention
    fused: bool = False  # the whole forward in one kernel call
    not_taken: dict[str, str] = field(default_factory=dict)  # choice -> why the better path is not taken

    def record(self, model: LlamaForCausalLM) -> dict[str, str]:
        """Every choice by name, as text, for the log, /metrics and /v1/models."""
        out = {"device": self.device, "dtype": self.dtype, "isa": self.isa,
               "projections": _projections(model), "embedding": type(model.model.embed_tokens).__name__,
               "elementwise": self.elementwise, "attention": str(self.attention),
               "fused_forward": "yes" if self.fused else "no"}
        out.update({f"{name} not taken": why for name, why in self.not_taken.items()})
        return out

    def inexact(self) -> str | None:
        """Why a row's results may differ in the last bits with the step that computes it (its
        chunk's length, its neighbours); None where they cannot, on tailrace's CPU kernels
        throughout, so a token verified in a chunk is the token a decode step would give."""
        if self.device != "cpu":
            return "GPU kernels round a row by the shape of its batch"
        if self.not_taken:
            return self._not_taken_reasons()
        return None

    def _not_taken_reasons(self) -> str:
        return "; ".join(f"{name}: {why}" for name, why in self.not_taken.items())

    def line(self, model: LlamaForCausalLM) -> str:
        return "backends: " + " | ".join(f"{k} = {v}" for k, v in self.record(model).items())

    def check_strict(self, strict: bool) -> None:
        """With strict on, refuse a CPU model with any choice not taken."""
        if strict and self.device == "cpu" and self.not_taken:
            raise BackendError(f"--strict-backends: this model would run on PyTorch's slower paths "
                               f"({self._not_taken_reasons()})")


def select(model: LlamaForCausalLM, device: torch.device, quantization: str | None,
           huge_pages: bool = True, attention: str = "auto", keeps_kv: bool = True) -> Backends:
    """What `cpu_ops.apply` and the runner carry out on this loaded model; `attention` as asked
    (--attention: auto, paged or slab), where the cache `keeps_kv`."""
    build = cpu_kernels.build() if device.type == "cpu" else None
    isa = build.isa if build is not None and build.module is not None else "none"
    not_taken: dict[str, str] = {}
    if build is not None and build.module is None:
        not_taken["cpu kernels"] = (f"{build.missing}; PyTorch's kernels serve, several times slower "
                                    "(install a C++ compiler and ninja, then restart)")
        log.warning("tailrace's CPU kernels are not in use: %s", not_taken["cpu kernels"])
    pack = quantization is None and packable(model.dtype, device)
    if device.type == "cpu" and quantization is None and not bf16_linear.available():
        not_taken["projections on tailrace's kernel"] = "no kernel build"
    if device.type == "cpu" and quantization is not None and not int_linear.available():
        not_taken["integer projections on tailrace's kernel"] = (
            "no kernel build" if build is None or build.module is None else "this CPU lacks AVX512-VNNI")
    elementwise, why = _elementwise(model, device, build)
    if why:
        not_taken["elementwise kernels"] = why
    chosen = choose_attention(attention, str(device), model.dtype, max(model.config.head_dims), is_plain(model))
    if not keeps_kv:  # the layout only counts blocks; PyTorch's SDPA attends within the step
        chosen = replace(chosen, kernel="pytorch", kept=False, not_taken=None)
    if chosen.not_taken is not None:
        not_taken[f"attention on {'Triton' if device.type == 'cuda' else 'tailrace'}'s kernel"] = chosen.not_taken
    return Backends(device=str(device), dtype=str(model.dtype).removeprefix("torch."), isa=isa, pack_linears=pack,
                    pack_routers=device.type == "cpu", huge_pages=device.type == "cpu" and huge_pages,
                    elementwise=elementwise, attention=chosen, not_taken=not_taken)


@dataclass(frozen=True, slots=True)
class Attention:
    layout: str  # of the KV cache: "paged" or "slab"
    kernel: str  # what attends: "tailrace", "triton" or "pytorch"
    plain: bool  # every layer attends every position at head_dim ** -0.5 (what CUDA graphs capture)
    not_taken: str | None = None  # why not the device's own kernel
    kept: bool = True  # False: no K/V is kept, each prompt attends whole within its step

    def __str__(self) -> str:
        if not self.kept:
            return f"within each prompt, no K/V kept ({KERNEL_NAMES[self.kernel]} SDPA)"
        return f"{self.layout} ({KERNEL_NAMES[self.kernel]})"


def is_plain(model: LlamaForCausalLM) -> bool:
    """Whether every layer's attention is plain (attention.plain_attention)."""
    return model.config.uniform_attention and all(
        plain_attention(layer.self_attn.how, model.config.head_dim) for layer in model.model.layers
        if layer.self_attn is not None)


def choose_attention(asked: str, device: str, dtype: torch.dtype, head_dim: int, plain: bool = True) -> Attention:
    """The KV layout and the attention kernel, for `asked` (--attention: auto, paged or slab).
    "auto" is paged attention: the Triton kernel over block tables on CUDA, tailrace's own kernel
    on CPUs with AVX512 or AVX2 (model/cpu/kernels.py). Elsewhere on CPU it is the slot slab, which
    measured faster there than PyTorch ops over the pages, for a `plain` model; the slab takes no
    other, so the pages serve the rest. Triton's kernel attends plainly; the PyTorch reference over
    the pages takes any attention."""
    on_cuda = device.startswith("cuda")
    built = not on_cuda and cpu_kernels.kernels() is not None
    if asked == "slab" and not plain:
        raise ValueError("--attention slab attends every position at head_dim ** -0.5, and this model's attention "
                         "uses sliding windows, another scale or a soft cap: use --attention paged (or auto)")
    layout = ("paged" if on_cuda or built or not plain else "slab") if asked == "auto" else asked
    if layout == "slab":
        return Attention(layout, "pytorch", plain,
                         "--attention slab was asked for" if asked == "slab" else "no kernel build")
    if on_cuda:
        if not plain:
            return Attention(layout, "pytorch", plain, "the model attends with windows, another scale or a soft cap")
        return (Attention(layout, "triton", plain) if _triton_installed()
                else Attention(layout, "pytorch", plain, "triton is not installed"))
    if not built:
        return Attention(layout, "pytorch", plain, "no kernel build")
    if not native_takes(dtype, head_dim):
        return Attention(layout, "pytorch", plain,
                         "the kernel takes float32 or bfloat16 with head_dim a multiple of 16 up to 256, or 512")
    return Attention(layout, "tailrace", plain)


def prepare(model: LlamaForCausalLM, device: torch.device, quantization: str | None,
            huge_pages: bool = True, *, attention: str = "auto", keeps_kv: bool = True) -> Backends:
    """Choose the backends for a loaded model and put them in place; what was chosen, and why not
    the rest. `huge_pages` off leaves the weights where packing put them (bench/decode_step.py's
    baseline). `keeps_kv` false: the cache keeps no K/V (ModelRunner.keeps_kv), each prompt
    attending whole within its step."""
    backends = select(model, device, quantization, huge_pages, attention, keeps_kv)
    cpu_ops.apply(model, pack=backends.pack_linears, routers=backends.pack_routers, huge_pages=backends.huge_pages,
                  elementwise=backends.elementwise == "tailrace")
    if backends.elementwise == "triton":
        from tailrace.model.gpu import triton_ops  # imports triton: only where it runs

        triton_ops.use_triton_ops(model)
    settle_fused(backends, model, keeps_kv)
    if backends.fused:
        model.model.fused_forward = cpu_ops.FusedForward(model)
    return backends


def _elementwise(model: LlamaForCausalLM, device: torch.device,
                 build: cpu_kernels.Build | None) -> tuple[str, str | None]:
    """Which kernels run the model's norms, rotary and activations. On the CPU, tailrace's, at a
    dtype they take, with head_dim a multiple of 32 (the rotary kernel's runs of 16 lanes never
    straddle the half-way roll). On CUDA, Triton's for a half-precision model where triton is
    installed, unless TAILRACE_TRITON_OPS=0 (as TAILRACE_CPU_KERNELS=0 for the CPU kernels: for a
    same-run comparison or a suspected kernel)."""
    if device.type == "cuda":
        if model.dtype not in TRITON_OPS_DTYPES:
            return "pytorch", None  # float32 on CUDA is the reference the GPU path is checked against
        if not envs.enabled("TAILRACE_TRITON_OPS"):
            return "pytorch", "TAILRACE_TRITON_OPS=0"
        return ("triton", None) if _triton_installed() else ("pytorch", "triton is not installed")
    if device.type != "cpu":
        return "pytorch", None
    if build is None or build.module is None:
        return "pytorch", "no kernel build"
    if model.dtype not in KERNEL_DTYPES:
        return "pytorch", f"dtype {model.dtype} (the kernels take float32 and bfloat16)"
    odd = [dim for dim in model.config.head_dims if dim % 32]
    if odd:
        return "pytorch", f"head_dim {odd[0]} is not a multiple of 32"
    return "tailrace", None


def _triton_installed() -> bool:
    """Without importing it: triton alone is 52 MB of a process's RSS."""
    return importlib.util.find_spec("triton") is not None


def settle_fused(backends: Backends, model: LlamaForCausalLM, keeps_kv: bool = True) -> None:
    """After the choices are applied: whether the whole forward runs as one kernel call (it reads
    and writes the K/V pages, so only where the cache keeps them)."""
    if backends.elementwise != "tailrace":
        return  # said already
    why = _not_fusable(model)
    if why is None and not keeps_kv:
        why = "each prompt runs whole keeping no K/V (a server that only pools): module by module"
    backends.fused = why is None
    if why is not None:
        backends.not_taken["fused forward"] = why


def _not_fusable(model: LlamaForCausalLM) -> str | None:
    """None when every part the whole-forward loop calls is on its kernels: a plain, packed or
    integer embedding, packed projections (or, at bfloat16, integer ones), packed routers, kernel
    norms at the config's eps, the rotary, activation and routing kernels; else the first part that is not."""
    eps, kinds = model.config.rms_norm_eps, FUSED_PROJECTIONS.get(model.dtype)
    if not model.config.causal:
        return "bidirectional attention (an encoder's, or EmbeddingGemma's) runs module by module"
    if model.config.gated_delta_layers:
        return "Gated DeltaNet layers run module by module"
    if not model.config.uniform_attention or model.config.per_layer_input_size or model.config.value_norm:
        return "Gemma 4's per-layer inputs, attention shapes and shared K/V run module by module"
    if kinds is None:
        return f"dtype {model.dtype}"
    embed = model.model.embed_tokens
    if type(embed) not in (Embedding, PackedEmbedding, IntEmbedding):
        return f"the embedding is {type(embed).__name__}"
    if not is_kernel_norm(model.model.norm, eps):
        return "the final norm is not the kernel's"
    router_kind = kernel_linear(model.dtype)
    for index, layer in enumerate(model.model.layers):
        why = _not_fusable_layer(layer, eps, kinds, router_kind)
        if why is not None:
            return f"layer {index}'s {why}"
    return None


def _not_fusable_layer(layer: DecoderLayer, eps: float, kinds: tuple[type, ...], router_kind: type | None) -> str | None:
    attn, mlp = layer.self_attn, layer.mlp
    projections = {"qkv_proj": attn.qkv_proj, "o_proj": attn.o_proj}
    if isinstance(mlp, MoE):
        if type(mlp.gate) is not router_kind:
            return f"router is {type(mlp.gate).__name__}"
        if not runs_kernel(mlp.choose):
            return "choice of experts is not the kernel's"
        for e, expert in enumerate(mlp.experts):
            projections |= {f"expert {e} gate_up_proj": expert.gate_up_proj, f"expert {e} down_proj": expert.down_proj}
    else:
        projections |= {"gate_up_proj": mlp.gate_up_proj, "down_proj": mlp.down_proj}
    for name, projection in projections.items():
        if type(projection) not in kinds:
            return f"{name} is {type(projection).__name__}"
    norms = {name: getattr(layer, name) for name in norms_of(layer.steps)} | {"q_norm": attn.q_norm,
                                                                             "k_norm": attn.k_norm}
    for name, norm in norms.items():
        if norm is not None and not is_kernel_norm(norm, eps):
            return f"{name} is not the kernel's at eps {eps}"
    if attn.rotate is not cpu_kernels.kernels().rotary:
        return "rotary is not the kernel's"
    if not runs_kernel(mlp.act_and_mul):
        return "activation is not the kernel's"
    return None


def _projections(model: LlamaForCausalLM) -> str:
    """The projection classes the model holds, with how many of each, and what computes them."""
    counts: dict[str, int] = {}
    for module in model.modules():
        name = type(module).__name__
        if name.endswith("Linear"):
            counts[name] = counts.get(name, 0) + 1
    described = ", ".join(f"{n} {name}" for name, n in sorted(counts.items()))
    ops = cpu_kernels.kernels()
    if ops is not None and model.dtype == torch.bfloat16 and counts.get("Bf16Linear"):
        described += " (AMX tiles)" if ops.amx_active() else (
            " (AVX512-BF16)" if ops.bf16_dot_active() else " (float32 FMA pairs)")
    return described

