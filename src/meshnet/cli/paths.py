"""Where Meshnet keeps what it caches on disk (``cache_home``): a node's shard files and their
load-time bit checks here; fetched artifacts, the tests' real models and certification models, and
the device check's kit beside them."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_home", "default_cache_dir", "load_checks_dir"]


def cache_home() -> Path:
    """``$XDG_CACHE_HOME/meshnet`` (``~/.cache/meshnet``): every Meshnet cache is a folder in it."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "meshnet"


def default_cache_dir() -> Path:
    return cache_home() / "shards"


def load_checks_dir(cache_dir: Path | None) -> Path:
    """Where a node keeps its shards' load-time bit checks between starts (backends/load_checks.py)."""
    return (cache_dir or default_cache_dir()) / "load-checks"
