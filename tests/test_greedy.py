"""The greedy-pick kernel (csrc/greedy.cpp) against torch.max(dim=1).indices, the path it replaces:
the same index for every row, with ties, infinities, NaN and masked (-inf) rows."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tailrace.engine.sampler import SamplingRow, sample
from tailrace.model.cpu.kernels import kernels
from tailrace.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(kernels() is None, reason="tailrace's CPU kernels do not run here")

# a few values, so rows have ties; the specials where the two passes could part ways
VALUES = st.sampled_from([0.0, -0.0, 1.5, -2.0, 3.25, 3.25, float("inf"), float("-inf"), float("nan"), 1e-30])


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 5).flatmap(lambda rows: st.integers(1, 70).flatmap(
    lambda vocab: st.lists(st.lists(VALUES, min_size=vocab, max_size=vocab), min_size=rows, max_size=rows))))
def test_kernel_picks_what_torch_max_picks(rows):
    logits = torch.tensor(rows, dtype=torch.float32)
    assert torch.equal(kernels().greedy_tokens(logits), logits.max(dim=1).indices)


@pytest.mark.parametrize("vocab", [49152, 8192, 17])
def test_kernel_picks_what_torch_max_picks_on_wide_rows_and_views(vocab):
    g = torch.Generator().manual_seed(vocab)
    wide = torch.randn(40, vocab + 5, generator=g)
    wide[3, vocab // 2] = wide[3].max()  # a tie with an earlier maximum, or a new one
    wide[7] = float("-inf")
    wide[9, vocab - 1] = float("nan")
    logits = wide[:, :vocab]  # rows a wider stride apart
    assert torch.equal(kernels().greedy_tokens(logits), logits.max(dim=1).indices)


def test_kernel_refuses_what_it_cannot_read():
    with pytest.raises(RuntimeError, match="float32"):
        kernels().greedy_tokens(torch.zeros(2, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="V > 0"):
        kernels().greedy_tokens(torch.zeros(2, 0))


def test_greedy_sampling_takes_the_kernels_pick():
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(0))
    rows = [SamplingRow(SamplingParams(temperature=0.0), [1], [], None, [2]) for _ in range(3)]
    assert sample(logits, rows).token_ids == logits.argmax(dim=1).tolist()
