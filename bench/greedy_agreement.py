"""Greedy answers of tailrace and llama.cpp's server on the same GGUF file, token for token:

    .venv/bin/python bench/greedy_agreement.py FILE.gguf [--prompts 8] [--tokens 32]

Each server in turn (the same threads, slots and context) answers the same plain completions at
temperature 0 with `ignore_eos`, and their top logprobs. Prints, per prompt, whether the answers
agree and, where they part, the first token that differs with both servers' logprobs of their two
candidates there: a gap within float summation's reach shows as both picks nearly tied in both
servers. Writes JSON with --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import httpx

from tailrace.bench.compare import CompareConfig, ours_server, peer_settings
from tailrace.bench.peers import llamacpp
from tailrace.bench.peers.install import PEERS_DIR
from tailrace.bench.serve import LoadConfig
from tailrace.bench.servers import ServerProcess, wait_ready

PROMPTS = ("The history of the city begins", "def fibonacci(n):", "Once upon a time, in a kingdom by the sea,",
           "The three laws of thermodynamics are", "Dear hiring manager, I am writing to",
           "To make bread you need flour, water,", "In 1969 the first people to walk on the moon",
           "A list of prime numbers: 2, 3, 5, 7,", "The recipe calls for", "SELECT name, price FROM")


def answers(base_url: str, model: str, prompts: list[str], tokens: int) -> list[list[tuple[str, dict[str, float]]]]:
    """Per prompt: each answer token's text and its top logprobs."""
    out = []
    for prompt in prompts:
        body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "logprobs": 2,
                "ignore_eos": True}
        choice = httpx.post(f"{base_url}/v1/completions", json=body, timeout=600).json()["choices"][0]
        logprobs = choice["logprobs"]
        if "content" in logprobs:  # llama.cpp's: chat's shape
            out.append([(c["token"], {t["token"]: t["logprob"] for t in c["top_logprobs"]})
                        for c in logprobs["content"]])
        else:
            out.append(list(zip(logprobs["tokens"], logprobs["top_logprobs"], strict=True)))
    return out


def run(path: str, prompts: list[str], tokens: int, log_dir: Path) -> dict[str, list]:
    config = CompareConfig(load=LoadConfig(concurrency=[1], input_len=64, output_len=tokens))
    results = {}
    for name in ("tailrace", "llamacpp"):
        settings = peer_settings(config, path)
        server = (ours_server(config, settings) if name == "tailrace"
                  else llamacpp.launch(PEERS_DIR / llamacpp.NAME, settings))
        url = f"http://127.0.0.1:{settings.port}"
        with ServerProcess(name, server.command, url, log_dir / f"{name}.log", env=server.env) as process:
            wait_ready([process], 600)
            model = server.model or httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
            results[name] = answers(url, model, prompts, tokens)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("gguf")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--out")
    args = parser.parse_args()
    prompts = list(PROMPTS[:args.prompts])
    with tempfile.TemporaryDirectory(prefix="tailrace-agreement-") as tmp:
        results = run(args.gguf, prompts, args.tokens, Path(tmp))
    ours, theirs = results["tailrace"], results["llamacpp"]
    rows = []
    for prompt, a, b in zip(prompts, ours, theirs, strict=True):
        parted = next((i for i, (x, y) in enumerate(zip(a, b)) if x[0] != y[0]), None)
        row = {"prompt": prompt, "equal": parted is None, "first_difference": parted}
        if parted is not None:
            row["tailrace"], row["llamacpp"] = a[parted], b[parted]
        rows.append(row)
        where = "equal" if parted is None else (f"part at token {parted}: tailrace {a[parted][0]!r} "
                                                f"{a[parted][1]}, llama.cpp {b[parted][0]!r} {b[parted][1]}")
        print(f"{prompt[:40]!r:44} {where}")
    print(f"{sum(r['equal'] for r in rows)} of {len(rows)} greedy answers equal over {args.tokens} tokens")
    if args.out:
        Path(args.out).write_text(json.dumps({"gguf": args.gguf, "tokens": args.tokens, "rows": rows}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
