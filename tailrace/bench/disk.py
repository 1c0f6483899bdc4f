"""Room on the disk for what benchmarks cache: shapes and GGUFs of several GB each (a Qwen3-30B-A3B
shape at Q4_0 is 17 GB), kept under bench/ and written again when a run needs one. The disk is
shared with the project's environments and its test suite, which a full disk stops at `pip
install` (session 26 left 77 GB of caches and 2 GB free, and CI failed so), so every write first
checks that the disk keeps RESERVE_BYTES free after it."""

from __future__ import annotations

import shutil
from pathlib import Path

from tailrace.bench.serve import BenchError

RESERVE_BYTES = 10 * 2**30  # .venv and .venv-ray (about 5 GB), a clean clone and the suite's files
CACHES = ("bench/.shapes/", "bench/.peers/llamacpp/gguf/")


def ensure_room(path: Path, nbytes: int, what: str, reserve: int = RESERVE_BYTES) -> None:
    """Raise BenchError unless writing `nbytes` at `path` (a file or directory, existing or not)
    leaves `reserve` bytes free on its disk."""
    free = shutil.disk_usage(_existing(path)).free
    if free - nbytes < reserve:
        raise BenchError(f"writing {what} ({_gb(nbytes)}) would leave {_gb(max(free - nbytes, 0))} of {_gb(free)} "
                         f"free on the disk of {path}; benchmarks keep {_gb(reserve)} free for the environments "
                         f"and the test suite. Delete cached shapes or GGUFs no run needs now "
                         f"({', '.join(CACHES)}): each is written again when a run asks for it")


def _existing(path: Path) -> Path:
    """The nearest existing directory at or above `path`."""
    path = path.absolute()
    while not path.is_dir():
        path = path.parent
    return path


def _gb(nbytes: int) -> str:
    return f"{nbytes / 1e9:.1f} GB"
