"""model/cpu/kernels.py: which build a CPU runs. The kernels themselves are tested through their
callers (test_bf16_linear, test_int_linear, test_paged_attention, test_cpu_ops, test_fused_forward),
on whichever build this machine takes."""

from __future__ import annotations

import fcntl
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from tailrace.model.cpu import kernels as cpu_kernels


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


def test_a_build_lock_file_left_by_a_killed_build_is_cleared(tmp_path):
    (tmp_path / "lock").touch()  # torch's lock file, as a build killed midway leaves it
    with cpu_kernels._building(str(tmp_path)):
        assert not (tmp_path / "lock").exists()


def test_a_running_build_is_waited_for(tmp_path):
    entered = threading.Event()

    def build() -> None:
        with cpu_kernels._building(str(tmp_path)):
            entered.set()

    with open(tmp_path / "tailrace.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another build holding it (flock: per open file, so a thread here waits too)
        waiter = threading.Thread(target=build)
        waiter.start()
        assert not entered.wait(0.5)
    waiter.join(5)
    assert entered.is_set()


@pytest.mark.skipif(cpu_kernels.kernels() is None, reason="tailrace's CPU kernels do not run here")
def test_the_kernels_load_past_a_lock_file_left_in_their_build_directory():
    """A server stopped while building left torch's `lock` file, and every later start waited on it
    without a word. Here a fresh process loads the (built) kernels with that file in place."""
    name = cpu_kernels.kernels().__name__
    left = Path(cpu_kernels._build_directory(name)) / "lock"
    left.touch()
    try:
        subprocess.run([sys.executable, "-c", "from tailrace.model.cpu.kernels import kernels; assert kernels()"],
                       check=True, timeout=300)
        assert not left.exists()
    finally:
        left.unlink(missing_ok=True)
