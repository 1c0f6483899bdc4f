"""Tensor parallelism over gloo on this CPU: two ranks give the tokens of one and logprobs within 1e-4,
for the embedded model and random Llama, Qwen2 and Qwen3 checkpoints (one with a single KV head, so
both ranks hold it), and shutdown then ends every rank; a worker that dies fails the step at once,
or wakes an idle core, which names it; a step that fails half-way still shuts down."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
import transformers

from tailrace.engine.config import EngineConfig
from tailrace.engine.core import EngineCore, EngineRequest
from tailrace.engine.core_process import FatalMsg, ReadyMsg, from_core_decoder, run_core
from tailrace.sampling_params import SamplingParams

ATOL = 1e-4
SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
             max_position_embeddings=256, head_dim=16, initializer_range=0.1)
CHECKPOINTS = {
    # an odd vocabulary: the last rank's part of the head is padded
    "llama_tied": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                   dict(num_key_value_heads=2, vocab_size=259, tie_word_embeddings=True)),
    "qwen2_one_kv_head": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
                          dict(num_key_value_heads=1, vocab_size=256)),
    "qwen3_one_kv_head": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
                          dict(num_key_value_heads=1, vocab_size=256, tie_word_embeddings=False)),
}


def save_checkpoint(root, name: str) -> str:
    config_cls, model_cls, extra = CHECKPOINTS[name]
    torch.manual_seed(0)
    model = model_cls(config_cls(**SMALL, **extra)).float().eval()
    with torch.no_grad():  # default init leaves biases at 0 and norms at 1, which would hide mistakes
        for param_name, param in model.named_parameters():
            if "norm" in param_name:
                param.uniform_(0.5, 1.5)
            elif param_name.endswith("bias"):
                param.normal_(0.0, 0.1)
    model.save_pretrained(root / name)
    return str(root / name)


def workload(vocab: int) -> dict[str, tuple[list[int], SamplingParams]]:
    """Prompts of several lengths decoding together, one repeated (a prefix-cache hit), two choices on
    one, sequences ending at different steps (their KV slots are released in between), top logprobs
    and prompt logprobs."""
    base = [(7 * i + 3) % vocab for i in range(40)]
    params = dict(temperature=0, ignore_eos=True, logprobs=3)
    return {
        "long": (base, SamplingParams(max_tokens=12, **params)),
        "again": (base, SamplingParams(max_tokens=6, **params)),
        "short": (base[:5], SamplingParams(max_tokens=9, n=2, **params)),
        "prompt": (base[10:30], SamplingParams(max_tokens=4, prompt_logprobs=2, **params)),
    }


def run(core: EngineCore, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    """Token ids and logprobs per request and choice, and each request's prompt logprobs."""
    out = {rid: {"tokens": [[] for _ in range(p.n)], "logprobs": [[] for _ in range(p.n)], "prompt": None}
           for rid, (_, p) in requests.items()}
    for rid, (ids, params) in requests.items():
        core.add_request(EngineRequest(rid, ids, params))
    while core.has_work():
        for o in core.step():
            out[o.request_id]["tokens"][o.sibling] += o.new_token_ids
            out[o.request_id]["logprobs"][o.sibling] += o.new_logprobs or []
            if o.prompt_logprobs is not None:
                out[o.request_id]["prompt"] = o.prompt_logprobs
    return out


def assert_logprobs_close(want, got) -> None:
    assert len(want) == len(got)
    for a, b in zip(want, got):
        if a is None:
            assert b is None
            continue
        assert abs(a.logprob - b.logprob) <= ATOL
        assert a.top and [t for t, _ in a.top] == [t for t, _ in b.top]
        assert all(abs(x - y) <= ATOL for (_, x), (_, y) in zip(a.top, b.top))


def assert_same_generation(path: str, vocab: int, two_only: dict | None = None, **engine: object) -> EngineCore:
    """Two ranks (with `two_only` set too) generate what one does; the two ranks' core, shut down."""
    requests = workload(vocab)
    one = run(EngineCore(EngineConfig(model=path, dtype="float32", **engine)), requests)
    core = EngineCore(EngineConfig(model=path, dtype="float32", tensor_parallel_size=2, **engine, **(two_only or {})))
    workers = [w.process for w in core.runner.tp._workers]
    try:
        two = run(core, requests)
    finally:
        core.shutdown()
    assert [p.returncode for p in workers] == [0]  # told to stop, and stopped
    for rid, (_, params) in requests.items():
        assert two[rid]["tokens"] == one[rid]["tokens"], rid
        assert [len(t) for t in one[rid]["tokens"]] == [params.max_tokens] * params.n
        for tokens, want, got in zip(one[rid]["tokens"], one[rid]["logprobs"], two[rid]["logprobs"]):
            assert len(want) == len(tokens)  # a logprob per token: nothing is compared vacuously
            assert_logprobs_close(want, got)
    prompt = one["prompt"]["prompt"]
    assert len(prompt) == len(requests["prompt"][0]) - 1  # every prompt token after the first
    assert_logprobs_close(prompt, two["prompt"]["prompt"])
    return core


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-ckpt")
    return {name: save_checkpoint(root, name) for name in CHECKPOINTS}


def test_two_ranks_generate_what_one_does_on_the_embedded_model(embedded_model):
    # a small token budget: prompts are prefilled in chunks, mixed with decodes
    assert_same_generation(embedded_model, 8192, max_num_batched_tokens=24)


def test_two_ranks_verifying_guesses_generate_what_one_does_without(embedded_model):
    """A guess's rows all get logits on rank 0 while the workers follow the same step; what is
    kept is one rank's plain decoding."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    core = assert_same_generation(embedded_model, 8192, two_only={"speculative_config": spec})
    assert core.speculator.stats.num_accepted_tokens > 0


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_two_ranks_generate_what_one_does(checkpoints, name):
    assert_same_generation(checkpoints[name], CHECKPOINTS[name][2]["vocab_size"])


def test_a_killed_worker_fails_the_next_step_within_seconds(embedded_model):
    core = EngineCore(EngineConfig(model=embedded_model, tensor_parallel_size=2))
    try:
        pid, = core.runner.tp.worker_pids
        os.kill(pid, signal.SIGKILL)
        core.add_request(EngineRequest("r", [1, 2, 3], SamplingParams(max_tokens=4)))
        start = time.monotonic()
        with pytest.raises(RuntimeError):
            while core.has_work():
                core.step()
        assert time.monotonic() - start < 5
    finally:
        core.shutdown()


def test_a_step_that_fails_half_way_on_rank_0_still_shuts_down_at_once(embedded_model):
    core = EngineCore(EngineConfig(model=embedded_model, tensor_parallel_size=2))
    worker, = [w.process for w in core.runner.tp._workers]

    def fault(*args):
        raise RuntimeError("a fault between two all-reduces")

    core.runner.model.model.layers[1].forward = fault  # rank 1 goes on into layer 1's all-reduces
    core.add_request(EngineRequest("r", [1, 2, 3], SamplingParams(max_tokens=4)))
    with pytest.raises(RuntimeError, match="between two all-reduces"):
        core.step()
    # A stop broadcast now would wait forever for rank 1, which is inside a collective: it is killed instead.
    stopper = threading.Thread(target=core.shutdown, daemon=True)
    stopper.start()
    stopper.join(timeout=10)
    assert not stopper.is_alive()
    assert worker.returncode is not None


def test_a_model_the_ranks_cannot_split_is_refused_before_any_worker_starts(checkpoints):
    with pytest.raises(ValueError, match="attention heads"):
        EngineCore(EngineConfig(model=checkpoints["llama_tied"], tensor_parallel_size=3))


def test_fewer_gpus_than_ranks_are_refused_before_any_worker_starts(embedded_model, monkeypatch):
    from tailrace.engine.tensor_parallel import group

    monkeypatch.setattr(group, "device_type", lambda config: "cuda")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(group, "_spawn", None)  # starting a worker would fail the test another way
    with pytest.raises(ValueError, match="needs one GPU per rank; CUDA sees 1"):
        EngineCore(EngineConfig(model=embedded_model, tensor_parallel_size=2))


def test_a_worker_that_dies_while_the_core_idles_ends_the_core_with_a_message_naming_it(embedded_model):
    ours, theirs = multiprocessing.Pipe()
    core = threading.Thread(target=run_core, args=(EngineConfig(model=embedded_model, tensor_parallel_size=2), theirs),
                            daemon=True)
    core.start()
    assert isinstance(from_core_decoder.decode(ours.recv_bytes()), ReadyMsg)
    worker, = [pid for pid in children() if b"tensor_parallel.worker" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    os.kill(worker, signal.SIGKILL)
    assert ours.poll(5), "the idle core did not notice"
    fatal = from_core_decoder.decode(ours.recv_bytes())
    assert isinstance(fatal, FatalMsg) and "tensor-parallel rank 1 exited with status -9" in fatal.message
    core.join(timeout=10)
    assert not core.is_alive()


def children() -> list[int]:
    """This process's child processes."""
    return [int(pid) for task in Path("/proc/self/task").iterdir() for pid in (task / "children").read_text().split()]
