"""The grammar-mask kernels (csrc/token_mask.cpp) against the PyTorch paths they replace: the same
logits after a mask, the same bits from exp, so seeded draws do not change."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tailrace.engine.sampler import SamplingRow, make_generator, sample
from tailrace.engine.structured_output import grammar
from tailrace.engine.structured_output.grammar import MaskJob
from tailrace.model.cpu.kernels import kernels
from tailrace.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(kernels() is None, reason="tailrace's CPU kernels do not run here")


def _job(bitmask: np.ndarray, vocab: int) -> MaskJob:
    job = MaskJob(None, None, [], [], vocab)
    job.bitmask = bitmask
    return job


def _random_bitmask(rows: int, vocab: int, allowed: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    bits = (rng.random((rows, (vocab + 31) // 32 * 32)) < allowed).astype(np.uint8)
    bits[:, vocab:] = 0  # llguidance never allows a column past the model's vocabulary
    return np.packbits(bits, axis=1, bitorder="little").view(np.uint32)


@pytest.mark.parametrize("vocab", [8192, 1000, 37])
def test_mask_kernel_gives_the_pytorch_paths_logits(vocab, monkeypatch):
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(vocab)) * 3
    bitmask = _random_bitmask(3, vocab, 0.1, vocab)
    rows = [4, 0, 2]
    native = logits.clone()
    _job(bitmask, vocab).apply(native, rows)
    monkeypatch.setattr(grammar, "kernels", lambda: None)
    reference = logits.clone()
    _job(bitmask, vocab).apply(reference, rows)
    assert torch.equal(native, reference)
    assert torch.equal(native[[1, 3, 5]], logits[[1, 3, 5]])


def test_mask_kernel_writes_through_a_view_of_wider_rows():
    wide = torch.zeros(4, 64)
    logits = wide[:, :40]
    bitmask = np.zeros((1, 2), dtype=np.uint32)
    bitmask[0, 1] = 1 << 3  # token 35 alone
    _job(bitmask, 40).apply(logits, [2])
    assert torch.isneginf(wide[2, :40]).sum() == 39 and wide[2, 35] == 0.0
    assert not torch.isneginf(wide[2, 40:]).any() and not torch.isneginf(wide[[0, 1, 3]]).any()


def test_mask_kernel_refuses_a_row_outside_the_logits():
    with pytest.raises(RuntimeError, match="outside"):
        kernels().mask_tokens(torch.zeros(2, 64), torch.zeros(1, 2, dtype=torch.int32), [2])


@pytest.mark.parametrize("vocab", [8192, 1003])
def test_exp_skipping_neg_inf_gives_exps_bits(vocab):
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(5, vocab, generator=g) * 20 - 10
    for row, share in ((1, 0.98), (3, 0.5), (4, 1.0)):
        x[row, torch.rand(vocab, generator=g) < share] = float("-inf")
    x[1, 7], x[0, 2] = float("nan"), float("-inf")
    got = x.clone()
    kernels().exp_skipping_neg_inf_(got, [1, 3, 4])
    torch.testing.assert_close(got, x.exp(), rtol=0, atol=0, equal_nan=True)


def test_masked_rows_draw_the_same_seeded_tokens_as_through_exp():
    logits = torch.randn(8, 8192, generator=torch.Generator().manual_seed(3)) * 3
    bitmask = _random_bitmask(3, 8192, 0.05, 3)
    _job(bitmask, 8192).apply(logits, [1, 4, 6])

    def draw(masked: set[int]) -> list[int]:
        rows = [SamplingRow(SamplingParams(temperature=1.0, top_p=0.9 if i % 2 else 1.0, seed=i), [1], [],
                            make_generator(i), [2], masked=i in masked) for i in range(8)]
        return sample(logits, rows, torch.Generator().manual_seed(0)).token_ids

    assert draw({1, 4, 6}) == draw(set())
