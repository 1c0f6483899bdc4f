"""`tailrace serve [MODEL]`: the OpenAI-compatible server; `tailrace bench ...`: benchmarks;
`tailrace check --base-url URL`: any OpenAI-compatible server's streaming bugs."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from tailrace import envs
from tailrace.arg_types import (DTYPE_NAMES, RefuseRemoteCode, SubcommandParser, device_name, dtype_name, fraction,
                                json_string_list, speculative_config, tensor_parallel_size, token_count)
from tailrace.bench.cli import add_bench_parser, run_bench
from tailrace.check.cli import add_check_parser, run_check
from tailrace.engine.config import ATTENTION_BACKENDS, EngineConfig
from tailrace.logs import LOG_LEVELS, UVICORN_LOG_LEVELS, configure_logging, timed
from tailrace.model.options import LOAD_FORMATS, QUANTIZATIONS
from tailrace.serving.context import ChatOptions
from tailrace.serving.limits import Limits
from tailrace.serving.parsers.choice import REASONING_FIELDS, REASONING_PARSERS, TOOL_PARSERS, resolve_formats
from tailrace.serving.pooling import TASKS, resolve_task
from tailrace.serving.responses_store import StoreLimits
from tailrace.serving.sampling_defaults import load_sampling_defaults
from tailrace.serving.template_fit import fit_to_template

if TYPE_CHECKING:
    from tailrace.api.app import ServerConfig
    from tailrace.tokenizer import Tokenizer

log = logging.getLogger("tailrace")

_ENGINE_FLAGS = {
    "dtype": (dtype_name, "weights and compute dtype: auto (bfloat16 on CUDA; on CPU bfloat16 for a "
                          "16-bit checkpoint where the CPU computes it fast, else float32), float32, "
                          "bfloat16, float16 (vLLM's half and float are the same)"),
    "quantization": (str, "weight-only quantization at load: int8 (per channel) or int4 (groups of 32), or "
                          "none for float weights (default: the checkpoint's own: a quantized GGUF stays "
                          "quantized on CPU, its blocks as stored and other quantized types as int8)"),
    "load_format": (str, "auto (safetensors) or dummy (random weights from config.json)"),
    "device": (device_name, "auto (cuda when a GPU is visible, else cpu), cpu, cuda or cuda:N"),
    "attention": (str, "KV cache layout: auto (slab on CPU, paged on CUDA), slab or paged"),
    "max_num_seqs": (int, "most sequences in one batch"),
    "max_num_batched_tokens": (int, "token budget of one engine step (chunked prefill)"),
    "block_size": (int, "tokens per KV cache block"),
    "kv_cache_memory_gb": (float, "KV cache size in GiB"),
    "num_kv_blocks": (int, "KV cache size in blocks; overrides --kv-cache-memory-gb"),
    "gpu_memory_utilization": (fraction, "on CUDA, size the KV cache to fill this fraction of the GPU's memory "
                                         "with weights and activations, as vLLM does (overrides "
                                         "--kv-cache-memory-gb; ignored on CPU)"),
    "max_model_len": (token_count, "context limit in tokens, also as 32k or 32K (default: the model's)"),
    "threads": (int, "torch threads in the engine core, fixed (default: chosen step by step among all cores, "
                     "all but one and half, by measured step time)"),
    "seed": (int, "seed for requests that give none"),
    "revision": (str, "of a hub id: the branch, tag or commit to serve (default: main)"),
}


_ENGINE_CHOICES = {"dtype": DTYPE_NAMES, "quantization": (*QUANTIZATIONS, "none"), "load_format": LOAD_FORMATS,
                   "attention": ATTENTION_BACKENDS}


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    defaults = {f.name: f.default for f in fields(EngineConfig)}
    for name, (kind, help_text) in _ENGINE_FLAGS.items():
        shown = "" if defaults[name] is None else f" (default: {defaults[name]})"
        parser.add_argument("--" + name.replace("_", "-"), type=kind, default=defaults[name],
                            choices=_ENGINE_CHOICES.get(name), help=help_text + shown)
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="reuse the KV blocks of prompts seen before (default: on)")
    parser.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                        help="the same as --no-enable-prefix-caching")
    parser.add_argument("--tensor-parallel-size", "-tp", type=tensor_parallel_size, default=1,
                        help="ranks (processes, one device each) to split the model over, Megatron-style; "
                             "gloo on CPU, nccl on CUDA (default: 1)")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs: run decode steps eagerly")
    parser.add_argument("--strict-backends", action="store_true",
                        help="do not start where a CPU model would run any part on PyTorch's slower paths "
                             "(tailrace's kernels not built, or not taking some layer); the error says why")
    parser.add_argument("--speculative-config", metavar="JSON", type=speculative_config,
                        help="speculative decoding, as vLLM spells it: '{\"method\": \"ngram\", "
                             "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}' guesses up to 4 tokens a "
                             "step from earlier text and keeps only those decoding without it would produce")
    parser.add_argument("--in-process", action="store_true",
                        help="run the engine core on a thread of this process (debugging)")


def engine_config_from(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(model=args.model, enable_prefix_caching=args.enable_prefix_caching,
                        enforce_eager=args.enforce_eager, strict_backends=args.strict_backends,
                        in_process=args.in_process,
                        tensor_parallel_size=args.tensor_parallel_size,
                        speculative_config=args.speculative_config,
                        **{name: getattr(args, name) for name in _ENGINE_FLAGS})


# Limits field -> (flag, type, help); defaults come from the dataclass.
_LIMIT_FLAGS = {
    "max_n": ("--max-n", int, "most choices (n) in one request"),
    "max_tokens": ("--max-tokens", int, "most tokens one choice may generate, also the default when a request "
                                        "sets none (default: the context length)"),
    "max_logprobs": ("--max-logprobs", int, "most logprob alternatives per token"),
    "max_stop_sequences": ("--max-stop-sequences", int, "most stop strings in one request"),
    "max_stop_chars": ("--max-stop-chars", int, "longest stop string, in characters"),
    "max_prompt_tokens": ("--max-prompt-tokens", int, "longest prompt in tokens (default: the context length)"),
    "max_waiting_seqs": ("--max-waiting-seqs", int, "sequences (one per choice) that may wait beyond "
                                                    "--max-num-seqs; more answer 429 with retry-after"),
    "request_timeout_s": ("--request-timeout", float, "abort a request after this many seconds: 408, or an "
                                                      "in-band error once streaming (default: no limit)"),
}


def add_limit_flags(parser: argparse.ArgumentParser) -> None:
    defaults = {f.name: f.default for f in fields(Limits)}
    for name, (flag, kind, help_text) in _LIMIT_FLAGS.items():
        shown = "" if defaults[name] is None else f" (default: {defaults[name]})"
        parser.add_argument(flag, dest=name, type=kind, default=defaults[name], help=help_text + shown)
    parser.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024,
                        help="largest request body; more answers 413 (default: 4 MiB)")
    store = StoreLimits()
    parser.add_argument("--responses-store-max-count", type=int, default=store.max_count,
                        help="stored Responses API responses kept, least recently used evicted first "
                             f"(default: {store.max_count})")
    parser.add_argument("--responses-store-max-bytes", type=int, default=store.max_bytes,
                        help="their total size in bytes (default: 256 MiB)")
    parser.add_argument("--graceful-shutdown-timeout", type=float, default=30.0,
                        help="on SIGTERM/SIGINT, seconds running requests may take to finish (default: 30)")


def limits_from(args: argparse.Namespace) -> Limits:
    return Limits(max_num_seqs=args.max_num_seqs, **{name: getattr(args, name) for name in _LIMIT_FLAGS})


def add_chat_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tool-call-parser", choices=[*TOOL_PARSERS, "auto", "none"], default="auto",
                        help="the format the model writes tool calls in (vLLM's names); auto: the one its chat "
                             "template shows; none: only the forms small models drift into (a ```json fence, a bare "
                             "JSON call, <function=NAME>{...}), which every request with tools reads (default: auto)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="accepted for vLLM's command lines: tool_choice auto is always on here")
    parser.add_argument("--chat-template", default=None, metavar="FILE_OR_STRING",
                        help="replaces the model's chat template: a file holding one, else the template itself")
    parser.add_argument("--generation-config", default="auto",
                        help="defaults for the sampling settings a request leaves unset: auto (the model's "
                             "generation_config.json), vllm (none: OpenAI's defaults) or a directory holding a "
                             "generation_config.json (default: auto)")
    parser.add_argument("--reasoning-parser", choices=[*REASONING_PARSERS, "auto", "none"], default="auto",
                        help="think (or vLLM's deepseek_r1, qwen3): thinking inside <think>...</think> goes to the "
                             "reasoning field, not the content; auto: think where the chat template writes <think> "
                             "blocks; none: off (default: auto)")
    parser.add_argument("--task", choices=TASKS, default="auto",
                        help="generate (text), embed (/v1/embeddings: each input pooled into one vector) or "
                             "score (a cross-encoder's /v1/score and /v1/rerank); auto: embed for a "
                             "sentence-transformers folder (modules.json) or a base model such as Qwen3Model or "
                             "BertModel, score for a sequence classifier such as BertForSequenceClassification, "
                             "generate otherwise (default: auto)")
    parser.add_argument("--reasoning-field", choices=REASONING_FIELDS, default="reasoning_content",
                        help="the message and delta field for the thinking (default: reasoning_content)")


def chat_options_from(args: argparse.Namespace) -> ChatOptions:
    reasoning = args.reasoning_parser if args.reasoning_parser in ("auto", "none") else \
        REASONING_PARSERS[args.reasoning_parser]
    return ChatOptions(tool_call_parser=args.tool_call_parser, reasoning_field=args.reasoning_field,
                       reasoning_parser=None if reasoning == "none" else reasoning)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tailrace", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=SubcommandParser)
    serve = sub.add_parser("serve", help="serve a model over the OpenAI API")
    serve.add_argument("model", nargs="?", default=None,
                       help="a Hugging Face model directory, a hub id (ORG/NAME) or a .gguf file "
                            "(default: the embedded tiny model)")
    serve.add_argument("--model", dest="model_option", default=None, metavar="MODEL",
                       help="the model, as vLLM's --model takes it")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=envs.optional("TAILRACE_API_KEY"),
                       help="require this bearer key (default: $TAILRACE_API_KEY; none: no auth)")
    serve.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                       help="the model names clients may use; responses carry the first (default: the "
                            "directory's name)")
    serve.add_argument("--metrics-public", action="store_true", help="/metrics needs no key")
    serve.add_argument("--cors-origin", action="append", default=[], help="allow this CORS origin (repeatable)")
    serve.add_argument("--allowed-origins", type=json_string_list, default=[],
                       help='CORS origins as a JSON list, as vLLM takes them: \'["https://example.com"]\'')
    serve.add_argument("--log-level", type=str.lower, choices=LOG_LEVELS, default="info",
                       help="tailrace's logs, and uvicorn's unless --uvicorn-log-level says (default: info)")
    serve.add_argument("--uvicorn-log-level", type=str.lower, choices=UVICORN_LOG_LEVELS, default=None,
                       help="uvicorn's logs (default: --log-level)")
    # One log line per request cost ~7% of the API process's CPU under load (py-spy), so it is opt-in.
    serve.add_argument("--access-log", action="store_true", help="log every HTTP request")
    serve.add_argument("--disable-log-requests", action="store_true",
                       help="accepted for vLLM's command lines: requests are not logged unless --access-log")
    serve.add_argument("--disable-log-stats", action="store_true",
                       help="no stats line in the log every 10 s of work (throughput, queue, KV cache)")
    serve.add_argument("--trust-remote-code", action=RefuseRemoteCode,
                       help="refused: tailrace runs no code from a checkpoint")
    add_engine_flags(serve)
    add_limit_flags(serve)
    add_chat_flags(serve)
    add_bench_parser(sub)
    add_check_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(getattr(args, "log_level", "info"))
    if args.command == "serve":
        return asyncio.run(serve(args))
    if args.command == "bench":
        return run_bench(args)
    if args.command == "check":
        return run_check(args)
    return 2


def _one_model(args: argparse.Namespace) -> str | None:
    """The positional MODEL or vLLM's --model; both only when they agree."""
    if args.model_option is not None and args.model not in (None, args.model_option):
        raise ValueError(f"two models given: {args.model} and --model {args.model_option}; give one")
    model = args.model or args.model_option
    # `--served-model-name NAME... MODEL` takes MODEL as one more name; serving the embedded model
    # under it would hide the mistake.
    swallowed = [name for name in (args.served_model_name or [])[1:] if os.path.exists(name)]
    if model is None and swallowed:
        raise ValueError(f"--served-model-name took {swallowed[0]!r}, a path: give the model before "
                         "--served-model-name, or as --model")
    return model


def _model_source(model: str | None, path: str) -> str:
    if model is None:
        return "embedded"
    if os.path.normpath(model) != os.path.normpath(path) and not os.path.exists(model):
        return "hub"
    return "gguf" if path.endswith(".gguf") else "local"


@dataclass(slots=True)
class ServerSetup:
    """What `tailrace serve` builds from its flags before anything starts; the Ray deployment
    (tailrace.ray) builds the same from the same flags."""

    engine: EngineConfig
    tokenizer: Tokenizer
    server: ServerConfig


def checked_engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine config the serve flags ask for, every flag checked (the limits too) and nothing
    loaded; ValueError names a bad one."""
    args.model = _one_model(args)
    config = engine_config_from(args)
    config.validate()
    limits_from(args).validate()
    # known before the core starts: a server that only pools keeps no K/V (ModelRunner.keeps_kv)
    config.pooling_only = resolve_task(args.task, config.model_path)[0] is not None
    return config


def server_setup(args: argparse.Namespace, config: EngineConfig | None = None) -> ServerSetup:
    """The engine config (`config` when already checked), tokenizer and server config the serve
    flags ask for; ValueError names a bad one."""
    from tailrace.api.app import ServerConfig
    from tailrace.model.loading.gguf_file import forget_readers
    from tailrace.model.loading.hub import served_name
    from tailrace.tokenizer import load_tokenizer, read_chat_template

    config = config or checked_engine_config(args)
    limits = limits_from(args)
    sampling_defaults = load_sampling_defaults(args.generation_config, config.model_path)
    chat_template = None if args.chat_template is None else read_chat_template(args.chat_template)
    with timed(log, "loading the tokenizer"):
        tokenizer = load_tokenizer(config.model_path, chat_template=chat_template)
    name, *other_names = args.served_model_name or [served_name(config.model or config.model_path)]
    if sampling_defaults:
        log.info("requests that leave them unset sample with the model's generation config: %s", sampling_defaults)
    chat, formats = resolve_formats(chat_options_from(args), tokenizer.chat_template)
    log.info("%s", formats)
    chat, fit = fit_to_template(chat, tokenizer)
    log.info("%s", fit)
    pooling, task = resolve_task(args.task, config.model_path)
    log.info("%s", task)
    if pooling is not None and config.tensor_parallel_size > 1:
        raise ValueError("embedding and scoring run on one rank: drop --tensor-parallel-size")
    server = ServerConfig(served_model_name=name, api_key=args.api_key, max_body_bytes=args.max_body_bytes,
                          metrics_public=args.metrics_public, cors_origins=args.cors_origin + args.allowed_origins,
                          limits=limits, chat=chat, pooling=pooling, other_model_names=other_names,
                          sampling_defaults=sampling_defaults, log_stats=not args.disable_log_stats,
                          responses_store=StoreLimits(args.responses_store_max_count, args.responses_store_max_bytes))
    forget_readers()  # a GGUF's: the API process has read what it needs of it
    return ServerSetup(config, tokenizer, server)


async def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from tailrace.api.app import build_app
    from tailrace.api.server import listen, run_server
    from tailrace.engine.client import EngineClient, start_core

    try:
        config = checked_engine_config(args)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    try:
        sock = listen(args.host, args.port)
    except OSError as exc:
        log.error("cannot listen on %s:%d: %s", args.host, args.port, os.strerror(exc.errno) if exc.errno else exc)
        return 1
    # The model loads in the core process while the tokenizer loads here: a GGUF's vocabulary takes
    # seconds to parse, on each side.
    core = start_core(config)
    try:
        setup = server_setup(args, config)
    except ValueError as exc:
        core.stop()
        sock.close()
        log.error("%s", exc)
        return 2
    name = setup.server.served_model_name
    engine = EngineClient(config, setup.tokenizer, core)
    app = build_app(engine, setup.server)

    def log_ready() -> None:
        info = engine.info
        kv = (f"KV cache {info.num_blocks * info.block_size} tokens ({info.num_blocks} blocks of {info.block_size})"
              if info.keeps_kv else "no K/V kept (each prompt runs whole)")
        log.info("model %s (%s) from %s, %s, dtype %s, %s, context %d", name,
                 _model_source(args.model, config.model_path), config.model_path, info.device, info.dtype, kv,
                 info.max_model_len)
        log.info("serving the OpenAI API at http://%s:%d/v1", args.host, args.port)

    # No log config of uvicorn's own: its records reach the root handler, in tailrace's format.
    return await run_server(uvicorn.Config(app, host=args.host, port=args.port, log_config=None,
                                           log_level=args.uvicorn_log_level or args.log_level,
                                           access_log=args.access_log,
                                           timeout_graceful_shutdown=args.graceful_shutdown_timeout),
                            sock, engine, on_ready=log_ready)


if __name__ == "__main__":
    sys.exit(main())
