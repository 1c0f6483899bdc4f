"""Speculative decoding's gain: tailrace with and without n-gram speculation, and llama.cpp's server
with and without its own n-gram speculation, on the same model and the same code-editing prompts,
one server after another in the same run.

    .venv/bin/python bench/speculative.py --shape smollm2-135m --dtype bfloat16 --concurrency 1,8,32 \
        --llamacpp --out bench/out/spec-smollm2.json
    .venv/bin/python bench/speculative.py --concurrency 1 --out bench/out/spec-embedded.json

Each prompt holds a Python function from this interpreter's standard library and asks for it
back with small changes: the answer mostly copies the prompt, the workload prompt lookup is for
(`--workload words`: random words instead, where guesses rarely land: what speculation costs).
Requests are greedy (or seeded at --temperature) and streamed, each answering exactly
--output-len tokens. The figure is output
tokens a second over each level's requests, the median over --repeats passes (every server in
turn, each pass); the answers of tailrace with and without speculation
are compared text for text (they must be equal), and the speculating server's /metrics give the
share of guessed tokens accepted. A shape's weights are seeded noise, so what a shape's model
writes, and so how many guesses land, is not what the real model's would be: a shape measures
what a step of guesses costs and gains on that model's work per token; the embedded model (real
weights, 5M parameters) how guesses land on real text.
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import re
import shlex
import statistics
import sys
import sysconfig
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

from tailrace.bench.compare import (Cells, CompareConfig, _model_dir, _run_alone, _server_load, ours_server,
                                    peer_settings)
from tailrace.bench.peers import llamacpp
from tailrace.bench.prompts import DEFAULT_TOKENS_PER_WORD, make_prompts
from tailrace.bench.records import LevelResult
from tailrace.bench.report import summarize
from tailrace.bench.serve import LoadConfig, Workload
from tailrace.bench.shapes import SHAPES

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'
LLAMACPP_NGRAM = "--spec-type ngram-simple"  # its defaults: a 12-token key, up to 48 tokens guessed
SOURCES = ("textwrap.py", "shlex.py", "fnmatch.py", "ipaddress.py", "json/decoder.py", "json/encoder.py",
           "csv.py", "calendar.py", "difflib.py", "string.py", "heapq.py", "bisect.py", "argparse.py",
           "configparser.py", "tarfile.py")
TASK = ("Rewrite this Python function so that it reads better: keep its behaviour, rename nothing "
        "public, and change only what needs changing.\n\n```python\n{code}\n```\n")


def code_functions(min_lines: int = 12, max_lines: int = 40) -> list[str]:
    """Functions of --min to --max lines from the standard library's SOURCES, in file order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for name in SOURCES:
        text = (stdlib / name).read_text()
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef) and min_lines <= node.end_lineno - node.lineno + 1 <= max_lines:
                body = lines[node.lineno - 1:node.end_lineno]
                indent = len(body[0]) - len(body[0].lstrip())
                found.append("\n".join(line[indent:] for line in body))
    return found


def word_cells(levels: int, num_prompts: int, seed: int) -> Cells:
    """tailrace bench compare's random-word prompts: little for a lookup to find."""
    return _cells(make_prompts(1 + levels * num_prompts, 128, seed), num_prompts)


def code_cells(levels: int, num_prompts: int, seed: int) -> Cells:
    picks = random.Random(seed).sample(code_functions(), 1 + levels * num_prompts)
    return _cells([TASK.format(code=code) for code in picks], num_prompts)


def _cells(prompts: list[str], num_prompts: int) -> Cells:
    """The first prompt warms up; the rest, num_prompts a level."""
    levels = [Workload(prompts[start:start + num_prompts], DEFAULT_TOKENS_PER_WORD, False)
              for start in range(1, len(prompts), num_prompts)]
    return Cells(prompts[0], levels)


def acceptance(base_url: str) -> dict[str, float]:
    """The speculating server's vllm:spec_decode_* counters."""
    text = httpx.get(base_url + "/metrics", timeout=10).text
    counts = {name: float(value) for name, value in
              re.findall(r"^vllm:spec_decode_(num_\w+?)_total(?:\{[^}]*\})? (\S+)$", text, re.M)
              if "per_pos" not in name}
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", help="a model directory or GGUF (default: the embedded model)")
    parser.add_argument("--shape", choices=sorted(SHAPES))
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--peer-quant", choices=("Q8_0", "Q4_0"))
    parser.add_argument("--ours-args", default="", help="more `tailrace serve` flags for both tailrace servers")
    parser.add_argument("--concurrency", default="1")
    parser.add_argument("--num-prompts", type=int, default=8, help="requests per level")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--speculative-config", default=NGRAM)
    parser.add_argument("--llamacpp", action="store_true", help="llama.cpp's server too, without and with n-grams")
    parser.add_argument("--llamacpp-spec", default=LLAMACPP_NGRAM, help="llama-server's speculation flags")
    parser.add_argument("--workload", default="code-edit", choices=("code-edit", "words"),
                        help="code-edit: rewrite a standard-library function; words: random words, where "
                             "guesses rarely land (what speculation costs)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="above 0: seeded sampling (each request seed 0), where few guesses land")
    parser.add_argument("--repeats", type=int, default=1, help="passes over every server, in turn; medians reported")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    concurrency = [int(c) for c in args.concurrency.split(",")]
    load = LoadConfig(endpoint="chat", concurrency=concurrency, num_prompts=args.num_prompts,
                      input_len=700, output_len=args.output_len, seed=args.seed, progress=False,
                      temperature=args.temperature, extra_body={"seed": 0} if args.temperature else {})
    config = CompareConfig(load=load, peers=[llamacpp.NAME] if args.llamacpp else [], model_dir=args.model,
                           shape=args.shape, dtype=args.dtype, peer_quant=args.peer_quant)
    if args.llamacpp:
        llamacpp.ensure_installed(config.peers_dir / llamacpp.NAME)
    cells = (code_cells if args.workload == "code-edit" else word_cells)(len(concurrency), args.num_prompts, args.seed)
    variants = [("tailrace", []), ("tailrace+ngram", ["--speculative-config", args.speculative_config])]
    if args.llamacpp:
        variants += [("llama.cpp", []), ("llama.cpp+ngram", args.llamacpp_spec.split())]
    passes, servers, accepted = run_passes(config, variants, cells, args.ours_args.split(), args.repeats)
    report(passes, accepted, concurrency)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        meta = {"workload": args.workload, "temperature": args.temperature, "shape": args.shape, "model": args.model,
                "dtype": args.dtype, "peer_quant": args.peer_quant, "speculative_config": args.speculative_config,
                "llamacpp_spec": args.llamacpp_spec, "ours_args": args.ours_args, "servers": servers,
                "acceptance": accepted, "command": shlex.join(sys.argv)}
        levels = [{n: [asdict(lv) for lv in levels] for n, levels in runs.items()} for runs in passes]
        args.out.write_text(json.dumps({"meta": meta, "passes": levels}, indent=1))
        print(f"wrote {args.out}")


Passes = list[dict[str, list[LevelResult]]]


def run_passes(config: CompareConfig, variants: list[tuple[str, list[str]]], cells: Cells, ours_args: list[str],
               repeats: int) -> tuple[Passes, dict[str, Any], dict[str, float]]:
    """Every variant's server alone, in turn, `repeats` times over: (levels per pass, what each
    server was, the speculating server's counters over all passes)."""
    passes: Passes = []
    servers: dict[str, dict[str, Any]] = {}
    accepted: dict[str, float] = {}

    def count(url: str) -> None:
        for name, value in acceptance(url).items():
            accepted[name] = accepted.get(name, 0.0) + value

    with tempfile.TemporaryDirectory(prefix="tailrace-spec-") as tmp:
        model_dir = _model_dir(config, Path(tmp))
        for _ in range(repeats):
            runs: dict[str, list[LevelResult]] = {}
            for name, extra in variants:
                settings = peer_settings(config, model_dir)
                if name.startswith("tailrace"):
                    config.ours_args = ours_args + extra
                    server = ours_server(config, settings)
                else:
                    settings.llamacpp_args = extra
                    server = llamacpp.launch(config.peers_dir / llamacpp.NAME, settings)
                server_load = _server_load(config.load, settings.port, server)
                runs[name], _, servers[name] = _run_alone(name, server, server_load, cells, Path(tmp), 900.0,
                                                          after=count if name == "tailrace+ngram" else None)
            passes.append(runs)
    return passes, servers, accepted


def report(passes: Passes, accepted: dict[str, float], concurrency: list[int]) -> None:
    """Each server's median over the passes, the ratios of those, and how many answers of the
    speculating tailrace equal the plain one's (in every pass)."""
    names = list(passes[0])
    llama = "llama.cpp" in names
    print(f"\n{'c':>3} " + "".join(f"{n:>17}" for n in names) + f"{'ngram/plain':>13}"
          + (f"{'vs llama.cpp+ngram':>20}{'llama.cpp gain':>16}" if llama else "") + f"{'same text':>11}")
    for i, c in enumerate(concurrency):
        tps = {n: statistics.median(summarize(runs[n][i]).output_throughput for runs in passes) for n in names}
        same = sum(r.text == g.text for runs in passes
                   for r, g in zip(runs["tailrace"][i].records, runs["tailrace+ngram"][i].records))
        line = f"{c:>3} " + "".join(f"{tps[n]:>17.2f}" for n in names)
        line += f"{tps['tailrace+ngram'] / tps['tailrace']:>12.2f}x"
        if llama:
            line += f"{tps['tailrace+ngram'] / tps['llama.cpp+ngram']:>19.2f}x"
            line += f"{tps['llama.cpp+ngram'] / tps['llama.cpp']:>15.2f}x"
        line += f"{same:>7}/{sum(len(runs['tailrace'][i].records) for runs in passes)}"
        print(line)
    if accepted.get("num_draft_tokens"):
        print(f"tailrace+ngram: {accepted['num_accepted_tokens']:.0f} of {accepted['num_draft_tokens']:.0f} "
              f"guessed tokens accepted ({accepted['num_accepted_tokens'] / accepted['num_draft_tokens']:.0%}) "
              f"in {accepted['num_drafts']:.0f} guesses")


if __name__ == "__main__":
    main()
