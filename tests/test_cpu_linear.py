"""Projections through oneDNN with weights packed at load."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tailrace.model.cpu.linear import PackedLinear, pack_linears, packable
from tailrace.model.decoder.llama import Linear
from tailrace.model.loading.loader import load_model

from conftest import EMBEDDED
from test_quant import _prefill_logits

pytestmark = pytest.mark.skipif(not packable(torch.float32, torch.device("cpu")), reason="no oneDNN in this torch")


@pytest.mark.parametrize("rows", [1, 8, 33])
def test_packed_linear_equals_f_linear(rows):
    torch.manual_seed(0)
    weight, bias, x = torch.randn(200, 96), torch.randn(200), torch.randn(rows, 96)
    assert torch.allclose(PackedLinear(weight, bias)(x), F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)


def test_packing_is_for_the_cpu_only():
    assert not packable(torch.float32, torch.device("meta"))


def test_packed_model_keeps_the_float32_logits():
    reference, config = load_model(str(EMBEDDED), dtype="float32")
    packed, _ = load_model(str(EMBEDDED), dtype="float32")
    pack_linears(packed)
    assert not any(isinstance(m, Linear) for m in packed.modules())
    tokens = list(range(300, 364))
    expected, got = _prefill_logits(reference, config, tokens), _prefill_logits(packed, config, tokens)
    assert torch.allclose(got, expected, rtol=1e-4, atol=1e-3)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
