"""A GGUF file opened and its metadata read: what both processes need of it (the API process for
the tokenizer and the task, the core for the config and weights), without PyTorch."""

from __future__ import annotations

import functools
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, ReaderTensor

from tailrace.heap import release_freed
from tailrace.model.decoder import registry

REQUIRED = object()


def open_gguf(path: str) -> GgufFile:
    """The file, parsed once per process while it is unchanged (config, weights and tokenizer each
    need it)."""
    try:
        return _reader(path, os.stat(path).st_mtime_ns)
    except (ValueError, OSError, KeyError, IndexError, struct.error, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not a readable GGUF file: {exc}") from exc


@functools.lru_cache(maxsize=1)
def _reader(path: str, mtime_ns: int) -> GgufFile:
    return GgufFile.read(path)


def forget_readers() -> None:
    """The cached reader dropped and its memory handed back, for a process that reads the file no
    more: the API process, once it has the config and the tokenizer, would otherwise keep the
    parsed values for its life (a 262k-token vocabulary's strings)."""
    _reader.cache_clear()
    release_freed()


# GGUF's value types (gguf.GGUFValueType) as struct formats and numpy dtypes; 8 is a string, 9 an array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_DTYPES = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
           7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
# Tensor types held as typed arrays (the others as their raw bytes, [..., row bytes]), as GGUFReader holds them.
_TYPED = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
          GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8, GGMLQuantizationType.I16: np.int16,
          GGMLQuantizationType.I32: np.int32, GGMLQuantizationType.I64: np.int64}
_STRING_LENGTH = struct.Struct("<Q")


@dataclass(frozen=True, slots=True)
class GgufFile:
    """A GGUF file (versions 2 and 3, little-endian) over one read-only map of it: its metadata
    values, and its tensors as gguf's ReaderTensor, their `data` viewing the map. gguf's GGUFReader reads
    the same, but builds an array per string: a Llama 3 vocabulary's took it 2.8 s in each
    process, where one pass of struct reads takes 0.05 s."""

    values: dict[str, Any]
    float32: frozenset[str]  # the keys of float32 scalars
    tensors: list[ReaderTensor]
    mapped: mmap.mmap

    @classmethod
    def read(cls, path: str) -> GgufFile:
        with open(path, "rb") as file:
            mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        data = np.frombuffer(mapped, dtype=np.uint8)
        view = memoryview(mapped)
        magic, version, tensor_count, value_count = struct.unpack_from("<4sIQQ", view, 0)
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError(f"not a little-endian GGUF file of version 2 or 3 (magic {magic!r}, version {version})")
        position, values, float32 = 24, {}, set()
        for _ in range(value_count):
            key, position = _string(view, position)
            (kind,) = struct.unpack_from("<I", view, position)
            values[key], position = _value(view, data, position + 4, kind)
            if kind == 6:
                float32.add(key)
        infos = []
        for _ in range(tensor_count):
            name, position = _string(view, position)
            (dims,) = struct.unpack_from("<I", view, position)
            shape = np.array(struct.unpack_from(f"<{dims}Q", view, position + 4), dtype=np.uint64)
            kind, offset = struct.unpack_from("<IQ", view, position + 4 + 8 * dims)
            infos.append((name, GGMLQuantizationType(kind), shape, offset))
            position += 4 + 8 * dims + 12
        alignment = values.get("general.alignment", 32)
        start = -(-position // alignment) * alignment
        return cls(values, frozenset(float32), [_tensor(data, start, *info) for info in infos], mapped)


def _string(view: memoryview, position: int) -> tuple[str, int]:
    (length,) = _STRING_LENGTH.unpack_from(view, position)
    return str(view[position + 8:position + 8 + length], "utf-8"), position + 8 + length


def _value(view: memoryview, data: np.ndarray, position: int, kind: int) -> tuple[Any, int]:
    if kind == 8:
        return _string(view, position)
    if kind != 9:
        fmt = "<" + _SCALARS[kind]
        return struct.unpack_from(fmt, view, position)[0], position + struct.calcsize(fmt)
    item, count = struct.unpack_from("<IQ", view, position)
    position += 12
    if item in (8, 9):  # strings, or arrays: each its own length
        items = []
        for _ in range(count):
            value, position = _value(view, data, position, item)
            items.append(value)
        return items, position
    array = data[position:position + count * np.dtype(_DTYPES[item]).itemsize].view(_DTYPES[item])
    return array.tolist(), position + array.nbytes


def _tensor(data: np.ndarray, start: int, name: str, kind: GGMLQuantizationType, shape: np.ndarray,
            offset: int) -> ReaderTensor:
    elements = int(np.prod(shape))
    block_size, type_size = GGML_QUANT_SIZES[kind]
    size = elements * type_size // block_size
    dims = tuple(int(d) for d in reversed(shape.tolist()))
    raw = data[start + offset:start + offset + size]
    values = raw.view(_TYPED[kind]).reshape(dims) if kind in _TYPED else raw.reshape(
        dims[:-1] + (dims[-1] // block_size * type_size,))
    return ReaderTensor(name=name, tensor_type=kind, shape=shape, n_elements=elements, n_bytes=size,
                        data_offset=start + offset, data=values, field=None)


def release_pages(reader: GgufFile) -> None:
    """The file's pages the reader has read, unmapped from this process (MADV_DONTNEED): they
    belong to the page cache, yet count as the process's resident memory while mapped, and the
    cached reader (open_gguf) keeps the mapping for the process's life. 7 GB of a loaded
    gpt-oss-20b GGUF stood resident beside the weights built from it (RssFile in the engine's
    /proc/PID/status). Whatever reads them again faults them back in from the cache."""
    reader.mapped.madvise(mmap.MADV_DONTNEED)


def metadata(reader: GgufFile, key: str, default: Any = REQUIRED) -> Any:
    """One metadata value (a number, string, bool or list); ValueError when a required key is absent."""
    if key not in reader.values:
        if default is REQUIRED:
            raise ValueError(f"GGUF metadata has no {key}")
        return default
    value = reader.values[key]
    if key in reader.float32:
        # The float32 the file holds, as the decimal it was written from (1e-05, not 9.99999974e-06),
        # so a model reads the same config from its GGUF as from its config.json.
        return float(str(np.float32(value)))
    return value


def architecture(reader: GgufFile) -> str:
    arch = metadata(reader, "general.architecture")
    if registry.GGUF_ARCHITECTURES.get(arch) is None:
        supported = ", ".join(registry.GGUF_ARCHITECTURES)
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {supported}")
    return arch
