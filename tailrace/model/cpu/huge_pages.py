"""Host memory on transparent huge pages, for the weights a CPU decode step streams.

A decode step reads every weight once, 84-270 MB on the SmolLM2-135M shape, and each projection
is a few hundred KB in its own allocation of 4 KB pages: some 20-65 thousand pages a step
against a TLB of about two thousand entries, so the stream walks the page tables all the way
through. Copied back to back into one mapping advised for 2 MB pages, in the order the step
reads them, the same weights took 2.4-3.6% less time a step at one row (int4, int8 and
bfloat16; `bench/decode_step.py --ab-huge-pages` runs both in one process). On Linux with
transparent huge pages set to `madvise` or `always` the kernel backs the mapping with them;
elsewhere it is an ordinary allocation and only the order remains.
"""

from __future__ import annotations

import mmap

import torch

HUGE_PAGE = 2 << 20
_ALIGN = 64  # each tensor starts on a cache line, as the allocator's would


class Arena:
    """One anonymous mapping that tensors are copied into one after another (`take`). A tensor
    taken out of it keeps the whole mapping alive, as a view keeps its base."""

    def __init__(self, nbytes: int) -> None:
        if hasattr(mmap, "MAP_PRIVATE"):
            # Private: a shared anonymous mapping is shmem, which the huge page setting leaves out.
            mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            whole = torch.frombuffer(mapping, dtype=torch.uint8)
            start = -whole.data_ptr() % HUGE_PAGE
            if hasattr(mmap, "MADV_HUGEPAGE") and nbytes >= HUGE_PAGE:
                try:
                    # Before the first write: the kernel picks a page's size when it is first touched.
                    mapping.madvise(mmap.MADV_HUGEPAGE, start, nbytes // HUGE_PAGE * HUGE_PAGE)
                except OSError:
                    pass  # a kernel built without transparent huge pages: 4 KB pages, in order
            self._bytes = whole[start:start + nbytes]
        else:
            self._bytes = torch.empty(nbytes, dtype=torch.uint8)
        self._used = 0

    @staticmethod
    def size_of(tensors: list[torch.Tensor]) -> int:
        """The bytes an arena needs to take these tensors."""
        return sum(_aligned(t.numel() * t.element_size()) for t in tensors)

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of `tensor` (contiguous, same dtype and shape) at the arena's next free bytes."""
        nbytes = tensor.numel() * tensor.element_size()
        if self._used + nbytes > self._bytes.numel():
            raise ValueError(f"the arena has {self._bytes.numel() - self._used} bytes left, not {nbytes}")
        copy = self._bytes[self._used:self._used + nbytes].view(tensor.dtype).view(tensor.shape)
        copy.copy_(tensor)
        self._used += _aligned(nbytes)
        return copy


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN
