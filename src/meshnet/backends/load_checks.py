"""The load-time bit checks of a llama.cpp shard, kept on disk so the next start of the same shard
does not pay for them again.

A shard measures at load which batched computations keep every position's bits (a verify chunk
against one-position steps, a batch of sessions against each session's own step: see
``LlamaShard._batch_matches_steps`` and ``_batch_matches_solo``). The answer depends only on the
shard's weights, the llama.cpp build and CPU features, the thread count and the shapes measured,
so it is cached under a key of exactly those. Any change among them is another key, measured anew.

The shard file is identified by its path, size and modification time plus a hash of its first and
last MiB (a shard file is written once, atomically, and never edited in place). A cache file that
cannot be read or parsed is measured anew and rewritten; one that cannot be written leaves the
shard measured and running. Concurrency: entries are written atomically, one file per key, so
nodes starting at once never see a half-written entry.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from meshnet.fsutil import write_atomic

__all__ = ["BatchChecks", "CheckCache", "check_key"]

log = logging.getLogger(__name__)

# Bumped whenever what the checks measure, or how, changes: old entries are then never read.
CHECKS_VERSION = 1
_SAMPLE_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class BatchChecks:
    """What the load checks found: each ``(after a short history, after a long one)``, or ``None``
    where that check does not apply to this shard (no verify chunks, one session a batch)."""

    verify: tuple[bool, bool] | None
    decode: tuple[bool, bool] | None


def _file_identity(path: Path) -> str:
    stat = path.stat()
    digest = hashlib.sha256()
    with path.open("rb") as f:
        digest.update(f.read(_SAMPLE_BYTES))
        if stat.st_size > _SAMPLE_BYTES:
            f.seek(max(_SAMPLE_BYTES, stat.st_size - _SAMPLE_BYTES))
            digest.update(f.read(_SAMPLE_BYTES))
    return f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{digest.hexdigest()}"


def check_key(shard: Path, *, build: str, threads: int, shapes: Mapping[str, object]) -> str:
    """The cache key: the shard file, the llama.cpp ``build`` (version and CPU features), the
    ``threads`` and every shape the checks measure (``shapes``: JSON-able values)."""
    what = {"v": CHECKS_VERSION, "file": _file_identity(shard), "build": build, "threads": threads}
    text = json.dumps({**what, "shapes": dict(shapes)}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _pair(raw: object) -> tuple[bool, bool] | None:
    if raw is None:
        return None
    if isinstance(raw, list) and len(raw) == 2 and all(isinstance(x, bool) for x in raw):
        return bool(raw[0]), bool(raw[1])
    raise ValueError(f"not a pair of booleans: {raw!r}")


class CheckCache:
    """One JSON file per key under ``directory``."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def _path(self, key: str) -> Path:
        return self.directory / f"{key}.json"

    def get(self, key: str) -> BatchChecks | None:
        path = self._path(key)
        try:
            raw = json.loads(path.read_text())
            return BatchChecks(verify=_pair(raw["verify"]), decode=_pair(raw["decode"]))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("meshnet: measuring the shard again: its cached load checks %s are unreadable (%s)", path, exc)
            return None

    def put(self, key: str, found: BatchChecks) -> None:
        body = {"verify": list(found.verify) if found.verify else None,
                "decode": list(found.decode) if found.decode else None}  # fmt: skip
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            write_atomic(self._path(key), json.dumps(body).encode())
        except OSError as exc:
            log.warning("meshnet: could not keep the shard's load checks in %s (%s)", self.directory, exc)
