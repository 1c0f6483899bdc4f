"""`tailrace bench compare`: tailrace next to `transformers serve --continuous-batching`, in one run.

Both servers are started here, on loopback, from one snapshot of the model directory (the embedded
model is re-exported while it trains, and both must serve the same weights); both are stopped at
the end, on error and on Ctrl-C too. They get the same prompts and the same arrival seed, and the
levels alternate between them so a slow patch of background load falls on both. Both get the same
compute threads and KV cache memory (see `peer`).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from tailrace.bench.peer import (PEER_NAME, ensure_peer_venv, peer_command, peer_env, peer_exact_length_body,
                                 peer_kv_blocks)
from tailrace.bench.records import LevelResult
from tailrace.bench.report import format_comparison, summarize
from tailrace.bench.serve import (BenchError, LoadConfig, build_workload, first_model, open_client, run_level,
                                  warm_up)
from tailrace.bench.servers import ServerProcess, free_port, wait_ready
from tailrace.engine.config import EngineConfig

OURS = "tailrace"
SNAPSHOT_TRIES = 3


@dataclass(slots=True)
class CompareConfig:
    model_dir: str
    load: LoadConfig  # the shared load; base_url and model are set per server
    peer_venv: Path
    threads: int | None = None  # compute threads of each server; None: tailrace's default
    ready_timeout_s: float = 600.0

    @property
    def server_threads(self) -> int:
        return self.threads or max(1, (os.cpu_count() or 2) - 1)


def snapshot(source: str, destination: Path) -> str:
    """A copy of the model directory taken while no file in it changed."""
    for _ in range(SNAPSHOT_TRIES):
        before = _mtimes(Path(source))
        shutil.copytree(source, destination, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__", "__init__.py"))
        if _mtimes(Path(source)) == before:
            return str(destination)
    raise BenchError(f"{source} kept changing while it was copied")


def _mtimes(directory: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in directory.iterdir() if p.is_file()}


def run_compare(config: CompareConfig) -> tuple[dict[str, Any], dict[str, list[LevelResult]]]:
    """(run metadata, levels by server label); prints each level's table as it completes."""
    executable = ensure_peer_venv(config.peer_venv)
    # A plain SIGTERM would end this process without unwinding, leaving both servers running.
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        with tempfile.TemporaryDirectory(prefix="tailrace-compare-") as tmp:
            model_dir = snapshot(config.model_dir, Path(tmp) / Path(config.model_dir).name)
            ours_port, peer_port = free_port(), free_port()
            threads, kv_gb = config.server_threads, EngineConfig().kv_cache_memory_gb
            ours_command = [sys.executable, "-m", "tailrace", "serve", model_dir, "--host", "127.0.0.1",
                            "--port", str(ours_port), "--threads", str(threads), "--kv-cache-memory-gb", str(kv_gb)]
            peer_args = peer_command(executable, model_dir, peer_port, peer_kv_blocks(model_dir, kv_gb))
            with ServerProcess(OURS, ours_command, f"http://127.0.0.1:{ours_port}", Path(tmp) / "ours.log") as ours, \
                 ServerProcess(PEER_NAME, peer_args, f"http://127.0.0.1:{peer_port}", Path(tmp) / "peer.log",
                               env=peer_env(threads)) as peer:
                print(f"waiting for {OURS} at {ours.url} and {PEER_NAME} at {peer.url} "
                      f"({threads} compute threads and {kv_gb:g} GiB of KV cache each) ...", flush=True)
                wait_ready([ours, peer], config.ready_timeout_s)
                return asyncio.run(_measure(config, ours.url, peer.url, model_dir))
    finally:
        signal.signal(signal.SIGTERM, previous)


async def _measure(config: CompareConfig, ours_url: str, peer_url: str,
                   model_dir: str) -> tuple[dict[str, Any], dict[str, list[LevelResult]]]:
    ours_load = replace(config.load, base_url=ours_url, model=None)
    peer_load = replace(config.load, base_url=peer_url, model=model_dir, exact_length=False,
                        extra_body=peer_exact_length_body(config.load.temperature))
    runs: dict[str, list[LevelResult]] = {OURS: [], PEER_NAME: []}
    async with open_client(ours_load) as ours, open_client(peer_load) as peer:
        ours_load.model = await first_model(ours, ours_load)
        # Prompts are sized with tailrace's /tokenize (same tokenizer files), then sent to both.
        workload = await build_workload(ours, ours_load, ours_load.model)
        await warm_up(ours, ours_load, ours_load.model, workload.prompts[0])
        await warm_up(peer, peer_load, model_dir, workload.prompts[0])
        for concurrency in config.load.concurrency:
            runs[OURS].append(await run_level(ours, ours_load, ours_load.model, workload, concurrency, f"{OURS} "))
            runs[PEER_NAME].append(await run_level(peer, peer_load, model_dir, workload, concurrency,
                                                   f"{PEER_NAME} "))
            print(format_comparison(summarize(runs[OURS][-1]), summarize(runs[PEER_NAME][-1]), (OURS, PEER_NAME)),
                  flush=True)
    meta = {"config": {**asdict(config.load), "api_key": None, "base_url": None, "model": config.model_dir,
                       "threads": config.server_threads},
            "servers": {OURS: {"url": ours_url, "extra_body": {}, "exact_length": True},
                        PEER_NAME: {"url": peer_url, "extra_body": peer_load.extra_body, "exact_length": False}},
            "tokens_per_word": workload.tokens_per_word, "calibrated": workload.calibrated}
    return meta, runs
