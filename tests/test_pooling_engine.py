"""Pooling in the engine core: a request with `pooling` set is one prefill (no token generated) that
ends with the pooled final hidden state, as transformers computes it from the base model's
last_hidden_state; the same split into prefill chunks, with other requests in the batch, and
with the prefix cache holding its prompt."""

from __future__ import annotations

import pytest
import torch
import transformers
from embedding_models import engine_vectors, save_embedding_model

from tailrace.engine.config import EngineConfig
from tailrace.engine.core import EngineCore, EngineRequest
from tailrace.sampling_params import SamplingParams

PROMPTS = [[5, 17, 200, 3, 99, 42, 7, 128, 64, 11, 250, 33, 12, 9], [40, 41, 42], [77],
           list(range(100, 140))]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(save_embedding_model(tmp_path_factory.mktemp("qwen3-embedding")))


def core(model_dir: str, **settings: object) -> EngineCore:
    return EngineCore(EngineConfig(model=model_dir, dtype="float32", num_kv_blocks=64, **settings))


def reference(model_dir: str, prompt: list[int], method: str) -> torch.Tensor:
    model = transformers.Qwen3Model.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = model(torch.tensor([prompt])).last_hidden_state[0]
    return {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[method]


def pooled(core: EngineCore, prompts: list[list[int]], method: str) -> list[torch.Tensor]:
    return [torch.from_numpy(v) for v in engine_vectors(core, prompts, method)]


@pytest.mark.parametrize("method", ["last", "mean", "cls"])
def test_pooled_vectors_are_transformers_hidden_states_pooled(model_dir, method):
    for prompt, vector in zip(PROMPTS, pooled(core(model_dir), PROMPTS, method)):
        torch.testing.assert_close(vector, reference(model_dir, prompt, method), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method", ["last", "mean", "cls"])
def test_chunks_a_batch_and_the_prefix_cache_change_no_bit(model_dir, method):
    alone = [pooled(core(model_dir), [p], method)[0] for p in PROMPTS]
    chunked = core(model_dir, max_num_batched_tokens=8, block_size=4)
    first = pooled(chunked, PROMPTS, method)
    again = pooled(chunked, PROMPTS, method)  # every prompt's blocks are in the prefix cache now
    for a, b, c in zip(alone, first, again):
        assert torch.equal(a, b) and torch.equal(b, c)
    assert chunked.blocks.num_free_blocks == chunked.blocks.num_blocks  # no KV kept after pooling


def test_pooling_under_tensor_parallelism_is_refused_by_name(model_dir):
    tp = EngineCore(EngineConfig(model=model_dir, dtype="float32", num_kv_blocks=64, tensor_parallel_size=2))
    try:
        with pytest.raises(ValueError, match="pooling runs on one rank"):
            tp.add_request(EngineRequest("r", [1, 2, 3], SamplingParams(max_tokens=0, pooling="last")))
    finally:
        tp.shutdown()


@pytest.fixture(scope="module")
def windowed_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(save_embedding_model(tmp_path_factory.mktemp("windowed"), use_sliding_window=True, sliding_window=5,
                                    max_window_layers=2, layer_types=["sliding_attention", "full_attention"]))


@pytest.mark.parametrize("method", ["last", "mean"])
@pytest.mark.parametrize("windowed", [False, True], ids=["full", "sliding"])
def test_a_pooling_only_engine_keeps_no_kv_and_pools_as_transformers(model_dir, windowed_dir, method, windowed):
    folder = windowed_dir if windowed else model_dir
    engine = core(folder, pooling_only=True, max_num_batched_tokens=16)
    assert not engine.runner.keeps_kv and engine.runner.cache.num_layers == 0
    assert engine.scheduler.max_num_batched_tokens == engine.max_model_len == 512  # a step holds the context
    for prompt, vector in zip(PROMPTS, pooled(engine, PROMPTS, method)):
        torch.testing.assert_close(vector, reference(folder, prompt, method), atol=1e-5, rtol=1e-5)


def test_a_pooling_only_engine_gives_a_prompt_the_same_bits_in_any_batch(model_dir):
    alone = pooled(core(model_dir, pooling_only=True), [PROMPTS[0]], "last")[0]
    others = [[(7 * i + j) % 300 + 1 for j in range(1 + i % 37)] for i in range(63)]
    together = pooled(core(model_dir, pooling_only=True), [*others[:20], PROMPTS[0], *others[20:]], "last")
    assert torch.equal(together[20], alone)


def test_a_pooling_only_engine_refuses_to_generate(model_dir):
    with pytest.raises(ValueError, match="only pools"):
        core(model_dir, pooling_only=True).add_request(EngineRequest("g", [2, 5, 3], SamplingParams(max_tokens=4)))
