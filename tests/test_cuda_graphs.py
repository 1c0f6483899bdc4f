"""Decode graph sizes, and padding a decode batch to one (the capture itself: tests/test_gpu.py)."""

import torch

from tailrace.engine.config import EngineConfig
from tailrace.engine.core import EngineCore, EngineRequest
from tailrace.engine.cuda_graphs import decode_logits, decode_size, decode_sizes
from tailrace.engine.scheduler import ScheduledSeq
from tailrace.engine.sequence import Sequence
from tailrace.sampling_params import SamplingParams


def items(*new_tokens: int) -> list[ScheduledSeq]:
    return [ScheduledSeq(Sequence(i, str(i), 0, [1, 2], SamplingParams(), 4), n) for i, n in enumerate(new_tokens)]


def test_sizes_are_powers_of_two_to_8_then_multiples_of_16_then_max_num_seqs():
    assert decode_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert decode_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert decode_sizes(6) == [1, 2, 4, 6]
    assert decode_sizes(1) == [1]


def test_a_decode_step_takes_the_smallest_size_that_holds_it():
    sizes = decode_sizes(64)
    assert decode_size(sizes, items(1)) == 1
    assert decode_size(sizes, items(*[1] * 3)) == 4
    assert decode_size(sizes, items(*[1] * 33)) == 48
    assert decode_size(sizes, items(*[1] * 64)) == 64


def test_a_chunk_or_too_many_sequences_run_eagerly():
    sizes = decode_sizes(8)
    assert decode_size(sizes, items(1, 2, 1)) is None
    assert decode_size(sizes, items(*[1] * 9)) is None


def test_padding_a_decode_batch_leaves_the_real_rows_logits_unchanged(embedded_model):
    core = EngineCore(EngineConfig(attention="paged", device="cpu", threads=1))
    for i, prompt in enumerate([[5, 6, 7, 8], list(range(20, 45)), [9] * 17]):
        core.add_request(EngineRequest(str(i), prompt, SamplingParams(max_tokens=8, temperature=0)))
    core.step()  # the prefills, so the decode below attends to cached K/V
    scheduled = core.scheduler.schedule().scheduled
    assert decode_size(decode_sizes(8), scheduled) == 4

    def logits(pad_to: int) -> torch.Tensor:
        inputs = core.runner.inputs.build(scheduled, pad_to=pad_to)
        core.runner.cache.begin(inputs.batch)
        return decode_logits(core.runner.model, core.runner.cache, inputs)

    plain, padded = logits(0), logits(8)
    assert padded.shape[0] == 8
    torch.testing.assert_close(padded[:3], plain, rtol=0, atol=1e-5)
    assert torch.isfinite(padded).all()
