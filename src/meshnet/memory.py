"""Keeping a node's heap close to what it holds: few malloc arenas, and freed memory handed back.

A node's memory should be its range's weights and KV, little more (docs/backends.md). glibc gives
threads heap arenas of their own (up to 8 per core), each keeping the pages its frees leave behind;
a node's threads (the fetch, the load, the HTTP server, the executor that computes) then each hold
such leftovers. ``limit_heap_arenas`` caps them before the first thread starts: a 14-layer tail of
a 1.5B model held 889 MiB after serving with glibc's default, 855 MiB with two arenas.
``release_free_memory`` returns what loading freed: the fetch's and the load's worker threads'
arenas keep their free pages until their top is free. Measured on a fetched 12-layer tail of a 0.5B
model: 631 MiB anonymous memory at serving time, 521 MiB after ``malloc_trim(0)`` (which also
releases free pages in the middle of every arena).
``fix_mmap_threshold`` keeps large blocks out of the heaps altogether: glibc raises its mmap
threshold to the size of each large block freed (up to 32 MiB), after which every logits row,
seam tensor and request body of that size is carved from a heap, whose freed holes then stay
resident. Fixed at 128 KiB, they are mapped and unmapped each time: after three chats a 14-layer
tail of a 1.5B model held a 51 MiB heap with glibc's default, 33 MiB fixed; its head 56 and 27 MiB.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from typing import Any

__all__ = ["HEAP_ARENAS", "MMAP_THRESHOLD", "fix_mmap_threshold", "limit_heap_arenas", "release_free_memory"]

log = logging.getLogger(__name__)

HEAP_ARENAS = 2  # the main heap and one shared by every other thread
MMAP_THRESHOLD = 128 * 1024  # glibc's initial threshold, kept
_M_ARENA_MAX = -8  # glibc's mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD = -3


def _libc_function(name: str) -> Any:
    """A function of glibc, or None (musl, macOS: these are glibc's)."""
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c")), name)
    except (OSError, AttributeError, TypeError):
        return None


def _mallopt(param: int, value: int) -> bool:
    mallopt = _libc_function("mallopt")
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(param, value))


def limit_heap_arenas(count: int = HEAP_ARENAS) -> bool:
    """Let malloc keep at most ``count`` heap arenas (glibc's ``mallopt(M_ARENA_MAX)``; the
    ``MALLOC_ARENA_MAX`` variable, set from inside): call it before starting threads. Whether it
    took effect; elsewhere a no-op that returns False."""
    return _mallopt(_M_ARENA_MAX, count)


def fix_mmap_threshold(size: int = MMAP_THRESHOLD) -> bool:
    """Map every block of ``size`` bytes or more on its own, and unmap it when freed, for the life of
    the process (glibc's ``mallopt(M_MMAP_THRESHOLD)``, which also stops the threshold's growth).
    Whether it took effect; elsewhere a no-op that returns False."""
    return _mallopt(_M_MMAP_THRESHOLD, size)


def release_free_memory() -> bool:
    """Return the free pages of every malloc heap to the OS (glibc's ``malloc_trim(0)``); whether
    any was returned. Elsewhere (musl, macOS) a no-op that returns False."""
    trim = _libc_function("malloc_trim")
    if trim is None:
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    released = bool(trim(0))
    log.debug("malloc_trim(0) released memory: %s", released)
    return released
