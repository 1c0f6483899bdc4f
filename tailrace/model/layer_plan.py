"""A decoder layer described once: the ordered steps of its two blocks, made from config.py's
features, which `llama.DecoderLayer` runs module by module and csrc/decoder.cpp runs in one call.

The steps move rows between three registers: h (the residual stream), x (a block's input) and y
(a block's output). Where each architecture puts its norms and multipliers is only the order of
steps here, so an architecture that combines them differently (Gemma's sandwich norms, OLMo 2's
output norms, Granite's residual multiplier) is written in this file alone; each step's
arithmetic is written once per path (the PyTorch reference and the kernel), with the same
rounding points, so both give the same bits (tests/test_fused_forward.py runs random orders
through both).
"""

from __future__ import annotations

from dataclasses import dataclass

from tailrace.model.config import ModelConfig

# read: x = norm(h), or h itself without a norm; attention: y = the attention of x (q/k/v, q/k
# norms, rotary, the K/V stored, o_proj); feed_forward: y = the MLP or the mixture of experts of
# x; norm_output: y = norm(y); scale: y = y * factor; add: h = h + y. Each product and sum is
# rounded to the model's dtype once, as eager PyTorch rounds it.
OPS = ("read", "attention", "feed_forward", "norm_output", "scale", "add")

# A layer's norms by the checkpoint's names, which a step names: RMSNorms over the hidden width
NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


@dataclass(frozen=True, slots=True)
class Step:
    op: str  # one of OPS
    norm: str | None = None  # the layer's norm that read and norm_output apply (one of NORMS)
    factor: float = 1.0  # scale's


# Per norm style: each block's input norm and output norm ("pre": Llama's inputs only, the MLP's
# under the name post_attention_layernorm; "sandwich": Gemma's inputs and outputs; "post": OLMo
# 2's outputs only)
_BLOCK_NORMS = {
    "pre": (("input_layernorm", None), ("post_attention_layernorm", None)),
    "sandwich": (("input_layernorm", "post_attention_layernorm"),
                 ("pre_feedforward_layernorm", "post_feedforward_layernorm")),
    "post": ((None, "post_attention_layernorm"), (None, "post_feedforward_layernorm")),
}


def layer_steps(config: ModelConfig) -> tuple[Step, ...]:
    """A layer's steps: for the attention block and then the feed-forward block, its input read
    (normed or not), the block, its output's norm where the style norms outputs, its output times
    the residual multiplier where there is one (Granite), and its output added to h."""
    steps: list[Step] = []
    for block, (input_norm, output_norm) in zip(("attention", "feed_forward"), _BLOCK_NORMS[config.norm_style]):
        steps += [Step("read", input_norm), Step(block)]
        if output_norm is not None:
            steps.append(Step("norm_output", output_norm))
        if config.residual_multiplier != 1.0:
            steps.append(Step("scale", factor=config.residual_multiplier))
        steps.append(Step("add"))
    return tuple(steps)


def norms_of(steps: tuple[Step, ...]) -> list[str]:
    """The norms the steps apply, each once, in NORMS' order."""
    used = {step.norm for step in steps}
    return [name for name in NORMS if name in used]
