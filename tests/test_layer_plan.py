"""A layer's steps per architecture (layer_plan.py), and the norms a layer gets from them."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from architectures import tiny
from tailrace.model.decoder.config import ModelConfig, parse_model_config
from tailrace.model.decoder.layer_plan import OUTSIDE_PLAN, Step, forward_plan, layer_steps, norms_of
from tailrace.model.decoder.llama import DecoderLayer, Module

BASE = {"vocab_size": 64, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "max_position_embeddings": 64}

LLAMA = (Step("read", "input_layernorm"), Step("attention"), Step("add"),
         Step("read", "post_attention_layernorm"), Step("feed_forward"), Step("add"))
GEMMA = (Step("read", "input_layernorm"), Step("attention"), Step("norm_output", "post_attention_layernorm"),
         Step("add"), Step("read", "pre_feedforward_layernorm"), Step("feed_forward"),
         Step("norm_output", "post_feedforward_layernorm"), Step("add"))
OLMO2 = (Step("read"), Step("attention"), Step("norm_output", "post_attention_layernorm"), Step("add"),
         Step("read"), Step("feed_forward"), Step("norm_output", "post_feedforward_layernorm"), Step("add"))
GRANITE = (Step("read", "input_layernorm"), Step("attention"), Step("scale", factor=0.25), Step("add"),
           Step("read", "post_attention_layernorm"), Step("feed_forward"), Step("scale", factor=0.25), Step("add"))

CASES = {
    "llama": ({}, LLAMA),
    "gemma3": ({"query_pre_attn_scalar": 32}, GEMMA),
    "olmo2": ({}, OLMO2),
    "granite": ({"residual_multiplier": 0.25}, GRANITE),
}


def config(name: str):
    return parse_model_config(tiny(name, **BASE, **CASES[name][0]))


@pytest.mark.parametrize("name", CASES)
def test_each_architecture_puts_its_norms_and_multiplier_in_its_steps(name):
    assert layer_steps(config(name)) == CASES[name][1]


@pytest.mark.parametrize("name, norms", [
    ("llama", ["input_layernorm", "post_attention_layernorm"]),
    ("gemma3", ["input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"]),
    ("olmo2", ["post_attention_layernorm", "post_feedforward_layernorm"]),
])
def test_a_layer_has_the_norms_its_steps_apply_under_the_checkpoints_names(name, norms):
    assert norms_of(layer_steps(config(name))) == norms
    layer = DecoderLayer(config(name), 0, torch.float32)
    assert sorted(name.removesuffix(".weight") for name, _ in layer.named_parameters() if "layernorm" in name) \
        == sorted(norms)


def test_the_per_module_layer_runs_the_steps_in_their_order():
    """Gemma's sandwich by hand: each block's output normed before it joins the residual."""
    layer = DecoderLayer(config("gemma3"), 0, torch.float32)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.linspace(-0.5, 0.7, param.numel()).reshape(param.shape))
    layer.self_attn, layer.mlp = Block(torch.randn(3, 64)), Block(torch.randn(3, 64))
    h = torch.randn(3, 64)
    got = layer(h, {}, None, None)
    mid = h + layer.post_attention_layernorm(layer.self_attn.out)
    assert torch.equal(layer.self_attn.seen, layer.input_layernorm(h))
    assert torch.equal(layer.mlp.seen, layer.pre_feedforward_layernorm(mid))
    assert torch.equal(got, mid + layer.post_feedforward_layernorm(layer.mlp.out))


class Block(Module):
    """A block that gives `out` and keeps the rows it was given."""

    def __init__(self, out: torch.Tensor) -> None:
        super().__init__()
        self.out, self.seen = out, None

    def forward(self, x: torch.Tensor, *_: object) -> torch.Tensor:
        self.seen = x
        return self.out


class Recording:
    """A ModelConfig that notes which fields are read."""

    def __init__(self, config) -> None:
        object.__setattr__(self, "_config", config)
        object.__setattr__(self, "read", set())

    def __getattr__(self, name: str):
        self.read.add(name)
        return getattr(self._config, name)


def test_every_model_config_field_is_in_the_forward_plan_or_says_how_it_reaches_the_forward():
    config = parse_model_config(tiny("llama", **BASE))
    recording = Recording(config)
    forward_plan(recording)
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    assert recording.read <= fields
    assert not recording.read & set(OUTSIDE_PLAN), "a field is both planned and listed as outside the plan"
    assert fields - recording.read - set(OUTSIDE_PLAN) == set(), "a new ModelConfig field never reaches the forward"
    assert set(OUTSIDE_PLAN) <= fields, "OUTSIDE_PLAN names a field ModelConfig no longer has"


def test_the_kernels_forward_spec_has_every_number_of_the_plan():
    from tailrace.model.cpu.kernels import kernels

    if kernels() is None:
        pytest.skip("tailrace's CPU kernels do not run here")
    plan = forward_plan(parse_model_config(tiny("llama", **BASE)))
    spec = kernels().ForwardSpec()
    for name, value in plan.numbers().items():
        setattr(spec, name, value)
        assert getattr(spec, name) == pytest.approx(value) if isinstance(value, float) else getattr(spec, name) == value
