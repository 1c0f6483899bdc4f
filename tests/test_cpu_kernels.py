"""model/cpu_kernels.py: which build a CPU runs. The kernels themselves are tested through their
callers (test_bf16_linear, test_int_linear, test_paged_attention, test_cpu_ops, test_fused_forward),
on whichever build this machine takes."""

from __future__ import annotations

import pytest
import torch

from tailrace.model import cpu_kernels


@pytest.mark.parametrize("avx512, avx2, asked, expected", [
    (True, True, None, "avx512"),
    (False, True, None, "avx2"),
    (False, False, None, None),
    (True, True, "avx2", "avx2"),  # the x86-64-v3 build tested on an AVX-512 CPU
    (True, True, "0", None),
    (False, True, "0", None),
    (False, False, "avx2", None),
])
def test_the_build_follows_the_cpu_and_the_setting(monkeypatch, avx512, avx2, asked, expected):
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: avx512)
    monkeypatch.setattr(torch.cpu, "_is_avx2_supported", lambda: avx2)
    if asked is None:
        monkeypatch.delenv("TAILRACE_CPU_KERNELS", raising=False)
    else:
        monkeypatch.setenv("TAILRACE_CPU_KERNELS", asked)
    assert cpu_kernels.target() == expected


def test_each_build_names_its_own_module_and_flags():
    assert set(cpu_kernels._TARGETS) == {"avx512", "avx2"}
    assert not any(flag.startswith("-mavx512") for flag in cpu_kernels._TARGETS["avx2"])
    if cpu_kernels.target() is not None and cpu_kernels.kernels() is not None:
        name = cpu_kernels.kernels().__name__
        assert name == ("tailrace_cpu_kernels" if cpu_kernels.target() == "avx512" else "tailrace_cpu_kernels_avx2")
