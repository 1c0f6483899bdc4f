"""One step's logits in, one token per sequence out: penalties, temperature, truncation, draw.

Everything is batched over the step's rows as tensors; per-row Python only builds small index
tensors. Rows that ask for nothing unusual (the common case) skip the penalty work entirely.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from tailrace.outputs import TokenLogprob
from tailrace.sampling_params import SamplingParams

_SEED_BITS = (1 << 64) - 1


@dataclass(slots=True)
class SamplingRow:
    """One sequence that samples a token this step."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated so far, before this step
    generator: torch.Generator | None  # per-request and seeded; None when params.seed is None
    eos_token_ids: list[int]


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[TokenLogprob | None]  # None for rows with params.logprobs None


def make_generator(seed: int) -> torch.Generator:
    """A CPU generator for one seeded request.

    Uniforms are always drawn on the CPU (one per row per step), so request generators never
    have to follow the logits to another device.
    """
    generator = torch.Generator(device="cpu")
    # OpenAI seeds may be negative or wider than the 64 bits torch accepts.
    generator.manual_seed(seed & _SEED_BITS)
    return generator


@torch.inference_mode()
def sample(
    logits: torch.Tensor, rows: list[SamplingRow], shared_generator: torch.Generator | None = None
) -> SamplerOutput:
    """Pick one token per row from `logits` [B, V] (float32, one row per SamplingRow).

    Order: logit_bias, min_tokens masking, repetition penalty, presence/frequency penalties, then
    temperature (greedy below 1e-5), top_k, top_p, min_p and one inverse-CDF draw. That is vLLM's
    v0 order; v1 applies min_p before top-k/top-p, which changes what top_p's mass is measured on.
    Returned logprobs describe the model's raw distribution (log_softmax of the unmodified
    logits), which is what vLLM returns by default; OpenAI does not specify which it reports.
    """
    penalised = _apply_penalties(logits, rows)
    greedy = [i for i, row in enumerate(rows) if row.params.greedy]
    random = [i for i, row in enumerate(rows) if not row.params.greedy]
    tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
    if greedy:
        tokens[greedy] = _argmax(_take(penalised, greedy))
    if random:
        picked = [rows[i] for i in random]
        tokens[random] = _sample_random(_take(penalised, random), picked, shared_generator)
    return SamplerOutput(token_ids=tokens.tolist(), logprobs=_sampled_logprobs(logits, rows, tokens))


@torch.inference_mode()
def prompt_logprobs(logits: torch.Tensor, prompt_token_ids: list[int], k: int) -> list[TokenLogprob]:
    """Logprobs of prompt tokens 1..P-1 from `logits` [P-1, V], each with its top-k alternatives.

    The caller prepends None for token 0, which nothing predicts.
    """
    targets = torch.tensor(prompt_token_ids[1:], dtype=torch.long, device=logits.device)
    return _token_logprobs(torch.log_softmax(logits, dim=1), targets, [k] * len(targets))


def _take(t: torch.Tensor, indices: list[int]) -> torch.Tensor:
    if len(indices) == t.shape[0]:
        return t
    return t[torch.tensor(indices, device=t.device)]


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    # max(dim) returns the first maximal index like argmax, and measured ~2.5x faster on CPU.
    return logits.max(dim=1).indices


# ---- penalties ---------------------------------------------------------------------------------


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The logits after bias and penalties: `logits` itself when no row asks for any."""
    if not any(_wants_penalty(row) for row in rows):
        return logits
    penalised = logits.clone()
    _add_logit_bias(penalised, rows)
    _mask_until_min_tokens(penalised, rows)
    _apply_repetition_penalty(penalised, rows)
    _apply_presence_frequency(penalised, rows)
    _fall_back_where_all_masked(penalised, logits)
    return penalised


def _wants_penalty(row: SamplingRow) -> bool:
    p = row.params
    return (bool(p.logit_bias) or len(row.output_token_ids) < p.min_tokens
            or p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0)


def _add_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    vocab = logits.shape[1]
    at_row, at_token, bias = [], [], []
    for i, row in enumerate(rows):
        for token, value in row.params.logit_bias.items():
            # An id outside the vocabulary can never be sampled, so its bias changes nothing.
            if 0 <= token < vocab:
                at_row.append(i)
                at_token.append(token)
                bias.append(value)
    if at_row:
        values = torch.tensor(bias, dtype=logits.dtype, device=logits.device)
        logits.index_put_(_pairs(at_row, at_token, logits.device), values, accumulate=True)


def _mask_until_min_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    # vLLM masks the eos ids here even with ignore_eos (they sit in its _all_stop_token_ids).
    vocab = logits.shape[1]
    at_row, at_token = [], []
    for i, row in enumerate(rows):
        if len(row.output_token_ids) < row.params.min_tokens:
            for token in set(row.params.stop_token_ids) | set(row.eos_token_ids):
                if 0 <= token < vocab:
                    at_row.append(i)
                    at_token.append(token)
    if at_row:
        masked = torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device)
        logits.index_put_(_pairs(at_row, at_token, logits.device), masked)


def _pairs(
    at_row: list[int], at_token: list[int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor(at_row, device=device), torch.tensor(at_token, device=device)


def _apply_repetition_penalty(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """HF/vLLM rule over prompt and output tokens: positive logits divided, negative multiplied."""
    chosen = [i for i, row in enumerate(rows) if row.params.repetition_penalty != 1.0]
    if not chosen:
        return
    device = logits.device
    row, token, _ = _occurrences([rows[i].prompt_token_ids + rows[i].output_token_ids for i in chosen],
                                 logits.shape[1], device)
    penalty = torch.tensor([rows[i].params.repetition_penalty for i in chosen],
                           dtype=logits.dtype, device=device)[row]
    at = (torch.tensor(chosen, device=device)[row], token)
    seen = logits[at]
    logits[at] = torch.where(seen > 0, seen / penalty, seen * penalty)


def _apply_presence_frequency(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """OpenAI rule over output tokens: logit -= frequency * count + presence * (count > 0)."""
    chosen = [i for i, row in enumerate(rows)
              if row.params.presence_penalty != 0.0 or row.params.frequency_penalty != 0.0]
    if not chosen:
        return
    device = logits.device
    row, token, count = _occurrences([rows[i].output_token_ids for i in chosen], logits.shape[1], device)
    frequency = torch.tensor([rows[i].params.frequency_penalty for i in chosen],
                             dtype=logits.dtype, device=device)[row]
    presence = torch.tensor([rows[i].params.presence_penalty for i in chosen],
                            dtype=logits.dtype, device=device)[row]
    logits[torch.tensor(chosen, device=device)[row], token] -= frequency * count + presence


def _occurrences(
    token_lists: list[list[int]], vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The distinct (list index, token) pairs in token_lists and how often each occurs.

    Penalties then touch only these positions instead of whole [rows, vocab] tensors.
    """
    tokens = torch.tensor(list(chain.from_iterable(token_lists)), dtype=torch.long, device=device)
    lengths = torch.tensor([len(t) for t in token_lists], device=device)
    owner = torch.repeat_interleave(torch.arange(len(token_lists), device=device), lengths)
    pairs, counts = torch.unique(owner * vocab + tokens, return_counts=True)
    return pairs // vocab, pairs % vocab, counts


def _fall_back_where_all_masked(penalised: torch.Tensor, raw: torch.Tensor) -> None:
    """A row with nothing left (everything masked or biased to -inf) takes the raw argmax.

    Its row becomes 0 at that token and -inf elsewhere, so greedy and random paths agree and
    no softmax ever sees a row without a finite value.
    """
    dead = torch.isneginf(penalised.amax(dim=1))
    if not bool(dead.any()):
        return
    index = dead.nonzero().squeeze(1)
    fallback = torch.full_like(penalised[index], float("-inf"))
    fallback.scatter_(1, _argmax(raw[index]).unsqueeze(1), 0.0)
    penalised[index] = fallback


# ---- random sampling ---------------------------------------------------------------------------


def _sample_random(
    logits: torch.Tensor, rows: list[SamplingRow], shared_generator: torch.Generator | None
) -> torch.Tensor:
    device = logits.device
    temperature = torch.tensor([row.params.temperature for row in rows],
                               dtype=logits.dtype, device=device).unsqueeze(1)
    # The clamp keeps a raw all -inf row finite: its probabilities become all zero (token 0).
    peak = logits.amax(dim=1, keepdim=True).clamp(min=torch.finfo(logits.dtype).min)
    # Unnormalised probabilities whose row maximum is exactly 1, so min_p is a plain threshold.
    probs = (logits - peak).div_(temperature).exp_()
    threshold = _truncation_thresholds(probs, rows)
    if threshold is not None:
        probs.masked_fill_(probs < threshold, 0.0)
    # float64 so that tail tokens of a large vocabulary keep their share of the CDF.
    cdf = probs.cumsum(dim=1, dtype=torch.float64)
    uniforms = _uniforms(rows, shared_generator).to(device)
    return _invert_cdf(cdf, uniforms)


def _truncation_thresholds(probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor | None:
    """Per-row [R, 1] probability below which tokens are cut (top_k, top_p, min_p); None: no cut.

    Each cut keeps a set of the most likely tokens, so one threshold expresses all three. Ties at
    the threshold are kept, as in vLLM. min_p needs no sort because the row maximum is 1.
    """
    vocab = probs.shape[1]
    cut = [i for i, row in enumerate(rows) if row.params.top_p < 1.0 or 0 < row.params.top_k < vocab]
    if not cut and not any(row.params.min_p > 0.0 for row in rows):
        return None
    threshold = torch.tensor([row.params.min_p for row in rows],
                             dtype=probs.dtype, device=probs.device).unsqueeze(1)
    if cut:
        index = torch.tensor(cut, device=probs.device)
        cut_rows = [rows[i] for i in cut]
        top = _top_k_top_p_threshold(_sort_descending(_take(probs, cut)), cut_rows)
        threshold[index] = torch.maximum(threshold[index], top)
    return threshold


def _top_k_top_p_threshold(descending: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The smallest probability kept by top_k and then top_p (over the top-k mass), per row."""
    vocab = descending.shape[1]
    device = descending.device
    k = torch.tensor([row.params.top_k if 0 < row.params.top_k < vocab else vocab for row in rows],
                     device=device).unsqueeze(1)
    top_p = torch.tensor([row.params.top_p for row in rows],
                         dtype=descending.dtype, device=device).unsqueeze(1)
    cdf = descending.cumsum(dim=1)
    top_k_mass = cdf.gather(1, k - 1)
    # The shortest prefix holding top_p of the top-k mass ends at the first cdf >= that share.
    last = torch.minimum(torch.searchsorted(cdf, top_p * top_k_mass), k - 1)
    return descending.gather(1, last)


def _sort_descending(probs: torch.Tensor) -> torch.Tensor:
    if probs.device.type != "cpu":
        return probs.sort(dim=1, descending=True).values
    # torch's CPU sort also tracks indices: 64 x 8192 measured 38 ms, numpy's value-only sort 2 ms.
    return torch.from_numpy(np.sort(probs.numpy(), axis=1)).flip(1)


def _uniforms(rows: list[SamplingRow], shared_generator: torch.Generator | None) -> torch.Tensor:
    """One float64 uniform per row: seeded rows from their own generator, the rest in one call."""
    uniforms = torch.empty(len(rows), dtype=torch.float64)
    shared = [i for i, row in enumerate(rows) if row.generator is None]
    if shared:
        uniforms[shared] = torch.rand(len(shared), dtype=torch.float64, generator=shared_generator)
    for i, row in enumerate(rows):
        if row.generator is not None:
            uniforms[i] = torch.rand(1, dtype=torch.float64, generator=row.generator)
    return uniforms


def _invert_cdf(cdf: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    total = cdf[:, -1:].contiguous()
    # side="right" lands on the first cdf step above the target, i.e. a token of non-zero
    # probability; the second search catches u * total rounding up to total itself.
    chosen = torch.searchsorted(cdf, uniforms.unsqueeze(1) * total, right=True)
    last_possible = torch.searchsorted(cdf, total)
    return torch.minimum(chosen, last_possible).squeeze(1)


# ---- logprobs ----------------------------------------------------------------------------------


def _sampled_logprobs(
    raw: torch.Tensor, rows: list[SamplingRow], tokens: torch.Tensor
) -> list[TokenLogprob | None]:
    wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    result: list[TokenLogprob | None] = [None] * len(rows)
    if not wanted:
        return result
    logprobs = torch.log_softmax(_take(raw, wanted), dim=1)
    targets = tokens[torch.tensor(wanted, device=tokens.device)]
    computed = _token_logprobs(logprobs, targets, [rows[i].params.logprobs for i in wanted])
    for i, entry in zip(wanted, computed):
        result[i] = entry
    return result


def _token_logprobs(logprobs: torch.Tensor, targets: torch.Tensor, ks: list[int]) -> list[TokenLogprob]:
    """Each row's logprob at its target plus its ks[i] best (token, logprob), best first.

    One topk with the largest k serves every row; each row keeps its own slice.
    """
    chosen = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
    widest = min(max(ks, default=0), logprobs.shape[1])
    if widest == 0:
        return [TokenLogprob(logprob=value) for value in chosen]
    top_values, top_ids = logprobs.topk(widest, dim=1)
    values, ids = top_values.tolist(), top_ids.tolist()
    return [TokenLogprob(logprob=chosen[r], top=list(zip(ids[r][:k], values[r][:k])))
            for r, k in enumerate(ks)]
