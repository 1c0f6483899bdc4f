"""One engine step as the tensor-parallel workers need it, in one int64 tensor.

Rank 0 schedules; the other ranks only run the same forward on their part of the model. What they
need each step is the flat batch (token ids, positions, KV slots), each sequence's slice of it and
its block table, the rows that need logits, and the sequences whose KV slots were freed since the
last step (the slab cache keeps per-sequence state). That is written into one tensor, so a step
reaches the workers as two broadcasts (its length, then the tensor) rather than as pickled Python
objects per sequence.

Layout: [tokens, seqs, rows, released | per seq: key, q_start, q_len, kv_len, table length |
block tables | logit rows | released keys | ids | positions | slots].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tailrace.engine.step_inputs import StepInputs
from tailrace.model.attention.kv_cache import AttentionBatch, SeqSlice

_COUNTS = 4
_PER_SEQ = 5


@dataclass(slots=True)
class FollowStep:
    """A step as a worker runs it."""

    inputs: StepInputs
    rows: list[int]  # rows of the flat batch that need logits, in order
    released: list[int]  # sequence keys to release before the step


def encode_step(inputs: StepInputs, rows: list[int], released: list[int]) -> torch.Tensor:
    """The step as one int64 CPU tensor."""
    seqs = inputs.batch.seqs
    meta = [inputs.input_ids.shape[0], len(seqs), len(rows), len(released)]
    for s in seqs:
        meta += (s.key, s.q_start, s.q_len, s.kv_len, len(s.block_table))
    for s in seqs:
        meta += s.block_table
    meta += rows
    meta += released
    tokens = torch.cat((inputs.input_ids, inputs.positions, inputs.batch.slot_mapping)).cpu()
    return torch.cat((torch.tensor(meta, dtype=torch.int64), tokens))


def decode_step(flat: torch.Tensor, device: torch.device) -> FollowStep:
    """`encode_step`'s tensor back as StepInputs (the token arrays on `device`), rows and releases."""
    num_tokens, num_seqs, num_rows, num_released = flat[:_COUNTS].tolist()
    end = _COUNTS + _PER_SEQ * num_seqs
    per_seq = flat[_COUNTS:end].view(num_seqs, _PER_SEQ).tolist()
    tables_len = sum(entry[4] for entry in per_seq)
    tail = flat[end : end + tables_len + num_rows + num_released].tolist()
    slices, at = [], 0
    for key, q_start, q_len, kv_len, table_len in per_seq:
        slices.append(SeqSlice(key, q_start, q_len, kv_len, tail[at : at + table_len]))
        at += table_len
    rows, released = tail[at : at + num_rows], tail[at + num_rows :]
    tokens = flat[end + tables_len + num_rows + num_released :].to(device)
    t = num_tokens
    return FollowStep(StepInputs(tokens[:t], tokens[t : 2 * t], AttentionBatch(slices, tokens[2 * t :])), rows, released)
