"""Tensor-parallel ranks: the torch.distributed process group, the worker processes the engine core
starts (worker.py), and each step's way from rank 0 to them (step.py).

The engine core is rank 0: it schedules, runs its part of the model and samples. It starts ranks
1..N-1 as processes of their own (`python -c ...main()`: the core may itself be a daemon process,
which multiprocessing does not let have children), and all N join one group over a TCPStore on
loopback: `gloo` on CPU, `nccl` on CUDA. A worker loads its part of the model and then loops: take
the step rank 0 broadcasts (step.py), run the forward, join the collectives, until rank 0 says stop.

Faults. Each worker holds the write end of a pipe whose read end rank 0 watches (`sentinels`): the
pipe reads EOF the moment the worker exits, so an idle core learns of a death while it waits for
requests, and a core inside a collective gets gloo's "connection closed" error at once. Either way
the core fails, and the API process takes the existing engine-dead path. A worker whose rank 0
goes away fails its next broadcast the same way and exits. The group's timeout is effectively
infinite: a worker waits in a broadcast for as long as the server idles.
"""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import time
from collections.abc import Collection
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import wait

import torch
import torch.distributed as dist

from tailrace.engine.config import EngineConfig, resolve_device
from tailrace.engine.step_inputs import StepInputs
from tailrace.engine.stop_signals import blocked_while_starting
from tailrace.engine.tensor_parallel.step import FollowStep, decode_step, encode_step
from tailrace.model.loading.loader import load_model_config
from tailrace.model.loading.tp_shard import Shard, check_shardable

log = logging.getLogger("tailrace.engine")

HOST = "127.0.0.1"
NO_TIMEOUT = timedelta(days=365)
_START_POLL_S = 0.05  # rank 0 checks for a worker that died before joining this often
_STOP_GRACE_S = 5.0
_STEP, _STOP = 1, 2
_BACKENDS = {"cpu": "gloo", "cuda": "nccl"}
_WORKER_MAIN = "from tailrace.engine.tensor_parallel.worker import main; main()"


@dataclass(slots=True)
class WorkerArgs:
    config: EngineConfig
    rank: int
    size: int
    port: int
    log_level: int


@dataclass(slots=True)
class _Worker:
    rank: int
    process: subprocess.Popen
    sentinel: int  # read end of a pipe that reads EOF when the process exits


class TensorParallel:
    """This process's place in the group; on rank 0, also the workers it started."""

    def __init__(self, rank: int, size: int, device_type: str, workers: list[_Worker] | None = None) -> None:
        self.shard = Shard(rank, size)
        self.backend = _BACKENDS[device_type]
        # NCCL moves device tensors only: the step description travels through the rank's GPU there.
        self._comm = torch.device("cuda", rank) if self.backend == "nccl" else torch.device("cpu")
        self._workers = [] if workers is None else workers
        self._header = torch.zeros(2, dtype=torch.int64, device=self._comm)
        self._in_step = False  # rank 0: a step was sent and its forward has not finished (the workers are in it)

    @property
    def rank(self) -> int:
        return self.shard.rank

    @property
    def size(self) -> int:
        return self.shard.size

    @property
    def worker_pids(self) -> list[int]:
        return [w.process.pid for w in self._workers]

    @property
    def sentinels(self) -> list[int]:
        """File descriptors that become readable when a worker exits (rank 0)."""
        return [w.sentinel for w in self._workers]

    def check_alive(self, ready: Collection[object] = ()) -> None:
        """RuntimeError naming the first worker that has exited; `ready`: sentinels seen readable, whose
        workers are exiting (their status is waited for)."""
        for w in self._workers:
            code = w.process.wait() if w.sentinel in ready else w.process.poll()
            if code is not None:
                raise RuntimeError(f"tensor-parallel rank {w.rank} exited with status {code}")

    def exited_worker(self, within_s: float) -> str | None:
        """Rank 0, after a collective failed: which worker exited, given within_s for its exit to show;
        None if none did."""
        try:
            self.check_alive(wait(self.sentinels, within_s))
        except RuntimeError as err:
            return str(err)
        return None

    def agree_min(self, value: int) -> int:
        """The smallest `value` over the ranks (each rank's KV cache must hold the same blocks)."""
        t = torch.tensor([value], dtype=torch.int64, device=self._comm)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def send_step(self, inputs: StepInputs, rows: list[int], released: list[int]) -> None:
        """Rank 0: the step to every worker, before rank 0 runs it itself."""
        body = encode_step(inputs, rows, released).to(self._comm)
        self._header[0], self._header[1] = _STEP, body.shape[0]
        self._in_step = True
        dist.broadcast(self._header, 0)
        dist.broadcast(body, 0)

    def step_done(self) -> None:
        """Rank 0: the step's collectives are over; the workers wait for the next step."""
        self._in_step = False

    def receive_step(self, device: torch.device) -> FollowStep | None:
        """A worker: the next step, or None when rank 0 says stop."""
        dist.broadcast(self._header, 0)
        kind, length = self._header.tolist()
        if kind == _STOP:
            return None
        body = torch.empty(length, dtype=torch.int64, device=self._comm)
        dist.broadcast(body, 0)
        return decode_step(body.cpu(), device)

    def shutdown(self) -> None:
        """Rank 0: tell every worker to stop, kill those that do not, leave the group. A step that
        failed half-way leaves the workers inside a collective, where no stop can reach them: they are
        killed at once."""
        if self._in_step:
            self._end(0)
            return
        if self._workers and all(w.process.poll() is None for w in self._workers):
            self._header[0] = _STOP
            try:
                dist.broadcast(self._header, 0)
            except RuntimeError:
                pass  # a worker died meanwhile: it is killed below like the others
        self._end(_STOP_GRACE_S)

    def kill(self) -> None:
        """Rank 0, when the workers may be anywhere (a failed start): kill them and leave the group."""
        self._end(0)

    def _end(self, grace_s: float) -> None:
        for w in self._workers:
            try:
                w.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                w.process.kill()
                w.process.wait()
            os.close(w.sentinel)
        self._workers = []
        if dist.is_initialized():
            dist.destroy_process_group()


def start_ranks(config: EngineConfig) -> TensorParallel:
    """Rank 0 (this process): start the workers and form the group with them. A model that `size`
    ranks cannot split, or fewer GPUs than ranks, is refused before any worker starts."""
    size = config.tensor_parallel_size
    check_shardable(load_model_config(config.model_path), size)
    kind = device_type(config)
    if kind == "cuda" and torch.cuda.device_count() < size:
        raise ValueError(f"tensor_parallel_size {size} needs one GPU per rank; CUDA sees "
                         f"{torch.cuda.device_count()}")
    store = dist.TCPStore(HOST, 0, size, is_master=True, wait_for_workers=False)
    workers: list[_Worker] = []
    tp = TensorParallel(0, size, kind, workers)
    try:
        for rank in range(1, size):
            workers.append(_spawn(WorkerArgs(config, rank, size, store.port, logging.getLogger().getEffectiveLevel())))
        for w in workers:
            _wait_joined(store, w)
        dist.init_process_group(tp.backend, store=store, rank=0, world_size=size, timeout=NO_TIMEOUT)
    except BaseException:
        tp.kill()
        raise
    log.info("tensor parallel: %d ranks over %s, worker pids %s", size, tp.backend, tp.worker_pids)
    return tp


def device_type(config: EngineConfig) -> str:
    return torch.device(resolve_device(config.device, torch.cuda.is_available())).type


def _spawn(args: WorkerArgs) -> _Worker:
    read_end, write_end = os.pipe()
    with blocked_while_starting():
        process = subprocess.Popen([sys.executable, "-c", _WORKER_MAIN], stdin=subprocess.PIPE, pass_fds=(write_end,))
    os.close(write_end)  # the worker holds the only write end now: EOF here when it exits
    process.stdin.write(pickle.dumps(args))
    process.stdin.close()
    return _Worker(args.rank, process, read_end)


def _wait_joined(store: dist.TCPStore, worker: _Worker) -> None:
    """Wait for the worker's key in the store, failing at once if the worker exits first."""
    while not store.check([f"joined/{worker.rank}"]):
        code = worker.process.poll()
        if code is not None:
            raise RuntimeError(f"tensor-parallel rank {worker.rank} exited with status {code} while starting; "
                               "its log above says why")
        time.sleep(_START_POLL_S)
