"""BERT and XLM-RoBERTa encoders in the engine, against sentence-transformers on random
checkpoints the tests write (the family's own tokenizer, float32): embeddings as
SentenceTransformer.encode makes them (CLS and mean pooling), cross-encoder scores as
CrossEncoder.predict gives them (the pair's second text typed 1 where the family types pairs),
each the same bits alone and in a batch of 64 of other lengths; a prompt runs whole, never
chunked; an encoder refuses to generate; the GGUFs llama.cpp's converter writes embed as their folders."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
from embedding_models import (engine_vectors, save_embeddinggemma, save_encoder_model, save_modernbert,
                              save_nomic_models, with_dense)
from sentence_transformers import CrossEncoder, SentenceTransformer

from tailrace.bench.peers import llamacpp
from tailrace.engine.config import EngineConfig
from tailrace.engine.core import EngineCore, EngineRequest
from tailrace.sampling_params import SamplingParams
from tailrace.serving.pooling import Pooling, resolve_task
from tailrace.tokenizer import load_tokenizer

FAMILIES = ["bert", "xlm-roberta"]
TEXTS = ["hello world", "what is the capital of france?", "the cat sat on the mat",
         "zebra quantum xylophone " * 3, "x"]
PAIRS = [("what is the capital of france?", "paris is the capital city of france."),
         ("what is the capital of france?", "the cat sat on the mat"), ("how fast is the server?", "fast"),
         ("hello", "hello world " * 10)]


def core(folder: Path, **settings: object) -> EngineCore:
    return EngineCore(EngineConfig(model=str(folder), dtype="float32", num_kv_blocks=256, **settings))


@pytest.fixture(scope="module", params=[(f, p) for f in FAMILIES for p in ("cls", "mean")],
                ids=lambda fp: "-".join(fp))
def embedder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    family, pooling = request.param
    return save_encoder_model(tmp_path_factory.mktemp(f"{family}-{pooling}"), family, pooling=pooling), pooling


@pytest.fixture(scope="module", params=FAMILIES)
def cross_encoder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_encoder_model(tmp_path_factory.mktemp(f"{request.param}-ce"), request.param, classifier=True)


def test_embeddings_are_sentence_transformers_encode(embedder):
    folder, method = embedder
    expected = SentenceTransformer(str(folder), device="cpu").encode(TEXTS, convert_to_numpy=True)
    tokenizer = load_tokenizer(str(folder))
    got = np.stack(engine_vectors(core(folder), [tokenizer.encode(t) for t in TEXTS], method))
    cosine = (got * expected).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(expected, axis=1)
    assert cosine.min() >= 0.99999, cosine


def test_cross_encoder_scores_are_sentence_transformers_predict(cross_encoder):
    expected = CrossEncoder(str(cross_encoder), device="cpu").predict(PAIRS)
    tokenizer = load_tokenizer(str(cross_encoder))
    encoded = [tokenizer.encode_pair(*pair) for pair in PAIRS]
    logits = engine_vectors(core(cross_encoder), [ids for ids, _ in encoded], "score", [start for _, start in encoded])
    scores = 1 / (1 + np.exp(-np.concatenate(logits)))
    assert np.abs(scores - expected).max() <= 1e-4, (scores, expected)


def test_bert_types_a_pairs_second_text_and_xlm_r_does_not(cross_encoder):
    ids, start = load_tokenizer(str(cross_encoder)).encode_pair(*PAIRS[0])
    if "bert" == cross_encoder.name.split("-ce")[0]:
        assert start is not None and ids[start - 1] == ids[-1]  # [SEP] ends the first text, and the pair
    else:
        assert start is None


@pytest.mark.parametrize("method", ["mean", "score"])
def test_a_prompt_is_the_same_alone_and_in_a_batch_of_64_of_other_lengths(embedder, cross_encoder, method):
    folder = embedder[0] if method == "mean" else cross_encoder
    tokenizer = load_tokenizer(str(folder))
    if method == "mean":
        target, start = tokenizer.encode(TEXTS[1]), None
        others = [(tokenizer.encode("the code " * (1 + i % 13) + str(i)), None) for i in range(63)]
    else:
        target, start = tokenizer.encode_pair(*PAIRS[0])
        others = [tokenizer.encode_pair("query " * (1 + i % 5), "document " * (1 + i % 11)) for i in range(63)]
    alone = engine_vectors(core(folder), [target], method, [start])[0]
    batch = [*others[:20], (target, start), *others[20:]]
    together = engine_vectors(core(folder), [ids for ids, _ in batch], method, [s for _, s in batch])
    assert np.array_equal(together[20], alone)


def test_a_prompt_runs_whole_never_chunked(embedder):
    folder, method = embedder
    tokenizer = load_tokenizer(str(folder))
    prompts = [ids for ids in (tokenizer.encode(t) for t in TEXTS) if len(ids) <= 16]
    assert len(prompts) >= 3 and sum(map(len, prompts)) > 16
    # a step holds the whole context however small the budget asked
    assert core(folder, max_num_batched_tokens=16).scheduler.max_num_batched_tokens == 128
    small = core(folder, max_num_batched_tokens=16, max_num_seqs=8, max_model_len=16)
    assert small.scheduler.max_num_batched_tokens == 16
    schedule, seen = small.scheduler.schedule, []

    def recording(*args):
        out = schedule(*args)
        seen.extend((item.seq.num_computed_tokens, item.num_new_tokens, item.seq.num_tokens) for item in out.scheduled)
        return out

    small.scheduler.schedule = recording
    vectors = engine_vectors(small, prompts, method)
    assert len(seen) == len(prompts) and all(done == 0 and new == total for done, new, total in seen)
    assert all(np.array_equal(a, b) for a, b in zip(vectors, engine_vectors(core(folder), prompts, method)))


def test_an_encoder_cannot_generate_and_only_a_classifier_scores(embedder):
    engine = core(embedder[0])
    with pytest.raises(ValueError, match="encoder: it embeds or scores, and cannot generate"):
        engine.add_request(EngineRequest("g", [2, 5, 3], SamplingParams(max_tokens=4)))
    with pytest.raises(ValueError, match="no classifier"):
        engine.add_request(EngineRequest("s", [2, 5, 3], SamplingParams(max_tokens=0, pooling="score")))


def test_dense_modules_run_after_pooling_as_sentence_transformers_runs_them(embedder, tmp_path):
    folder = with_dense(embedder[0], tmp_path / "dense")
    expected = SentenceTransformer(str(folder), device="cpu").encode(TEXTS, convert_to_numpy=True)
    engine = core(folder)
    assert engine.runner.model.embedding_size == expected.shape[1] == 32
    tokenizer = load_tokenizer(str(folder))
    got = np.stack(engine_vectors(engine, [tokenizer.encode(t) for t in TEXTS], embedder[1]))
    cosine = (got * expected).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(expected, axis=1)
    assert cosine.min() >= 0.99999, cosine


def convert(llamacpp_tree: Path, folder: Path, out: Path) -> Path:
    subprocess.run(llamacpp.convert_command(llamacpp_tree, folder, "f32", out), check=True, capture_output=True)
    return out


@pytest.mark.parametrize("family,pooling", [("bert", "cls"), ("bert", "mean"), ("xlm-roberta", "cls")])
def test_an_encoder_gguf_by_llama_cpps_converter_embeds_as_its_folder(llamacpp_tree, tmp_path, family, pooling):
    folder = save_encoder_model(tmp_path / family, family, pooling=pooling)
    gguf = convert(llamacpp_tree, folder, tmp_path / f"{family}.gguf")
    assert resolve_task("auto", str(gguf))[0] == Pooling(pooling, True)  # the file's pooling_type
    texts = [*TEXTS, "Héllo, Wörld!", "日本語 text", "tab\tand\nnewline", "UPPER lower 123", "  extra   spaces ",
             "ﬁ ① Ｆｕｌｌ ｗｉｄｔｈ"]
    ours, theirs = load_tokenizer(str(folder)), load_tokenizer(str(gguf))
    assert [theirs.encode(t) for t in texts] == [ours.encode(t) for t in texts]
    assert theirs.encode_pair(*PAIRS[0]) == ours.encode_pair(*PAIRS[0])
    prompts = [ours.encode(t) for t in texts]
    from_folder = engine_vectors(core(folder), prompts, pooling)
    from_gguf = engine_vectors(core(gguf), prompts, pooling)
    assert all(np.array_equal(a, b) for a, b in zip(from_folder, from_gguf))


def test_a_bert_classifiers_gguf_is_refused_by_name(llamacpp_tree, tmp_path):
    folder = save_encoder_model(tmp_path / "ce", "bert", classifier=True)
    gguf = convert(llamacpp_tree, folder, tmp_path / "ce.gguf")
    with pytest.raises(ValueError, match="writes without its pooler"):
        core(gguf)


def test_embeddinggemma_attends_both_ways_within_its_windows_as_sentence_transformers(tmp_path):
    folder = save_embeddinggemma(tmp_path)
    texts = [*TEXTS, "a longer text, whose tokens reach past the sliding window on either side of most of them"]
    expected = SentenceTransformer(str(folder), device="cpu").encode(texts, convert_to_numpy=True)
    tokenizer = load_tokenizer(str(folder))
    engine = core(folder)
    assert not engine.runner.model_config.causal and engine.runner.model_config.layer_windows == [5, 5, None]
    got = np.stack(engine_vectors(engine, [tokenizer.encode(t) for t in texts], "mean"))
    cosine = (got * expected).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(expected, axis=1)
    assert cosine.min() >= 0.99999, cosine
    assert resolve_task("auto", str(folder))[1] == ("task: embed (modules.json): the mean of the tokens' hidden "
                                                     "state, through 2 Dense module(s), normalized")


def test_an_embeddinggemma_gguf_with_its_dense_modules_embeds_as_its_folder(llamacpp_tree, tmp_path):
    # six layers: llama.cpp's gemma-embedding rule (five sliding, then a full one) is the checkpoint's
    folder = save_embeddinggemma(tmp_path / "gemma", layers=6)
    gguf = tmp_path / "gemma.gguf"
    command = llamacpp.convert_command(llamacpp_tree, folder, "f32", gguf)
    subprocess.run([*command, "--sentence-transformers-dense-modules"], check=True, capture_output=True)
    assert resolve_task("auto", str(gguf))[0] == Pooling("mean", True)
    texts = [*TEXTS, "a longer text, whose tokens reach past the sliding window on either side of most of them"]
    tokenizer = load_tokenizer(str(folder))
    prompts = [tokenizer.encode(t) for t in texts]
    assert [load_tokenizer(str(gguf)).encode(t) for t in texts] == prompts
    engine = core(gguf)
    assert not engine.runner.model_config.causal and engine.runner.model.embedding_size == 64
    from_folder = engine_vectors(core(folder), prompts, "mean")
    from_gguf = engine_vectors(engine, prompts, "mean")
    assert all(np.array_equal(a, b) for a, b in zip(from_folder, from_gguf))


def test_nomic_bert_in_both_layouts_and_its_gguf_embeds_as_sentence_transformers(llamacpp_tree, tmp_path):
    ours, hub = save_nomic_models(tmp_path)
    texts = [*TEXTS, "search_query: what is the capital of france?"]
    expected = SentenceTransformer(str(ours), device="cpu").encode(texts, convert_to_numpy=True)
    tokenizer = load_tokenizer(str(ours))
    prompts = [tokenizer.encode(t) for t in texts]
    got = np.stack(engine_vectors(core(ours), prompts, "mean"))
    cosine = (got * expected).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(expected, axis=1)
    assert cosine.min() >= 0.99999, cosine
    hub_engine = core(hub)
    assert hub_engine.max_model_len == 2048  # max_trained_positions, as llama.cpp's converter serves it
    from_hub = engine_vectors(hub_engine, prompts, "mean")
    assert all(np.array_equal(a, b) for a, b in zip(got, from_hub))
    gguf = convert(llamacpp_tree, hub, tmp_path / "nomic.gguf")
    assert resolve_task("auto", str(gguf))[0] == Pooling("mean", True)
    assert [load_tokenizer(str(gguf)).encode(t) for t in texts] == prompts
    from_gguf = engine_vectors(core(gguf), prompts, "mean")
    assert all(np.array_equal(a, b) for a, b in zip(got, from_gguf))


def test_modernbert_embeds_as_sentence_transformers(tmp_path):
    folder = save_modernbert(tmp_path / "modernbert")
    texts = [*TEXTS, "a longer text, whose tokens reach past the local window on either side of most of them"]
    expected = SentenceTransformer(str(folder), device="cpu").encode(texts, convert_to_numpy=True)
    tokenizer = load_tokenizer(str(folder))
    engine = core(folder)
    config = engine.runner.model_config
    assert config.layer_windows == [None, 5, 5, None] and config.layer_rope == ["global", "local", "local", "global"]
    got = np.stack(engine_vectors(engine, [tokenizer.encode(t) for t in texts], "mean"))
    cosine = (got * expected).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(expected, axis=1)
    assert cosine.min() >= 0.99999, cosine
