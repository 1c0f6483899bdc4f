"""The model runner: both KV layouts give the same tokens, and a step is launched, then collected."""

import pytest
import torch

from tailrace.engine.config import EngineConfig
from tailrace.engine.core import EngineCore, EngineRequest
from tailrace.model.attention.kv_cache import KVCache
from tailrace.model.attention.paged import PagedKVCache
from tailrace.model.cpu.kernels import kernels
from tailrace.sampling_params import SamplingParams
from test_engine_core import prompts, run

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
VOCAB = 8192  # the embedded model's


def make_core(**kwargs: object) -> EngineCore:
    return EngineCore(EngineConfig(threads=1, **kwargs))


def drain(core: EngineCore, tokens: dict[str, list[int]]) -> dict[str, list[int]]:
    """Step the core until it is idle, adding each request's new tokens to `tokens`."""
    while core.has_work():
        for o in core.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    return tokens


@pytest.fixture(scope="module")
def slab(embedded_model) -> EngineCore:
    return make_core(attention="slab")


def test_on_cpu_auto_is_float32_paged_where_tailraces_kernels_run_else_on_the_slab(embedded_model):
    if torch.cuda.is_available():
        pytest.skip("auto picks CUDA here")
    runner = make_core(num_kv_blocks=8).runner
    layout, cache = ("paged", PagedKVCache) if kernels() is not None else ("slab", KVCache)
    assert (runner.device.type, runner.backends.attention.layout, runner.model.dtype) == ("cpu", layout, torch.float32)
    assert isinstance(runner.cache, cache) and runner.graphs is None


def test_the_paged_layout_reserves_one_scratch_block_past_the_managed_ones(embedded_model):
    core = make_core(attention="paged", num_kv_blocks=8)
    assert isinstance(core.runner.cache, PagedKVCache)
    assert core.blocks.num_blocks == 8 and core.runner.cache.num_blocks == 9
    assert core.runner.inputs.scratch_block == 8


def test_paged_attention_gives_the_slab_greedy_tokens_alone_and_batched(slab):
    paged = make_core(attention="paged")
    batch = {str(i): (p, GREEDY) for i, p in enumerate(prompts(8, seed=11, vocab=VOCAB))}
    assert run(paged, batch) == run(slab, batch)
    for rid in ("0", "5"):
        assert run(paged, {rid: batch[rid]}) == run(slab, {rid: batch[rid]})


def test_paged_attention_gives_the_slab_tokens_through_chunks_prefix_hits_and_preemption(slab):
    shared = prompts(1, seed=12, vocab=VOCAB)[0][:3] * 8  # 24 tokens: three full blocks of 8
    batch = {str(i): (shared + tail[:10], GREEDY) for i, tail in enumerate(prompts(6, seed=13, vocab=VOCAB))}
    tight = make_core(attention="paged", num_kv_blocks=12, block_size=8, max_num_batched_tokens=20)
    assert run(tight, batch) == run(slab, batch)
    assert tight.scheduler.num_preemptions > 0
    assert tight.blocks.prefix_cache_hits > 0
    assert tight.blocks.num_free_blocks == 12


def test_an_abort_between_launch_and_collect_drops_that_sequences_result(embedded_model):
    core = make_core(attention="paged")
    a, b = prompts(2, seed=14, vocab=VOCAB)
    core.add_request(EngineRequest("a", a, GREEDY))
    core.add_request(EngineRequest("b", b, GREEDY))
    step = core.launch()
    assert [o.finish_reason for o in core.abort("a")] == ["abort"]
    assert [o.request_id for o in core.collect(step)] == ["b"]
    assert list(drain(core, {})) == ["b"]
    assert core.blocks.num_free_blocks == core.blocks.num_blocks


def test_a_request_added_between_launch_and_collect_runs_from_the_next_step(embedded_model, slab):
    core = make_core(attention="paged")
    a, b = prompts(2, seed=15, vocab=VOCAB)
    core.add_request(EngineRequest("a", a, GREEDY))
    step = core.launch()
    core.add_request(EngineRequest("b", b, GREEDY))
    first = core.collect(step)
    assert [o.request_id for o in first] == ["a"]
    out = drain(core, {"a": first[0].new_token_ids})
    assert {rid: [tokens] for rid, tokens in out.items()} == run(slab, {"a": (a, GREEDY), "b": (b, GREEDY)})
