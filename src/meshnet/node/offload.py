"""Where a node's shard calls run: a worker thread, or — a short decode step while nothing else
runs on a worker thread — the event loop itself.

Every shard call used to go to a worker thread so that a long one (a prefill chunk, a snapshot)
never stalls the event loop. For a decode step that hand-off is most of a hop's cost beyond its
compute: waking a worker, and the worker waking the loop with the result, took 0.25 ms of every
decode step on each hop of the bundled 3-node route on a 2-core machine (timestamps at each hand-off;
a token of that route took 1 ms less without them). A step that takes a few
milliseconds gains nothing from leaving the loop: the loop could do nothing else for the shard
meanwhile, and llama.cpp runs its own threads for the compute either way.

So ``ShardCalls.step`` runs a decode step on the loop when all of these hold, and on a worker
thread otherwise:

- ``WorkerPool.idle``: no call submitted to the node's worker threads is running or waiting, so
  no other thread holds the shard's compute lock or its session store's lock — the loop never
  blocks on a lock held by a long call (the pool is the loop's default executor, so every
  ``run_in_executor(None, …)`` and ``asyncio.to_thread`` of the node counts);
- the last decode call took at most ``INLINE_MAX_S`` (the first one goes to a thread: a step of a
  large model on a slow CPU may take seconds, and the loop answers health checks and heartbeats);
- the node has no machine-wide core lease (``--core-lease``): taking it may wait for another
  process's compute.

Where the pool is not installed (a ``NodeService`` driven in-process, without the app), every call
goes to a worker thread as before.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

__all__ = ["INLINE_MAX_S", "ShardCalls", "WorkerPool"]

T = TypeVar("T")

INLINE_MAX_S = 0.05  # a decode call at most this long may run on the event loop


class WorkerPool(ThreadPoolExecutor):
    """A thread pool that knows whether anything submitted to it is still running or waiting."""

    def __init__(self, max_workers: int | None = None) -> None:
        super().__init__(max_workers, thread_name_prefix="meshnet-node")
        self._count_lock = threading.Lock()
        self._pending = 0

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        with self._count_lock:
            self._pending += 1
        try:
            future = super().submit(fn, *args, **kwargs)
        except BaseException:
            self._done()
            raise
        future.add_done_callback(lambda _: self._done())  # after the call returned: its locks are free
        return future

    def _done(self) -> None:
        with self._count_lock:
            self._pending -= 1

    @property
    def idle(self) -> bool:
        return self._pending == 0


class ShardCalls:
    """Runs decode calls on the loop or a worker thread (module docstring) and times their compute."""

    def __init__(self) -> None:
        self.pool: WorkerPool | None = None  # installed by the node's app (``install``)
        self.shares_cores = False
        self.last_s: float | None = None  # the last decode call's compute
        self.inline = 0  # decode calls run on the loop (tests)

    def install(self, loop: asyncio.AbstractEventLoop, *, shares_cores: bool) -> None:
        """Make a fresh ``WorkerPool`` the loop's default executor; from now on decode steps may run on
        the loop, unless the shard ``shares_cores`` (a core lease)."""
        self.pool = WorkerPool()
        self.shares_cores = shares_cores
        loop.set_default_executor(self.pool)

    def on_loop(self) -> bool:
        pool = self.pool
        return (
            pool is not None
            and not self.shares_cores
            and self.last_s is not None
            and self.last_s <= INLINE_MAX_S
            and pool.idle
        )

    async def step(self, work: Callable[..., T], *args: Any) -> tuple[T, float]:
        """``work(*args)`` — a decode call — and the seconds it computed (hand-offs not counted)."""
        if self.on_loop():
            return self.here(work, *args)
        result, seconds = await timed_off_loop(work, *args)
        self.last_s = seconds
        return result, seconds

    def here(self, work: Callable[..., T], *args: Any) -> tuple[T, float]:
        """``work(*args)`` on the loop, now (the caller checked ``on_loop``), and its seconds."""
        self.inline += 1
        result, seconds = _timed(work, *args)
        self.last_s = seconds
        return result, seconds


async def timed_off_loop(work: Callable[..., T], *args: Any) -> tuple[T, float]:
    """``work(*args)`` on a worker thread, and the seconds it took there (hand-offs not counted)."""
    return await asyncio.get_running_loop().run_in_executor(None, _timed, work, *args)


def _timed(work: Callable[..., T], *args: Any) -> tuple[T, float]:
    began = time.perf_counter()
    result = work(*args)
    return result, time.perf_counter() - began
