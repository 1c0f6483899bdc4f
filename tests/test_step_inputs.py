"""The flat batch of a step: ids, positions and KV slots per token, and padding sequences."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tailrace.engine.scheduler import ScheduledSeq
from tailrace.engine.sequence import Sequence
from tailrace.engine.step_inputs import PADDING_KEY, StepInputBuilder
from tailrace.model.attention.kv_cache import SeqSlice
from tailrace.sampling_params import SamplingParams

CPU = torch.device("cpu")
BLOCK_SIZE = 4


def scheduled(seq_id: int, tokens: list[int], table: list[int], computed: int, new: int) -> ScheduledSeq:
    seq = Sequence(seq_id, str(seq_id), 0, tokens, SamplingParams(), max_tokens=8, block_table=table)
    seq.num_computed_tokens = computed
    return ScheduledSeq(seq, new)


def expected_slots(table: list[int], start: int, end: int) -> list[int]:
    return [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, end)]


def test_a_chunk_across_block_boundaries_gets_each_position_its_slot():
    table = [7, 2, 5]
    item = scheduled(0, list(range(100, 111)), table, computed=3, new=8)
    inputs = StepInputBuilder(64, BLOCK_SIZE, None, CPU).build([item])
    assert inputs.input_ids.tolist() == list(range(103, 111))
    assert inputs.positions.tolist() == list(range(3, 11))
    assert inputs.batch.slot_mapping.tolist() == expected_slots(table, 3, 11)


def test_sequences_follow_each_other_in_schedule_order():
    a = scheduled(4, list(range(10, 19)), [1, 0, 3], computed=8, new=1)  # a decode
    b = scheduled(9, list(range(50, 56)), [6, 8], computed=0, new=6)  # a prefill
    inputs = StepInputBuilder(64, BLOCK_SIZE, None, CPU).build([a, b])
    assert inputs.batch.seqs == [SeqSlice(4, 0, 1, 9, [1, 0, 3]), SeqSlice(9, 1, 6, 6, [6, 8])]
    assert inputs.input_ids.tolist() == [18, *range(50, 56)]
    assert inputs.positions.tolist() == [8, *range(6)]
    assert inputs.batch.slot_mapping.tolist() == expected_slots([1, 0, 3], 8, 9) + expected_slots([6, 8], 0, 6)


@given(st.integers(1, 12), st.integers(0, 12), st.data())
def test_a_decode_row_takes_the_token_at_its_position_from_the_prompt_or_the_output(prompt_len, output_len, data):
    prompt = list(range(100, 100 + prompt_len))
    outputs = list(range(500, 500 + output_len))
    table = data.draw(st.permutations(range(10)))[: -(-(prompt_len + output_len) // BLOCK_SIZE)]
    position = data.draw(st.integers(0, prompt_len + output_len - 1))
    item = scheduled(3, prompt, table, computed=position, new=1)
    item.seq.output_token_ids = outputs
    inputs = StepInputBuilder(8, BLOCK_SIZE, None, CPU).build([item])
    assert inputs.input_ids.tolist() == (prompt + outputs)[position : position + 1]
    assert inputs.positions.tolist() == [position]
    assert inputs.batch.slot_mapping.tolist() == expected_slots(table, position, position + 1)
    assert inputs.batch.seqs == [SeqSlice(3, 0, 1, position + 1, table)]


def test_padding_sequences_are_one_token_each_in_the_scratch_block():
    a = scheduled(0, [5, 6, 7], [2], computed=2, new=1)
    b = scheduled(1, [8, 9], [3], computed=1, new=1)
    inputs = StepInputBuilder(16, BLOCK_SIZE, scratch_block=9, device=CPU).build([a, b], pad_to=4)
    assert inputs.input_ids.tolist() == [7, 9, 0, 0]
    assert inputs.positions.tolist() == [2, 1, 0, 0]
    assert inputs.batch.slot_mapping.tolist() == [2 * 4 + 2, 3 * 4 + 1, 9 * 4, 9 * 4]
    assert inputs.batch.seqs[2:] == [SeqSlice(PADDING_KEY, 2, 1, 1, [9]), SeqSlice(PADDING_KEY, 3, 1, 1, [9])]


def test_a_batch_already_at_its_size_gets_no_padding():
    a = scheduled(0, [5, 6, 7], [2], computed=2, new=1)
    inputs = StepInputBuilder(16, BLOCK_SIZE, scratch_block=9, device=CPU).build([a], pad_to=1)
    assert len(inputs.batch.seqs) == 1 and inputs.input_ids.tolist() == [7]


def test_padding_without_a_scratch_block_is_refused():
    a = scheduled(0, [5, 6, 7], [2], computed=2, new=1)
    with pytest.raises(RuntimeError, match="scratch block"):
        StepInputBuilder(16, BLOCK_SIZE, None, CPU).build([a], pad_to=2)
