import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tailrace.engine.sampler import (
    SamplingRow,
    _apply_penalties,
    _sort_descending,
    make_generator,
    prompt_logprobs,
    sample,
)
from tailrace.sampling_params import SamplingParams


def _row(output=(), prompt=(1, 2), eos=(), seed=None, **params) -> SamplingRow:
    sp = SamplingParams(seed=seed, **params)
    generator = make_generator(seed) if seed is not None else None
    return SamplingRow(params=sp, prompt_token_ids=list(prompt), output_token_ids=list(output),
                       generator=generator, eos_token_ids=list(eos))


def _logits(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def _draw_many(logits_row: torch.Tensor, n: int, **params) -> torch.Tensor:
    """n independent draws from one distribution, as one batch with a seeded shared generator."""
    logits = logits_row.unsqueeze(0).expand(n, -1).contiguous()
    out = sample(logits, [_row(**params) for _ in range(n)], torch.Generator().manual_seed(7))
    return torch.tensor(out.token_ids)


# ---- greedy and truncation ---------------------------------------------------------------------


def test_greedy_equals_argmax_with_lowest_index_on_ties():
    logits = _logits(6, 300)
    logits[4, [10, 50, 299]] = 100.0
    logits[5] = 0.0
    out = sample(logits, [_row(temperature=0.0) for _ in range(6)])
    assert out.token_ids == logits.argmax(dim=1).tolist()
    assert out.token_ids[4:] == [10, 0]


def test_temperature_below_epsilon_is_greedy():
    logits = _logits(8, 100, seed=3)
    out = sample(logits, [_row(temperature=1e-6) for _ in range(8)], torch.Generator().manual_seed(1))
    assert out.token_ids == logits.argmax(dim=1).tolist()


def test_temperature_sampling_frequencies_match_softmax():
    logits_row = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    tokens = _draw_many(logits_row, 40_000, temperature=0.8)
    frequencies = torch.bincount(tokens, minlength=6).double() / len(tokens)
    expected = torch.softmax(logits_row.double() / 0.8, dim=0)
    # Binomial standard deviation is at most 0.0025 here; 0.012 is about five of them.
    assert torch.allclose(frequencies, expected, atol=0.012)


def test_top_k_one_equals_greedy():
    logits = _logits(16, 500, seed=1)
    out = sample(logits, [_row(top_k=1) for _ in range(16)], torch.Generator().manual_seed(0))
    assert out.token_ids == logits.argmax(dim=1).tolist()


def test_tiny_top_p_equals_greedy():
    logits = _logits(16, 500, seed=2)
    out = sample(logits, [_row(top_p=1e-6) for _ in range(16)], torch.Generator().manual_seed(0))
    assert out.token_ids == logits.argmax(dim=1).tolist()


def test_top_k_keeps_exactly_the_k_most_likely_tokens():
    logits_row = torch.tensor([0.0, 3.0, 1.0, 2.0, -1.0])
    tokens = _draw_many(logits_row, 4000, top_k=3)
    assert set(tokens.tolist()) == {1, 2, 3}


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits_row = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    tokens = _draw_many(logits_row, 4000, top_p=0.7)
    assert set(tokens.tolist()) == {0, 1}


def test_top_p_applies_to_the_mass_left_by_top_k():
    # Top-2 mass is 0.8; 0.6 of it is 0.48 < 0.5, so only the best token survives.
    logits_row = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    tokens = _draw_many(logits_row, 2000, top_k=2, top_p=0.6)
    assert set(tokens.tolist()) == {0}


def test_min_p_removes_low_probability_tokens():
    # min_p 0.2 of the top probability 0.5 cuts at 0.1: only the 0.05 token goes.
    logits_row = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    tokens = _draw_many(logits_row, 4000, min_p=0.2)
    assert set(tokens.tolist()) == {0, 1, 2}


# ---- seeds -------------------------------------------------------------------------------------


def _run_seeded(position: int, steps: int, neighbours: list[dict]) -> list[int]:
    vocab = 1000
    seeded = _row(seed=1234, temperature=1.0)
    others = [_row(**params) for params in neighbours]
    shared = torch.Generator().manual_seed(99 + position)
    tokens = []
    for step in range(steps):
        rows = others[:position] + [seeded] + others[position:]
        logits = _logits(len(rows), vocab, seed=1000 + step)
        # The seeded row always sees the same logits, wherever it sits.
        logits[position] = _logits(1, vocab, seed=step)[0]
        out = sample(logits, rows, shared)
        tokens.append(out.token_ids[position])
        seeded.output_token_ids.append(out.token_ids[position])
    return tokens


def test_same_seed_gives_same_tokens_alone_or_at_any_batch_position():
    neighbours = [dict(temperature=0.0), dict(top_p=0.9), dict(seed=5), dict(top_k=20, min_p=0.1),
                  dict(temperature=0.7), dict(presence_penalty=1.0), dict(logprobs=3)]
    alone = _run_seeded(0, 12, [])
    assert len(set(alone)) > 1
    for position in range(8):
        assert _run_seeded(position, 12, neighbours) == alone


def test_make_generator_accepts_negative_and_wide_seeds():
    first = torch.rand(3, generator=make_generator(-1))
    second = torch.rand(3, generator=make_generator(2**64 - 1))
    assert torch.equal(first, second)
    make_generator(2**70)


# ---- bias, min_tokens, penalties ---------------------------------------------------------------


def test_logit_bias_plus_100_forces_token():
    logits = _logits(8, 200, seed=4)
    rows = [_row(logit_bias={17: 100.0}) for _ in range(8)]
    assert sample(logits, rows, torch.Generator().manual_seed(0)).token_ids == [17] * 8


def test_logit_bias_minus_100_forbids_token():
    logits_row = torch.tensor([5.0, 4.0, 0.0])
    tokens = _draw_many(logits_row, 2000, logit_bias={0: -100.0})
    assert 0 not in tokens.tolist()
    assert 1 in tokens.tolist()


def test_min_tokens_forbids_eos_and_stop_token_ids_until_reached():
    logits = torch.tensor([[9.0, 8.0, 1.0, 0.0]])
    row = _row(output=[3, 3], eos=[0], temperature=0.0, min_tokens=3, stop_token_ids=[1])
    assert sample(logits, [row]).token_ids == [2]


@given(st.lists(st.floats(-5, 5), min_size=4, max_size=12), st.sampled_from([0.0, 1.0]))
def test_min_tokens_alone_masks_in_place_and_picks_what_the_copying_path_picks(values, temperature):
    # logprobs=0 takes the path that copies the logits (the raw ones are read back); without, masking
    # is done in place. Both must pick the same token from the same draw.
    logits = torch.tensor([values])
    rows = [_row(output=[3], eos=[0], temperature=temperature, min_tokens=3, stop_token_ids=[1], logprobs=logprobs)
            for logprobs in (None, 0)]
    picked = [sample(logits.clone(), [row], torch.Generator().manual_seed(5)).token_ids for row in rows]
    assert picked[0] == picked[1] and picked[0][0] not in (0, 1)


def test_min_tokens_allows_eos_once_reached():
    logits = torch.tensor([[9.0, 8.0, 1.0, 0.0]])
    row = _row(output=[3, 3, 3], eos=[0], temperature=0.0, min_tokens=3, stop_token_ids=[1])
    assert sample(logits, [row]).token_ids == [0]


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 3.0]])
    row = _row(prompt=[0], output=[1, 4], repetition_penalty=2.0)
    penalised = _apply_penalties(logits, [row])
    assert penalised.tolist() == [[1.0, -4.0, 1.0, -1.0, 1.5]]


def test_a_vanishing_repetition_penalty_still_samples_inside_the_vocabulary():
    # A positive seen logit divided by ~1e-266 overflows; it must become the favourite, not NaN.
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    row = _row(prompt=[0, 1], temperature=1.0, top_p=0.25, repetition_penalty=4.6e-266, seed=1)
    assert sample(logits, [row]).token_ids == [0]


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = torch.zeros(1, 5)
    row = _row(prompt=[0, 1], output=[2, 2, 3], frequency_penalty=0.5, presence_penalty=1.0)
    penalised = _apply_penalties(logits, [row])
    assert penalised.tolist() == [[0.0, 0.0, -2.0, -1.5, 0.0]]


def test_penalties_touch_only_the_rows_that_ask():
    logits = _logits(3, 50, seed=5)
    rows = [_row(output=[1, 2]), _row(output=[1, 2], frequency_penalty=1.0), _row(output=[1, 2])]
    penalised = _apply_penalties(logits, rows)
    assert torch.equal(penalised[[0, 2]], logits[[0, 2]])
    assert not torch.equal(penalised[1], logits[1])


def test_sample_leaves_the_callers_logits_unchanged():
    logits = _logits(2, 50, seed=6)
    before = logits.clone()
    sample(logits, [_row(logit_bias={3: 50.0}, repetition_penalty=1.5), _row(min_tokens=2, eos=[0])])
    assert torch.equal(logits, before)


# ---- logprobs ----------------------------------------------------------------------------------


def test_sampled_logprob_is_from_raw_logits_despite_bias_and_temperature():
    logits = _logits(3, 100, seed=8)
    rows = [_row(logprobs=0, temperature=0.5, logit_bias={7: 100.0}), _row(), _row(logprobs=2)]
    out = sample(logits, rows, torch.Generator().manual_seed(0))
    raw = torch.log_softmax(logits, dim=1)
    assert out.token_ids[0] == 7
    assert out.logprobs[0].logprob == pytest.approx(raw[0, 7].item(), abs=1e-6)
    assert out.logprobs[2].logprob == pytest.approx(raw[2, out.token_ids[2]].item(), abs=1e-6)


def test_rows_without_logprobs_get_none():
    out = sample(_logits(3, 20), [_row(), _row(logprobs=1), _row()])
    assert out.logprobs[0] is None and out.logprobs[2] is None
    assert out.logprobs[1] is not None


def test_top_logprobs_are_the_k_best_sorted_best_first():
    logits = _logits(3, 100, seed=9)
    out = sample(logits, [_row(logprobs=5), _row(logprobs=0), _row(logprobs=20)])
    raw = torch.log_softmax(logits, dim=1)
    for r, k in enumerate([5, 0, 20]):
        top = out.logprobs[r].top
        assert len(top) == k
        expected_values, expected_ids = raw[r].topk(k)
        assert [token for token, _ in top] == expected_ids.tolist()
        assert [value for _, value in top] == pytest.approx(expected_values.tolist(), abs=1e-6)


def test_prompt_logprobs_match_log_softmax_at_next_prompt_tokens():
    prompt = [5, 9, 2, 7]
    logits = _logits(3, 12, seed=10)
    entries = prompt_logprobs(logits, prompt, k=2)
    raw = torch.log_softmax(logits, dim=1)
    expected = [raw[i, prompt[i + 1]].item() for i in range(3)]
    assert [e.logprob for e in entries] == pytest.approx(expected)
    assert [[token for token, _ in e.top] for e in entries] == raw.topk(2, dim=1).indices.tolist()


# ---- degenerate rows ---------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_row_with_everything_masked_falls_back_to_raw_argmax(temperature):
    logits = torch.tensor([[0.0, 2.0, 1.0]])
    row = _row(temperature=temperature, min_tokens=1, eos=[0, 1], stop_token_ids=[2])
    assert sample(logits, [row], torch.Generator().manual_seed(0)).token_ids == [1]


def test_all_neg_inf_raw_row_does_not_crash():
    logits = torch.full((2, 10), float("-inf"))
    logits[1, 4] = 0.0
    out = sample(logits, [_row(), _row(top_p=0.5, logprobs=1)], torch.Generator().manual_seed(0))
    assert out.token_ids[1] == 4
    assert 0 <= out.token_ids[0] < 10
    assert not math.isnan(out.logprobs[1].logprob)


def test_cpu_value_sort_matches_torch_sort_descending():
    probs = torch.rand(4, 300, generator=torch.Generator().manual_seed(11))
    probs[:, :5] = 0.5
    assert torch.equal(_sort_descending(probs), probs.sort(dim=1, descending=True).values)


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_a_non_finite_logit_never_draws_a_token_outside_the_vocabulary(poison):
    # An id == vocab fed back as the next input took the whole engine down (IndexError in the
    # embedding), found by the schema fuzz test.
    logits = torch.zeros(3, 10)
    logits[0, 3] = poison
    logits[1] = poison
    logits[2, 7] = 5.0
    for seed in range(20):
        out = sample(logits, [_row(), _row(), _row()], torch.Generator().manual_seed(seed))
        assert all(0 <= t < 10 for t in out.token_ids)
