"""Batch-1 (and batch-B) decode step time against the weight-streaming floor, in one run:

    .venv/bin/python bench/decode_step.py --model /path/to/shape --dtype float32 --threads 2

The floor is the bytes of weights a decode step must read (every linear layer and the LM head;
the embedding lookup reads one row) divided by the read bandwidth measured here, on the same
threads, by summing a buffer larger than the caches. The step is the model's forward plus
logits for B sequences at a context of --context tokens, through the engine's own KV cache, and
the sampler's greedy pick, with dummy weights (load_format dummy: only config.json is needed).

The bandwidth (best of 5 sums) is read once, before the steps; on a shared host it moves by 1.5x
from minute to minute, and the steps with it. So the table has a paired figure too: before every
_PROBE_EVERY-th step, one timed sum gives the floor of that moment, and each step is set against
the floor read just before it; the median of those ratios. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from datetime import datetime, timezone

import torch
import torch.nn.functional as F

from tailrace.engine.config import EMBEDDED_MODEL
from tailrace.engine.sampler import greedy_tokens
from tailrace.model import backends
from tailrace.model.attention.kv_cache import AttentionBatch, KVCache, SeqSlice
from tailrace.model.attention.paged import PagedKVCache
from tailrace.model.cpu import bf16_linear, ops as cpu_ops
from tailrace.model.cpu.linear import PackedLinear, packable
from tailrace.model.loading.loader import load_model
from tailrace.model.options import QUANTIZATIONS

_BANDWIDTH_BYTES = 1 << 30
_PROBE_EVERY = 10  # steps between two paired reads of the bandwidth


def load_as_engine(model_dir: str, dtype: str = "float32", quantization: str | None = None,
                   load_format: str = "auto", pack: bool = True, huge_pages: bool = True):
    """The model as the engine's model runner prepares it on the CPU: loaded, quantized or packed,
    its weights on huge pages, and with tailrace's elementwise kernels where they run."""
    model, config = load_model(model_dir, dtype=dtype, load_format=load_format, quantization=quantization)
    if pack:
        print(backends.prepare(model, torch.device("cpu"), quantization, huge_pages).line(model))
    return model, config


def read_bandwidth(threads: int, repeats: int = 5) -> float:
    """Bytes/s of a sum over a 1 GiB float32 buffer: the rate weights stream at from memory."""
    torch.set_num_threads(threads)
    buffer = torch.ones(_BANDWIDTH_BYTES // 4)
    buffer.sum()
    best = min(_timed(buffer.sum) for _ in range(repeats))
    return _BANDWIDTH_BYTES / best


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def streamed_weight_bytes(model: torch.nn.Module) -> int:
    """What a decode step reads: every weight (plain, packed or quantized) but the embedding table
    and the rotary tables, plus the table when the logits read it (a tied, unreplaced head)."""
    table = getattr(model.model.embed_tokens, "weight", None)  # a packed tied head's lookups have none
    skipped = {id(table), id(model.model.rotary.cos), id(model.model.rotary.sin)}
    tensors = [t for t in [*model.parameters(), *model.buffers()] if id(t) not in skipped]
    tensors += [m.packed for m in model.modules() if hasattr(m, "packed") and m.packed.is_mkldnn]
    if model.lm_head is None:
        tensors.append(table)
    return sum(t.numel() * t.element_size() for t in tensors)


def new_cache(model, config, num_blocks: int, block_size: int, max_seqs: int, max_model_len: int,
              attention: str = "auto"):
    """The KV cache of `--attention` (auto: the one the engine would use on this CPU)."""
    chosen = backends.choose_attention(attention, "cpu", model.dtype, config.head_dim, backends.is_plain(model))
    args = (config.num_hidden_layers, config.num_key_value_heads, config.head_dim, num_blocks, block_size, model.dtype)
    if chosen.layout == "paged":
        return PagedKVCache(*args, max_seqs=max_seqs, max_model_len=max_model_len, kernel=chosen.kernel)
    return KVCache(*args, max_seqs=max_seqs, max_model_len=max_model_len)


def prefilled_cache(model, config, batch: int, context: int, steps: int,
                    attention: str = "auto") -> tuple[KVCache, list[list[int]]]:
    """A KV cache holding `batch` sequences of `context` tokens, filled by one prefill, with room
    for `steps` more each, and the sequences' block tables."""
    block = 16
    per_seq = -(-(context + steps + 1) // block)
    cache = new_cache(model, config, per_seq * batch, block, batch, per_seq * block, attention)
    tables = [list(range(j * per_seq, (j + 1) * per_seq)) for j in range(batch)]
    with torch.inference_mode():
        forward_step(model, cache, tables, [list(range(3, 3 + context))] * batch, 0)
    return cache, tables


def decode_step_times(model, config, batch: int, context: int, steps: int,
                      paths: dict[str, Callable[[], None]] | None = None,
                      before: Callable[[int], None] | None = None) -> dict[str, list[float]]:
    """Each decode step's time, per path: `paths` names a function that sets the model up for that
    path (the model as it is by default). Each step runs once on every path at the same position
    (each path writes the same K/V bits), the order rotating, so load on shared cores falls on
    every path alike; `before(i)` runs ahead of step i's. The model is left on the first path."""
    paths = paths or {"": lambda: None}
    names = list(paths)
    cache, tables = prefilled_cache(model, config, batch, context, steps)
    times = {name: [] for name in names}
    with torch.inference_mode():
        ids = [[5]] * batch
        for i in range(steps):
            if before is not None:
                before(i)
            for name in names[i % len(names):] + names[:i % len(names)]:
                paths[name]()
                start = time.perf_counter()
                greedy_tokens(forward_step(model, cache, tables, ids, context + i)).tolist()
                times[name].append(time.perf_counter() - start)
    paths[names[0]]()
    return times


def _with_forward(model, forward, head=None, buffers: dict | None = None) -> Callable[[], None]:
    """A path of decode_step_times: this fused forward (None: module by module), and these buffers
    in the head."""
    def use() -> None:
        model.model.fused_forward = forward
        if head is not None:
            head._buffers.update(buffers)
    return use


def forward_step(model, cache: KVCache, tables: list[list[int]], rows: list[list[int]], past: int) -> torch.Tensor:
    """Sequence j (block table tables[j]) runs its new tokens rows[j] after `past` cached ones:
    the logits of each sequence's last row, from the model and KV cache alone."""
    block = cache.block_size
    slices, slots, ids, positions = [], [], [], []
    for j, (row, table) in enumerate(zip(rows, tables)):
        slices.append(SeqSlice(j, len(ids), len(row), past + len(row), table))
        ids.extend(row)
        positions.extend(range(past, past + len(row)))
        slots.extend(table[p // block] * block + p % block for p in range(past, past + len(row)))
    batch = AttentionBatch(slices, torch.tensor(slots))
    cache.begin(batch)
    last = [s.q_start + s.q_len - 1 for s in slices]
    return model.compute_logits(model(torch.tensor(ids), torch.tensor(positions), batch, cache, last))


def sequence_cache(model, config, tokens: int, block: int = 16, attention: str = "auto") -> tuple[KVCache, list[int]]:
    """An empty KV cache just large enough for one sequence of `tokens` tokens, and its block table."""
    blocks = -(-tokens // block)
    cache = new_cache(model, config, blocks, block, 1, blocks * block, attention)
    return cache, list(range(blocks))


def prefill_time(model, config, tokens: int, repeats: int = 5) -> float:
    """Best time of one sequence's prefill of `tokens` tokens plus its last row's logits (TTFT's compute)."""
    best = math.inf
    with torch.inference_mode():
        for _ in range(repeats + 1):
            cache, table = sequence_cache(model, config, tokens)
            start = time.perf_counter()
            greedy_tokens(forward_step(model, cache, [table], [list(range(3, 3 + tokens))], 0)).tolist()
            best = min(best, time.perf_counter() - start)
    return best


def matmul_bound(config, tokens: int, dtype: torch.dtype, repeats: int = 5) -> float:
    """The prefill's FLOP bound: the same projections as bare matmuls (the fastest of MKL's F.linear,
    oneDNN over packed weights and tailrace's own kernel) for `tokens` rows, and the head for one
    row. At a lower precision float32's matmuls are candidates too: without AVX512-BF16 or AMX,
    oneDNN emulates bfloat16 several times slower than float32, which would make a bound anything
    beats. tailrace's kernel is one, as it outruns both at float32 (a 1B-shape prefill measured
    0.91x a bound without it): the bound is the fastest bare matmul here."""
    return bound_of(bound_matmuls(config, tokens, dtype, repeats))


# One shape of the bound: its fastest matmul, how many a prefill runs, its best time.
BoundPart = tuple[Callable[[], object], int, float]


def bound_matmuls(config, tokens: int, dtype: torch.dtype, repeats: int = 5) -> list[BoundPart]:
    """matmul_bound's parts: for each shape, (its fastest matmul, how many a prefill runs, its best time)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    shapes = [(q + 2 * kv, hidden), (hidden, q), (2 * inter, hidden), (hidden, inter)]
    parts = []
    for (out_features, in_features), rows, count in [*((s, tokens, config.num_hidden_layers) for s in shapes),
                                                     ((config.vocab_size, hidden), 1, 1)]:
        candidates = []
        for kind in dict.fromkeys([dtype, torch.float32]):
            weight, x = torch.randn(out_features, in_features, dtype=kind), torch.randn(rows, in_features, dtype=kind)
            candidates.append(lambda weight=weight, x=x: F.linear(x, weight))
            if packable(kind, torch.device("cpu")):
                candidates.append(lambda packed=PackedLinear(weight, None), x=x: packed(x))
            own = bf16_linear.kernel_linear(kind)
            if own is not None and bf16_linear.available() and bf16_linear.kernel_takes(weight):
                candidates.append(lambda linear=own(weight, None), x=x: linear(x))
        best, fn = min(((_best_of(fn, repeats), fn) for fn in candidates), key=lambda pair: pair[0])
        parts.append((fn, count, best))
    return parts


def bound_of(parts: list[BoundPart]) -> float:
    """The bound: each shape's best time, as many times as a prefill runs it."""
    return sum(count * best for _, count, best in parts)


def bound_pass(parts: list[BoundPart]) -> float:
    """One timed pass of the bound's fastest matmuls, each as many times as a prefill runs it."""
    return sum(sum(_timed(fn) for _ in range(count)) for fn, count, _ in parts)


def _best_of(fn, repeats: int) -> float:
    fn()
    return min(_timed(fn) for _ in range(repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=EMBEDDED_MODEL, help="a model directory (config.json is enough)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quantization", choices=QUANTIZATIONS, default=None)
    parser.add_argument("--no-pack", action="store_true", help="plain F.linear projections (the unpacked baseline)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--batch", type=int, nargs="+", default=[1])
    parser.add_argument("--context", type=int, default=192)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--prefill", type=int, default=128, help="prompt tokens of the prefill measured (0: none)")
    parser.add_argument("--ab-fused", action="store_true",
                        help="time each step on both paths: the whole forward in one call, and module by module")
    parser.add_argument("--ab-huge-pages", action="store_true",
                        help="time each step on both copies of the weights: gathered onto huge pages (the "
                             "engine's), and where packing left them")
    parser.add_argument("--out", default="bench/out/decode_step.json")
    args = parser.parse_args()
    if args.ab_fused and args.ab_huge_pages:
        parser.error("one A/B at a time")
    bandwidth = read_bandwidth(args.threads)
    model, config = load_as_engine(args.model, args.dtype, args.quantization, "dummy", pack=not args.no_pack,
                                   huge_pages=not args.ab_huge_pages)
    weight_bytes = streamed_weight_bytes(model)
    floor = weight_bytes / bandwidth
    paths = None
    if (args.ab_fused or args.ab_huge_pages) and model.model.fused_forward is None:
        parser.error("the A/B paths are whole-forward calls: this model runs module by module only (the "
                     "backends line above says why)")
    if args.ab_fused:
        paths = {"fused": _with_forward(model, model.model.fused_forward), "modules": _with_forward(model, None)}
    if args.ab_huge_pages:
        # The forward made before the move keeps the weights where packing put them, and the head
        # its buffers as they were; after the move, both read the copy on huge pages.
        head = model.lm_head  # None: a head that reads the embedding table, not moved
        head_buffers = (lambda: {}) if head is None else (lambda: dict(head._buffers))
        scattered = model.model.fused_forward, head_buffers()
        cpu_ops.gather_weights(model)
        huge = cpu_ops.FusedForward(model), head_buffers()
        paths = {name: _with_forward(model, forward, head, buffers)
                 for name, (forward, buffers) in (("huge", huge), ("scattered", scattered))}
    rows = []
    probe = torch.ones(_BANDWIDTH_BYTES // 4)
    for batch in args.batch:
        floors: list[float] = []  # the floor read before steps 0, _PROBE_EVERY, 2 * _PROBE_EVERY, ...

        def read_floor(i: int) -> None:
            if i % _PROBE_EVERY == 0:
                floors.append(weight_bytes * _timed(probe.sum) / _BANDWIDTH_BYTES)

        for path, times in decode_step_times(model, config, batch, args.context, args.steps, paths,
                                             read_floor).items():
            median = statistics.median(times[2:])
            paired = statistics.median(t / floors[i // _PROBE_EVERY] for i, t in enumerate(times) if i >= 2)
            rows.append({"batch": batch, "path": path, "step_ms": median * 1e3, "tok_per_s": batch / median,
                         "vs_floor": median / floor, "vs_floor_paired": paired})
    print(f"{args.model}: {args.dtype}{' ' + args.quantization if args.quantization else ''}, {args.threads} "
          f"threads, weights read per step {weight_bytes / 1e6:.1f} MB, read bandwidth {bandwidth / 1e9:.1f} GB/s, "
          f"floor {floor * 1e3:.2f} ms, load {os.getloadavg()[0]:.2f}")
    print(f"{'batch':>6} {'path':>8} {'step ms':>9} {'tok/s':>8} {'/ floor':>8} {'/ paired':>9}")
    for row in rows:
        print(f"{row['batch']:>6} {row['path']:>8} {row['step_ms']:>9.2f} {row['tok_per_s']:>8.1f} "
              f"{row['vs_floor']:>8.2f} {row['vs_floor_paired']:>9.2f}")
    prefill = {}
    if args.prefill:
        seconds, bound = prefill_time(model, config, args.prefill), matmul_bound(config, args.prefill, model.dtype)
        prefill = {"tokens": args.prefill, "seconds": seconds, "matmul_bound_s": bound, "vs_bound": seconds / bound}
        print(f"prefill of {args.prefill} tokens: {seconds * 1e3:.1f} ms; the same matmuls bare: {bound * 1e3:.1f} ms "
              f"({seconds / bound:.2f}x)")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"date": datetime.now(timezone.utc).isoformat(), "args": vars(args), "load": os.getloadavg(),
                   "weight_bytes": weight_bytes, "bandwidth": bandwidth, "floor_s": floor, "rows": rows,
                   "prefill": prefill}, f, indent=2)


if __name__ == "__main__":
    main()
