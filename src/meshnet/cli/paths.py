"""Where a node keeps what it caches on disk: its shard files and their load-time bit checks."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["default_cache_dir", "load_checks_dir"]


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "meshnet" / "shards"


def load_checks_dir(cache_dir: Path | None) -> Path:
    """Where a node keeps its shards' load-time bit checks between starts (backends/load_checks.py)."""
    return (cache_dir or default_cache_dir()) / "load-checks"
