"""The step description rank 0 broadcasts: a worker decodes exactly the step rank 0 runs."""

from __future__ import annotations

import torch

from tailrace.engine.step_inputs import StepInputs
from tailrace.engine.tensor_parallel.step import decode_step, encode_step
from tailrace.model.attention.kv_cache import AttentionBatch, SeqSlice


def test_a_step_comes_back_as_it_was_sent():
    seqs = [SeqSlice(7, 0, 5, 5, [3, 4]), SeqSlice(2, 5, 1, 19, [0, 1, 9]), SeqSlice(11, 6, 1, 1, [5])]
    flat = torch.arange(21, dtype=torch.int64)
    inputs = StepInputs(flat[:7], flat[7:14], AttentionBatch(seqs, flat[14:]))
    step = decode_step(encode_step(inputs, [4, 5, 6], [9, 1]), torch.device("cpu"))
    assert step.rows == [4, 5, 6] and step.released == [9, 1]
    assert step.inputs.batch.seqs == seqs
    assert torch.equal(step.inputs.input_ids, flat[:7]) and torch.equal(step.inputs.positions, flat[7:14])
    assert torch.equal(step.inputs.batch.slot_mapping, flat[14:])


def test_an_empty_step_has_no_rows():
    empty = torch.zeros(0, dtype=torch.int64)
    step = decode_step(encode_step(StepInputs(empty, empty, AttentionBatch([], empty)), [], [3]), torch.device("cpu"))
    assert step.inputs.batch.seqs == [] and step.rows == [] and step.released == [3]
    assert step.inputs.input_ids.numel() == 0
