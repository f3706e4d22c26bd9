"""Files that are never half-written: the one atomic write of Meshnet.

Manifests, torrents, credentials, invite ledgers, member registries, revocation lists and the
gateway's billing spool all go through ``write_atomic``: a reader (or the process itself after a
crash) sees the old file or the new one, never a mix.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from pathlib import Path

__all__ = ["PRIVATE_MODE", "PUBLIC_MODE", "file_sha256", "fsync_directory", "write_atomic"]

PRIVATE_MODE = 0o600
PUBLIC_MODE = 0o644


def write_atomic(path: Path, data: bytes, *, mode: int = PUBLIC_MODE) -> None:
    """Write ``data`` to ``path`` so that a crash leaves the old file or the new one, never half of
    one: a temporary file (created 0600) in the same directory, fsync, chmod, ``os.replace``, then
    an fsync of the directory so the rename itself is durable. ``OSError`` if it cannot."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_directory(path.parent)


def fsync_directory(directory: Path) -> None:
    with contextlib.suppress(OSError):  # not every platform or filesystem can open or fsync a directory
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def file_sha256(path: Path, chunk_bytes: int = 8 << 20) -> str:
    """The SHA-256 of a file's bytes, read in bounded chunks (a model file may be many GiB)."""
    digest = hashlib.sha256()
    # One buffer read into again and again: a new 8 MiB object per chunk would raise glibc's mmap
    # threshold and leave the chunks' memory in a heap arena of the calling thread, resident for good.
    buffer = bytearray(chunk_bytes)
    view = memoryview(buffer)
    with path.open("rb", buffering=0) as f:
        while n := f.readinto(view):
            digest.update(view[:n])
    return digest.hexdigest()
