"""A GGUF file opened and its metadata read: what both processes need of it (the API process for
the tokenizer and the task, the core for the config and weights), without PyTorch."""

from __future__ import annotations

import functools
import mmap
import os
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType

from tailrace.heap import release_freed
from tailrace.model.decoder import registry

REQUIRED = object()


def open_gguf(path: str) -> GGUFReader:
    """The file's reader, parsed once per process while the file is unchanged: GGUFReader builds an
    array per string, so a Llama 3 vocabulary (128k tokens, 280k merges) took 26 s to parse here,
    and config, weights and tokenizer each need it."""
    try:
        return _reader(path, os.stat(path).st_mtime_ns)
    except (ValueError, OSError, KeyError, IndexError) as exc:
        raise ValueError(f"{path} is not a readable GGUF file: {exc}") from exc


@functools.lru_cache(maxsize=1)
def _reader(path: str, mtime_ns: int) -> GGUFReader:
    return _PlainReader(path)


def forget_readers() -> None:
    """The cached reader dropped and its memory handed back, for a process that reads the file no
    more: the API process, once it has the config and the tokenizer, would otherwise keep the
    parsed fields for its life (0.24 GiB of Gemma 3's 262k-token vocabulary)."""
    _reader.cache_clear()
    release_freed()


class _PlainReader(GGUFReader):
    """GGUFReader over a plain ndarray view of its memory map. The reader slices `data` a few times
    per string, and every slice of an np.memmap runs memmap's __array_finalize__: Gemma 3's 262k
    tokens took 18.4 s to parse so, 7.2 s over the same pages as a plain ndarray (Phi-4-mini's
    vocabulary 13.8 s and 5.6 s). The tensors' arrays are views of the same mapping either way."""

    @property
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, mapped: np.memmap) -> None:
        self._plain = mapped.view(np.ndarray)


def release_pages(reader: GGUFReader) -> None:
    """The file's pages the reader has read, unmapped from this process (MADV_DONTNEED): they
    belong to the page cache, yet count as the process's resident memory while mapped, and the
    cached reader (open_gguf) keeps the mapping for the process's life. 7 GB of a loaded
    gpt-oss-20b GGUF stood resident beside the weights built from it (RssFile in the engine's
    /proc/PID/status). Whatever reads them again faults them back in from the cache."""
    buffer = reader.data
    while not isinstance(buffer, mmap.mmap):
        buffer = buffer.base
    buffer.madvise(mmap.MADV_DONTNEED)


def metadata(reader: GGUFReader, key: str, default: Any = REQUIRED) -> Any:
    """One metadata value (a number, string, bool or list); ValueError when a required key is absent."""
    field = reader.get_field(key)
    if field is None:
        if default is REQUIRED:
            raise ValueError(f"GGUF metadata has no {key}")
        return default
    value = field.contents()
    if field.types == [GGUFValueType.FLOAT32]:
        # The float32 the file holds, as the decimal it was written from (1e-05, not 9.99999974e-06),
        # so a model reads the same config from its GGUF as from its config.json.
        return float(str(np.float32(value)))
    return value


def architecture(reader: GGUFReader) -> str:
    arch = metadata(reader, "general.architecture")
    if registry.GGUF_ARCHITECTURES.get(arch) is None:
        supported = ", ".join(registry.GGUF_ARCHITECTURES)
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {supported}")
    return arch
