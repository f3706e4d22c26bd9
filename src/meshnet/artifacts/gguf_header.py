"""A lean GGUF header reader: metadata decoded on demand, tensor infos, no mapping of the data.

gguf-py's ``GGUFReader`` keeps a few numpy objects per array item, so opening a model with a
150K-token vocabulary costs about 0.5 GB of memory before a byte of tensor data is read. This
reader keeps, per key, where its value lies in the file, and decodes a value when asked
(``Field.contents()``, the same call as gguf-py's): metadata costs what is decoded, a vocabulary
only while a writer copies it. Fields answer ``name``, ``types`` and ``contents()`` like gguf-py's
``ReaderField``, so every function over a reader's fields takes these too; ``raw`` is the entry's
exact bytes (key, type, value).

Only little-endian GGUF v2/v3 (what llama.cpp writes); anything else is an ``InvalidRequest``.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshnet.errors import InvalidRequest

__all__ = ["Field", "Header", "TensorInfo", "read_header"]

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# GGUF value types (gguf.GGUFValueType): struct format of each fixed-size one.
_FIXED = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True, slots=True)
class Field:
    """One metadata key: where its value lies in ``path``, decoded by ``contents()``."""

    name: str
    types: tuple[Any, ...]  # gguf.GGUFValueType: (ARRAY, item type) for an array, else (type,)
    path: Path
    start: int  # the entry's first byte (its key's length)
    value_start: int  # the value's first byte (an array's: its item type)
    end: int
    count: int  # array items (1 for a scalar)

    @property
    def raw(self) -> bytes:
        with self.path.open("rb") as f:
            f.seek(self.start)
            return f.read(self.end - self.start)

    def contents(self) -> Any:
        with self.path.open("rb") as f:
            f.seek(self.value_start)
            data = f.read(self.end - self.value_start)
        kind = int(self.types[0])
        if kind != _ARRAY:
            return _decode_scalar(data, 0, kind)[0]
        sub = int(self.types[-1])
        if sub in _FIXED:
            fmt = _FIXED[sub]
            return list(struct.unpack_from(f"<{self.count}{fmt[1]}", data, 12))
        items, pos = [], 12
        for _ in range(self.count):
            value, pos = _decode_scalar(data, pos, sub)
            items.append(value)
        return items


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # GGML order (innermost first)
    ggml_type: int
    offset: int  # absolute, in the file


@dataclass(frozen=True, slots=True)
class Header:
    path: Path
    version: int
    fields: dict[str, Field]
    tensors: tuple[TensorInfo, ...]
    data_start: int


def _decode_scalar(data: bytes | mmap.mmap, pos: int, kind: int) -> tuple[Any, int]:
    if kind == _STRING:
        (n,) = struct.unpack_from("<Q", data, pos)
        return bytes(data[pos + 8 : pos + 8 + n]).decode("utf-8"), pos + 8 + n
    fmt = _FIXED.get(kind)
    if fmt is None:
        raise ValueError(f"unknown GGUF value type {kind}")
    return struct.unpack_from(fmt, data, pos)[0], pos + struct.calcsize(fmt)


def _skip_value(data: mmap.mmap, pos: int, kind: int) -> tuple[int, int]:
    """The position after a value of ``kind`` at ``pos`` and its item count."""
    if kind != _ARRAY:
        return _decode_scalar(data, pos, kind)[1], 1
    sub, count = struct.unpack_from("<IQ", data, pos)
    pos += 12
    if sub in _FIXED:
        return pos + count * struct.calcsize(_FIXED[sub]), count
    if sub != _STRING:
        raise ValueError(f"GGUF arrays of type {sub} are not supported")
    for _ in range(count):
        (n,) = struct.unpack_from("<Q", data, pos)
        pos += 8 + n
    return pos, count


def _types(kind: int, data: mmap.mmap, pos: int) -> tuple[Any, ...]:
    import gguf

    if kind == _ARRAY:
        return gguf.GGUFValueType(_ARRAY), gguf.GGUFValueType(struct.unpack_from("<I", data, pos)[0])
    return (gguf.GGUFValueType(kind),)


def _entries(data: mmap.mmap, path: Path, count: int, pos: int) -> Iterator[tuple[Field, int]]:
    for _ in range(count):
        start = pos
        (n,) = struct.unpack_from("<Q", data, pos)
        name = bytes(data[pos + 8 : pos + 8 + n]).decode("utf-8")
        (kind,) = struct.unpack_from("<I", data, pos + 8 + n)
        value_start = pos + 12 + n
        end, items = _skip_value(data, value_start, kind)
        yield Field(name, _types(kind, data, value_start), path, start, value_start, end, items), end
        pos = end


def read_header(path: Path) -> Header:
    """The header of the GGUF at ``path``; ``InvalidRequest`` naming the file if it is not one."""
    try:
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _parse(path, data)
    except (OSError, ValueError, struct.error, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"{path} is not a readable GGUF file: {exc}", param="gguf") from None


def _parse(path: Path, data: mmap.mmap) -> Header:
    if bytes(data[:4]) != _MAGIC:
        raise ValueError("no GGUF magic")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", data, 4)
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} (a big-endian file, or not one llama.cpp writes)")
    fields: dict[str, Field] = {}
    pos = 24
    for field, end in _entries(data, path, n_kv, pos):
        fields[field.name] = field
        pos = end
    tensors = []
    for _ in range(n_tensors):
        (n,) = struct.unpack_from("<Q", data, pos)
        name = bytes(data[pos + 8 : pos + 8 + n]).decode("utf-8")
        pos += 8 + n
        (n_dims,) = struct.unpack_from("<I", data, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", data, pos + 4)
        ggml_type, offset = struct.unpack_from("<IQ", data, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        tensors.append((name, tuple(int(d) for d in dims), int(ggml_type), int(offset)))
    align_field = fields.get("general.alignment")
    alignment = int(align_field.contents()) if align_field is not None else _DEFAULT_ALIGNMENT
    data_start = -(-pos // alignment) * alignment
    infos = tuple(TensorInfo(name, dims, kind, data_start + off) for name, dims, kind, off in tensors)
    return Header(path, version, fields, infos, data_start)
