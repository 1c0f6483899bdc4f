"""Engine settings: how device and attention are resolved, what validation refuses, and the CLI
flags that fill them."""

import pytest
import torch

from tailrace.cli import build_parser, engine_config_from
from tailrace.engine.config import EngineConfig, resolve_device
from tailrace.model.backends import choose_attention
from tailrace.model.cpu import kernels as cpu_kernels


def test_auto_device_is_cuda_when_a_gpu_is_visible_else_cpu():
    assert resolve_device("auto", cuda_available=True) == "cuda"
    assert resolve_device("auto", cuda_available=False) == "cpu"


def test_an_explicit_device_is_kept():
    assert resolve_device("cpu", cuda_available=True) == "cpu"
    assert resolve_device("cuda:1", cuda_available=True) == "cuda:1"


def test_cuda_without_a_gpu_is_an_error():
    with pytest.raises(ValueError, match="no CUDA GPU"):
        resolve_device("cuda", cuda_available=False)


def layout(asked: str, device: str, plain: bool = True) -> str:
    return choose_attention(asked, device, torch.float32, 64, plain).layout


def test_auto_attention_is_paged_on_cuda_and_on_cpus_that_run_tailraces_kernels(monkeypatch):
    assert layout("auto", "cuda") == "paged"
    assert layout("auto", "cuda:1") == "paged"
    monkeypatch.setattr(cpu_kernels, "kernels", lambda: object())
    assert layout("auto", "cpu") == "paged"


def test_auto_attention_is_the_slab_on_cpus_without_tailraces_kernels(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "kernels", lambda: None)
    assert layout("auto", "cpu") == "slab"
    assert layout("auto", "cuda") == "paged"


def test_attention_the_slab_cannot_take_goes_to_the_pages_or_is_refused_by_name(monkeypatch):
    """Sliding windows, another scale, soft caps or sinks (attention.plain_attention)."""
    monkeypatch.setattr(cpu_kernels, "kernels", lambda: None)
    assert layout("auto", "cpu", plain=False) == "paged"
    with pytest.raises(ValueError, match="--attention slab .* use --attention paged"):
        layout("slab", "cpu", plain=False)


def test_an_explicit_attention_is_kept_on_either_device():
    assert layout("paged", "cpu") == "paged"
    assert layout("slab", "cuda") == "slab"


def test_the_attention_kernel_is_the_devices_own_where_it_takes_the_model_and_says_why_not(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "kernels", lambda: object())
    assert choose_attention("auto", "cpu", torch.bfloat16, 128).kernel == "tailrace"
    half = choose_attention("auto", "cpu", torch.float16, 128)
    assert (half.layout, half.kernel) == ("paged", "pytorch") and "float32 or bfloat16" in half.not_taken
    assert "head_dim" in choose_attention("auto", "cpu", torch.float32, 40).not_taken
    windowed = choose_attention("auto", "cuda", torch.bfloat16, 128, plain=False)
    assert (windowed.kernel, str(windowed)) == ("pytorch", "paged (PyTorch)") and "windows" in windowed.not_taken
    slab = choose_attention("slab", "cpu", torch.float32, 64)
    assert (str(slab), slab.not_taken) == ("slab (PyTorch)", "--attention slab was asked for")


def test_defaults_choose_the_device_and_layout_at_start_up_with_graphs_on():
    config = EngineConfig()
    assert (config.device, config.attention, config.dtype, config.enforce_eager) == ("auto", "auto", "auto", False)


@pytest.mark.parametrize(("field", "value"), [("device", "tpu"), ("attention", "flash")])
def test_an_unknown_device_or_attention_is_refused(field, value):
    with pytest.raises(ValueError, match=f"unsupported {field}"):
        EngineConfig(**{field: value}).validate()


def test_cli_flags_fill_device_attention_and_enforce_eager():
    args = build_parser().parse_args(["serve", "--device", "cuda", "--attention", "paged", "--enforce-eager"])
    config = engine_config_from(args)
    assert (config.device, config.attention, config.enforce_eager) == ("cuda", "paged", True)


def test_cli_defaults_are_the_config_defaults():
    config = engine_config_from(build_parser().parse_args(["serve"]))
    assert (config.device, config.attention, config.dtype, config.enforce_eager) == ("auto", "auto", "auto", False)
