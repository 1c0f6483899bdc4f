"""One step's logits in, one token per sequence out: penalties, temperature, truncation, draw.

Everything is batched over the step's rows as tensors; per-row Python only builds small index
tensors. Rows that ask for nothing unusual (the common case) skip the penalty work entirely.

`start_sample` only queues the work: on CUDA nothing in it waits for the device, except the
penalty and fallback paths (torch.unique, one any()), so the engine reads every result back with
one wait per step (`PendingSample.to_host`, then `resolve`). `sample` does both at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from tailrace.engine.transfer import to_device, to_host
from tailrace.model.cpu.kernels import kernels
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
    masked: bool = False  # a grammar set most of its logits to -inf


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[TokenLogprob | None]  # None for rows with params.logprobs None


@dataclass(slots=True)
class PendingLogprobs:
    """Logprobs still where they were computed: each row's at its target, and its ks[r] best."""

    chosen: torch.Tensor  # [R]
    top_values: torch.Tensor | None  # [R, max(ks)], best first; None when every k is 0
    top_ids: torch.Tensor | None
    ks: list[int]

    def to_host(self) -> "PendingLogprobs":
        top = (None, None) if self.top_values is None else (to_host(self.top_values), to_host(self.top_ids))
        return PendingLogprobs(to_host(self.chosen), *top, self.ks)

    def resolve(self) -> list[TokenLogprob]:
        chosen = self.chosen.tolist()
        if self.top_values is None:
            return [TokenLogprob(logprob=value) for value in chosen]
        values, ids = self.top_values.tolist(), self.top_ids.tolist()
        return [TokenLogprob(logprob=chosen[r], top=list(zip(ids[r][:k], values[r][:k])))
                for r, k in enumerate(self.ks)]


@dataclass(slots=True)
class PendingSample:
    """One step's sampled tokens (and logprobs) before they are read back."""

    token_ids: torch.Tensor  # [R] int64
    logprobs: PendingLogprobs | None  # for logprob_rows, in order
    logprob_rows: list[int]

    def to_host(self) -> "PendingSample":
        logprobs = None if self.logprobs is None else self.logprobs.to_host()
        return PendingSample(to_host(self.token_ids), logprobs, self.logprob_rows)

    def resolve(self) -> SamplerOutput:
        token_ids = self.token_ids.tolist()
        logprobs: list[TokenLogprob | None] = [None] * len(token_ids)
        if self.logprobs is not None:
            for row, entry in zip(self.logprob_rows, self.logprobs.resolve()):
                logprobs[row] = entry
        return SamplerOutput(token_ids, logprobs)


def make_generator(seed: int) -> torch.Generator:
    """A CPU generator for one seeded request.

    Uniforms are always drawn on the CPU (one per row per step), so request generators never
    have to follow the logits to another device.
    """
    generator = torch.Generator(device="cpu")
    # OpenAI seeds may be negative or wider than the 64 bits torch accepts.
    generator.manual_seed(seed & _SEED_BITS)
    return generator


def sample(
    logits: torch.Tensor, rows: list[SamplingRow], shared_generator: torch.Generator | None = None
) -> SamplerOutput:
    """`start_sample`, read back at once."""
    return start_sample(logits, rows, shared_generator).resolve()


@torch.inference_mode()
def start_sample(
    logits: torch.Tensor, rows: list[SamplingRow], shared_generator: torch.Generator | None = None
) -> PendingSample:
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
    if not random:
        tokens = greedy_tokens(penalised)
    elif not greedy:
        tokens = _sample_random(penalised, rows, shared_generator)
    else:
        tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        tokens[to_device(greedy, logits.device)] = greedy_tokens(take_rows(penalised, greedy))
        picked = [rows[i] for i in random]
        tokens[to_device(random, logits.device)] = _sample_random(take_rows(penalised, random), picked,
                                                                  shared_generator)
    wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    return PendingSample(tokens, _sampled_logprobs(logits, rows, tokens, wanted), wanted)


def prompt_logprobs(logits: torch.Tensor, prompt_token_ids: list[int], k: int) -> list[TokenLogprob]:
    """`start_prompt_logprobs`, read back at once."""
    return start_prompt_logprobs(logits, prompt_token_ids, k).resolve()


@torch.inference_mode()
def start_prompt_logprobs(logits: torch.Tensor, prompt_token_ids: list[int], k: int) -> PendingLogprobs:
    """Logprobs of prompt tokens 1..P-1 from `logits` [P-1, V], each with its top-k alternatives.

    The caller prepends None for token 0, which nothing predicts.
    """
    targets = to_device(prompt_token_ids[1:], logits.device, torch.long)
    return _token_logprobs(torch.log_softmax(logits, dim=1), targets, [k] * len(targets))


def take_rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """t[rows] for ascending distinct rows: a view when they are the first len(rows) rows (every
    row of a decode step samples, and most steps sample alike, so that is the common case)."""
    if not rows or rows[-1] == len(rows) - 1:
        return t[: len(rows)]
    return t[to_device(rows, t.device)]


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first maximal index (its first NaN where it has one). On CPU the kernel's pass
    over the row took a few us where torch's reduction took 51 (180 right after a step's weights
    had streamed through the caches), for one row of 49k logits."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and (ops := kernels()) is not None:
        return ops.greedy_tokens(logits)
    # max(dim) returns the first maximal index like argmax, and measured ~2.5x faster on CPU.
    return logits.max(dim=1).indices


# ---- penalties ---------------------------------------------------------------------------------


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The logits after bias and penalties: `logits` itself when no row asks for any."""
    if not any(_wants_penalty(row) for row in rows):
        return logits
    if all(_only_min_tokens(row, logits.shape[1]) for row in rows):
        # Only stop ids masked, fewer than the vocabulary, in rows whose other logits are the
        # model's (finite): no row can be left empty, and no row reads its raw logits back, so no
        # copy and no check. Exact-length requests (a benchmark's) take this path every step: at
        # one row of 49k logits, after 128 MB of other reads, 364 -> 190-240 us (120 without
        # min_tokens).
        _mask_until_min_tokens(logits, rows)
        return logits
    penalised = logits.clone()
    _add_logit_bias(penalised, rows)
    _mask_until_min_tokens(penalised, rows)
    _apply_repetition_penalty(penalised, rows)
    _apply_presence_frequency(penalised, rows)
    _fall_back_where_all_masked(penalised, logits)
    return penalised


def _wants_penalty(row: SamplingRow) -> bool:
    return len(row.output_token_ids) < row.params.min_tokens or _biased_or_penalised(row.params)


def _biased_or_penalised(p: SamplingParams) -> bool:
    """Every adjustment but min_tokens masking."""
    return (bool(p.logit_bias) or p.repetition_penalty != 1.0 or p.presence_penalty != 0.0
            or p.frequency_penalty != 0.0)


def _only_min_tokens(row: SamplingRow, vocab: int) -> bool:
    # The two lists' lengths bound _stop_ids' size without building the set for every row of every
    # step (_mask_until_min_tokens builds it for the rows it masks).
    return not (row.masked or row.params.logprobs is not None or _biased_or_penalised(row.params)
                or len(row.params.stop_token_ids) + len(row.eos_token_ids) >= vocab)


def _stop_ids(row: SamplingRow) -> set[int]:
    """What min_tokens masks: vLLM masks the eos ids here even with ignore_eos (they sit in its
    _all_stop_token_ids)."""
    return set(row.params.stop_token_ids) | set(row.eos_token_ids)


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
        values = to_device(bias, logits.device, logits.dtype)
        logits.index_put_(_pairs(at_row, at_token, logits.device), values, accumulate=True)


def _mask_until_min_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    vocab = logits.shape[1]
    at_row, at_token = [], []
    for i, row in enumerate(rows):
        if len(row.output_token_ids) < row.params.min_tokens:
            for token in _stop_ids(row):
                if 0 <= token < vocab:
                    at_row.append(i)
                    at_token.append(token)
    if not at_row:
        return
    if logits.device.type == "cpu":
        logits.numpy()[at_row, at_token] = -np.inf  # no torch ops, each of which runs cold after a step
    else:
        logits.index_put_(_pairs(at_row, at_token, logits.device), logits.new_full((), float("-inf")))


def _pairs(
    at_row: list[int], at_token: list[int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    return to_device(at_row, device), to_device(at_token, device)


def _apply_repetition_penalty(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """HF/vLLM rule over prompt and output tokens: positive logits divided, negative multiplied."""
    chosen = [i for i, row in enumerate(rows) if row.params.repetition_penalty != 1.0]
    if not chosen:
        return
    device = logits.device
    row, token, _ = _occurrences([rows[i].prompt_token_ids + rows[i].output_token_ids for i in chosen],
                                 logits.shape[1], device)
    penalty = to_device([rows[i].params.repetition_penalty for i in chosen], device, logits.dtype)[row]
    at = (to_device(chosen, device)[row], token)
    seen = logits[at]
    # A penalty near 0 (any in (0, 10] is valid) overflows a positive logit; +inf would make the
    # random path's softmax NaN and its draw land past the vocabulary.
    logits[at] = torch.where(seen > 0, seen / penalty, seen * penalty).clamp(max=torch.finfo(logits.dtype).max)


def _apply_presence_frequency(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """OpenAI rule over output tokens: logit -= frequency * count + presence * (count > 0)."""
    chosen = [i for i, row in enumerate(rows)
              if row.params.presence_penalty != 0.0 or row.params.frequency_penalty != 0.0]
    if not chosen:
        return
    device = logits.device
    row, token, count = _occurrences([rows[i].output_token_ids for i in chosen], logits.shape[1], device)
    frequency = to_device([rows[i].params.frequency_penalty for i in chosen], device, logits.dtype)[row]
    presence = to_device([rows[i].params.presence_penalty for i in chosen], device, logits.dtype)[row]
    logits[to_device(chosen, device)[row], token] -= frequency * count + presence


def _occurrences(
    token_lists: list[list[int]], vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The distinct (list index, token) pairs in token_lists and how often each occurs.

    Penalties then touch only these positions instead of whole [rows, vocab] tensors.
    """
    tokens = to_device(list(chain.from_iterable(token_lists)), device, torch.long)
    lengths = to_device([len(t) for t in token_lists], device)
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
    fallback.scatter_(1, greedy_tokens(raw[index]).unsqueeze(1), 0.0)
    penalised[index] = fallback


# ---- random sampling ---------------------------------------------------------------------------


def _sample_random(
    logits: torch.Tensor, rows: list[SamplingRow], shared_generator: torch.Generator | None
) -> torch.Tensor:
    device = logits.device
    temperature = to_device([row.params.temperature for row in rows], device, logits.dtype).unsqueeze(1)
    # The clamp keeps a raw all -inf row finite: its probabilities become all zero (token 0).
    peak = logits.amax(dim=1, keepdim=True).clamp(min=torch.finfo(logits.dtype).min)
    # Unnormalised probabilities whose row maximum is exactly 1, so min_p is a plain threshold.
    probs = _exp_((logits - peak).div_(temperature), [i for i, row in enumerate(rows) if row.masked])
    # A NaN (from a NaN or +inf logit) gets no probability, like an all -inf row: a NaN in the
    # CDF made the draw land one past the vocabulary, and that id killed the engine's next step.
    probs.nan_to_num_(nan=0.0)
    threshold = _truncation_thresholds(probs, rows)
    if threshold is not None:
        probs.masked_fill_(probs < threshold, 0.0)
    # float64 so that tail tokens of a large vocabulary keep their share of the CDF.
    cdf = probs.cumsum(dim=1, dtype=torch.float64)
    uniforms = to_device(_uniforms(rows, shared_generator), device)
    return _invert_cdf(cdf, uniforms)


def _exp_(scaled: torch.Tensor, masked: list[int]) -> torch.Tensor:
    """scaled.exp_(). Torch's CPU exp takes -inf on a slow path, and a grammar's row is mostly
    -inf: 4 masked rows of 8k added ~280 us to a 35 us exp of 16 rows. The kernel gives those
    -inf their 0 directly and every other value the bits torch's exp gives it."""
    ops = kernels() if masked and scaled.device.type == "cpu" else None
    if ops is None:
        return scaled.exp_()
    ops.exp_skipping_neg_inf_(scaled, masked)
    return scaled


def _truncation_thresholds(probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor | None:
    """Per-row [R, 1] probability below which tokens are cut (top_k, top_p, min_p); None: no cut.

    Each cut keeps a set of the most likely tokens, so one threshold expresses all three. Ties at
    the threshold are kept, as in vLLM. min_p needs no sort because the row maximum is 1.
    """
    vocab = probs.shape[1]
    cut = [i for i, row in enumerate(rows) if row.params.top_p < 1.0 or 0 < row.params.top_k < vocab]
    if not cut and not any(row.params.min_p > 0.0 for row in rows):
        return None
    threshold = to_device([row.params.min_p for row in rows], probs.device, probs.dtype).unsqueeze(1)
    if cut:
        index = to_device(cut, probs.device)
        cut_rows = [rows[i] for i in cut]
        top = _top_k_top_p_threshold(_sort_descending(take_rows(probs, cut)), cut_rows)
        threshold[index] = torch.maximum(threshold[index], top)
    return threshold


def _top_k_top_p_threshold(descending: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The smallest probability kept by top_k and then top_p (over the top-k mass), per row."""
    vocab = descending.shape[1]
    device = descending.device
    k = to_device([row.params.top_k if 0 < row.params.top_k < vocab else vocab for row in rows], device).unsqueeze(1)
    top_p = to_device([row.params.top_p for row in rows], device, descending.dtype).unsqueeze(1)
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
            uniforms[i] = _draw(row.generator)
    return uniforms


def _draw(generator: torch.Generator) -> torch.Tensor:
    """A seeded row's uniform for one step."""
    return torch.rand(1, dtype=torch.float64, generator=generator)


def replay_draws(generator: torch.Generator, state: torch.Tensor, draws: int) -> None:
    """Put `generator` where it stands `draws` steps after `state`: a verified step that drew
    for more positions than it kept leaves the generator as plain decoding of the kept ones would."""
    generator.set_state(state)
    for _ in range(draws):
        _draw(generator)


def _invert_cdf(cdf: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    total = cdf[:, -1:].contiguous()
    # side="right" lands on the first cdf step above the target, i.e. a token of non-zero
    # probability; the second search catches u * total rounding up to total itself.
    chosen = torch.searchsorted(cdf, uniforms.unsqueeze(1) * total, right=True)
    last_possible = torch.searchsorted(cdf, total)
    return torch.minimum(chosen, last_possible).squeeze(1)


# ---- logprobs ----------------------------------------------------------------------------------


def _sampled_logprobs(
    raw: torch.Tensor, rows: list[SamplingRow], tokens: torch.Tensor, wanted: list[int]
) -> PendingLogprobs | None:
    """The raw logprobs of the `wanted` rows' sampled tokens; None when no row wants any."""
    if not wanted:
        return None
    logprobs = torch.log_softmax(take_rows(raw, wanted), dim=1)
    return _token_logprobs(logprobs, take_rows(tokens, wanted), [rows[i].params.logprobs for i in wanted])


def _token_logprobs(logprobs: torch.Tensor, targets: torch.Tensor, ks: list[int]) -> PendingLogprobs:
    """Each row's logprob at its target plus its ks[i] best (token, logprob), best first.

    One topk with the largest k serves every row; each row keeps its own slice.
    """
    chosen = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1)
    widest = min(max(ks, default=0), logprobs.shape[1])
    if widest == 0:
        return PendingLogprobs(chosen, None, None, ks)
    top_values, top_ids = logprobs.topk(widest, dim=1)
    return PendingLogprobs(chosen, top_values, top_ids, ks)
