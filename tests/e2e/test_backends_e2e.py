"""The start-up record of what runs the model (model/backends.py), through a real server: one log
line naming every choice, each path not taken with its reason, the same record on /v1/models and
/metrics, and --strict-backends refusing to start on PyTorch's slower paths."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from .conftest import REPO_ROOT, serving

CHOICES = ("device", "dtype", "isa", "projections", "embedding", "elementwise", "attention", "fused_forward")


def backend_lines(log: Path) -> list[str]:
    return [line for line in log.read_text(errors="replace").splitlines() if " backends: " in line]


def record_of(line: str) -> dict[str, str]:
    return dict(part.split(" = ", 1) for part in line.split(" backends: ", 1)[1].split(" | "))


@pytest.fixture(scope="module")
def without_kernels(model_dir: str, tmp_path_factory: pytest.TempPathFactory):
    """A server whose CPU kernels are turned off, and its log."""
    log = tmp_path_factory.mktemp("no-kernels") / "server.log"
    with contextlib.closing(serving([model_dir], log, env={"TAILRACE_CPU_KERNELS": "0"})) as server:
        yield next(server), log


def test_the_server_logs_one_record_naming_each_backend_and_why_each_path_was_not_taken(without_kernels):
    url, log = without_kernels
    [line] = backend_lines(log)
    record = record_of(line)
    assert set(CHOICES) <= set(record)
    assert record["isa"] == "none" and record["fused_forward"] == "no" and record["elementwise"] == "pytorch"
    not_taken = {key.removesuffix(" not taken"): why for key, why in record.items() if key.endswith(" not taken")}
    assert not_taken["cpu kernels"].startswith("TAILRACE_CPU_KERNELS=0; PyTorch's kernels serve")
    assert not_taken["elementwise kernels"] == "no kernel build"
    assert not_taken["attention on tailrace's kernel"] == "no kernel build"
    assert all(why for why in not_taken.values())
    assert "tailrace's CPU kernels are not in use" in log.read_text()


def test_models_and_metrics_carry_the_same_record(without_kernels):
    url, log = without_kernels
    record = record_of(backend_lines(log)[0])
    [card] = httpx.get(f"{url}/v1/models").json()["data"]
    assert card["backends"] == record
    metrics = httpx.get(f"{url}/metrics").text
    [info] = [line for line in metrics.splitlines() if line.startswith("tailrace:backend_info{")]
    assert 'isa="none"' in info and 'fused_forward="no"' in info
    assert 'cpu_kernels_not_taken="TAILRACE_CPU_KERNELS=0;' in info


def test_a_server_with_the_kernels_runs_the_whole_forward_in_one_call(server_url, http):
    [card] = http.get(f"{server_url}/v1/models").json()["data"]
    backends = card["backends"]
    if backends["isa"] == "none":
        pytest.skip("tailrace's CPU kernels do not run here")
    assert backends["fused_forward"] == "yes" and backends["attention"] == "paged (tailrace)"
    assert not [key for key in backends if key.endswith(" not taken")]


def test_strict_backends_refuses_to_start_on_the_slower_paths(model_dir, tmp_path):
    done = subprocess.run([sys.executable, "-m", "tailrace", "serve", model_dir, "--port", "0", "--strict-backends"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TAILRACE_CPU_KERNELS": "0"})
    assert done.returncode != 0
    assert "--strict-backends: this model would run on PyTorch's slower paths" in done.stderr
    assert "cpu kernels: TAILRACE_CPU_KERNELS=0" in done.stderr
