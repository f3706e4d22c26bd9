"""A GGUF as published: one file, or a llama.cpp split set (``NAME-00001-of-0000N.gguf``, ...).

Big models ship as split sets: the first file holds every metadata key and some tensors, each
later file only its ``split.*`` keys and more tensors (what ``llama-gguf-split`` and gguf-py's
``GGUFWriter(split_max_size=...)`` write; llama.cpp loads the set from its first file). A user
names the first file; :func:`open_gguf` finds and checks every part and lists every tensor with
the file and byte range that holds it.

Tensor bytes are never mapped or loaded whole: a :class:`TensorBytes` copies its range with
bounded reads (:data:`COPY_CHUNK` at a time). Pages of an mmap a process touched count as its
resident memory until it unmaps them, so copying through gguf-py's whole-file map makes cutting
or publishing a model cost about the model's size in RSS; reads through a small buffer cost the
buffer. Offsets and sizes are Python ints (no 32-bit arithmetic anywhere): files past 4 GiB work.

Errors are :class:`InvalidRequest` naming the file at fault: a missing part, a part of another
set, a part whose count or number disagrees with the first, a truncated part.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from meshnet.artifacts.gguf_header import Field, Header, TensorInfo, read_header
from meshnet.errors import InvalidRequest

__all__ = [
    "COPY_CHUNK",
    "GGUFSource",
    "TensorBytes",
    "model_stem",
    "open_gguf",
    "split_parts",
]

COPY_CHUNK = 8 << 20  # bytes one read moves: the whole cost in memory of copying a tensor
SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")
_SPLIT_NAME = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclass(frozen=True, slots=True)
class TensorBytes:
    """One tensor's bytes in a GGUF file, as gguf-py describes it (``shape``/``dtype`` of its
    reader's array: for quantized types ``uint8`` rows of packed blocks)."""

    name: str
    shape: tuple[int, ...]
    dtype: Any  # numpy dtype
    tensor_type: Any  # gguf.GGMLQuantizationType
    path: Path
    offset: int  # absolute, in ``path``
    nbytes: int

    def first_rows(self, n: int) -> TensorBytes:
        """The tensor's first ``n`` rows (outermost dimension): a prefix of its bytes."""
        rows = self.shape[0]
        if not 0 < n <= rows:
            raise ValueError(f"{self.name}: {n} rows of {rows}")
        return TensorBytes(
            self.name, (n, *self.shape[1:]), self.dtype, self.tensor_type, self.path, self.offset,
            self.nbytes // rows * n,
        )  # fmt: skip

    def tofile(self, out: IO[bytes]) -> None:
        """Copy the bytes to ``out`` with bounded reads (what ``GGUFWriter.write_tensor_data`` calls)."""
        with self.path.open("rb", buffering=0) as f:
            f.seek(self.offset)
            remaining = self.nbytes
            buffer = memoryview(bytearray(min(COPY_CHUNK, max(1, remaining))))
            while remaining:
                got = f.readinto(buffer[: min(len(buffer), remaining)])
                if not got:
                    raise InvalidRequest(f"{self.path} ends inside tensor {self.name}: the file is truncated")
                out.write(buffer[:got])
                remaining -= got

    def read(self) -> bytes:
        """The bytes in memory (for small tensors only)."""
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read(self.nbytes)
        if len(data) != self.nbytes:
            raise InvalidRequest(f"{self.path} ends inside tensor {self.name}: the file is truncated")
        return data


@dataclass(frozen=True, slots=True)
class GGUFSource:
    """A GGUF model as published: its parts (one for a plain file), the first part's metadata
    (``fields``: a ``gguf.GGUFReader``'s), every tensor of every part, in order, and every part's
    header (``headers``, as ``parts``: the tensor infos in GGML order, the raw metadata entries)."""

    path: Path  # the first part: the name the user gave
    parts: tuple[Path, ...]
    fields: dict[str, Field]
    tensors: tuple[TensorBytes, ...]
    endianess: Any  # gguf.GGUFEndian
    headers: tuple[Header, ...]

    @property
    def size(self) -> int:
        return sum(p.stat().st_size for p in self.parts)

    def meta(self, key: str, default: Any = None) -> Any:
        return self.fields[key].contents() if key in self.fields else default

    @property
    def architecture(self) -> str:
        return str(self.meta("general.architecture"))

    def tensor(self, name: str) -> TensorBytes | None:
        return next((t for t in self.tensors if t.name == name), None)


def model_stem(path: Path) -> str:
    """The model's name from its file: ``NAME`` for ``NAME.gguf`` and for ``NAME-00001-of-00004.gguf``."""
    match = _SPLIT_NAME.match(path.name)
    return match.group("stem") if match else path.name.removesuffix(".gguf")


def _read(path: Path) -> Header:
    if not path.is_file():
        raise InvalidRequest(f"GGUF file not found: {path}", param="gguf")
    return read_header(path)


# GGML types gguf-py reads as arrays of their own element type; every other is uint8 rows of blocks.
_ELEMENT_TYPES = {0: "float32", 1: "float16", 24: "int8", 25: "int16", 26: "int32", 27: "int64", 28: "float64"}


def _tensor_bytes(info: TensorInfo, path: Path) -> TensorBytes:
    """A tensor as gguf-py's reader describes it: numpy shape (outermost first), dtype, bytes."""
    import gguf
    import numpy as np

    qtype = gguf.GGMLQuantizationType(info.ggml_type)
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    elements = 1
    for d in info.dims:
        elements *= d
    shape = tuple(reversed(info.dims))
    dtype = _ELEMENT_TYPES.get(info.ggml_type)
    if dtype is None:
        shape = tuple(int(d) for d in gguf.quant_shape_to_byte_shape(shape, qtype))
    return TensorBytes(
        info.name, shape, np.dtype(dtype or "uint8"), qtype, path, info.offset, elements * type_size // block
    )


def _split_info(reader: Header) -> tuple[int, int, int] | None:
    """``(split.no, split.count, split.tensors.count)`` of a part, None for a plain file."""
    if "split.count" not in reader.fields:
        return None
    no, count, tensors = (int(reader.fields[k].contents()) if k in reader.fields else -1 for k in SPLIT_KEYS)
    return no, count, tensors


def _part_names(first: Path, count: int) -> tuple[Path, ...]:
    match = _SPLIT_NAME.match(first.name)
    if match is None:
        raise InvalidRequest(
            f"{first.name} is part 1 of a {count}-file split GGUF, but its name does not follow llama.cpp's "
            "NAME-00001-of-0000N.gguf, so its other parts cannot be found; rename the parts that way",
            param="gguf",
        )
    if int(match.group("count")) != count:
        raise InvalidRequest(
            f"{first.name} says it is one of {count} parts (split.count) but its name says {match.group('count')}",
            param="gguf",
        )
    stem = match.group("stem")
    return tuple(first.with_name(f"{stem}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1))


def split_parts(path: Path) -> tuple[Path, ...]:
    """Every file of the GGUF ``path`` names (itself alone for a plain file), from its metadata only."""
    info = _split_info(_read(path))
    if info is None or info[1] <= 1:
        return (path,)
    return _part_names(path, info[1])


def open_gguf(path: Path) -> GGUFSource:
    """The GGUF ``path`` names, every part found and checked; ``InvalidRequest`` naming the file at fault."""
    first = _read(path)
    info = _split_info(first)
    readers = [first]
    parts: tuple[Path, ...] = (path,)
    if info is not None and info[1] > 1:
        no, count, total = info
        if no != 0:
            raise InvalidRequest(
                f"{path.name} is part {no + 1} of a {count}-file split GGUF; pass its first file "
                f"({_part_names_hint(path, count)})",
                param="gguf",
            )
        parts = _part_names(path, count)
        for i, part in enumerate(parts[1:], start=1):
            if not part.is_file():
                raise InvalidRequest(f"part {i + 1} of {count} of the split GGUF {path.name} is missing: {part}")
            reader = _read(part)
            got = _split_info(reader)
            if got is None or got[0] != i or got[1] != count:
                where = "no split metadata" if got is None else f"split.no {got[0]} of split.count {got[1]}"
                raise InvalidRequest(f"{part} does not belong to {path.name}'s split set: it has {where}")
            readers.append(reader)
        held = sum(len(r.tensors) for r in readers)
        if held != total:
            raise InvalidRequest(
                f"the split GGUF {path.name} should hold {total} tensors (split.tensors.count); its parts hold {held}"
            )
    tensors: list[TensorBytes] = []
    for part, reader in zip(parts, readers, strict=True):
        size = part.stat().st_size
        for tensor_info in reader.tensors:
            entry = _tensor_bytes(tensor_info, part)
            if entry.offset + entry.nbytes > size:
                raise InvalidRequest(f"{part} ends inside tensor {entry.name}: the file is truncated")
            tensors.append(entry)
    return GGUFSource(path, parts, first.fields, tuple(tensors), _little_endian(), tuple(readers))


def _little_endian() -> Any:
    import gguf

    return gguf.GGUFEndian.LITTLE


def _part_names_hint(path: Path, count: int) -> str:
    match = _SPLIT_NAME.match(path.name)
    return f"{match.group('stem')}-00001-of-{count:05d}.gguf" if match else "its part 00001"
