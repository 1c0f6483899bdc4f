"""What lower-precision weights cost in quality, against float32 on held-out text:

    .venv/bin/python bench/quality.py --model MODEL_DIR --prompts 64 --tokens 64

Held-out text: docstrings of numpy's public functions (the embedded model was trained on
CPython's standard library only). For each prompt, float32 writes a greedy continuation of
--tokens tokens; every format then reads prompt + that continuation in one forward pass
(teacher forcing), and we report, over all continuation positions: the mean absolute
difference of the continuation token's logprob against float32, and greedy agreement (the
share of positions where the format's argmax is float32's token). Formats: bfloat16 compute,
and int8 / int4 weight-only quantization on float32 and on bfloat16 compute, each prepared as the
engine does.
Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
from datetime import datetime, timezone

import numpy
import torch
from decode_step import load_as_engine, sequence_cache  # bench/ is on sys.path when a script here runs

from tailrace.engine.config import EMBEDDED_MODEL
from tailrace.model.attention.kv_cache import AttentionBatch, SeqSlice
from tailrace.tokenizer import load_tokenizer

FORMATS = {"float32": ("float32", None), "bfloat16": ("bfloat16", None),
           "int8": ("float32", "int8"), "int4": ("float32", "int4"),
           "int8 bfloat16": ("bfloat16", "int8"), "int4 bfloat16": ("bfloat16", "int4")}


def held_out_prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    """The first `length` tokens of numpy's longest public docstrings, one per function."""
    docs = sorted({inspect.getdoc(getattr(numpy, name)) or "" for name in dir(numpy) if not name.startswith("_")},
                  key=len, reverse=True)
    prompts = []
    for doc in docs:
        ids = tokenizer.encode(doc)
        if len(ids) >= length:
            prompts.append(ids[:length])
        if len(prompts) == count:
            break
    return prompts


@torch.inference_mode()
def all_logprobs(model, config, tokens: list[int]) -> torch.Tensor:
    """Log-softmax at every position of one sequence read in a single prefill: [len, vocab]."""
    cache, table = sequence_cache(model, config, len(tokens))
    batch = AttentionBatch([SeqSlice(0, 0, len(tokens), len(tokens), table)], torch.arange(len(tokens)))
    cache.begin(batch)
    hidden = model(torch.tensor(tokens), torch.arange(len(tokens)), batch, cache)
    return torch.log_softmax(model.compute_logits(hidden), dim=-1)


@torch.inference_mode()
def greedy_continuation(model, config, prompt: list[int], tokens: int) -> list[int]:
    sequence = list(prompt)
    for _ in range(tokens):  # a full prefill per token: simple, and cheap at these sizes
        sequence.append(int(all_logprobs(model, config, sequence)[-1].argmax()))
    return sequence[len(prompt):]


def compare(model, config, sequences: list[tuple[list[int], list[int]]], reference: list[torch.Tensor]) -> dict:
    diffs, agree, total = 0.0, 0, 0
    for (prompt, continuation), ref in zip(sequences, reference):
        logprobs = all_logprobs(model, config, prompt + continuation)[len(prompt) - 1:-1]
        target = torch.tensor(continuation)
        ours = logprobs.gather(1, target[:, None])[:, 0].float()
        diffs += (ours - ref).abs().sum().item()
        agree += (logprobs.argmax(-1) == target).sum().item()
        total += len(continuation)
    return {"mean_abs_logprob_diff": diffs / total, "greedy_agreement": agree / total, "positions": total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=EMBEDDED_MODEL)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", default="bench/out/quality.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    prompts = held_out_prompts(load_tokenizer(args.model), args.prompts, args.prompt_len)
    model, config = load_as_engine(args.model)
    sequences = [(p, greedy_continuation(model, config, p, args.tokens)) for p in prompts]
    reference = [all_logprobs(model, config, p + c)[len(p) - 1:-1].gather(1, torch.tensor(c)[:, None])[:, 0]
                 for p, c in sequences]
    rows = {}
    for name, (dtype, quantization) in FORMATS.items():
        model, config = load_as_engine(args.model, dtype, quantization)
        rows[name] = compare(model, config, sequences, reference)
    print(f"{args.model}: {len(prompts)} held-out prompts x {args.tokens} greedy float32 tokens, "
          f"load {os.getloadavg()[0]:.2f}")
    print(f"{'format':<10} {'mean |dlogprob|':>16} {'greedy agreement':>17}")
    for name, row in rows.items():
        print(f"{name:<10} {row['mean_abs_logprob_diff']:>16.4f} {row['greedy_agreement']:>17.4f}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"date": datetime.now(timezone.utc).isoformat(), "args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
