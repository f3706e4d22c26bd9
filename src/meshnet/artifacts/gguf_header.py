"""A GGUF's metadata and tensor sizes, read from its header alone, fast.

``gguf.GGUFReader`` builds a numpy view of every field part, which for a 49,152-token vocabulary
takes seconds (8.6 s on a loaded 2-core machine here); a ``--layers auto`` node needs only the
scalars, the numeric arrays (per-layer patterns) and each tensor's byte size before it asks the
tracker for a range. This reader walks the header with ``struct`` over an mmap and *skips* string
arrays (the vocabulary, the merges): their ``contents()`` is ``None``. Values mimic
``gguf.ReaderField.contents()`` for everything else, so ``shard_file.range_starts_of`` and
``plan.shape_from_fields`` read the fields unchanged. Little-endian GGUF v2 and v3.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshnet.errors import InvalidRequest

__all__ = ["GGUFHeader", "read_header"]

_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True, slots=True)
class _Field:
    value: Any

    def contents(self) -> Any:
        return self.value


@dataclass(frozen=True, slots=True)
class GGUFHeader:
    fields: dict[str, _Field]
    tensor_bytes: dict[str, int]  # tensor name -> bytes of its data


def read_header(path: Path) -> GGUFHeader:
    """Raises ``InvalidRequest`` naming the file when it is no GGUF this reader understands."""
    try:
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _Walker(data).header()
    except (OSError, ValueError, struct.error, KeyError) as exc:
        raise InvalidRequest(f"cannot read the GGUF header of {path}: {exc}", param="gguf") from None


class _Walker:
    def __init__(self, data: mmap.mmap) -> None:
        self.data = data
        self.at = 0

    def take(self, fmt: str) -> Any:
        value = struct.unpack_from("<" + fmt, self.data, self.at)[0]
        self.at += struct.calcsize("<" + fmt)
        return value

    def string(self) -> str:
        n = self.take("Q")
        text = bytes(self.data[self.at : self.at + n]).decode("utf-8", errors="replace")
        self.at += n
        return text

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise ValueError(f"unknown GGUF value type {kind}")
        item, count = self.take("I"), self.take("Q")
        if item == _STRING:  # the vocabulary and merges: skipped, not decoded
            for _ in range(count):
                length = self.take("Q")  # read before adding: take() moves self.at itself
                self.at += length
            return None
        if item not in _SCALARS:
            return [self.value(item) for _ in range(count)]
        fmt = _SCALARS[item]
        size = struct.calcsize("<" + fmt)
        values = list(struct.unpack_from(f"<{count}{fmt}", self.data, self.at))
        self.at += count * size
        return values

    def header(self) -> GGUFHeader:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        if bytes(self.data[:4]) != b"GGUF":
            raise ValueError("not a GGUF file (no GGUF magic)")
        self.at = 4
        version = self.take("I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (this reader reads 2 and 3)")
        n_tensors, n_kv = self.take("Q"), self.take("Q")
        fields: dict[str, _Field] = {}
        for _ in range(n_kv):
            key = self.string()
            fields[key] = _Field(self.value(self.take("I")))
        sizes: dict[str, int] = {}
        for _ in range(n_tensors):
            name = self.string()
            dims = [self.take("Q") for _ in range(self.take("I"))]
            kind = GGMLQuantizationType(self.take("I"))
            self.take("Q")  # data offset
            elements = 1
            for d in dims:
                elements *= d
            block, type_size = GGML_QUANT_SIZES[kind]
            sizes[name] = elements // block * type_size
        return GGUFHeader(fields, sizes)
