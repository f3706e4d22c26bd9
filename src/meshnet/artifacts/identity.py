"""A GGUF's model identity: what a ``--gguf`` node advertises so routes never mix models.

Every range of one file must agree on it, so it is computed over the *whole* model, never over a
range's data alone: a digest (sha256) of

- every metadata field but the split bookkeeping (``split.*``: the same model cut into another
  number of files is the same model), in its raw GGUF encoding, sorted by key;
- the tensor-info table: each tensor's name, type and shape, sorted by name (a requantized copy
  changes the types: Q2_K is not Q4_1);
- a sample of each tensor's data: its first and last ``SAMPLE_BYTES`` (a fine-tune with the same
  metadata and types changes essentially every weight, so the samples change too).

That reads a few KiB per tensor through the file's memory map, never the whole model, so it is
cheap for a model of many GiB and needs no cache. It is a claim like any advertisement: it keeps
honest nodes of different files apart; a lying node can send anything (the route's ledger and the
output checks are the defence there). A published model's nodes advertise the manifest digest
instead (``--manifest``), so a ``--gguf`` node and a ``--manifest`` node never share a route.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["IDENTITY_PREFIX", "SAMPLE_BYTES", "gguf_identity", "identity_of_readers"]

IDENTITY_PREFIX = "gguf-sha256:"
SAMPLE_BYTES = 4096
_SKIPPED_PREFIXES = ("split.", "GGUF.")  # split bookkeeping, and gguf-py's pseudo-fields of the header


def gguf_identity(path: Path) -> str:
    """The identity of the model in ``path`` (a GGUF; for a split set, pass the readers of every
    part to ``identity_of_readers``)."""
    import gguf

    return identity_of_readers([gguf.GGUFReader(str(path))])


def identity_of_readers(readers: Sequence[Any]) -> str:
    """The identity over ``gguf.GGUFReader`` objects of one model (one file, or the parts of a split set)."""
    digest = hashlib.sha256(b"meshnet-model-identity-v1\0")
    fields: dict[str, bytes] = {}
    for reader in readers:
        for name, field in reader.fields.items():
            if not name.startswith(_SKIPPED_PREFIXES):
                fields.setdefault(name, b"".join(np.asarray(p).tobytes() for p in field.parts))
    for name in sorted(fields):
        digest.update(_framed(name.encode()))
        digest.update(_framed(fields[name]))
    tensors = sorted((t for r in readers for t in r.tensors), key=lambda t: t.name)
    for tensor in tensors:
        shape = ",".join(str(int(n)) for n in tensor.shape)
        digest.update(_framed(f"{tensor.name}\0{int(tensor.tensor_type)}\0{shape}".encode()))
        data = np.asarray(tensor.data).reshape(-1).view(np.uint8)  # a view of the memory map: no copy
        digest.update(_framed(data[:SAMPLE_BYTES].tobytes()))
        digest.update(_framed(data[-SAMPLE_BYTES:].tobytes()))
    return IDENTITY_PREFIX + digest.hexdigest()


def _framed(blob: bytes) -> bytes:
    """Length-prefixed, so no two different field lists hash the same concatenation."""
    return len(blob).to_bytes(8, "little") + blob
