"""Batched decode on a node: the decode steps of different sessions that reach a node together
run as one shard call (``ShardBackend.decode_many``: one ``llama_decode`` over several sequences).

No step waits for a batch to fill. A step that arrives while the shard is idle computes at once,
alone; the steps that arrive while a batch computes queue up and go together as the next batch.
So one session sees no added latency, and under load each compute call serves every session
that is waiting — continuous batching, the way llama-server's slots and vLLM's scheduler work.

A batch computes on a worker thread, or on the event loop itself when it is short and nothing else
runs on a worker thread (``node.offload``). On the loop, the step that finds the batcher idle
*leads* its batch: it lets the loop take one turn (the steps that reach the node in that turn
join it; a node that holds no other session, whose step could join, takes no turn), computes the
batch in its own task and goes on with its own result at once. A batch task beside it would cost
a loop turn more on every hop of every token (its result handed back to the waiting step), and
computing without that one turn would leave steps that arrive together unbatched.

A shard batches only where it measured that a batch gives every session the bits of its own step
(``ShardInfo.decode_batch``); a node whose shard does not runs each step on its own, as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from meshnet.backends.shard import DecodeStep, ShardBackend, ShardOutput
from meshnet.errors import MeshnetError
from meshnet.node.offload import ShardCalls

__all__ = ["DecodeBatcher"]

_Waiting = tuple[DecodeStep, "asyncio.Future[tuple[ShardOutput, float]]"]
_Done = tuple[list[ShardOutput | MeshnetError], float] | Exception  # a call's outputs and seconds, or its fault


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
        self._leading = False  # a step leads a batch on the loop (``_lead``)

    @property
    def waiting(self) -> int:
        return len(self._queue)

    async def step(self, step: DecodeStep) -> tuple[ShardOutput, float]:
        """The step's output, and the seconds its batch's compute call took."""
        future: asyncio.Future[tuple[ShardOutput, float]] = asyncio.get_running_loop().create_future()
        self._queue.append((step, future))
        if self._drain is None and not self._leading:
            if self._calls.on_loop():
                return await self._lead(future)
            self._start_drain()
        return await future

    def _start_drain(self) -> None:
        # A task of its own: a caller that is cancelled (its client went away) must not take the
        # other sessions' results with it.
        self._drain = asyncio.ensure_future(self._run())

    async def _lead(self, own: asyncio.Future[tuple[ShardOutput, float]]) -> tuple[ShardOutput, float]:
        """Compute the batch ``own`` starts on the loop, in the caller's task, after one loop turn."""
        self._leading = True
        if len(self._shard.store) > 1:  # only another session's step could join: alone, no turn to wait
            try:
                await asyncio.sleep(0)  # the steps that arrive in this turn join the batch
            except asyncio.CancelledError:
                self._leading = False
                self._start_drain()  # the others that joined still get their results
                raise
        self._leading = False
        if not self._calls.on_loop():  # meanwhile something went to a worker thread: it may hold the locks
            self._start_drain()
            return await own
        # From here to the return nothing awaits: the batch cannot be cancelled halfway.
        batch, steps = self._take()
        try:
            done: _Done = self._calls.here(self._shard.decode_many, steps)
        except Exception as exc:  # a fault of the shard call itself: every step in it failed
            done = exc
        self._settle(batch, done)
        return own.result()

    async def _run(self) -> None:
        try:
            while self._queue:
                batch, steps = self._take()
                try:
                    done: _Done = await self._calls.step(self._shard.decode_many, steps)
                except Exception as exc:  # a fault of the shard call itself: every step in it failed
                    done = exc
                self._settle(batch, done)
        finally:
            self._drain = None

    def _take(self) -> tuple[list[_Waiting], list[DecodeStep]]:
        """The steps waiting now, as the next batch."""
        batch, self._queue = self._queue, []
        if self._on_batch is not None:
            self._on_batch(len(batch))
        return batch, [step for step, _ in batch]

    def _settle(self, batch: list[_Waiting], done: _Done) -> None:
        """Hand each step of ``batch`` its output (and the call's seconds) or its error."""
        outs, seconds = ([done] * len(batch), 0.0) if isinstance(done, Exception) else done
        for (_, future), result in zip(batch, outs, strict=True):
            if future.done():  # its caller is gone; the session's position still moved
                continue
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result((result, seconds))
