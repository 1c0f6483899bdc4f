"""Shared fixtures: a tiny random Llama checkpoint made here, and the embedded model."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis.internal.conjecture import engine as hypothesis_engine

# Property tests explore afresh on every run, CI's included. A failure prints the blob that
# replays it (`@reproduce_failure(...)`, also with the database off and the shrink phase skipped),
# and shrinking it stops after 30 s rather than Hypothesis's 300, so a failure costs seconds.
settings.register_profile("tailrace", print_blob=True)
settings.load_profile("tailrace")
assert hasattr(hypothesis_engine, "MAX_SHRINKING_SECONDS"), "hypothesis moved its shrinking time limit"
hypothesis_engine.MAX_SHRINKING_SECONDS = 30

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The suite checks the CPU path exactly (float32 parity with transformers); on a machine with a
# GPU, device "auto" would take CUDA and bfloat16 instead. The GPU checks run with
# TAILRACE_TEST_GPU=1 (bench/gpu.sh sets it for tests/test_gpu.py and tests/test_paged_attention.py).
GPU_TESTS = os.environ.get("TAILRACE_TEST_GPU") == "1"
if not GPU_TESTS:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

EMBEDDED = Path(__file__).resolve().parent.parent / "tailrace" / "models" / "tiny"


def make_tiny_checkpoint(directory: Path, seed: int = 0) -> Path:
    """A random 2-layer Llama with a byte-level BPE tokenizer, saved by `transformers`."""
    import torch
    from tokenizers import Tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    from tokenizer_fixtures import IM_END, save_byte_level

    save_byte_level(directory)
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=0, eos_token_id=tok.token_to_id(IM_END), tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    return directory


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def llamacpp_tree() -> Path:
    """The parts of llama.cpp's tree the tests use, from the llama-cpp-python sdist pip downloads
    (once per environment): the converter (convert_hf_to_gguf.py; run it with
    tailrace.bench.peers.llamacpp.convert_command) and models/ (tokenizer-only GGUFs with
    llama.cpp's own tokenization vectors beside them, and real chat templates)."""
    from tailrace.bench.peers import llamacpp

    directory = Path(sys.prefix) / "llama.cpp-tree"
    parts = (*llamacpp.CONVERTER_PARTS, "models/")
    if not all((llamacpp.tree(directory) / part).exists() for part in parts):
        directory.mkdir(exist_ok=True)
        llamacpp.fetch_tree(directory, parts)
    return llamacpp.tree(directory)


@pytest.fixture(scope="session")
def embedded_model() -> str:
    if not (EMBEDDED / "model.safetensors").exists():
        pytest.fail("the embedded model is missing: run scripts/train_tiny.py")
    return str(EMBEDDED)


@pytest.fixture
def triton_interpreter():
    """Skip without triton; without a GPU, run tailrace's Triton kernels (model/attention/triton_paged.py,
    model/gpu/triton_ops.py) on CPU tensors in triton's interpreter.

    Triton picks the interpreter when a function is decorated, if TRITON_INTERPRET=1 is set then.
    Other test modules import triton earlier without it (torch._dynamo does, on import), so the
    fixture turns the compiled kernels into interpreted ones itself. It also patches triton 3.6's
    interpreter for numpy >= 2.4, which refuses int() of the 1-element arrays that hold scalars,
    such as loop bounds (triton-lang/triton#9171, fixed after 3.6).
    """
    pytest.importorskip("triton")
    import torch

    if torch.cuda.is_available():
        yield
        return
    from triton.runtime import interpreter
    from triton.runtime.jit import JITFunction

    from tailrace.model.attention import triton_paged as triton_attention

    from tailrace.model.gpu import triton_ops

    def interpret_call(jit_function, *args, **kwargs):
        return interpreter.InterpretedFunction(jit_function.fn)(*args, **kwargs)

    patch_tensor = interpreter._patch_lang_tensor

    def patch_tensor_and_index(tensor, scope) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        mp.setattr(JITFunction, "__call__", interpret_call)  # triton.language's own jit functions
        for module in (triton_attention, triton_ops):
            for name, value in vars(module).items():
                if isinstance(value, JITFunction):
                    mp.setattr(module, name, interpreter.InterpretedFunction(value.fn))
        mp.setattr(interpreter, "_patch_lang_tensor", patch_tensor_and_index)
        yield
