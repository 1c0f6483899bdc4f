"""Projections on the CPU packed once at load: through tailrace's kernel where it runs (AVX512:
bf16_linear.py, bfloat16 and float32), else through oneDNN, each weight reordered once into its
blocked layout (`PackedLinear`).

F.linear sends float32 to MKL's sgemm. On an AVX2 AMD EPYC (Zen 3) a decode step of a
SmolLM2-135M-shaped model spent 84% of its time there, and oneDNN's JIT kernels over weights
packed at load measured faster at every batch size: 30 layers plus the 49k-vocabulary head,
cold weights, 1 thread, 38.6 vs 42.1 ms at 1 row, 66.8 vs 102.9 ms at 8 rows and 170 vs 198 ms
at 32 rows. On AVX512, tailrace's float32 tiles measured 0.49-0.98x oneDNN's time
(`bench/bf16_linear_ab.py --dtype float32` runs both), and its layout lets a tied model's lookups
read the packed head, which oneDNN's blocked one cannot. The packed weight replaces the plain one,
so the model holds one copy.
"""

from __future__ import annotations

import torch

from tailrace.model.cpu import bf16_linear
from tailrace.model.decoder.llama import Embedding, Linear, LlamaForCausalLM, Module, MoE, replace_projections

# The row count oneDNN picks its blocking for: decode batches of a loaded server, measured best
# over 1, 8 and 32 rows against a hint of 1.
_BATCH_HINT = 32


class PackedLinear(Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features = weight.shape[0]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _BATCH_HINT)
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [None], "")


def packable(dtype: torch.dtype, device: torch.device) -> bool:
    """tailrace's kernel takes either dtype wherever it runs (bfloat16 by two FMAs a pair where the
    CPU lacks AVX512-BF16); oneDNN runs float32 on any x86 CPU, bfloat16 only where it has the
    instructions for it."""
    if device.type != "cpu":
        return False
    return (_own_kernel(dtype) is not None
            or (torch.backends.mkldnn.is_available() and _onednn_takes(dtype)))


def _onednn_takes(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _own_kernel(dtype: torch.dtype) -> type[Module] | None:
    """tailrace's projection class for `dtype` where its kernels run here."""
    return bf16_linear.kernel_linear(dtype) if bf16_linear.available() else None


def pack_linears(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """Every projection (and the tied LM head) packed once, in place: through tailrace's kernel
    where it runs (faster than oneDNN over the benchmark shapes' projections at 1-128 rows, either
    dtype, bench/bf16_linear_ab.py), the
    rest as a oneDNN PackedLinear where oneDNN takes the dtype, else left plain. A tied model's
    lookups then read the kernel's packed head, so its table is not held twice."""
    own = _own_kernel(model.dtype)
    onednn = torch.backends.mkldnn.is_available() and _onednn_takes(model.dtype)
    tied = model.lm_head is None

    def make(weight: torch.Tensor, bias: torch.Tensor | None) -> Module:
        if own is not None and bf16_linear.kernel_takes(weight):
            return own(weight, bias)
        if onednn:
            return PackedLinear(weight, bias)
        plain = Linear(weight.shape[1], weight.shape[0], bias is not None, weight.dtype)
        plain.weight, plain.bias = weight, bias
        return plain

    replace_projections(model, make)
    if tied and own is not None and isinstance(model.lm_head, own) and isinstance(model.model.embed_tokens, Embedding):
        # The head's packed table serves the lookups too: one copy (SmolLM2-135M's: 57 MB in
        # bfloat16, 113 MB in float32; Llama 3.2 1B's: 525 MB / 1 GB) instead of two.
        model.model.embed_tokens = bf16_linear.PackedEmbedding(model.lm_head)
    return model


def pack_routers(model: LlamaForCausalLM) -> None:
    """Each mixture of experts' router through tailrace's kernel at the model's dtype, in place,
    whether or not the rest is packed or quantized: its logits then never depend on the batch
    (oneDNN's and MKL's blocking follows the row count), so neither does a token's choice of
    experts, and the whole-forward loop runs the same router (cpu_ops.FusedForward)."""
    own = _own_kernel(model.dtype)
    if own is None:
        return
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, MoE) and bf16_linear.kernel_takes(module.gate.weight):
                module.gate = own(module.gate.weight, module.gate.bias)
