"""Embedding throughput: tailrace's /v1/embeddings next to sentence-transformers' `encode`, the same
model (a shape's seeded random weights, as a sentence-transformers folder), the same inputs, one
after the other in the same run.

    .venv/bin/python bench/embed.py --shape qwen3-embedding-0.6b --doc-tokens 256 --batches 1,32 \
        --out bench/out/embed.json
    .venv/bin/python bench/embed.py --shape bge-base --out bench/out/embed-bge-base.json

Each cell embeds `--docs` documents of exactly --doc-tokens random token ids in requests (or
sentence-transformers forwards, what `encode` runs after tokenizing) of `batch` documents, one at a
time, after one warm-up call; the figure is the median over --repeats passes of the whole table
(every system's cell one after another) of documents per second over the whole cell. The peers:
sentence-transformers, and llama.cpp's server (`--embedding`, the folder's pooling) on the GGUF
its converter makes of the same weights (F32 or BF16). All run at --dtype (float32 by default) on
all cores, one at a time.
Also timed: the p50 of one 16-token query a request (tailrace, llama.cpp, and tailrace's bare
model forward in this process), and each server's resident memory (all its processes)
after the largest batch, against the weights' bytes. Prints a table and writes JSON (--out).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import torch

from tailrace.bench.servers import ServerProcess, free_port, wait_ready
from tailrace.bench.shapes import SHAPES, SHAPES_DIR, STAMP, tokenizer_size, write_shape

MODULES = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
           {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
           {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]


def embedding_folder(shape_name: str) -> Path:
    """The shape's random model with sentence-transformers' modules: last-token pooling, normalized,
    as Qwen3-Embedding ships."""
    directory = write_shape(SHAPES[shape_name])
    (directory / "modules.json").write_text(json.dumps(MODULES))
    (directory / "1_Pooling").mkdir(exist_ok=True)
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": SHAPES[shape_name].hidden_size, "pooling_mode_lasttoken": True}))
    (directory / "2_Normalize").mkdir(exist_ok=True)
    settings = json.loads((directory / "tokenizer_config.json").read_text())
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):  # transformers 5 takes these as strings
        if isinstance(settings.get(key), dict):
            settings[key] = settings[key]["content"]
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))
    return directory


# Encoder shapes, written by transformers itself (random weights, seeded) with a WordPiece
# vocabulary of the shape's size: BAAI/bge-base-en-v1.5's (BERT-base, CLS pooling, normalized).
ENCODER_SHAPES = {"bge-base": {"vocab_size": 30522, "hidden_size": 768, "num_hidden_layers": 12,
                               "num_attention_heads": 12, "intermediate_size": 3072, "max_position_embeddings": 512,
                               "type_vocab_size": 2, "pooling": "pooling_mode_cls_token"}}


def encoder_folder(shape_name: str, seed: int = 0) -> Path:
    """The encoder shape's random BERT as a sentence-transformers folder, written on first use."""
    import transformers

    settings = dict(ENCODER_SHAPES[shape_name])
    pooling = settings.pop("pooling")
    directory = SHAPES_DIR / shape_name
    stamp = json.dumps({**settings, "pooling": pooling, "seed": seed})
    if (directory / STAMP).exists() and (directory / STAMP).read_text() == stamp:
        return directory
    print(f"writing the {shape_name} shape with random weights (seed {seed}) into {directory}", flush=True)
    directory.mkdir(parents=True, exist_ok=True)
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = specials + [f"w{i}" for i in range(settings["vocab_size"] - len(specials))]
    transformers.BertTokenizer(vocab={piece: i for i, piece in enumerate(vocab)}).save_pretrained(directory)
    torch.manual_seed(seed)
    transformers.BertModel(transformers.BertConfig(**settings)).float().save_pretrained(directory)
    (directory / "modules.json").write_text(json.dumps(MODULES))
    (directory / "1_Pooling").mkdir(exist_ok=True)
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": settings["hidden_size"], pooling: True}))
    (directory / "2_Normalize").mkdir(exist_ok=True)
    (directory / STAMP).write_text(stamp)
    return directory


def documents(count: int, tokens: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(tokens)] for _ in range(count)]


def load_sentence_transformers(folder: Path, dtype: str) -> Any:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(folder), device="cpu", model_kwargs={"torch_dtype": getattr(torch, dtype)})


def bench_sentence_transformers(model: Any, docs: list[list[int]], batch: int) -> float:
    """Documents per second of sentence-transformers' forward (what `encode` runs after its
    tokenizer) on the same token ids."""
    def encode(chunk: list[list[int]]) -> None:
        ids = torch.tensor(chunk)
        with torch.inference_mode():
            model({"input_ids": ids, "attention_mask": torch.ones_like(ids)})["sentence_embedding"].tolist()
    encode(docs[:batch])
    start = time.perf_counter()
    for i in range(0, len(docs), batch):
        encode(docs[i:i + batch])
    return len(docs) / (time.perf_counter() - start)


def bench_server(url: str, docs: list[list[int]], batch: int, model: str | None = None) -> float:
    """Documents per second of an OpenAI-style /v1/embeddings (tailrace's, llama.cpp's) taking
    token ids, `batch` documents a request."""
    with httpx.Client(timeout=600) as client:
        def embed(chunk: list[list[int]]) -> None:
            body = {"input": chunk, "encoding_format": "float", **({"model": model} if model else {})}
            client.post(f"{url}/v1/embeddings", json=body).raise_for_status()
        embed(docs[:batch])
        start = time.perf_counter()
        for i in range(0, len(docs), batch):
            embed(docs[i:i + batch])
        return len(docs) / (time.perf_counter() - start)


def query_latency(url: str, queries: list[list[int]], model: str | None = None) -> float:
    """p50 seconds of one short query a request, one after another."""
    times = []
    with httpx.Client(timeout=600) as client:
        for ids in [queries[0], *queries]:  # the first warms up
            start = time.perf_counter()
            client.post(f"{url}/v1/embeddings", json={"input": [ids], **({"model": model} if model else {})}
                        ).raise_for_status()
            times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def bare_forward_latency(folder: Path, queries: list[list[int]], dtype: str) -> float:
    """p50 seconds of tailrace's model forward alone on one query (loaded and prepared as a server
    that only pools loads it: packed projections on its kernels, a cache keeping no K/V), without
    scheduler, engine or HTTP."""
    from tailrace.model import backends
    from tailrace.model.attention.kv_cache import AttentionBatch, KVCache, SeqSlice
    from tailrace.model.loading.loader import load_model

    model, config = load_model(str(folder), dtype=dtype)
    backends.prepare(model, torch.device("cpu"), None, keeps_kv=False)
    cache = KVCache(0, config.num_key_value_heads, config.head_dim, 1, 16, model.dtype)
    times = []
    for ids in [queries[0], *queries]:
        n = len(ids)
        batch = AttentionBatch([SeqSlice(0, 0, n, n, [])], torch.zeros(n, dtype=torch.long))
        start = time.perf_counter()
        model(torch.tensor(ids), torch.arange(n), batch, cache, [n - 1]).tolist()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def llamacpp_server(folder: Path, pooling: str, max_batch: int, max_len: int, port: int, log: Path,
                    dtype: str) -> ServerProcess:
    """llama.cpp's server on the F32 GGUF its converter makes of the folder: embeddings only, the
    folder's pooling, a slot per document of a batch, its default logical batch (2048 tokens) and
    micro-batches of one context (a sequence must fit in one; one micro-batch of every document
    attends across all of them, masked: bge-base at batch 32 made 1.18 documents/s so, 2.01 this
    way, on a 2-core AVX2 Zen 3)."""
    from tailrace.bench.peers import llamacpp
    from tailrace.bench.peers.install import PEERS_DIR

    directory = PEERS_DIR / llamacpp.NAME
    llamacpp.ensure_installed(directory)
    gguf = llamacpp.ensure_gguf(directory, folder, dtype, None)
    tokens = max_batch * max_len
    command = [str(llamacpp.binary(directory, "llama-server")), "-m", str(gguf), "--host", "127.0.0.1",
               "--port", str(port), "--embedding", "--pooling", pooling, "-np", str(max_batch), "-c", str(tokens),
               "-b", str(max(2048, max_len)), "-ub", str(max_len), "-t", str(os.cpu_count() or 1)]
    return ServerProcess("llama.cpp", command, f"http://127.0.0.1:{port}", log)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-embedding-0.6b",
                        choices=[*(n for n in SHAPES if "embedding" in n), *ENCODER_SHAPES])
    parser.add_argument("--doc-tokens", type=int, default=256)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="every system's weights and compute (llama.cpp: the GGUF's type)")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--docs", type=int, default=32, help="documents per cell (default: 32)")
    parser.add_argument("--queries", type=int, default=20, help="16-token queries timed one by one (default: 20)")
    parser.add_argument("--peers", default="sentence-transformers,llama.cpp")
    parser.add_argument("--repeats", type=int, default=3, help="times the whole table is run (default: 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    batches = [int(b) for b in args.batches.split(",")]
    peers = [p for p in args.peers.split(",") if p]
    encoder = args.shape in ENCODER_SHAPES
    folder = encoder_folder(args.shape) if encoder else embedding_folder(args.shape)
    vocab = tokenizer_size(folder / "tokenizer.json")
    docs = documents(args.docs, args.doc_tokens, vocab, args.seed)
    queries = documents(args.queries, 16, vocab, args.seed + 1)
    pooling = "cls" if encoder and ENCODER_SHAPES[args.shape]["pooling"] == "pooling_mode_cls_token" else "last"
    runs: dict[str, dict[int, list[float]]] = {name: {b: [] for b in batches} for name in ("tailrace", *peers)}
    latency: dict[str, float] = {}
    logs = Path(args.out).with_suffix("") if args.out else Path("/tmp/tailrace-embed")
    max_len = max(512, args.doc_tokens)
    port, peer_port = free_port(), free_port()
    command = [sys.executable, "-m", "tailrace", "serve", str(folder), "--port", str(port), "--dtype", args.dtype,
               "--max-model-len", str(max_len), "--max-num-seqs", str(max(batches)),
               "--max-num-batched-tokens", str(max(batches) * args.doc_tokens), "--disable-log-stats"]
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(ServerProcess("tailrace", command, f"http://127.0.0.1:{port}",
                                                   Path(f"{logs}.tailrace.log")))
        started = [server]
        if "llama.cpp" in peers:
            started.append(stack.enter_context(llamacpp_server(folder, pooling, max(batches), max_len, peer_port,
                                                               Path(f"{logs}.llamacpp.log"), args.dtype)))
        wait_ready(started, 900)
        st_model = load_sentence_transformers(folder, args.dtype) if "sentence-transformers" in peers else None
        # Every cell's systems one after another, the whole table --repeats times: drift on a shared
        # machine then falls on all of them alike; each figure is its cell's median.
        for _ in range(args.repeats):
            for batch in batches:
                runs["tailrace"][batch].append(bench_server(server.url, docs, batch))
                if "llama.cpp" in peers:
                    runs["llama.cpp"][batch].append(bench_server(started[1].url, docs, batch, model="model"))
                if st_model is not None:
                    runs["sentence-transformers"][batch].append(bench_sentence_transformers(st_model, docs, batch))
        resident = {peer.name: peer.memory().rss for peer in started}
        latency["tailrace"] = query_latency(server.url, queries)
        if "llama.cpp" in peers:
            latency["llama.cpp"] = query_latency(started[1].url, queries, model="model")
    latency["bare forward"] = bare_forward_latency(folder, queries, args.dtype)
    cells = {name: {b: statistics.median(values) for b, values in by_batch.items()} for name, by_batch in runs.items()}
    weights = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    print(f"{args.shape}, {args.doc_tokens}-token documents, {args.dtype}, {os.cpu_count()} cores: documents/s")
    print(f"{'batch':>6} {'tailrace':>10} " + " ".join(f"{p:>22} {'ratio':>7}" for p in peers))
    for batch in batches:
        ours = cells["tailrace"][batch]
        print(f"{batch:>6} {ours:>10.2f} " + " ".join(f"{cells[p][batch]:>22.2f} {ours / cells[p][batch]:>6.2f}x"
                                                     for p in peers))
    bare = latency.get("bare forward")
    print("p50 of one 16-token query: " + ", ".join(f"{name} {value * 1e3:.1f} ms" for name, value in latency.items())
          + (f"; tailrace / bare forward {latency['tailrace'] / bare:.2f}x" if bare else ""))
    print(f"resident after batch {max(batches)}, weights {weights / 2**20:.0f} MiB: " + ", ".join(
        f"{name} {value / 2**20:.0f} MiB ({value / weights:.2f}x)" for name, value in resident.items())
        + " (every process of each server)")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.processor() or
            platform.machine(), "cpu_count": os.cpu_count(), "command": " ".join(sys.argv), "shape": args.shape, "dtype": args.dtype,
            "doc_tokens": args.doc_tokens, "docs": args.docs, "docs_per_s": cells, "docs_per_s_runs": runs,
            "query_p50_s": latency, "resident_bytes": resident["tailrace"], "resident_bytes_by_server": resident,
            "weight_bytes": weights}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
