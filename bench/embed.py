"""Embedding throughput: tailrace's /v1/embeddings next to sentence-transformers' `encode`, the same
model (a shape's seeded random weights, as a sentence-transformers folder), the same inputs, one
after the other in the same run.

    .venv/bin/python bench/embed.py --shape qwen3-embedding-0.6b --doc-tokens 256 --batches 1,32 \
        --out bench/out/embed.json
    .venv/bin/python bench/embed.py --shape bge-base --out bench/out/embed-bge-base.json

Each cell embeds `--docs` documents of exactly --doc-tokens random token ids in requests (or
sentence-transformers forwards, what `encode` runs after tokenizing) of `batch` documents, one at a
time, after one warm-up call; the figure is documents per second over the whole cell. Both run
float32 on all cores. Prints a table and writes JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

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


def bench_sentence_transformers(folder: Path, docs: list[list[int]], batch: int) -> float:
    """Documents per second of sentence-transformers' forward (what `encode` runs after its
    tokenizer) on the same token ids."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device="cpu")

    def encode(chunk: list[list[int]]) -> None:
        ids = torch.tensor(chunk)
        with torch.inference_mode():
            model({"input_ids": ids, "attention_mask": torch.ones_like(ids)})["sentence_embedding"].tolist()
    encode(docs[:batch])
    start = time.perf_counter()
    for i in range(0, len(docs), batch):
        encode(docs[i:i + batch])
    return len(docs) / (time.perf_counter() - start)


def bench_tailrace(url: str, docs: list[list[int]], batch: int) -> float:
    with httpx.Client(timeout=600) as client:
        def embed(chunk: list[list[int]]) -> None:
            response = client.post(f"{url}/v1/embeddings", json={"input": chunk, "encoding_format": "base64"})
            response.raise_for_status()
        embed(docs[:batch])
        start = time.perf_counter()
        for i in range(0, len(docs), batch):
            embed(docs[i:i + batch])
        return len(docs) / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-embedding-0.6b",
                        choices=[*(n for n in SHAPES if "embedding" in n), *ENCODER_SHAPES])
    parser.add_argument("--doc-tokens", type=int, default=256)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--docs", type=int, default=32, help="documents per cell (default: 32)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    batches = [int(b) for b in args.batches.split(",")]
    folder = encoder_folder(args.shape) if args.shape in ENCODER_SHAPES else embedding_folder(args.shape)
    docs = documents(args.docs, args.doc_tokens, tokenizer_size(folder / "tokenizer.json"), args.seed)
    cells: dict[str, dict[int, float]] = {"tailrace": {}, "sentence-transformers": {}}
    port = free_port()
    log = Path(args.out).with_suffix(".tailrace.log") if args.out else Path("/tmp/tailrace-embed.log")
    command = [sys.executable, "-m", "tailrace", "serve", str(folder), "--port", str(port), "--dtype", "float32",
               "--max-model-len", str(max(512, args.doc_tokens)), "--max-num-seqs", str(max(batches)),
               "--max-num-batched-tokens", str(max(batches) * args.doc_tokens), "--disable-log-stats"]
    with ServerProcess("tailrace", command, f"http://127.0.0.1:{port}", log) as server:
        wait_ready([server], 900)
        for batch in batches:
            cells["tailrace"][batch] = bench_tailrace(server.url, docs, batch)
    for batch in batches:
        cells["sentence-transformers"][batch] = bench_sentence_transformers(folder, docs, batch)
    print(f"{args.shape}, {args.doc_tokens}-token documents, float32, {os.cpu_count()} cores: documents/s")
    print(f"{'batch':>6} {'tailrace':>10} {'sentence-transformers':>22} {'ratio':>7}")
    for batch in batches:
        ours, peer = cells["tailrace"][batch], cells["sentence-transformers"][batch]
        print(f"{batch:>6} {ours:>10.2f} {peer:>22.2f} {ours / peer:>6.2f}x")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.processor() or
            platform.machine(), "cpu_count": os.cpu_count(), "command": " ".join(sys.argv), "shape": args.shape,
            "doc_tokens": args.doc_tokens, "docs": args.docs, "docs_per_s": cells}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
