"""A tensor-parallel worker process (ranks 1..N-1): join rank 0's group, load this rank's part of
the model, and run the forward of each step rank 0 broadcasts until it says stop."""

from __future__ import annotations

import logging
import pickle
import sys
import traceback
from datetime import timedelta

import torch.distributed as dist

from tailrace.engine.model_runner import ModelRunner
from tailrace.engine.stop_signals import ignore_in_child
from tailrace.engine.tensor_parallel.group import HOST, NO_TIMEOUT, TensorParallel, WorkerArgs, device_type
from tailrace.heap import freeze_startup_objects
from tailrace.logs import configure_logging

log = logging.getLogger("tailrace.engine")

_JOIN_TIMEOUT = timedelta(seconds=60)  # a worker's wait for rank 0's store


def main() -> None:
    """A worker process: its arguments arrive pickled on stdin from rank 0, its parent."""
    ignore_in_child()  # like the core: stopped by rank 0, never by a signal to the process group
    args: WorkerArgs = pickle.load(sys.stdin.buffer)
    configure_logging(args.log_level)
    sys.exit(run_worker(args))


def run_worker(args: WorkerArgs) -> int:
    """Join the group, load this rank's part of the model, follow rank 0's steps; the exit status."""
    store = dist.TCPStore(HOST, args.port, args.size, is_master=False, timeout=_JOIN_TIMEOUT)
    store.set(f"joined/{args.rank}", "1")
    tp = TensorParallel(args.rank, args.size, device_type(args.config))
    dist.init_process_group(tp.backend, store=store, rank=args.rank, world_size=args.size, timeout=NO_TIMEOUT)
    try:
        runner = ModelRunner(args.config, tp)
        freeze_startup_objects()
        while (step := tp.receive_step(runner.device)) is not None:
            runner.follow(step)
    except Exception:
        log.error("tensor-parallel rank %d failed:\n%s", args.rank, traceback.format_exc())
        return 1
    dist.destroy_process_group()
    return 0
