"""A GGUF's model identity: what a ``--gguf`` node advertises so routes never mix models.

Every range of one file must agree on it, so it is computed over the *whole* model, never over a
range's data alone: a digest (sha256) of

- every metadata field but the split bookkeeping (``split.*``: the same model cut into another
  number of files is the same model), in its raw GGUF encoding, sorted by key;
- the tensor-info table: each tensor's name, type and shape, sorted by name (a requantized copy
  changes the types: Q2_K is not Q4_1);
- a sample of each tensor's data: its first and last ``SAMPLE_BYTES`` (a fine-tune with the same
  metadata and types changes essentially every weight, so the samples change too).

The metadata and tensor infos come from the lean header reader of every part (``open_gguf``: a
split set has the identity of the same model as one file), the samples from two small reads per
tensor, never the whole model: it costs tens of milliseconds for a model of many GiB and its
150K-token vocabulary (gguf-py's reader takes seconds and about 0.5 GB there), and needs no cache.

It is a claim like any advertisement: it keeps honest nodes of different files apart; a lying node
can send anything (the route's ledger and the output checks are the defence there). A published
model's nodes advertise the manifest digest instead (``--manifest``), so a ``--gguf`` node and a
``--manifest`` node never share a route.
"""

from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path
from typing import BinaryIO

from meshnet.artifacts.gguf_source import GGUFSource, open_gguf

__all__ = ["IDENTITY_PREFIX", "SAMPLE_BYTES", "gguf_identity", "source_identity"]

IDENTITY_PREFIX = "gguf-sha256:"
SAMPLE_BYTES = 4096
_SKIPPED_PREFIXES = ("split.", "GGUF.")  # split bookkeeping, and gguf-py's pseudo-fields of the header


def gguf_identity(path: Path) -> str:
    """The identity of the model in ``path``: a GGUF, or the first file of a split set (every part is
    read); ``InvalidRequest`` naming the file at fault for a broken set."""
    return source_identity(open_gguf(path))


def source_identity(source: GGUFSource) -> str:
    """The identity of a GGUF already open (``open_gguf``): every part's metadata and tensors."""
    digest = hashlib.sha256(b"meshnet-model-identity-v1\0")
    fields: dict[str, bytes] = {}
    for header in source.headers:
        for name, field in header.fields.items():
            if not name.startswith(_SKIPPED_PREFIXES):
                fields.setdefault(name, field.raw)  # the entry's exact bytes: key, type, value
    for name in sorted(fields):
        digest.update(_framed(name.encode()))
        digest.update(_framed(fields[name]))
    dims = {t.name: t.dims for header in source.headers for t in header.tensors}  # GGML order
    with contextlib.ExitStack() as stack:
        files = {part: stack.enter_context(part.open("rb")) for part in source.parts}
        for tensor in sorted(source.tensors, key=lambda t: t.name):
            shape = ",".join(str(n) for n in dims[tensor.name])
            digest.update(_framed(f"{tensor.name}\0{int(tensor.tensor_type)}\0{shape}".encode()))
            sample = min(SAMPLE_BYTES, tensor.nbytes)
            f = files[tensor.path]
            digest.update(_framed(_read_at(f, tensor.offset, sample)))
            digest.update(_framed(_read_at(f, tensor.offset + tensor.nbytes - sample, sample)))
    return IDENTITY_PREFIX + digest.hexdigest()


def _read_at(f: BinaryIO, offset: int, size: int) -> bytes:
    f.seek(offset)
    return f.read(size)


def _framed(blob: bytes) -> bytes:
    """Length-prefixed, so no two different field lists hash the same concatenation."""
    return len(blob).to_bytes(8, "little") + blob
