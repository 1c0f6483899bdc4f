"""The GPU backend's figures in one run; bench/gpu.sh drives it on a lent H200 (its figures are in
bench/README.md), and `--smoke` runs the same logic here on the CPU.

    python3 bench/gpu_bench.py --out $OUT          # Llama-3.1-8B shape, dummy bfloat16 weights, cuda
    .venv/bin/python bench/gpu_bench.py --smoke    # the embedded model's shape, dummy float32 weights, cpu

Phases, each in its own process under its own time limit inside one overall budget, so that one
that fails or hangs costs only its own rows:
  tests         pytest tests/test_gpu.py tests/test_paged_attention.py tests/test_triton_ops.py
  tailrace      (a) LLM.generate over the random prompts, then batch-1 decode (median of 3 requests)
  http          (b) the same shapes through `tailrace serve` and `tailrace bench serve`
  transformers  (c) transformers' continuous batching `generate_batch`, same config, random init
Prints one table last, with ratios to (c), and writes gpu.json, http.json and each phase's log to --out.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

from offline import random_prompts, time_generate  # bench/ is on sys.path when a script here runs

from tailrace.bench.servers import ServerProcess, free_port, wait_ready
from tailrace.engine.config import EMBEDDED_MODEL

REPO = Path(__file__).resolve().parents[1]
ANCHOR_TOK_S = 956.0  # the figure for transformers generate_batch on this model and GPU
OFFLINE_TARGET_TOK_S = 20_000.0
BATCH1_TARGET_TOK_S = 200.0
HTTP_TARGET_SHARE = 0.85  # of the offline figure
PHASE_LIMITS_S = {"tests": 120, "tailrace": 180, "http": 180, "transformers": 240}
MIN_PHASE_S = 20  # a phase that would get less is skipped

# Llama-3.1-8B's shape. The context is capped (131072 in the real one) as nothing here needs more;
# bos/eos are the embedded tokenizer's, which the model directory carries.
LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "bos_token_id": 0, "eos_token_id": 2, "dtype": "bfloat16",
}


@dataclass(slots=True)
class Setup:
    title: str
    config: dict  # config.json of the model directory made for the run
    num_prompts: int
    input_len: int
    output_len: int
    concurrency: int
    engine: dict  # engine args: LLM(**engine), and `tailrace serve` flags of the same names
    budget_s: float  # all phases together
    client_processes: int = 1  # `tailrace bench serve --processes`: one could not read (b) fast enough


def make_setup(smoke: bool, eager: bool = False) -> Setup:
    if not smoke:
        # eager: the fallback if CUDA-graph capture breaks, so a rerun still measures the rest.
        return Setup("Llama-3.1-8B shape, dummy bfloat16 weights" + (", eager" if eager else ""), LLAMA_31_8B,
                     512, 256, 256, 256,
                     {"device": "cuda", "dtype": "bfloat16", "load_format": "dummy", "max_num_seqs": 256,
                      "max_num_batched_tokens": 8192, "kv_cache_memory_gb": 40.0, "enforce_eager": eager},
                     budget_s=450, client_processes=4)
    # The embedded model's shape with a wider vocabulary, so the tokenizer padding is exercised as on the GPU.
    config = {**json.loads((Path(EMBEDDED_MODEL) / "config.json").read_text()), "vocab_size": 10_000}
    return Setup("smoke: embedded model shape, dummy float32 weights", config, 8, 16, 16, 4,
                 {"device": "cpu", "dtype": "float32", "load_format": "dummy", "max_num_seqs": 4,
                  "max_num_batched_tokens": 2048, "kv_cache_memory_gb": 0.5}, budget_s=600)


def make_model_dir(config: dict, directory: Path) -> None:
    """config.json and the embedded model's tokenizer, its vocabulary padded to the model's: random
    weights sample any id and each must decode to text. The prompts use the real ids only."""
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(Path(EMBEDDED_MODEL) / name, directory / name)
    tokenizer = json.loads((Path(EMBEDDED_MODEL) / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    for token in tokenizer["added_tokens"]:  # else tokenizers renumbers them past the grown vocabulary
        vocab.setdefault(token["content"], token["id"])
    used = set(vocab.values())
    for token_id in range(config["vocab_size"]):
        piece = f"Ġ#{token_id}"  # " #12345": byte-level ASCII that no merge produces
        if token_id not in used:
            assert piece not in vocab, piece
            vocab[piece] = token_id
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer))


def prompts_for(setup: Setup, count: int, seed: int) -> list[list[int]]:
    vocab = json.loads((Path(EMBEDDED_MODEL) / "config.json").read_text())["vocab_size"]
    return random_prompts(count, setup.input_len, vocab, seed)


# --- the phases that run in a child process: each saves what it measured as soon as it has it ---

class SavedDict(dict):
    """A child phase's results, written to its file at every change: killed at its limit, it keeps
    what it measured so far."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    def __setitem__(self, key: str, value: object) -> None:
        super().__setitem__(key, value)
        self.path.write_text(json.dumps(self))


def phase_tailrace(setup: Setup, model_dir: Path, save: SavedDict) -> None:
    import torch

    from tailrace import LLM

    start = time.perf_counter()
    llm = LLM(str(model_dir), **setup.engine)
    save["load_s"] = time.perf_counter() - start
    time_generate(llm, prompts_for(setup, 8, seed=1), 8)  # warm-up: kernels compiled, memory pools grown
    seconds, tokens = time_generate(llm, prompts_for(setup, setup.num_prompts, seed=0), setup.output_len)
    check_tokens(tokens, setup.num_prompts * setup.output_len)
    save["offline"] = {"seconds": seconds, "output_tokens": tokens, "output_tok_per_s": tokens / seconds}
    runs = [time_generate(llm, [prompt], setup.output_len) for prompt in prompts_for(setup, 3, seed=2)]
    save["batch1"] = {"seconds": [s for s, _ in runs],
                      "output_tok_per_s": statistics.median(tokens / s for s, tokens in runs)}
    if torch.cuda.is_available():
        save["max_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30


def phase_transformers(setup: Setup, model_dir: Path, save: SavedDict) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    start = time.perf_counter()
    with torch.device(setup.engine["device"]):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir),
                                                 dtype=getattr(torch, setup.engine["dtype"]),
                                                 attn_implementation="sdpa").eval()
    save["load_s"] = time.perf_counter() - start
    # eos_token_id -1: no EOS, so every request runs to max_new_tokens (greedy, as tailrace's runs).
    generation = GenerationConfig(max_new_tokens=setup.output_len, do_sample=False, eos_token_id=-1)
    start = time.perf_counter()
    outs = list(model.generate_batch(prompts_for(setup, setup.num_prompts, seed=0),
                                     generation_config=generation).values())
    wall = time.perf_counter() - start
    # generate_batch first warms up (CUDA graph capture), then queues the requests: timing from the
    # first request's creation to the last one's end leaves the warm-up out, as (a) leaves the engine's out.
    seconds = max(out.lifespan[1] for out in outs) - min(out.created_time for out in outs)
    errors = [out.error for out in outs if out.error]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed; the first: {errors[0]}")
    tokens = sum(len(out.generated_tokens) for out in outs)
    check_tokens(tokens, setup.num_prompts * setup.output_len)
    save["transformers"] = {"seconds": seconds, "wall_s": wall, "output_tokens": tokens,
                            "output_tok_per_s": tokens / seconds}


def check_tokens(tokens: int, expected: int) -> None:
    """Every request must run to output_len (EOS ignored), or the systems' tok/s would not compare."""
    if tokens != expected:
        raise RuntimeError(f"{tokens} output tokens, expected {expected}")


PHASES = {"tailrace": phase_tailrace, "transformers": phase_transformers}


def run_phase_child(args: argparse.Namespace) -> None:
    PHASES[args.phase](make_setup(args.smoke, args.eager), Path(args.model_dir), SavedDict(Path(args.result)))


# --- the parent: phases under their limits, the table ---

def run_limited(command: list[str], limit_s: float, log_path: Path, env: dict[str, str] | None = None) -> int | None:
    """The command's exit code; None when it ran past limit_s (its whole process group is killed)."""
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   cwd=REPO, start_new_session=True, env=env)
        try:
            return process.wait(limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            return None


def failure(code: int | None, limit_s: float, log_path: Path) -> str:
    if code is None:
        return f"FAILED: over its {limit_s:.0f} s limit"
    lines = log_path.read_text(errors="replace").strip().splitlines() if log_path.exists() else []
    return f"FAILED: exit {code}: {lines[-1][:200] if lines else 'no output'}"


def child_phase(phase: str, args: argparse.Namespace, model_dir: Path, tmp: Path, limit_s: float) -> dict:
    result_path = tmp / f"{phase}.json"
    command = [sys.executable, __file__, "--phase", phase, "--model-dir", str(model_dir),
               "--result", str(result_path), *(["--smoke"] if args.smoke else []),
               *(["--eager"] if args.eager else [])]
    log_path = args.out / f"{phase}.log"
    code = run_limited(command, limit_s, log_path)
    result = json.loads(result_path.read_text()) if result_path.exists() else {}
    return {"status": "ok" if code == 0 else failure(code, limit_s, log_path), **result}


def tests_phase(args: argparse.Namespace, limit_s: float) -> dict:
    paths = ["tests/test_gpu.py", "tests/test_paged_attention.py", "tests/test_triton_ops.py"]
    log_path = args.out / "tests.log"
    # The suite hides GPUs unless asked (tests/conftest.py); on the GPU, the GPU tests must run, not skip.
    env = os.environ if args.smoke else {**os.environ, "TAILRACE_TEST_GPU": "1"}
    code = run_limited([sys.executable, "-m", "pytest", *paths], limit_s, log_path, env=dict(env))
    lines = log_path.read_text(errors="replace").strip().splitlines()
    return {"status": "ok" if code == 0 else failure(code, limit_s, log_path), "paths": paths,
            "summary": lines[-1] if lines else ""}


def http_phase(setup: Setup, args: argparse.Namespace, model_dir: Path, limit_s: float) -> dict:
    started = time.monotonic()
    port = free_port()
    flags = [f"--{name.replace('_', '-')}" + ("" if value is True else f"={value}")
             for name, value in setup.engine.items() if value is not False]
    serve = [sys.executable, "-m", "tailrace", "serve", str(model_dir), "--port", str(port), *flags]
    bench = [sys.executable, "-m", "tailrace", "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
             "--concurrency", str(setup.concurrency), "--num-prompts", str(setup.num_prompts),
             "--input-len", str(setup.input_len), "--output-len", str(setup.output_len), "--no-progress",
             "--processes", str(setup.client_processes),
             "--out", str(args.out / "http.json")]
    (args.out / "http.json").unlink(missing_ok=True)  # a file left by an earlier run is no result of this one
    try:
        with ServerProcess("tailrace serve", serve, f"http://127.0.0.1:{port}", args.out / "server.log") as server:
            wait_ready([server], limit_s)
            ready_s = time.monotonic() - started
            api_cpu_s, client_cpu_s = process_cpu_s(server.process.pid), children_cpu_s()
            done = subprocess.run(bench, capture_output=True, text=True, timeout=limit_s - ready_s)
            api_cpu_s = process_cpu_s(server.process.pid) - api_cpu_s
            client_cpu_s = children_cpu_s() - client_cpu_s
            client_wall_s = time.monotonic() - started - ready_s
    except Exception as exc:  # a phase that breaks costs its row only; the reason goes in the table
        print(f"{type(exc).__name__}: {exc}")
        first, *log = str(exc).strip().splitlines() or [""]
        errors = [line for line in log if "error" in line.lower()]  # a server's log tail: its error line
        reason = " ... ".join([first, *(errors or log)[-1:]])
        return {"status": f"FAILED: {type(exc).__name__}: {reason[:300]}"}
    print(done.stdout + done.stderr)
    if not (args.out / "http.json").exists():
        return {"status": f"FAILED: exit {done.returncode}: {(done.stdout + done.stderr).strip()[-200:]}"}
    summary = next(iter(json.loads((args.out / "http.json").read_text())["runs"].values()))[0]["summary"]
    status = "ok" if summary["failed"] == 0 else f"FAILED: {summary['failed']} requests: {summary['first_error']}"
    # Cores used: the API process near 1.0 (its one core, asyncio), or the load generator near its
    # process count, limits (b), not the engine. The API process's over the level (its CPU before is
    # idle), the load generator's over its whole run (start-up imports included: its own CPU time
    # is all that can be read from outside).
    cpu_share = {"api_process": api_cpu_s / summary["duration_s"], "load_generator": client_cpu_s / client_wall_s}
    return {"status": status, "ready_s": ready_s, "cpu_share": cpu_share,
            "output_tok_per_s": summary["output_throughput"],
            "completed": summary["completed"], "failed": summary["failed"],
            "mean_prompt_tokens": summary["total_input_tokens"] / max(1, summary["completed"]),
            "mean_output_tokens": summary["total_output_tokens"] / max(1, summary["completed"]),
            "ttft_p50_ms": summary["ttft_ms"]["p50"], "tpot_p50_ms": summary["tpot_ms"]["p50"]}


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of one running process so far, all its threads (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children_cpu_s() -> float:
    """CPU seconds of this process's children that have ended, such as the load generator."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def environment() -> dict:
    versions = {}
    for name in ("torch", "triton", "transformers"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    device = f"no GPU, {os.cpu_count()} CPUs ({platform.processor() or platform.machine()})"
    if shutil.which("nvidia-smi"):
        device = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                 "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    return {"python": platform.python_version(), **versions, "device": device}


def table(setup: Setup, env: dict, phases: dict) -> str:
    tailrace, http, peer, tests = phases["tailrace"], phases["http"], phases["transformers"], phases["tests"]

    def figure(phase: dict, key: str | None = None) -> float | None:
        found = phase.get(key, {}) if key else phase
        return found.get("output_tok_per_s")

    offline, batch1, served = figure(tailrace, "offline"), figure(tailrace, "batch1"), figure(http)
    base = figure(peer, "transformers")
    rows = [  # label, tok/s (None: failed), its phase, target, target met (None: no target)
        ("(a) tailrace offline, LLM.generate", offline, tailrace, f">= {OFFLINE_TARGET_TOK_S:,.0f} tok/s",
         (offline or 0) >= OFFLINE_TARGET_TOK_S),
        ("(a) tailrace batch-1 decode, 1 request", batch1, tailrace, f">= {BATCH1_TARGET_TOK_S:.0f} tok/s",
         (batch1 or 0) >= BATCH1_TARGET_TOK_S),
        (f"(b) tailrace HTTP, concurrency {setup.concurrency}", served, http, f">= {HTTP_TARGET_SHARE:.0%} of (a)",
         offline is not None and (served or 0) >= HTTP_TARGET_SHARE * offline),
        (f"(c) transformers {env['transformers']} generate_batch", base, peer, "", None),
        ("    issue's anchor: transformers generate_batch", ANCHOR_TOK_S, {}, "", None),
    ]
    title = (f"{setup.title}, {env['device']}: {setup.num_prompts} requests x ({setup.input_len} prompt, "
             f"{setup.output_len} output) tokens, greedy, EOS ignored")
    ran = f", {' '.join(tests['paths'])}: {tests['summary']}" if "paths" in tests else ""
    lines = [title, f"correctness: {tests['status']}{ran}",
             f"{'system':<48}{'out tok/s':>11}{'vs (c)':>9}{f'vs {ANCHOR_TOK_S:.0f}':>9}  {'target':<18}met"]
    for label, value, phase, target, met in rows:
        if value is None:
            lines.append(f"{label:<48}{'-':>11}{'':>9}{'':>9}  {target:<18}{phase['status']}")
            continue
        vs_base = f"{value / base:.2f}x" if base else "-"
        met_text = "" if met is None else "yes" if met else "NO"
        lines.append(f"{label:<48}{value:>11.1f}{vs_base:>9}{value / ANCHOR_TOK_S:>8.2f}x  {target:<18}{met_text}")
    if served:
        share = http["cpu_share"]
        of_offline = f"HTTP / offline {served / offline:.1%}; " if offline else ""
        lines.append(f"(b): {of_offline}mean prompt {http['mean_prompt_tokens']:.0f} tokens, output "
                     f"{http['mean_output_tokens']:.0f}; cores used: API process {share['api_process']:.2f}, "
                     f"load generator {share['load_generator']:.2f} ({setup.client_processes} "
                     f"process{'es' if setup.client_processes > 1 else ''})")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="the embedded model's shape on the CPU, tiny numbers")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "out")
    parser.add_argument("--phases", default=",".join(PHASE_LIMITS_S),
                        help="the phases to run, e.g. http,transformers to rerun two (default: all)")
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs (--enforce-eager), if capture fails")
    parser.add_argument("--phase", choices=PHASES, help=argparse.SUPPRESS)  # a child process's one phase
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        run_phase_child(args)
        return

    setup = make_setup(args.smoke, args.eager)
    deadline = time.monotonic() + setup.budget_s
    args.out.mkdir(parents=True, exist_ok=True)
    env = environment()
    print(json.dumps(env), flush=True)
    phases: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        model_dir.mkdir()
        make_model_dir(setup.config, model_dir)
        for name in PHASE_LIMITS_S:
            if name not in args.phases.split(","):
                phases[name] = {"status": "not run (--phases)"}
                continue
            limit_s = min(PHASE_LIMITS_S[name], deadline - time.monotonic())
            start = time.monotonic()
            print(f"--- {name} (limit {limit_s:.0f} s)", flush=True)
            if limit_s < MIN_PHASE_S:
                phases[name] = {"status": "FAILED: skipped, the run's time budget is spent"}
            elif name == "tests":
                phases[name] = tests_phase(args, limit_s)
            elif name == "http":
                phases[name] = http_phase(setup, args, model_dir, limit_s)
            else:
                phases[name] = child_phase(name, args, model_dir, Path(tmp), limit_s)
            phases[name]["wall_s"] = time.monotonic() - start
            print(json.dumps({name: phases[name]}), flush=True)
    text = table(setup, env, phases)
    (args.out / "gpu.json").write_text(json.dumps(
        {"date": datetime.now(timezone.utc).isoformat(), "setup": asdict(setup), "environment": env,
         "phases": phases, "anchor_tok_s": ANCHOR_TOK_S, "table": text}, indent=1))
    print(f"\nwrote {args.out / 'gpu.json'}\n\n{text}")


if __name__ == "__main__":
    main()
