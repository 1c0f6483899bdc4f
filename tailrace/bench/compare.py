"""`tailrace bench compare`: tailrace against peer servers (transformers, vLLM, llama.cpp), one run.

Every server is started here on loopback with the same model directory, compute threads and KV
memory, and measured alone on the machine: one after another, each started, warmed up, run
through every concurrency level and stopped before the next starts. Each level (a cell) has its
own prompt seed, so no cell can hit a prefix cached by an earlier one, and every server gets the
same prompts per cell. tailrace goes first: its /tokenize sizes the prompts for all of them.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from time import monotonic
from typing import Any

from tailrace import envs
from tailrace.bench.peers import PeerServer, PeerSettings, llamacpp, transformers, vllm
from tailrace.bench.peers.install import PEERS_DIR
from tailrace.bench.prompts import DEFAULT_TOKENS_PER_WORD, make_prompts
from tailrace.bench.records import LevelResult
from tailrace.bench.report import format_comparison, format_level_line, summarize
from tailrace.bench.serve import (BenchError, LoadConfig, Workload, calibrate, first_model, open_client, run_level,
                                  warm_up)
from tailrace.bench.servers import ServerProcess, free_port, wait_ready
from tailrace.bench.shapes import SHAPES, write_shape_config
from tailrace.engine.config import EMBEDDED_MODEL, EngineConfig
from tailrace.model.loading.hub import is_gguf

OURS = "tailrace"
PEERS = {peer.NAME: peer for peer in (transformers, vllm, llamacpp)}
SNAPSHOT_TRIES = 3
CONTEXT_SPARE = 256  # tokens of a sequence beyond prompt and answer: chat template, prompt length estimate


@dataclass(slots=True)
class CompareConfig:
    load: LoadConfig  # the shared load; base_url and model are set per server
    peers: list[str] = field(default_factory=lambda: [transformers.NAME])
    model_dir: str | None = None  # None: the shape's directory, or else the embedded model
    shape: str | None = None  # a name in shapes.SHAPES
    threads: int | None = None  # compute threads of each server; None: each one's best policy (see server_threads)
    dtype: str = "float32"
    peer_quant: str | None = None  # llama.cpp's weights: Q8_0 or Q4_0
    ours_args: list[str] = field(default_factory=list)  # more `tailrace serve` flags
    llamacpp_args: list[str] = field(default_factory=list)  # more llama-server flags
    peers_dir: Path = PEERS_DIR
    ready_timeout_s: float = 900.0
    log_dir: Path | None = None  # where each server's log is kept; None: a temporary directory, gone after

    @property
    def server_threads(self) -> int:
        """The peers' thread count. By default all cores: llama.cpp's -t 2 beat -t 1 on 2 cores
        (research/cpu_peers.md), vLLM's "auto" binding is its own best (see vllm.thread_binding),
        and tailrace gets no --threads at all and measures its own count step by step."""
        return self.threads or os.cpu_count() or 1


@dataclass(slots=True)
class Cells:
    """The prompts of the warm-up and of each concurrency level, the same for every server."""
    warm_up: str
    levels: list[Workload]


def cell_seed(seed: int, cell: int) -> int:
    """Distinct for every cell of every run seed; cell 0 is the warm-up."""
    return seed * 1000 + cell


def make_cells(load: LoadConfig, tokens_per_word: float, calibrated: bool) -> Cells:
    warm = make_prompts(1, load.input_len, cell_seed(load.seed, 0), tokens_per_word)[0]
    levels = [Workload(make_prompts(load.num_prompts, load.input_len, cell_seed(load.seed, i + 1), tokens_per_word),
                       tokens_per_word, calibrated) for i in range(len(load.concurrency))]
    return Cells(warm, levels)


def snapshot(source: str, destination: Path) -> str:
    """A copy of the model directory taken while no file in it changed (the embedded model is
    re-exported while it trains); copies keep their modification times."""
    for _ in range(SNAPSHOT_TRIES):
        before = _mtimes(Path(source))
        shutil.copytree(source, destination, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__", "__init__.py"))
        if _mtimes(Path(source)) == before:
            return str(destination)
    raise BenchError(f"{source} kept changing while it was copied")


def _mtimes(directory: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in directory.iterdir() if p.is_file()}


def ours_server(config: CompareConfig, settings: PeerSettings) -> PeerServer:
    """tailrace with llama.cpp's context and slots: max_num_seqs sequences of max_model_len tokens,
    and a KV cache of exactly their tokens (llama.cpp's -c), so that both hold the same KV bytes."""
    blocks = -(-settings.max_num_seqs * settings.max_model_len // EngineConfig().block_size)
    command = [sys.executable, "-m", "tailrace", "serve", settings.model_dir, "--host", "127.0.0.1",
               "--port", str(settings.port), *(["--threads", str(config.threads)] if config.threads else []),
               "--num-kv-blocks", str(blocks), "--max-num-seqs", str(settings.max_num_seqs),
               "--max-model-len", str(settings.max_model_len), "--dtype", settings.dtype, *config.ours_args]
    return PeerServer(command, envs.environment(), model="")  # the model is the one it lists


def peer_settings(config: CompareConfig, model_dir: str) -> PeerSettings:
    return PeerSettings(model_dir=model_dir, port=free_port(), threads=config.server_threads,
                        kv_cache_gb=EngineConfig().kv_cache_memory_gb, max_num_seqs=max(config.load.concurrency),
                        max_model_len=config.load.input_len + config.load.output_len + CONTEXT_SPARE,
                        dtype=config.dtype, quant=config.peer_quant, llamacpp_args=config.llamacpp_args)


def server_settings(config: CompareConfig, name: str, model_dir: str) -> PeerSettings:
    """peer_settings, except that vLLM serves a shape written as one layer from its config alone,
    drawing random weights: it reads no GGUF of that layer repeated (see Shape.one_layer)."""
    settings = peer_settings(config, model_dir)
    if name == vllm.NAME and config.shape and SHAPES[config.shape].one_layer:
        settings.model_dir, settings.dummy_weights = str(write_shape_config(SHAPES[config.shape])), True
    return settings


def run_compare(config: CompareConfig) -> tuple[dict[str, Any], dict[str, list[LevelResult]]]:
    """(run metadata, levels by server name); prints each server's levels, then the ratio tables."""
    for name in config.peers:
        PEERS[name].ensure_installed(config.peers_dir / name)
    # A plain SIGTERM would end this process without unwinding, leaving a server running.
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        with tempfile.TemporaryDirectory(prefix="tailrace-compare-") as tmp:
            model_dir = _model_dir(config, Path(tmp))
            log_dir = config.log_dir or Path(tmp)
            log_dir.mkdir(parents=True, exist_ok=True)
            runs: dict[str, list[LevelResult]] = {}
            servers: dict[str, dict[str, Any]] = {}
            cells: Cells | None = None
            for name in [OURS, *config.peers]:
                settings = server_settings(config, name, model_dir)
                server = (ours_server(config, settings) if name == OURS
                          else PEERS[name].launch(config.peers_dir / name, settings))
                load = _server_load(config.load, settings.port, server)
                runs[name], cells, servers[name] = _run_alone(name, server, load, cells, log_dir,
                                                              config.ready_timeout_s)
    finally:
        signal.signal(signal.SIGTERM, previous)
    for level in range(len(config.load.concurrency)):
        print(format_comparison({name: summarize(levels[level]) for name, levels in runs.items()}, OURS), flush=True)
    meta = {"config": {**asdict(config.load), "api_key": None, "base_url": None, "model": None},
            "model_dir": config.model_dir, "shape": config.shape, "threads": config.server_threads,
            "dtype": config.dtype, "peer_quant": config.peer_quant, "ours_args": config.ours_args,
            "llamacpp_args": config.llamacpp_args,
            "servers": servers, "tokens_per_word": cells.levels[0].tokens_per_word if cells else None,
            "calibrated": cells.levels[0].calibrated if cells else False,
            "cell_seeds": [cell_seed(config.load.seed, i + 1) for i in range(len(config.load.concurrency))]}
    return meta, runs


def _model_dir(config: CompareConfig, tmp: Path) -> str:
    if config.shape and SHAPES[config.shape].one_layer:
        if not set(config.peers) <= {llamacpp.NAME, vllm.NAME}:
            raise BenchError(f"the {config.shape} shape is a GGUF of one repeated layer, which llamacpp reads and "
                             f"vllm draws at random (--peer llamacpp, --peer vllm)")
        if vllm.NAME in config.peers and config.peer_quant:
            raise BenchError(f"vllm draws the {config.shape} shape's weights at --dtype; --peer-quant is "
                             f"llama.cpp's alone")
        return str(llamacpp.repeated_layer_gguf(config.peers_dir / llamacpp.NAME, SHAPES[config.shape],
                                                config.dtype, config.peer_quant))
    if config.shape:
        return str(llamacpp.shape_dir(config.peers_dir / llamacpp.NAME, SHAPES[config.shape]))  # written once
    source = config.model_dir or EMBEDDED_MODEL
    if is_gguf(source):  # a file people download, served as it is
        if set(config.peers) - {llamacpp.NAME} or config.peer_quant:
            raise BenchError(f"{source} is a GGUF file, which tailrace and llamacpp serve as it is (--peer llamacpp, "
                             f"no --peer-quant)")
        return source
    return snapshot(source, tmp / Path(source).name)


def _server_load(load: LoadConfig, port: int, server: PeerServer) -> LoadConfig:
    return LoadConfig(**{**asdict(load), "base_url": f"http://127.0.0.1:{port}", "model": server.model or None,
                         "exact_length": server.exact_length, "extra_body": {**load.extra_body, **server.extra_body}})


def _run_alone(name: str, server: PeerServer, load: LoadConfig, cells: Cells | None, log_dir: Path,
               ready_timeout_s: float, after: Callable[[str], None] | None = None,
               ) -> tuple[list[LevelResult], Cells, dict[str, Any]]:
    """Start one server, measure it at every level, call `after` with its URL, stop it: (levels,
    cells, what it was)."""
    load_before = os.getloadavg()
    print(f"{name}: starting ({' '.join(server.command[:3])} ...); load average {_loads(load_before)}", flush=True)
    started = monotonic()
    with ServerProcess(name, server.command, load.base_url, log_dir / f"{name}.log", env=server.env) as process:
        wait_ready([process], ready_timeout_s)
        ready_s = monotonic() - started
        print(f"{name}: ready after {ready_s:.0f} s", flush=True)
        levels, cells = asyncio.run(_measure(name, load, cells))
        memory = process.memory()
        if after is not None:
            after(load.base_url)
    print(f"{name}: memory at the end {memory.pss / 2**30:.2f} GiB proportional ({memory.pss_anon / 2**30:.2f} "
          f"anonymous, {memory.pss_file / 2**30:.2f} file-backed), {memory.rss / 2**30:.2f} GiB resident, peaks "
          f"{memory.peak_rss / 2**30:.2f} GiB (the server's processes)", flush=True)
    for level in levels:
        print(format_level_line(name, summarize(level)), flush=True)
    load_after = os.getloadavg()
    print(f"{name}: done; load average {_loads(load_after)}", flush=True)
    info = {"command": server.command, "model": load.model, "exact_length": load.exact_length,
            "extra_body": load.extra_body, "ready_s": ready_s, "load_average_before": load_before,
            "load_average_after": load_after, "rss_bytes": memory.rss, "peak_rss_bytes": memory.peak_rss,
            "pss_bytes": memory.pss, "pss_anon_bytes": memory.pss_anon, "pss_file_bytes": memory.pss_file}
    return levels, cells, info


def _loads(averages: tuple[float, float, float]) -> str:
    return " ".join(f"{a:.2f}" for a in averages) + " (1, 5, 15 min)"


async def _measure(name: str, load: LoadConfig, cells: Cells | None) -> tuple[list[LevelResult], Cells]:
    async with open_client(load) as client:
        load.model = load.model or await first_model(client, load)
        if cells is None:  # the first server sizes the prompts with its /tokenize
            measured = await calibrate(client, load, load.model)
            cells = make_cells(load, measured or DEFAULT_TOKENS_PER_WORD, measured is not None)
        await warm_up(client, load, load.model, cells.warm_up)
        levels = [await run_level(client, load, load.model, workload, concurrency, f"{name} ")
                  for concurrency, workload in zip(load.concurrency, cells.levels)]
    return levels, cells
