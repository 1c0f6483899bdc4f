"""`tailrace serve`'s command line: vLLM's flags fill the same settings as tailrace's own, and a bad
flag or value stops it at once with the `serve` usage."""

import argparse
import shutil

import pytest

from tailrace.cli import _one_model, build_parser, chat_options_from, engine_config_from, main
from tailrace.engine.client import start_core as START_CORE
from tailrace.engine.config import EMBEDDED_MODEL


def parse(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *flags])


def refused(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(list(argv))
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_model_flag_is_the_positional_model():
    assert _one_model(parse("--model", "/models/a")) == "/models/a"
    assert _one_model(parse("/models/a", "--model", "/models/a")) == "/models/a"


def test_two_different_models_are_refused():
    with pytest.raises(ValueError, match="two models"):
        _one_model(parse("/models/a", "--model", "/models/b"))


def test_a_model_path_taken_as_a_served_name_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="a path: give the model before --served-model-name"):
        _one_model(parse("--served-model-name", "tiny", str(tmp_path)))


def test_served_model_name_takes_several_names():
    assert parse("--served-model-name", "gpt-4-0613", "gpt-4").served_model_name == ["gpt-4-0613", "gpt-4"]


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral", "llama3", "auto"])
def test_tool_call_parser_takes_vllms_names(name):
    assert chat_options_from(parse("--tool-call-parser", name)).tool_call_parser == name


def test_enable_auto_tool_choice_is_accepted():
    assert parse("--enable-auto-tool-choice").enable_auto_tool_choice


def test_generation_config_defaults_to_auto():
    assert parse().generation_config == "auto"
    assert parse("--generation-config", "vllm").generation_config == "vllm"


def test_gpu_memory_utilization_fills_the_engine_config():
    assert engine_config_from(parse("--gpu-memory-utilization", "0.85")).gpu_memory_utilization == 0.85
    assert engine_config_from(parse()).gpu_memory_utilization is None


def test_max_model_len_and_max_num_seqs_fill_the_engine_config():
    config = engine_config_from(parse("--max-model-len", "32k", "--max-num-seqs", "8"))
    assert (config.max_model_len, config.max_num_seqs) == (32000, 8)


@pytest.mark.parametrize(("flags", "enabled"), [((), True), (("--enable-prefix-caching",), True),
                                                (("--no-enable-prefix-caching",), False),
                                                (("--no-prefix-caching",), False)])
def test_prefix_caching_flags(flags, enabled):
    assert engine_config_from(parse(*flags)).enable_prefix_caching is enabled


def test_seed_fills_the_engine_config():
    assert engine_config_from(parse("--seed", "7")).seed == 7


def test_tensor_parallel_size_one_is_accepted():
    assert parse("--tensor-parallel-size", "1").tensor_parallel_size == 1
    assert parse("-tp", "1").tensor_parallel_size == 1


def test_tensor_parallel_size_fills_the_engine_config():
    assert engine_config_from(parse("-tp", "2")).tensor_parallel_size == 2


def test_tensor_parallel_size_zero_is_a_clear_error(capsys):
    assert "at least 1" in refused(capsys, "serve", "--tensor-parallel-size", "0")


def test_speculative_config_is_read_as_vllm_writes_it(capsys):
    config = engine_config_from(parse("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'))
    assert (config.speculative_config.method, config.speculative_config.num_speculative_tokens) == ("ngram", 3)
    assert engine_config_from(parse()).speculative_config is None
    err = refused(capsys, "serve", "--speculative-config", '{"method": "eagle", "num_speculative_tokens": 3}')
    assert "'eagle' is not served" in err and "usage: tailrace serve" in err


def test_trust_remote_code_is_refused(capsys):
    err = refused(capsys, "serve", "--trust-remote-code")
    assert "--trust-remote-code is refused" in err and "usage: tailrace serve" in err


def test_disable_log_requests_is_accepted():
    assert parse("--disable-log-requests").disable_log_requests


def test_log_levels():
    args = parse("--log-level", "WARNING", "--uvicorn-log-level", "trace")
    assert (args.log_level, args.uvicorn_log_level) == ("warning", "trace")
    assert parse().uvicorn_log_level is None  # uvicorn follows --log-level


def test_allowed_origins_take_a_json_list():
    assert parse("--allowed-origins", '["https://a.example"]').allowed_origins == ["https://a.example"]


def test_dtype_takes_vllms_half():
    assert engine_config_from(parse("--dtype", "half")).dtype == "float16"


def test_a_bad_dtype_lists_the_valid_ones(capsys):
    err = refused(capsys, "serve", "--dtype", "fp16")
    assert "invalid choice: 'fp16'" in err and "bfloat16" in err and "float16" in err


@pytest.mark.parametrize(("flag", "value"), [("--load-format", "pt"), ("--attention", "flash"),
                                             ("--device", "gpu"), ("--log-level", "verbose"),
                                             ("--reasoning-parser", "r1")])
def test_bad_choices_stop_the_parser(capsys, flag, value):
    assert "invalid choice" in refused(capsys, "serve", flag, value)


def test_an_unknown_flag_prints_the_serve_usage(capsys):
    err = refused(capsys, "serve", "--no-such-flag")
    assert "usage: tailrace serve" in err and "unrecognized arguments: --no-such-flag" in err


def test_an_unknown_bench_flag_prints_that_subcommands_usage(capsys):
    assert "usage: tailrace bench serve" in refused(capsys, "bench", "serve", "--no-such-flag")


def test_serve_exits_2_on_two_models(caplog):
    assert main(["serve", "/models/a", "--model", "/models/b"]) == 2
    assert "two models" in caplog.text


def test_a_tokenizer_that_cannot_load_stops_the_core_started_beside_it(tmp_path, caplog, monkeypatch):
    """serve starts the engine core before it loads the tokenizer (both take seconds on a GGUF): a
    tokenizer that fails ends the core too, with one line and exit 2."""
    from tailrace.engine import client

    model = tmp_path / "model"
    shutil.copytree(EMBEDDED_MODEL, model, ignore=shutil.ignore_patterns("__pycache__", "__init__.py"))
    (model / "tokenizer.json").write_text('{"broken')
    started = []
    monkeypatch.setattr(client, "start_core", lambda config: started.append(START_CORE(config)) or started[0])
    assert main(["serve", str(model), "--port", "0"]) == 2
    assert "tokenizer.json is not a readable tokenizer" in caplog.text
    assert len(started) == 1 and not started[0].worker.is_alive() and started[0].conn.closed


def test_ready_line_names_where_the_model_came_from(tmp_path):
    from tailrace.cli import _model_source

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")
    assert _model_source(None, "/anything") == "embedded"
    assert _model_source("org/name", "/cache/models--org--name/snapshots/abc") == "hub"
    assert _model_source(str(gguf), str(gguf)) == "gguf"
    assert _model_source(str(tmp_path), str(tmp_path)) == "local"


def test_the_api_process_keeps_no_gguf_reader_once_set_up(tmp_path):
    """server_setup reads a GGUF's config and tokenizer, then drops the cached reader: its parsed
    fields would stay resident in the API process for its life."""
    from gguf_writer import write_gguf

    from tailrace.cli import server_setup
    from tailrace.model.loading.gguf_file import open_gguf

    path = str(write_gguf(tmp_path / "tiny.gguf"))
    cached = open_gguf(path)
    setup = server_setup(build_parser().parse_args(["serve", path]))
    assert setup.tokenizer.decode(setup.tokenizer.encode("Hello there")) == "Hello there"
    assert open_gguf(path) is not cached


def test_the_api_process_never_loads_pytorch():
    # The command line, the app and every route run in the API process; PyTorch (180 MB resident,
    # over a second to import) loads in the engine core's process alone.
    import subprocess
    import sys

    code = ("import sys, tailrace, tailrace.cli, tailrace.api.app, tailrace.api.server, tailrace.engine.client; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"
