"""What schema-constrained requests cost the unconstrained ones running beside them.

    .venv/bin/python bench/structured_throughput.py --steps 600

A closed loop on the engine core (no HTTP) at concurrency 16: every client replaces its request
the moment it finishes, so the batch always holds 16 sequences. Five setups, each on its own
engine core in this process:

  free:          16 unconstrained requests (temperature 1, 128 tokens each, EOS ignored);
  mixed:         12 of those plus 4 constrained by a JSON schema, max_tokens 512 (each ends when
                 its JSON is complete, after about 100 tokens, so the setups replace requests
                 about as often), without closing within the budget (the grammar alone);
  mixed+closing: the same with closing on (the engine's default): far from their budget the
                 constrained rows only queue their bytes for the closer;
  tight:         as mixed, but the constrained requests get max_tokens 100, 3 over the shortest
                 valid answer (97 tokens), so the budget ends most of them (cut JSON without
                 closing), and every token is within the schema's bound of the budget;
  tight+closing: the same with closing on: every constrained request closes a valid document.

The cores take steps in turn, and each step is timed on its own: on a shared machine a burst
of someone else's work then lands on all setups alike. The figure of merit is the decode rate
one unconstrained request sees (its tokens per second of its own steps); the drop is that rate
in each setup against `free`. CPU time per step (all threads, and the engine thread alone, which
the mask thread overlaps) is reported too, and how many constrained answers parse as JSON.
Prints a table and writes JSON (--out).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time

from tailrace.engine.config import EngineConfig
from tailrace.engine.core import EngineCore, EngineRequest
from tailrace.sampling_params import SamplingParams, StructuredSpec
from tailrace.tokenizer import Tokenizer, load_tokenizer

SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["lines"],
    "properties": {"lines": {"type": "array", "minItems": 5, "maxItems": 5, "items": {
        "type": "object", "additionalProperties": False, "required": ["item", "qty", "gift"],
        "properties": {"item": {"type": "string", "maxLength": 12},
                       "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                       "gift": {"type": "boolean"}}}}},
}
FREE = SamplingParams(temperature=1.0, max_tokens=128, ignore_eos=True)
CONSTRAINED = SamplingParams(temperature=1.0, max_tokens=512, structured=StructuredSpec(json.dumps(SCHEMA)))
TIGHT = SamplingParams(temperature=1.0, max_tokens=100, structured=StructuredSpec(json.dumps(SCHEMA)))
# name: (constrained params, whether the engine closes within the budget)
SETUPS = {"free": (None, False), "mixed": (CONSTRAINED, False), "mixed+closing": (CONSTRAINED, True),
          "tight": (TIGHT, False), "tight+closing": (TIGHT, True)}


def parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


class ClosedLoop:
    """A core with `free` and `constrained` clients; a finished request is replaced at once."""

    def __init__(self, core: EngineCore, tokenizer: Tokenizer, prompt: list[int], free: int, constrained: int,
                 params: SamplingParams | None) -> None:
        self.core = core
        self.tokenizer = tokenizer
        self.prompt = prompt
        self.free_clients = free
        self.constrained_params = params
        self.ids = itertools.count()
        self.kind: dict[str, str] = {}
        self.text: dict[str, list[int]] = {}
        self.counts = {"free": 0, "constrained": 0, "json_done": 0, "json_valid": 0}
        self.seconds = self.cpu_seconds = self.thread_seconds = 0.0
        for kind, count in (("free", free), ("constrained", constrained)):
            for _ in range(count):
                self._start(kind)

    def _start(self, kind: str) -> None:
        request_id = f"{kind}-{next(self.ids)}"
        self.kind[request_id] = kind
        self.text[request_id] = []
        self.core.add_request(EngineRequest(request_id, self.prompt, FREE if kind == "free" else self.constrained_params))

    def step(self) -> None:
        """One timed engine step; replacing finished requests is not timed."""
        start, cpu, thread = time.perf_counter(), time.process_time(), time.thread_time()
        outputs = self.core.step()
        self.seconds += time.perf_counter() - start
        self.cpu_seconds += time.process_time() - cpu
        self.thread_seconds += time.thread_time() - thread
        for out in outputs:
            kind = self.kind[out.request_id]
            self.counts[kind] += len(out.new_token_ids)
            self.text[out.request_id] += out.new_token_ids
            if out.finish_reason is not None:
                if kind == "constrained":
                    self.counts["json_done"] += 1
                    self.counts["json_valid"] += parses(self.tokenizer.decode(self.text[out.request_id]))
                del self.kind[out.request_id], self.text[out.request_id]
                self._start(kind)

    def reset_counts(self) -> None:
        self.counts = dict.fromkeys(self.counts, 0)
        self.seconds = self.cpu_seconds = self.thread_seconds = 0.0

    def summary(self, steps: int) -> dict:
        free_rate = self.counts["free"] / self.seconds / self.free_clients
        return {**self.counts, "steps": steps, "seconds": self.seconds, "per_free_request_tok_s": free_rate,
                "step_ms": 1000 * self.seconds / steps, "cpu_ms_per_step": 1000 * self.cpu_seconds / steps,
                "engine_thread_ms_per_step": 1000 * self.thread_seconds / steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory (default: the embedded tiny model)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--constrained", type=int, default=4, help="constrained clients in the mixed setup")
    parser.add_argument("--steps", type=int, default=600, help="measured steps per setup")
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--setups", default=",".join(SETUPS), help=f"comma-separated, from {', '.join(SETUPS)}; "
                        "free among them (the others are measured against it)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per core (default: cores - 1)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--out", default="bench/out/structured_throughput.json")
    args = parser.parse_args()

    def core(closing: bool) -> EngineCore:
        engine = EngineCore(EngineConfig(model=args.model, dtype=args.dtype, max_num_seqs=args.concurrency,
                                         threads=args.threads, kv_cache_memory_gb=0.125))
        engine.grammars.close_within_budget = closing
        return engine

    cores = {name: core(SETUPS[name][1]) for name in args.setups.split(",")}
    tokenizer = load_tokenizer(next(iter(cores.values())).config.model_path)
    prompt = tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": "Describe a user of our shop."}]), add_special_tokens=False)
    loops = {}
    for name, engine in cores.items():
        params = SETUPS[name][0]
        constrained = 0 if params is None else args.constrained
        loops[name] = ClosedLoop(engine, tokenizer, prompt, args.concurrency - constrained, constrained, params)
    for measured, steps in ((False, args.warmup), (True, args.steps)):
        for loop in loops.values():
            loop.reset_counts()
        for _ in range(steps):
            for loop in loops.values():
                loop.step()
    results = {name: loop.summary(args.steps) for name, loop in loops.items()}
    base = results["free"]["per_free_request_tok_s"]
    drops = {name: 1.0 - r["per_free_request_tok_s"] / base for name, r in results.items()}

    print("| setup | free / constrained clients | tok/s per free request | drop vs free | step ms | CPU ms per "
          "step (all threads / engine thread) | free tokens | JSON answers done / parsing |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        loop = loops[name]
        print(f"| {name} | {loop.free_clients} / {args.concurrency - loop.free_clients} | "
              f"{r['per_free_request_tok_s']:.1f} | {100 * drops[name]:.1f}% | {r['step_ms']:.2f} | "
              f"{r['cpu_ms_per_step']:.2f} / {r['engine_thread_ms_per_step']:.2f} | {r['free']} | "
              f"{r['json_done']} / {r['json_valid']} |")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"args": vars(args), "results": results, "drops": drops}, f, indent=2)


if __name__ == "__main__":
    main()
