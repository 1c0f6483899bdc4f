"""A causal reranker (Qwen3-Reranker's layout for sentence-transformers 6: a text-generation
Transformer, then LogitScore) in the engine and the serving layer, against sentence-transformers'
CrossEncoder.predict on random checkpoints it saves itself: each pair rendered by the chat
template (with the default instruction as a system message where the model names one), its
score the last token's "yes" logit less "no"'s (or "yes"'s alone) through the activation, within
1e-4; a truncated pair keeps the template's tail as sentence-transformers keeps it; each score
the same bits alone and in a batch of 64 of other lengths; the folder is served for scoring only."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from embedding_models import engine_vectors, save_causal_reranker
from sentence_transformers import CrossEncoder

from tailrace.engine.config import EngineConfig
from tailrace.engine.core import EngineCore, EngineRequest
from tailrace.sampling_params import SamplingParams
from tailrace.serving.pair_prompts import PairPrompts
from tailrace.serving.pooling import resolve_task
from tailrace.tokenizer import load_tokenizer

PAIRS = [("what is the capital of france?", "paris is the capital city of france."),
         ("what is the capital of france?", "the cat sat on the mat"), ("how fast is the server?", "fast"),
         ("hello", "hello world " * 10)]


def core(folder: Path) -> EngineCore:
    return EngineCore(EngineConfig(model=str(folder), dtype="float32", num_kv_blocks=256))


def scores(folder: Path, pairs: list[tuple[str, str]], max_length: int | None = None) -> np.ndarray:
    pooling, _ = resolve_task("auto", str(folder))
    tokenizer = load_tokenizer(str(folder))
    logits = engine_vectors(core(folder), [PairPrompts(tokenizer, pooling)(*p, max_length) for p in pairs], "logits")
    return 1 / (1 + np.exp(-np.concatenate(logits)))


@pytest.fixture(scope="module")
def reranker(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_causal_reranker(tmp_path_factory.mktemp("reranker"))


@pytest.mark.parametrize("variant", ["yes-no", "instruction", "yes-only"])
def test_scores_are_cross_encoder_predict(variant, reranker, tmp_path):
    folder = reranker if variant == "yes-no" else save_causal_reranker(
        tmp_path, prompt="Find the sentence about cities" if variant == "instruction" else None,
        false_token=variant != "yes-only", seed=1)
    expected = CrossEncoder(str(folder), device="cpu").predict(PAIRS)
    got = scores(folder, PAIRS)
    assert np.abs(got - expected).max() <= 1e-4, (got, expected)
    assert len(set(np.round(got, 4))) == len(PAIRS)  # the pairs score differently: the test can fail


def test_a_truncated_pair_keeps_the_templates_tail_as_sentence_transformers(reranker):
    tokenizer, (pooling, _) = load_tokenizer(str(reranker)), resolve_task("auto", str(reranker))
    full = PairPrompts(tokenizer, pooling)(*PAIRS[3])
    cut = PairPrompts(tokenizer, pooling)(*PAIRS[3], max_length=len(full) - 20)
    assert len(cut) == len(full) - 20 and cut[-12:] == full[-12:] and cut[:-30] == full[:-50]
    limit = len(full) - 20
    expected = CrossEncoder(str(reranker), device="cpu", max_length=limit).predict(PAIRS)
    assert np.abs(scores(reranker, PAIRS, limit) - expected).max() <= 1e-4


def test_a_pair_scores_the_same_alone_and_in_a_batch_of_64_of_other_lengths(reranker):
    tokenizer, (pooling, _) = load_tokenizer(str(reranker)), resolve_task("auto", str(reranker))
    target = PairPrompts(tokenizer, pooling)(*PAIRS[0])
    others = [PairPrompts(tokenizer, pooling)("query " * (1 + i % 5), "document " * (1 + i % 11)) for i in range(63)]
    alone = engine_vectors(core(reranker), [target], "logits")[0]
    together = engine_vectors(core(reranker), [*others[:20], target, *others[20:]], "logits")
    assert np.array_equal(together[20], alone)


def test_the_folder_serves_scores_only(reranker):
    pooling, line = resolve_task("auto", str(reranker))
    assert pooling.method == "logits" and pooling.score_activation == "sigmoid"
    assert line.startswith("task: score (Qwen3ForCausalLM with LogitScore)")
    for task in ("embed", "generate"):
        with pytest.raises(ValueError, match=f"a reranker .* cannot {task}"):
            resolve_task(task, str(reranker))
    engine = core(reranker)
    with pytest.raises(ValueError, match="no classifier"):
        engine.add_request(EngineRequest("s", [2, 5, 3], SamplingParams(max_tokens=0, pooling="score")))
