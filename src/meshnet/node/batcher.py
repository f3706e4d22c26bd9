"""Batched decode on a node: the decode steps of different sessions that reach a node together
run as one shard call (``ShardBackend.decode_many``: one ``llama_decode`` over several sequences).

No step waits for a batch to fill. A step that arrives while the shard is idle computes at once,
alone; the steps that arrive while a batch computes queue up and go together as the next batch.
So one session sees no added latency, and under load each compute call serves every session
that is waiting — continuous batching, the way llama-server's slots and vLLM's scheduler work.

A batch computes on a worker thread, or on the event loop itself when it is short and nothing else
runs on a worker thread (``node.offload``).

A shard batches only where it measured that a batch gives every session the bits of its own step
(``ShardInfo.decode_batch``); a node whose shard does not runs each step on its own, as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from meshnet.backends.shard import DecodeStep, ShardBackend, ShardOutput
from meshnet.node.offload import ShardCalls

__all__ = ["DecodeBatcher"]

_Waiting = tuple[DecodeStep, "asyncio.Future[tuple[ShardOutput, float]]"]


class DecodeBatcher:
    """Gathers concurrent decode steps into ``decode_many`` calls, one call at a time.

    ``on_batch(steps)`` is told the size of every call (metrics); ``calls`` runs them (node.offload).
    Each step's own error (wrong position, busy session, bad input) fails only that step's ``step()`` call."""

    def __init__(
        self, shard: ShardBackend, on_batch: Callable[[int], None] | None = None, calls: ShardCalls | None = None
    ) -> None:
        self._shard = shard
        self._on_batch = on_batch
        self._calls = calls or ShardCalls()
        self._queue: list[_Waiting] = []
        self._drain: asyncio.Task[None] | None = None

    @property
    def waiting(self) -> int:
        return len(self._queue)

    async def step(self, step: DecodeStep) -> tuple[ShardOutput, float]:
        """The step's output, and the seconds its batch's compute call took."""
        future: asyncio.Future[tuple[ShardOutput, float]] = asyncio.get_running_loop().create_future()
        self._queue.append((step, future))
        if self._drain is None:
            # A task of its own: a caller that is cancelled (its client went away) must not take
            # the other sessions' results with it.
            self._drain = asyncio.ensure_future(self._run())
        return await future

    async def _run(self) -> None:
        try:
            while self._queue:
                batch, self._queue = self._queue, []
                steps = [step for step, _ in batch]
                if self._on_batch is not None:
                    self._on_batch(len(steps))
                seconds = 0.0
                try:
                    outs, seconds = await self._calls.step(self._shard.decode_many, steps)
                    results: list[ShardOutput | BaseException] = list(outs)
                except Exception as exc:  # a fault of the shard call itself: every step in it failed
                    results = [exc] * len(batch)
                for (_, future), result in zip(batch, results, strict=True):
                    if future.done():  # its caller is gone; the session's position still moved
                        continue
                    if isinstance(result, BaseException):
                        future.set_exception(result)
                    else:
                        future.set_result((result, seconds))
        finally:
            self._drain = None
