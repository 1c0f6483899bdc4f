"""Benchmarks' caches check for room before they write: a shape, a converted or quantized GGUF and a
repeated layer each refuse, before writing anything, a write that would leave less than the
reserve free; nothing here converts a model or starts a server."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file
from test_bench_peers import TINY

from tailrace.bench import disk, shapes
from tailrace.bench.peers import llamacpp
from tailrace.bench.serve import BenchError
from tailrace.engine.config import EMBEDDED_MODEL



def free_bytes(monkeypatch: pytest.MonkeyPatch, free: int) -> list[Path]:
    """The disk reports `free` bytes free; returns the paths it was asked about."""
    asked: list[Path] = []

    def usage(path: Path) -> SimpleNamespace:
        asked.append(Path(path))
        return SimpleNamespace(free=free)

    monkeypatch.setattr(disk.shutil, "disk_usage", usage)
    return asked


def test_a_write_that_keeps_the_reserve_free_passes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    free_bytes(monkeypatch, 5_000)
    disk.ensure_room(tmp_path / "file", 1_000, "a file", reserve=4_000)


def test_a_write_that_eats_into_the_reserve_is_refused_naming_the_caches(monkeypatch: pytest.MonkeyPatch,
                                                                        tmp_path: Path):
    free_bytes(monkeypatch, 5 * 10**9)
    with pytest.raises(BenchError) as refused:
        disk.ensure_room(tmp_path / "file", 2 * 10**9, "a shape", reserve=4 * 10**9)
    message = str(refused.value)
    assert "a shape (2.0 GB)" in message and "3.0 GB of 5.0 GB" in message and "4.0 GB free" in message
    assert all(cache in message for cache in disk.CACHES)


def test_room_is_asked_of_the_nearest_directory_that_exists(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    asked = free_bytes(monkeypatch, 10**12)
    disk.ensure_room(tmp_path / "not" / "yet" / "there.gguf", 1, "a file")
    assert asked == [tmp_path]


def test_the_default_reserve_is_the_real_one(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    free_bytes(monkeypatch, disk.RESERVE_BYTES + 99)
    disk.ensure_room(tmp_path, 99, "a file")
    with pytest.raises(BenchError):
        disk.ensure_room(tmp_path, 100, "a file")


def test_a_shape_too_large_for_the_disk_is_not_started(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    needed = sum(4 * torch.Size(size).numel() for size in shapes.tensor_shapes(TINY).values())
    free_bytes(monkeypatch, disk.RESERVE_BYTES + needed - 1)
    with pytest.raises(BenchError, match="the tiny shape"):
        shapes.write_shape(TINY, tmp_path)
    assert list(tmp_path.iterdir()) == []
    free_bytes(monkeypatch, disk.RESERVE_BYTES + needed)
    assert (shapes.write_shape(TINY, tmp_path) / "model.safetensors").exists()


def test_a_repeated_layer_is_sized_before_it_is_written(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    from gguf import GGMLQuantizationType, GGUFReader

    from gguf_writer import write_gguf

    source = shapes.write_shape(shapes.layer_of(TINY), tmp_path / "shapes")
    one = write_gguf(tmp_path / "one.gguf", GGMLQuantizationType.F32, source=source)
    tensors = GGUFReader(one).tensors
    layer = sum(t.data.nbytes for t in tensors if t.name.startswith("blk.0."))
    needed = sum(t.data.nbytes for t in tensors) + 3 * layer
    free_bytes(monkeypatch, disk.RESERVE_BYTES + needed - 1)
    with pytest.raises(BenchError, match="four.gguf"):
        shapes.repeat_layer(one, 4, tmp_path / "four.gguf")
    assert not (tmp_path / "four.gguf").exists()
    free_bytes(monkeypatch, disk.RESERVE_BYTES + needed)
    shapes.repeat_layer(one, 4, tmp_path / "four.gguf")
    assert len(GGUFReader(tmp_path / "four.gguf").tensors) == len(tensors) + 3 * sum(
        t.name.startswith("blk.0.") for t in tensors)


def test_converting_asks_room_for_every_weight_at_the_output_type(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    model = tmp_path / "model"
    shutil.copytree(EMBEDDED_MODEL, model, ignore=shutil.ignore_patterns("__pycache__", "__init__.py", "*.safetensors"))
    save_file({"a": torch.zeros(3, 5), "b": torch.zeros(7, dtype=torch.bfloat16)}, str(model / "model.safetensors"))
    assert llamacpp.weight_count(model) == 22
    free_bytes(monkeypatch, disk.RESERVE_BYTES + 2 * 22 - 1)
    (tmp_path / "llamacpp").mkdir()
    with pytest.raises(BenchError, match=r"bf16\.gguf \(0\.0 GB\)"):
        llamacpp.ensure_gguf(tmp_path / "llamacpp", model, "bfloat16", None)
    assert not list((tmp_path / "llamacpp" / "gguf").iterdir())
