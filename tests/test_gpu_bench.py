"""bench/gpu_bench.py: the parts the one GPU run depends on, checked here without a GPU."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import gpu_bench  # noqa: E402  (bench/ is on sys.path only from here)
from tokenizers import Tokenizer  # noqa: E402

from tailrace.tokenizer import load_tokenizer  # noqa: E402

EMBEDDED_TOKENIZER = Path(gpu_bench.EMBEDDED_MODEL) / "tokenizer.json"


def test_padded_tokenizer_decodes_every_id_of_the_8b_vocabulary(tmp_path: Path) -> None:
    gpu_bench.make_model_dir(gpu_bench.LLAMA_31_8B, tmp_path)
    tokenizer = load_tokenizer(str(tmp_path))
    assert tokenizer.vocab_size == 128256
    for token_id in (3, 8187, 8191, 8192, 128255):
        assert tokenizer.token_raw_bytes(token_id)  # raises for an id outside the vocabulary
    assert tokenizer.decode([128255]) == " #128255"


def test_padded_tokenizer_keeps_the_embedded_ids_and_encoding(tmp_path: Path) -> None:
    gpu_bench.make_model_dir(gpu_bench.LLAMA_31_8B, tmp_path)
    padded = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    embedded = Tokenizer.from_file(str(EMBEDDED_TOKENIZER))
    text = "<|im_start|>the list type <think> json.dumps </think><tool_call>"
    assert padded.encode(text).ids == embedded.encode(text).ids
    assert [padded.id_to_token(i) for i in range(8192)] == [embedded.id_to_token(i) for i in range(8192)]


def test_table_gives_ratios_to_transformers_and_a_failed_phase_its_reason() -> None:
    setup = gpu_bench.make_setup(smoke=False)
    env = {"device": "NVIDIA H200", "transformers": "5.17.0"}
    phases = {
        "tests": {"status": "ok", "paths": ["tests/test_paged_attention.py"], "summary": "19 passed in 9s"},
        "tailrace": {"status": "ok", "offline": {"output_tok_per_s": 21_000.0},
                     "batch1": {"output_tok_per_s": 150.0}},
        "http": {"status": "FAILED: over its 180 s limit"},
        "transformers": {"status": "ok", "transformers": {"output_tok_per_s": 1_000.0}},
    }
    rows = {line.strip().split("  ")[0]: line for line in gpu_bench.table(setup, env, phases).splitlines()}
    offline = rows["(a) tailrace offline, LLM.generate"]
    assert "21.00x" in offline and offline.endswith("yes")
    assert rows["(a) tailrace batch-1 decode, 1 request"].endswith("NO")
    assert rows["(b) tailrace HTTP, concurrency 256"].endswith("FAILED: over its 180 s limit")
    assert "0.96x" in rows["issue's anchor: transformers generate_batch"]
