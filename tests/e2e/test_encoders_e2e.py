"""Encoders through the real server and the clients, on folders the test writes, served with no
flags: a BERT sentence-transformers folder (CLS pooling, normalized) answers /v1/embeddings as
SentenceTransformer.encode; a BERT cross-encoder and a causal reranker (Qwen3-Reranker's layout)
answer /v1/rerank (Cohere's SDK too) and /v1/score as CrossEncoder.predict, and refuse embeddings
and generation with 400s that say why."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from embedding_models import save_causal_reranker, save_encoder_model
from sentence_transformers import CrossEncoder, SentenceTransformer

from e2e.conftest import serving

QUERY = "what is the capital of france?"
DOCUMENTS = ["paris is the capital city of france.", "the cat sat on the mat", "france", "hello world " * 4]


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_encoder_model(tmp_path_factory.mktemp("bert") / "model", "bert", pooling="cls")


@pytest.fixture(scope="module")
def reranker_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_encoder_model(tmp_path_factory.mktemp("reranker") / "model", "bert", classifier=True, seed=3)


@pytest.fixture(scope="module")
def bert_url(bert_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from serving([str(bert_dir), "--served-model-name", "bge"], tmp_path_factory.mktemp("bert") / "server.log")


@pytest.fixture(scope="module")
def reranker_url(reranker_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from serving([str(reranker_dir), "--served-model-name", "reranker"],
                       tmp_path_factory.mktemp("reranker") / "server.log")


def test_bert_embeddings_are_sentence_transformers_encode(bert_dir, bert_url):
    texts = [QUERY, *DOCUMENTS]
    expected = SentenceTransformer(str(bert_dir), device="cpu").encode(texts, convert_to_numpy=True)
    client = openai.OpenAI(base_url=f"{bert_url}/v1", api_key="unused", max_retries=0)
    answer = client.embeddings.create(model="bge", input=texts, encoding_format="float")
    got = np.array([d.embedding for d in answer.data], dtype=np.float32)
    assert ((got * expected).sum(1) >= 0.99999).all()
    over = httpx.post(f"{bert_url}/v1/embeddings", json={"model": "bge", "input": "hello " * 200}, timeout=60)
    assert over.status_code == 400 and "limit of 128 tokens" in over.json()["error"]["message"]


def test_rerank_scores_are_cross_encoder_predict(reranker_dir, reranker_url):
    expected = CrossEncoder(str(reranker_dir), device="cpu").predict([(QUERY, d) for d in DOCUMENTS])
    best = sorted(range(len(DOCUMENTS)), key=lambda i: -expected[i])
    answer = httpx.post(f"{reranker_url}/v1/rerank", timeout=60,
                        json={"model": "reranker", "query": QUERY, "documents": DOCUMENTS}).json()
    assert [r["index"] for r in answer["results"]] == best
    assert np.allclose([r["relevance_score"] for r in answer["results"]], expected[best], atol=1e-4)
    score = httpx.post(f"{reranker_url}/v1/score", timeout=60,
                       json={"model": "reranker", "text_1": [QUERY, DOCUMENTS[1]], "text_2": DOCUMENTS[:2]}).json()
    pairwise = CrossEncoder(str(reranker_dir), device="cpu").predict([(QUERY, DOCUMENTS[0]),
                                                                      (DOCUMENTS[1], DOCUMENTS[1])])
    assert np.allclose([d["score"] for d in score["data"]], pairwise, atol=1e-4)


def test_the_cohere_sdk_reranks_with_the_cross_encoder(reranker_url):
    import cohere

    expected = httpx.post(f"{reranker_url}/v1/rerank", timeout=60,
                          json={"query": QUERY, "documents": DOCUMENTS, "top_n": 2}).json()["results"]
    answer = cohere.ClientV2(base_url=reranker_url, api_key="unused").rerank(model="reranker", query=QUERY,
                                                                              documents=DOCUMENTS, top_n=2)
    assert [(r.index, r.relevance_score) for r in answer.results] == [
        (r["index"], r["relevance_score"]) for r in expected]


def test_a_cross_encoder_makes_no_embeddings_and_generates_nothing(reranker_url):
    embeddings = httpx.post(f"{reranker_url}/v1/embeddings", json={"model": "reranker", "input": "x"}, timeout=60)
    assert embeddings.status_code == 400 and "cross-encoder" in embeddings.json()["error"]["message"]
    chat = httpx.post(f"{reranker_url}/v1/chat/completions", timeout=60,
                      json={"model": "reranker", "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 400
    long = httpx.post(f"{reranker_url}/v1/rerank", timeout=60,
                      json={"query": QUERY, "documents": ["hello " * 200]})
    assert long.status_code == 400 and long.json()["error"]["param"] == "documents"
    cut = httpx.post(f"{reranker_url}/v1/rerank", timeout=60,
                     json={"query": QUERY, "documents": ["hello " * 200], "truncate_prompt_tokens": -1})
    assert cut.status_code == 200 and cut.json()["usage"]["total_tokens"] == 128


@pytest.fixture(scope="module")
def causal_reranker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str]]:
    folder = save_causal_reranker(tmp_path_factory.mktemp("causal"), prompt="Find the sentence about cities")
    for url in serving([str(folder), "--served-model-name", "qwen3-reranker"],
                       tmp_path_factory.mktemp("causal") / "server.log"):
        yield folder, url


def test_a_causal_reranker_ranks_and_scores_as_cross_encoder_predict(causal_reranker):
    folder, url = causal_reranker
    expected = CrossEncoder(str(folder), device="cpu").predict([(QUERY, d) for d in DOCUMENTS])
    best = sorted(range(len(DOCUMENTS)), key=lambda i: -expected[i])
    answer = httpx.post(f"{url}/v1/rerank", timeout=60, json={"query": QUERY, "documents": DOCUMENTS}).json()
    assert [r["index"] for r in answer["results"]] == best
    assert np.allclose([r["relevance_score"] for r in answer["results"]], expected[best], atol=1e-4)
    score = httpx.post(f"{url}/v1/score", timeout=60, json={"text_1": QUERY, "text_2": DOCUMENTS[:2]}).json()
    assert np.allclose([d["score"] for d in score["data"]], expected[:2], atol=1e-4)
    embeddings = httpx.post(f"{url}/v1/embeddings", json={"input": "x"}, timeout=60)
    assert embeddings.status_code == 400 and "cross-encoder" in embeddings.json()["error"]["message"]
    chat = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={"messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 400
