"""/v1/embeddings, /v1/score and /v1/rerank through the real server and the clients (openai,
LangChain's OpenAIEmbeddings, LlamaIndex's OpenAILikeEmbedding, Cohere's v1 and v2 rerank), on a
sentence-transformers folder the test writes (a random Qwen3 base model, last-token pooling,
normalized), served with no flags:
- each vector is sentence-transformers' `encode` of the same text (cosine >= 0.99999, float32);
- a text's vector is the same, bit for bit, alone and in a batch of 64 inputs of other lengths;
- base64 is the float vector's bytes; token-id inputs are the text's ids;
- a score is the cosine of the two texts' vectors, and rerank orders documents by it;
- inputs that cannot be embedded get OpenAI-shaped 400s, and the generation routes say the model
  is served for embeddings; a chat model's server says it serves no embeddings.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from embedding_models import save_embedding_model
from sentence_transformers import SentenceTransformer

from e2e.conftest import serving

TEXTS = ["The list type", "def add(a, b):\n    return a + b", "x", "héllo 日本 world " * 12,
         "If the file does not exist, open() raises FileNotFoundError."]
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def embedder_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_embedding_model(tmp_path_factory.mktemp("embedder") / "model")


@pytest.fixture(scope="module")
def embed_url(embedder_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("embed-server") / "server.log"
    yield from serving([str(embedder_dir), "--served-model-name", "embedder", "--max-model-len", str(MAX_MODEL_LEN)],
                       log)


@pytest.fixture(scope="module")
def client(embed_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{embed_url}/v1", api_key="unused", max_retries=0)


def test_vectors_are_sentence_transformers_encode(client, embedder_dir):
    expected = SentenceTransformer(str(embedder_dir), device="cpu").encode(TEXTS, convert_to_numpy=True)
    answer = client.embeddings.create(model="embedder", input=TEXTS, encoding_format="float")
    assert [d.index for d in answer.data] == list(range(len(TEXTS)))
    got = np.array([d.embedding for d in answer.data], dtype=np.float32)
    cosine = (got * expected).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(expected, axis=1)
    assert cosine.min() >= 0.99999, cosine
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)
    assert answer.usage.prompt_tokens == answer.usage.total_tokens > len(TEXTS)


def test_a_named_prompt_goes_before_each_text_as_sentence_transformers_puts_it(client, embedder_dir):
    expected = SentenceTransformer(str(embedder_dir), device="cpu").encode(TEXTS[:2], prompt_name="query",
                                                                          convert_to_numpy=True)
    got = np.array([d.embedding for d in client.embeddings.create(
        model="embedder", input=TEXTS[:2], encoding_format="float", extra_body={"prompt_name": "query"}).data])
    assert ((got * expected).sum(1) >= 0.99999).all()
    with pytest.raises(openai.BadRequestError, match="prompt_name 'passage' is not a prompt of this model"):
        client.embeddings.create(model="embedder", input="x", extra_body={"prompt_name": "passage"})


def test_metrics_count_embedding_requests_and_their_tokens(client, embed_url):
    def counters() -> dict[str, float]:
        text = httpx.get(f"{embed_url}/metrics", timeout=60).text
        return {line.split("{")[0]: float(line.split()[-1]) for line in text.splitlines()
                if line.startswith(("tailrace:pooling_requests_total", "tailrace:pooling_prompt_tokens_total"))}
    before = counters()
    answer = client.embeddings.create(model="embedder", input=TEXTS[:2], encoding_format="float")
    after = counters()
    assert after["tailrace:pooling_requests_total"] - before["tailrace:pooling_requests_total"] == 1
    assert (after["tailrace:pooling_prompt_tokens_total"] - before["tailrace:pooling_prompt_tokens_total"]
            == answer.usage.prompt_tokens)


def test_a_vector_is_the_same_alone_and_in_a_batch_of_64(client):
    others = [("word " * (1 + i % 17)) + str(i) for i in range(63)]
    alone = client.embeddings.create(model="embedder", input=TEXTS[1], encoding_format="float").data[0].embedding
    batch = client.embeddings.create(model="embedder", input=[*others[:30], TEXTS[1], *others[30:]],
                                     encoding_format="float").data
    assert len(batch) == 64 and batch[30].embedding == alone


def test_base64_is_the_float_vectors_little_endian_bytes(embed_url):
    def create(encoding_format: str) -> dict:
        body = {"model": "embedder", "input": TEXTS[0], "encoding_format": encoding_format}
        return httpx.post(f"{embed_url}/v1/embeddings", json=body, timeout=60).json()["data"][0]["embedding"]
    floats = np.array(create("float"), dtype=np.float32)
    assert np.array_equal(np.frombuffer(base64.b64decode(create("base64")), dtype="<f4"), floats)


def test_token_ids_embed_as_their_text(client, embed_url):
    ids = httpx.post(f"{embed_url}/tokenize", json={"model": "embedder", "prompt": TEXTS[4]}, timeout=60).json()
    by_text = client.embeddings.create(model="embedder", input=TEXTS[4], encoding_format="float").data[0].embedding
    by_ids = client.embeddings.create(model="embedder", input=[ids["tokens"]], encoding_format="float")
    assert by_ids.data[0].embedding == by_text


@pytest.mark.parametrize("body,param,words", [
    ({"input": "word " * 300}, "input", "limit of 256 tokens"),
    ({"input": ""}, "input", "empty"),
    ({"input": "x", "dimensions": 8}, "dimensions", "Matryoshka"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format", None),
    ({"input": [[1, 10 ** 9]]}, "input", None),
])
def test_inputs_that_cannot_be_embedded_are_400s_that_say_why(embed_url, body, param, words):
    response = httpx.post(f"{embed_url}/v1/embeddings", json={"model": "embedder", **body}, timeout=60)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and (words is None or words in error["message"]), error


def test_truncate_prompt_tokens_keeps_the_last_tokens(client, embed_url):
    long = "word " * 300
    ids = httpx.post(f"{embed_url}/tokenize", json={"model": "embedder", "prompt": long}, timeout=60).json()["tokens"]
    cut = client.embeddings.create(model="embedder", input=long, encoding_format="float",
                                   extra_body={"truncate_prompt_tokens": 100})
    last = client.embeddings.create(model="embedder", input=[ids[-100:]], encoding_format="float")
    assert cut.data[0].embedding == last.data[0].embedding and cut.usage.prompt_tokens == 100


def test_the_generation_routes_say_the_model_serves_embeddings(embed_url):
    chat = httpx.post(f"{embed_url}/v1/chat/completions", timeout=60,
                      json={"model": "embedder", "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 400 and "--task embed" in chat.json()["error"]["message"]
    messages = httpx.post(f"{embed_url}/v1/messages", timeout=60, json={
        "model": "embedder", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]})
    assert messages.status_code == 400 and messages.json()["type"] == "error"


@pytest.mark.parametrize("path,body", [("/v1/embeddings", {"input": "hi"}),
                                       ("/v1/rerank", {"query": "hi", "documents": ["a"]})])
def test_a_chat_models_server_serves_no_embeddings(server_url, auth, path, body):
    response = httpx.post(server_url + path, headers=auth, json={"model": "tiny", **body}, timeout=60)
    assert response.status_code == 400 and "--task embed" in response.json()["error"]["message"]


def test_langchain_openai_embeddings_are_the_servers(client, embed_url):
    from langchain_openai import OpenAIEmbeddings

    # As vLLM documents for any server but OpenAI's: otherwise LangChain sends tiktoken's token ids.
    embedder = OpenAIEmbeddings(model="embedder", base_url=f"{embed_url}/v1", api_key="unused",
                                check_embedding_ctx_length=False)
    expected = [d.embedding for d in client.embeddings.create(model="embedder", input=TEXTS[:3],
                                                              encoding_format="float").data]
    assert np.allclose(embedder.embed_documents(TEXTS[:3]), expected, atol=1e-7)
    assert np.allclose(embedder.embed_query(TEXTS[0]), expected[0], atol=1e-7)


def test_llamaindex_openai_like_embeddings_are_the_servers(client, embed_url):
    from llama_index.embeddings.openai_like import OpenAILikeEmbedding

    embedder = OpenAILikeEmbedding(model_name="embedder", api_base=f"{embed_url}/v1", api_key="unused",
                                   embed_batch_size=2, max_retries=0)
    # LlamaIndex sends each text with its newlines as spaces, as OpenAI once advised
    sent = [text.replace("\n", " ") for text in TEXTS[:3]]
    expected = [d.embedding for d in client.embeddings.create(model="embedder", input=sent,
                                                              encoding_format="float").data]
    assert np.allclose(embedder.get_text_embedding_batch(TEXTS[:3]), expected, atol=1e-7)  # two requests
    assert np.allclose(embedder.get_query_embedding(TEXTS[0]), expected[0], atol=1e-7)


def cosine(a: list[float], b: list[float]) -> float:
    return float(np.dot(a, b) / np.linalg.norm(a) / np.linalg.norm(b))


def test_score_is_the_cosine_of_the_two_texts_embeddings(client, embed_url):
    vectors = [d.embedding for d in client.embeddings.create(model="embedder", input=TEXTS[:3],
                                                             encoding_format="float").data]
    one = httpx.post(f"{embed_url}/v1/score", timeout=60,
                     json={"model": "embedder", "text_1": TEXTS[0], "text_2": TEXTS[1:3]}).json()
    assert [d["index"] for d in one["data"]] == [0, 1] and one["object"] == "list"
    assert np.allclose([d["score"] for d in one["data"]], [cosine(vectors[0], v) for v in vectors[1:3]], atol=1e-6)
    pairwise = httpx.post(f"{embed_url}/score", timeout=60,
                          json={"text_1": TEXTS[:2], "text_2": [TEXTS[2], TEXTS[0]]}).json()["data"]
    assert np.allclose([d["score"] for d in pairwise], [cosine(vectors[0], vectors[2]), cosine(vectors[1], vectors[0])],
                       atol=1e-6)
    mismatched = httpx.post(f"{embed_url}/v1/score", timeout=60, json={"text_1": TEXTS[:2], "text_2": TEXTS[:3]})
    assert mismatched.status_code == 400 and mismatched.json()["error"]["param"] == "text_1"


def test_rerank_orders_the_documents_by_that_cosine(client, embed_url):
    query, documents = TEXTS[0], TEXTS[1:]
    vectors = [d.embedding for d in client.embeddings.create(model="embedder", input=[query, *documents],
                                                             encoding_format="float").data]
    scores = [cosine(vectors[0], v) for v in vectors[1:]]
    best = sorted(range(len(documents)), key=lambda i: -scores[i])[:2]
    for path in ("/v1/rerank", "/v2/rerank"):
        answer = httpx.post(embed_url + path, timeout=60, json={
            "model": "embedder", "query": query, "documents": [documents[0], *({"text": d} for d in documents[1:])],
            "top_n": 2}).json()
        assert [r["index"] for r in answer["results"]] == best
        assert np.allclose([r["relevance_score"] for r in answer["results"]], [scores[i] for i in best], atol=1e-6)
        assert [r["document"]["text"] for r in answer["results"]] == [documents[i] for i in best]
        assert answer["usage"]["total_tokens"] > 0
    bare = httpx.post(f"{embed_url}/rerank", timeout=60,
                      json={"query": query, "documents": documents, "return_documents": False}).json()
    assert len(bare["results"]) == len(documents) and "document" not in bare["results"][0]


def test_the_cohere_sdk_reranks_through_v1_and_v2(embed_url):
    import cohere

    query, documents = TEXTS[0], TEXTS[1:]
    expected = httpx.post(f"{embed_url}/v1/rerank", timeout=60,
                          json={"query": query, "documents": documents, "top_n": 3}).json()["results"]
    v2 = cohere.ClientV2(base_url=embed_url, api_key="unused").rerank(model="embedder", query=query,
                                                                       documents=documents, top_n=3)
    v1 = cohere.Client(base_url=embed_url, api_key="unused").rerank(model="embedder", query=query,
                                                                     documents=documents, top_n=3)
    for answer in (v2, v1):
        assert [(r.index, r.relevance_score) for r in answer.results] == [
            (r["index"], r["relevance_score"]) for r in expected]


def test_ollamas_api_embed_answers_in_its_shape(client, embed_url):
    expected = [d.embedding for d in client.embeddings.create(model="embedder", input=TEXTS[:2],
                                                              encoding_format="float").data]
    answer = httpx.post(f"{embed_url}/api/embed", json={"model": "embedder", "input": TEXTS[:2]}, timeout=60).json()
    assert answer["model"] == "embedder" and answer["embeddings"] == expected
    assert answer["prompt_eval_count"] > 0 and answer["total_duration"] > 0
    long = "word " * 300
    ids = httpx.post(f"{embed_url}/tokenize", json={"model": "embedder", "prompt": long}, timeout=60).json()["tokens"]
    cut = httpx.post(f"{embed_url}/api/embed", json={"model": "embedder", "input": long}, timeout=60).json()
    start = client.embeddings.create(model="embedder", input=[ids[:MAX_MODEL_LEN]], encoding_format="float")
    assert cut["embeddings"][0] == start.data[0].embedding  # Ollama cuts the end
    refused = httpx.post(f"{embed_url}/api/embed", json={"model": "embedder", "input": long, "truncate": False},
                         timeout=60)
    assert refused.status_code == 400 and "limit of 256 tokens" in refused.json()["error"]
    unknown = httpx.post(f"{embed_url}/api/embed", json={"model": "nomic-embed-text", "input": "x"}, timeout=60)
    assert unknown.status_code == 404 and isinstance(unknown.json()["error"], str)
