"""`tailrace bench serve` and `tailrace bench compare`: their flags, and what runs them."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import shlex
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from tailrace import envs

if TYPE_CHECKING:  # the bench modules load only when a bench command runs
    from tailrace.bench.records import LevelResult
    from tailrace.bench.serve import LoadConfig

DEFAULT_CONCURRENCY = "1,8,32,64"
PEER_NAMES = ("transformers", "vllm", "llamacpp")  # tailrace.bench.compare.PEERS, without importing it
# tailrace.bench.shapes.SHAPES that generate (bench/embed.py takes the embedding one)
SHAPE_NAMES = ("smollm2-135m", "llama-3.2-1b", "qwen2.5-1.5b", "gemma-3-1b", "gemma-4-e2b", "phi-4-mini", "qwen3.5-0.8b",
               "qwen3-30b-a3b", "gpt-oss-20b")


def concurrency_list(text: str) -> list[int]:
    levels = [int(part) for part in text.split(",") if part.strip()]
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError("a comma-separated list of positive integers, such as 1,8,32")
    return levels


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("a positive integer")
    return value


def request_rate(text: str) -> float:
    rate = float(text)  # float() reads "inf" too
    if rate <= 0:
        raise argparse.ArgumentTypeError("requests/s must be positive, or inf")
    return rate


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("a JSON object, such as '{\"top_p\": 0.9}'")
    return value


def _add_load_flags(parser: argparse.ArgumentParser, concurrency: str, num_prompts: int) -> None:
    parser.add_argument("--concurrency", type=concurrency_list, default=concurrency_list(concurrency),
                        help=f"most requests in flight; one run per level (default: {concurrency})")
    parser.add_argument("--num-prompts", type=int, default=num_prompts,
                        help=f"requests per level (default: {num_prompts})")
    parser.add_argument("--input-len", type=int, default=128, help="prompt length in tokens, about (default: 128)")
    parser.add_argument("--output-len", type=int, default=128, help="answer length in tokens (default: 128)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts and arrivals (default: 0)")
    parser.add_argument("--out", default=None,
                        help="write summaries and per-request records to this JSON file, such as "
                             "bench/out/run.json (default: none, the tables are only printed)")
    parser.add_argument("--plot", default=None,
                        help="draw throughput and latency CDFs into this PNG file (default: none)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks: load-test a server, compare with a peer")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    serve = kinds.add_parser("serve", help="streamed load against any OpenAI-compatible server")
    serve.add_argument("--base-url", default="http://127.0.0.1:8000", help="server URL, with or without /v1")
    serve.add_argument("--model", default=None, help="model name (default: the first one the server lists)")
    serve.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    _add_load_flags(serve, DEFAULT_CONCURRENCY, 128)
    serve.add_argument("--request-rate", type=request_rate, default=math.inf,
                       help="requests/s, Poisson arrivals (default: inf, all at once within --concurrency)")
    serve.add_argument("--temperature", type=float, default=0.0, help="0 greedy (default), 1 sampled")
    serve.add_argument("--api-key", default=envs.optional("OPENAI_API_KEY"),
                       help="bearer key (default: $OPENAI_API_KEY)")
    serve.add_argument("--no-exact-length", action="store_true",
                       help="do not send ignore_eos and min_tokens (for servers that reject unknown fields)")
    serve.add_argument("--extra-body", type=json_object, default={},
                       help="a JSON object merged into every request, e.g. '{\"top_p\": 0.9}'")
    serve.add_argument("--timeout", type=float, default=600.0, help="longest wait for one read, s (default: 600)")
    serve.add_argument("--processes", type=positive_int, default=1,
                       help="client processes sharing each level's requests and concurrency, where one process "
                            "cannot read the streams as fast as the server sends them (default: 1)")
    _add_compare_parser(kinds.add_parser("compare",
                                         help="tailrace against peer servers started here, one after another"))


def _add_compare_parser(compare: argparse.ArgumentParser) -> None:
    compare.add_argument("model", nargs="?", default=None,
                         help="a Hugging Face model directory (default: the embedded tiny model)")
    compare.add_argument("--shape", choices=SHAPE_NAMES, default=None,
                         help="a public model's shape with seeded random weights, written under bench/.shapes "
                              "on first use, instead of a model directory")
    compare.add_argument("--peer", dest="peers", action="append", choices=PEER_NAMES, default=None,
                         help="a server to measure tailrace against, installed under bench/.peers on first use; "
                              "repeat for several (default: transformers)")
    _add_load_flags(compare, "1,8,32", 64)
    compare.add_argument("--endpoint", choices=("completions", "chat"), default="chat")
    compare.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                         help="weights and compute of every server (default: float32)")
    compare.add_argument("--peer-quant", choices=("Q8_0", "Q4_0", "MXFP4_MOE"), default=None,
                         help="llama.cpp's weights quantized to this (default: none, --dtype); MXFP4_MOE: "
                              "experts MXFP4, every other matrix Q8_0, as gpt-oss ships")
    compare.add_argument("--ours-args", type=shlex.split, default=[],
                         help="more `tailrace serve` flags, e.g. '--quantization int8' "
                              "(a flag alone: --ours-args=--FLAG)")
    compare.add_argument("--llamacpp-args", type=shlex.split, default=[],
                         help="more llama-server flags, e.g. --llamacpp-args=--no-repack where its weight "
                              "repacking crashes on this CPU")
    compare.add_argument("--threads", type=int, default=None,
                         help="compute threads of each server (default: each one's best: all cores for "
                              "llama.cpp and transformers, vLLM's auto binding, tailrace's measured choice)")
    compare.add_argument("--peers-dir", type=Path, default=None,
                         help="where the peers are installed (default: bench/.peers)")
    compare.add_argument("--ready-timeout", type=float, default=900.0,
                         help="longest wait for a server to be ready, s (default: 900; vLLM compiles its model "
                              "at each start, over 15 minutes for a 4B model on two cores)")
    compare.add_argument("--log-dir", type=Path, default=None,
                         help="keep each server's log here, as NAME.log (default: beside --out, in OUT.logs/ "
                              "for OUT.json; without --out, logs go with the run's temporary directory)")


def run_bench(args: argparse.Namespace) -> int:
    try:
        from tailrace.bench.serve import BenchError
    except ImportError as exc:  # the serving install leaves the load generator's packages out
        print(f"error: tailrace bench needs the bench extra ({exc.name} is missing): pip install -e '.[bench]'")
        return 2

    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request would bury the progress bar
    try:
        if args.bench_command == "serve":
            return _serve(args)
        return _compare(args)
    except BenchError as exc:
        print(f"error: {exc}")
        return 1
    except KeyboardInterrupt:
        print("interrupted")  # any servers this started are stopped by now
        return 130


def _load_config(args: argparse.Namespace, **overrides: object) -> LoadConfig:
    from tailrace.bench.serve import LoadConfig

    return LoadConfig(concurrency=args.concurrency, num_prompts=args.num_prompts, input_len=args.input_len,
                      output_len=args.output_len, seed=args.seed, progress=not args.no_progress, **overrides)


def _serve(args: argparse.Namespace) -> int:
    from tailrace.bench.report import format_summary, summarize
    from tailrace.bench.levels import run_benchmark

    config = _load_config(args, base_url=args.base_url, model=args.model, endpoint=args.endpoint,
                          request_rate=args.request_rate, temperature=args.temperature, api_key=args.api_key,
                          exact_length=not args.no_exact_length, extra_body=args.extra_body,
                          timeout_s=args.timeout, processes=args.processes)
    model, workload, levels = asyncio.run(run_benchmark(config))
    for level in levels:
        print(format_summary(f"{model} @ concurrency {level.concurrency}", summarize(level)))
    meta = {"config": {**asdict(config), "api_key": None, "model": model},
            "tokens_per_word": workload.tokens_per_word, "calibrated": workload.calibrated}
    _save(args, meta, {model: levels}, f"{model} at {config.base_url}: {config.input_len} in / "
                                        f"{config.output_len} out, {config.endpoint}")
    return 0 if all(r.ok for level in levels for r in level.records) else 1


def _compare(args: argparse.Namespace) -> int:
    from tailrace.bench.compare import CompareConfig, run_compare
    from tailrace.bench.peers.install import PEERS_DIR

    if args.model and args.shape:
        print("error: give a model directory or --shape, not both")
        return 2
    peers = list(dict.fromkeys(args.peers or ["transformers"]))  # each once, in the order given
    config = CompareConfig(load=_load_config(args, endpoint=args.endpoint), peers=peers, model_dir=args.model,
                           shape=args.shape, threads=args.threads, dtype=args.dtype, peer_quant=args.peer_quant,
                           ours_args=args.ours_args, llamacpp_args=args.llamacpp_args,
                           peers_dir=args.peers_dir or PEERS_DIR, ready_timeout_s=args.ready_timeout,
                           log_dir=args.log_dir or (Path(args.out).with_suffix(".logs") if args.out else None))
    meta, runs = run_compare(config)
    model = args.shape or Path(args.model or "embedded").name
    _save(args, meta, runs, f"{model}: tailrace vs {', '.join(peers)}, {args.input_len} in / {args.output_len} out")
    return 0 if all(r.ok for levels in runs.values() for level in levels for r in level.records) else 1


def _save(args: argparse.Namespace, meta: dict, runs: dict[str, list[LevelResult]], title: str) -> None:
    from tailrace.bench.report import write_json

    if args.out:
        write_json(args.out, meta, runs)
        print(f"wrote {args.out}")
    if args.plot:
        from tailrace.bench.plot import plot

        plot(runs, args.plot, title)
        print(f"wrote {args.plot}")
