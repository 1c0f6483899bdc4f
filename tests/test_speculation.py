"""Speculative decoding keeps exactly plain decoding's tokens and logprobs: greedy and seeded,
alone and batched, with chunked prefill, prefix-cache hits, preemption and n > 1."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tailrace.engine.config import EngineConfig
from tailrace.engine.core import EngineCore, EngineRequest
from tailrace.engine.sampler import make_generator, replay_draws
from tailrace.engine.sequence import Sequence
from tailrace.engine.speculation.config import SpeculativeConfig, parse_speculative_config
from tailrace.engine.speculation.ngram import NgramIndex, NgramProposer
from tailrace.engine.speculation.speculator import MAX_PAUSE, Speculator, accepted_count
from tailrace.sampling_params import SamplingParams
from tailrace.tokenizer import load_tokenizer

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


# ---- the config -----------------------------------------------------------------------------------

def test_config_reads_vllms_json_and_defaults_the_window_as_vllm_does():
    assert parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}') == \
        SpeculativeConfig("ngram", 4, 3, 3)
    assert parse_speculative_config({"method": "[ngram]", "num_speculative_tokens": 2}) == \
        SpeculativeConfig("ngram", 2, 5, 5)
    assert parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2}) == \
        SpeculativeConfig("ngram", 2, 2, 2)
    assert parse_speculative_config(None) is None


@pytest.mark.parametrize("bad, words", [
    ("{not json", "not JSON"),
    ("[1]", "JSON object"),
    ({"method": "ngram"}, "needs num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "positive integer"),
    ({"method": "ngram", "num_speculative_tokens": True}, "positive integer"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "'eagle' is not served"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, 'needs "model"'),
    ({"method": "ngram", "model": "/some/draft", "num_speculative_tokens": 2}, "takes none"),
    ({"model": "/some/draft", "num_speculative_tokens": 2, "prompt_lookup_max": 2}, "unknown speculative config"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "over"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 2}, "unknown speculative config keys"),
])
def test_bad_configs_are_refused_naming_what_is_wrong(bad, words):
    with pytest.raises(ValueError, match=words):
        parse_speculative_config(bad)


def test_a_model_means_a_draft_model_as_in_vllm():
    assert parse_speculative_config({"model": "/drafts/0.5b", "num_speculative_tokens": 3}) == \
        SpeculativeConfig("draft_model", 3, model="/drafts/0.5b")


def test_engine_config_keeps_the_config_parsed():
    assert EngineConfig(speculative_config=NGRAM).speculative_config == SpeculativeConfig("ngram", 4, 1, 3)


# ---- proposing and judging --------------------------------------------------------------------------

def seq_of(tokens: list[int], prompt_len: int, max_tokens: int = 1000) -> Sequence:
    seq = Sequence(0, "r", 0, tokens[:prompt_len], SamplingParams(), max_tokens)
    seq.output_token_ids = tokens[prompt_len:]
    seq.num_computed_tokens = len(tokens) - 1
    return seq


def lookup(tokens: list[int], low: int, high: int, k: int) -> list[int]:
    """The proposal by definition: the latest earlier occurrence of the longest suffix."""
    for n in range(min(high, len(tokens)), low - 1, -1):
        suffix = tokens[len(tokens) - n:]
        for end in range(len(tokens) - 1, n - 1, -1):
            if tokens[end - n:end] == suffix:
                guess = tokens[end:end + k]
                while len(guess) < k:  # what follows a match that overlaps the suffix repeats
                    guess.append(guess[len(guess) - (len(tokens) - end)])
                return guess
    return []


def test_ngram_proposes_what_followed_the_latest_earlier_occurrence_of_the_longest_suffix():
    index = NgramIndex(1, 3)
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    assert index.propose(seq_of(tokens, 4), 3) == [7, 8, 5]  # "2 3" last ended before 7; "5 2 3" never
    assert NgramIndex(1, 3).propose(seq_of([4, 1, 2, 1, 2], 2), 5) == [1, 2, 1, 2, 1]  # "1 2" repeats
    assert NgramIndex(3, 3).propose(seq_of(tokens, 4), 3) == []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=60), st.integers(1, 3), st.integers(0, 3),
       st.integers(1, 5), st.data())
def test_ngram_index_grown_step_by_step_proposes_what_a_full_search_finds(tokens, low, extra, k, data):
    high = low + extra
    index = NgramIndex(low, high)
    length = 1
    while True:
        seq = seq_of(tokens[:length], max(1, length // 2))
        assert index.propose(seq, k) == lookup(tokens[:length], low, high, k)
        if length == len(tokens):
            break
        length = data.draw(st.integers(length + 1, len(tokens)))


def test_accepted_count_is_the_prefix_where_the_sampled_tokens_are_the_guesses():
    assert accepted_count([5, 6, 7], [5, 6]) == 2
    assert accepted_count([5, 9, 7], [5, 6]) == 1
    assert accepted_count([4, 6, 7], [5, 6]) == 0


def ngram_speculator(k: int, max_model_len: int) -> Speculator:
    return Speculator(SpeculativeConfig("ngram", k, 1, 1), max_model_len, NgramProposer(1, 1))


def test_guesses_shrink_after_a_miss_pause_after_a_total_miss_and_grow_back():
    spec = ngram_speculator(4, max_model_len=10_000)
    seq = seq_of([1, 2] * 20, 4)
    assert spec.propose([seq]) == {0: [1, 2, 1, 2]}
    spec.record(seq, 4, 1)
    assert spec.propose([seq]) == {0: [1, 2]}
    spec.record(seq, 2, 0)  # nothing stood: one step without guessing, then the pause doubles
    assert spec.propose([seq]) == {}
    assert spec.propose([seq]) == {0: [1]}
    spec.record(seq, 1, 0)
    assert [spec.propose([seq]) for _ in range(3)] == [{}, {}, {0: [1]}]
    spec.record(seq, 1, 1)
    assert spec.propose([seq]) == {0: [1, 2]}
    for _ in range(10):
        spec.record(seq, 1, 0)
        while not spec.propose([seq]):
            pass
    assert spec._seqs[0].backoff == MAX_PAUSE
    assert spec.stats.num_drafts == 14 and spec.stats.accepted_per_position == [2, 0, 0, 0]


def test_guesses_leave_room_for_one_token_within_max_tokens_and_the_context():
    spec = ngram_speculator(4, max_model_len=10_000)
    tokens = [1, 2] * 20
    assert spec.propose([seq_of(tokens, 4, max_tokens=40)]) == {0: [1, 2, 1]}  # 36 made, 4 left
    assert spec.propose([seq_of(tokens, 4, max_tokens=37)]) == {}
    spec = ngram_speculator(4, max_model_len=42)
    assert spec.propose([seq_of(tokens, 4)]) == {0: [1, 2]}  # 40 tokens: positions 40 and 41 are left


def test_replayed_draws_leave_the_generator_where_that_many_steps_leave_it():
    plain = make_generator(7)
    state = plain.get_state()
    wanted = [float(torch.rand(1, dtype=torch.float64, generator=plain)) for _ in range(5)]
    guessed = make_generator(7)
    for _ in range(4):
        torch.rand(1, dtype=torch.float64, generator=guessed)
    replay_draws(guessed, state, 2)
    assert [float(torch.rand(1, dtype=torch.float64, generator=guessed)) for _ in range(3)] == wanted[2:]


# ---- the engine -------------------------------------------------------------------------------------

def run(core: EngineCore, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list]:
    """Token ids and (logprob, top) per request and choice."""
    out: dict[str, list] = {rid: [([], []) for _ in range(p.n)] for rid, (_, p) in requests.items()}
    for rid, (ids, params) in requests.items():
        core.add_request(EngineRequest(rid, ids, params))
    while core.has_work():
        for o in core.step():
            ids, lps = out[o.request_id][o.sibling]
            ids.extend(o.new_token_ids)
            lps.extend((lp.logprob, lp.top) for lp in o.new_logprobs or [])
    return out


def repetitive_prompts(k: int, seed: int) -> list[list[int]]:
    """Prompts of repeated phrases, so that lookups find earlier occurrences."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(k):
        phrase = [rng.randrange(3, 8000) for _ in range(rng.randrange(3, 9))]
        prompts.append([rng.randrange(3, 8000) for _ in range(rng.randrange(0, 20))] + phrase * rng.randrange(2, 6))
    return prompts


def core_of(spec: dict | None, **kwargs: object) -> EngineCore:
    return EngineCore(EngineConfig(speculative_config=spec, **kwargs))


def assert_speculated(core: EngineCore) -> None:
    """The run guessed, and some guesses stood: otherwise the comparison proved nothing."""
    stats = core.speculator.stats
    assert stats.num_draft_tokens > stats.num_accepted_tokens > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_tokens_and_logprobs_equal_plain_decoding_alone_and_in_a_batch(embedded_model, dtype):
    ps = repetitive_prompts(12, seed=1)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=3)
    requests = {str(i): (p, params) for i, p in enumerate(ps)}
    plain = {rid: run(core_of(None, dtype=dtype), {rid: r})[rid] for rid, r in list(requests.items())[:3]}
    spec = core_of(NGRAM, dtype=dtype)
    batched = run(spec, requests)
    assert_speculated(spec)
    assert {rid: batched[rid] for rid in plain} == plain
    assert batched == run(core_of(None, dtype=dtype), requests)


def test_seeded_sampling_with_penalties_draws_plain_decodings_tokens(embedded_model):
    ps = repetitive_prompts(8, seed=2)
    params = [SamplingParams(max_tokens=40, temperature=t, seed=i, top_p=0.9, repetition_penalty=r,
                             frequency_penalty=f, min_tokens=10, logprobs=1)
              for i, (t, r, f) in enumerate([(0.3, 1.0, 0.0), (0.5, 1.1, 0.0), (0.2, 1.0, 0.5), (1.0, 1.0, 0.0)] * 2)]
    requests = {str(i): (p, sp) for i, (p, sp) in enumerate(zip(ps, params))}
    spec = core_of(NGRAM)
    assert run(spec, requests) == run(core_of(None), requests)
    assert_speculated(spec)


def test_chunked_prefill_prefix_hits_and_preemption_with_guesses_change_nothing(embedded_model):
    rng = random.Random(9)
    shared = [rng.randrange(3, 8000) for _ in range(40)]
    ps = [shared + p for p in repetitive_prompts(4, seed=9)] + repetitive_prompts(4, seed=10)
    params = [SamplingParams(max_tokens=40, temperature=0.3 if i % 2 else 0, seed=i, ignore_eos=True)
              for i in range(len(ps))]
    requests = {str(i): (p, sp) for i, (p, sp) in enumerate(zip(ps, params))}
    alone = {rid: run(core_of(None, enable_prefix_caching=False), {rid: r})[rid] for rid, r in requests.items()}
    assert run(core_of(NGRAM, max_num_batched_tokens=7), requests) == alone
    cached = core_of(NGRAM)
    run(cached, {"warm": (shared + [5], params[0])})
    assert run(cached, requests) == alone
    assert cached.blocks.prefix_cache_hits > 0
    tight = core_of(NGRAM, num_kv_blocks=20, block_size=8)
    assert run(tight, requests) == alone
    assert tight.scheduler.num_preemptions > 0
    assert_speculated(tight)
    assert tight.blocks.num_free_blocks == 20


def test_siblings_and_stops_end_where_plain_decoding_ends(embedded_model):
    ps = repetitive_prompts(6, seed=3)
    plain_run = run(core_of(None), {"probe": (ps[0], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))})
    stop_token = plain_run["probe"][0][0][7]
    params = [SamplingParams(n=3, max_tokens=25, temperature=0.4, seed=5),
              SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop_token_ids=[stop_token]),
              SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)]
    requests = {f"{i}-{j}": (p, sp) for i, p in enumerate(ps) for j, sp in enumerate(params)}
    spec = core_of(NGRAM)
    got = run(spec, requests)
    assert got == run(core_of(None), requests)
    assert all(len(got[f"{i}-2"][0][0]) == 3 for i in range(len(ps)))
    assert got["0-1"][0][0][-1] == stop_token and len(got["0-1"][0][0]) <= 8
    assert_speculated(spec)


def test_the_context_limit_ends_a_guessing_sequence_where_it_ends_a_plain_one(embedded_model):
    p = repetitive_prompts(1, seed=4)[0]
    params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    limit = len(p) + 23
    spec = core_of(NGRAM, max_model_len=limit)
    got = run(spec, {"r": (p, params)})
    assert got == run(core_of(None, max_model_len=limit), {"r": (p, params)})
    assert len(got["r"][0][0]) == 23


# ---- a draft model ----------------------------------------------------------------------------------

def tiny_prompts(k: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(rng.randrange(4, 60))] for _ in range(k)]


def draft(path: str, k: int = 3) -> dict:
    return {"model": path, "num_speculative_tokens": k}


def test_a_draft_model_keeps_plain_decodings_tokens_whether_its_guesses_land_or_not(tiny_checkpoint, tmp_path):
    from conftest import make_tiny_checkpoint

    other = str(make_tiny_checkpoint(tmp_path / "other", seed=1))
    params = [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=30, temperature=0.7, seed=3, ignore_eos=True, logprobs=1),
              SamplingParams(n=2, max_tokens=20, temperature=1.0, seed=5, ignore_eos=True)]
    requests = {f"{i}-{j}": (p, sp) for i, p in enumerate(tiny_prompts(6, seed=7)) for j, sp in enumerate(params)}
    plain = run(core_of(None, model=tiny_checkpoint), requests)
    itself = core_of(draft(tiny_checkpoint), model=tiny_checkpoint)
    assert run(itself, requests) == plain
    stats = itself.speculator.stats
    assert stats.num_accepted_tokens > 0.5 * stats.num_draft_tokens  # the same model guesses greedy tokens right
    stranger = core_of(draft(other), model=tiny_checkpoint)
    assert run(stranger, requests) == plain
    assert stranger.speculator.stats.num_draft_tokens > 0


def test_a_draft_model_under_chunking_and_preemption_changes_nothing(tiny_checkpoint):
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    requests = {str(i): (p, params) for i, p in enumerate(tiny_prompts(8, seed=8))}
    plain = run(core_of(None, model=tiny_checkpoint), requests)
    tight = core_of(draft(tiny_checkpoint, k=4), model=tiny_checkpoint, num_kv_blocks=24, block_size=8,
                    max_num_batched_tokens=24)
    assert run(tight, requests) == plain
    assert tight.scheduler.num_preemptions > 0 and tight.speculator.stats.num_accepted_tokens > 0
    assert tight.blocks.num_free_blocks == 24
    assert tight.speculator.proposer.blocks.num_free_blocks == tight.speculator.proposer.runner.num_blocks


def test_a_draft_model_of_another_vocabulary_is_refused(embedded_model, tiny_checkpoint):
    with pytest.raises(ValueError, match="share the served model's tokenizer"):
        core_of(draft(tiny_checkpoint))


def test_a_missing_draft_model_is_named_before_anything_loads(tmp_path):
    with pytest.raises(ValueError, match="nowhere"):
        EngineConfig(speculative_config=draft(str(tmp_path / "nowhere"))).validate()


def test_a_draft_model_read_from_a_quantized_gguf_guesses_for_its_float_original(embedded_model, tmp_path):
    from gguf import GGMLQuantizationType as Q
    from gguf_writer import write_gguf

    gguf_draft = str(write_gguf(tmp_path / "draft-q8_0.gguf", Q.Q8_0))
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=1)
    requests = {str(i): (p, params) for i, p in enumerate(repetitive_prompts(4, seed=11))}
    spec = core_of(draft(gguf_draft, k=4))
    assert run(spec, requests) == run(core_of(None), requests)
    stats = spec.speculator.stats
    assert stats.num_accepted_tokens > 0.5 * stats.num_draft_tokens


# ---- under a grammar ----------------------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {
    "type": "string", "enum": ["alpha", "beta", "gamma"]}}}, "required": ["name", "tags"]}


def test_guesses_under_a_grammar_keep_plain_decodings_valid_answers(embedded_model):
    """The grammar cuts each guess where it refuses a token, masks every guessed position as plain
    decoding would mask it, and its closing (answers cut by max_tokens) ends a kept run."""
    import json

    from tailrace.sampling_params import StructuredSpec

    spec = StructuredSpec(json.dumps(SCHEMA))
    params = [SamplingParams(max_tokens=80, temperature=0, structured=spec, logprobs=1),
              SamplingParams(max_tokens=60, temperature=0.8, seed=4, structured=spec),
              SamplingParams(max_tokens=14, temperature=1.0, seed=9, structured=spec)]
    ps = repetitive_prompts(4, seed=12)
    requests = {f"{i}-{j}": (p, sp) for i, p in enumerate(ps) for j, sp in enumerate(params)}
    guessing = core_of(NGRAM)
    got = run(guessing, requests)
    assert got == run(core_of(None), requests)
    assert_speculated(guessing)
    texts = [load_tokenizer(embedded_model).decode(got[f"{i}-0"][0][0]) for i in range(len(ps))]
    assert all(isinstance(json.loads(text), dict) for text in texts)
