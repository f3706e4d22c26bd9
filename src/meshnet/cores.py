"""Sharing one machine's cores between co-located shards: the core lease.

llama.cpp's compute threads spin at every barrier of a graph: two processes that each run as many
threads as there are cores fight over them, and decode slows by orders of magnitude (measured: a
hundredfold on 2 cores). Splitting the cores (one thread per node on a 2-core machine with three
nodes) avoids the fight but leaves a node that computes alone — the usual case in a pipeline,
where one hop computes while the others wait for it — with a fraction of the machine.

A ``CoreLease`` is a lock that every process on the machine opening the same file shares
(``flock``): a shard takes it for each compute call and gives it back right after, so co-located
nodes compute one at a time, each with all its threads, and never spin against each other. The
lock is the kernel's: a process that dies (even by ``kill -9``) releases it, so nothing waits on
a holder that is gone; a compute call is bounded, so every wait is too. Within one process a
thread lock orders the callers (``flock`` does not exclude two holders of one open file).

Threads and bits: a shard's numerics depend on its thread count only where llama.cpp splits a
lone row's attention across threads (past 256 KV cells); every node under one lease runs the same
thread count, measures what it keeps exact at load (``ShardInfo.verify_batched_below``,
``decode_batch_below``) and advertises it, so a lease changes speed, never text.
"""

from __future__ import annotations

import fcntl
import os
import threading
from pathlib import Path
from types import TracebackType

__all__ = ["CoreLease"]


class CoreLease:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise ValueError(f"cannot open the core lease file {self.path}: {exc.strerror}") from None
        self._lock = threading.Lock()
        self.taken = 0  # compute calls that held the lease

    def __enter__(self) -> CoreLease:
        self._lock.acquire()
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        except BaseException:
            self._lock.release()
            raise
        self.taken += 1
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._lock.release()

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
