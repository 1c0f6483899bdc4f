"""huge_pages.Arena: tensors copied into one mapping back to back, bit for bit, each on a cache line,
in the order taken; on Linux the mapping is advised for transparent huge pages."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from tailrace.heap import release_freed
from tailrace.model.cpu.huge_pages import HUGE_PAGE, Arena


def tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(300, 17, generator=g).to(torch.bfloat16), torch.randint(-128, 128, (5, 3, 32), generator=g,
                                                                                 dtype=torch.int8),
            torch.randn(7, generator=g).half(), torch.randint(0, 255, (HUGE_PAGE + 3,), generator=g, dtype=torch.uint8),
            torch.empty(0, 4)]


def test_taken_tensors_are_equal_copies_in_order_each_on_a_cache_line():
    originals = tensors()
    arena = Arena(Arena.size_of(originals))
    copies = [arena.take(t) for t in originals]
    for original, copy in zip(originals, copies):
        assert copy.dtype == original.dtype and copy.shape == original.shape and copy.is_contiguous()
        assert torch.equal(copy, original)
    stored = copies[:-1]  # the empty one has no address
    assert all(c.data_ptr() % 64 == 0 for c in stored)
    ends = [c.data_ptr() + c.numel() * c.element_size() for c in stored]
    assert all(end <= c.data_ptr() for end, c in zip(ends, stored[1:]))
    originals[0].zero_()
    assert not torch.equal(copies[0], originals[0])  # a copy, not a view


def test_a_full_arena_refuses_more():
    arena = Arena(64)
    arena.take(torch.zeros(16))
    with pytest.raises(ValueError, match="0 bytes left"):
        arena.take(torch.zeros(1))


def test_a_copy_outlives_the_arena_object():
    arena = Arena(HUGE_PAGE * 2)
    copy = arena.take(torch.arange(1000))
    del arena
    assert torch.equal(copy, torch.arange(1000))


@pytest.mark.skipif(sys.platform != "linux" or not os.path.exists("/sys/kernel/mm/transparent_hugepage"),
                    reason="transparent huge pages are Linux's")
def test_the_mapping_is_advised_for_huge_pages():
    copy = Arena(HUGE_PAGE * 3).take(torch.ones(HUGE_PAGE // 4))
    address = copy.data_ptr()
    with open("/proc/self/smaps", encoding="ascii") as f:
        mapping = None
        for line in f:
            fields = line.split()
            if "-" in fields[0] and ":" not in fields[0]:
                low, high = (int(x, 16) for x in fields[0].split("-"))
                mapping = low <= address < high
            elif mapping and fields[0] == "VmFlags:":
                assert "hg" in fields[1:]  # MADV_HUGEPAGE on this mapping
                return
    pytest.fail("the arena's mapping is not in /proc/self/smaps")


def _resident() -> int:
    return int(next(line for line in open("/proc/self/status") if line.startswith("VmRSS")).split()[1]) * 1024


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads Linux's /proc")
def test_gathered_weights_leave_no_resident_old_copies():
    """Weights below glibc's risen mmap threshold come from its heaps, which keep freed memory
    resident: gathered into an arena, their old copies stayed resident beside it until released."""
    bigger = torch.ones(8 << 20, dtype=torch.uint8)
    del bigger  # raises glibc's mmap threshold above the weights' size, as a model load does
    weights = [torch.ones(1 << 20, dtype=torch.uint8) for _ in range(256)]
    before = _resident()
    arena = Arena(Arena.size_of(weights))
    weights = [arena.take(w) for w in weights]
    release_freed()
    assert _resident() - before < 64 << 20  # not the 256 MB of old copies
