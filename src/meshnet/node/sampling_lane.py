"""A tail's sampling, off the event loop and under a per-token deadline: ``SamplingLane``.

Sampling under a grammar costs what the grammar makes it cost: llama.cpp's grammar engine checked
the vocabulary for 1 s per step under a grammar of 1,000 identical alternatives, for tens of seconds
under 3,000. On the event loop such a step stopped the node's heartbeats, health answers and every
other session. So the tail samples on worker threads (llama.cpp's calls release the GIL), and a
step that has not finished within its deadline (``deadline_s`` per token it decides) fails that
generation with a clear error — the node goes on. The clock restarts at each token the step decides
(``progress``): a verify chunk of 16 drafts gets 0.5 s for each of its tokens, not 8 s for whichever
token the grammar makes costly.

A thread cannot be stopped from outside: a step past its deadline is told to stop (a grammar's
check of the vocabulary runs in chunks and stops at the next one: ``TokenGrammar.cancel``), and
whatever it still does runs on in the background with its result dropped (the caller breaks the
session, so nothing uses its sampler again; a node that stops tells its running steps to stop and
waits for them before it frees the vocabulary they read: ``stop``). Grammar steps run on a lane
of their own, a few threads; when every grammar thread is still busy with runaway steps, another
grammar step is refused at once (503) rather than queued behind them.

Sampling without a grammar is bounded by the vocabulary (a softmax, the top alternatives, the
penalties over the generation so far: under 0.1 ms for 49K tokens here, in proportion for larger
vocabularies) and runs on the event loop itself: the hand-off to a worker thread and back cost
about 0.2 ms of every decode step on a busy 2-core machine (``make bench --only route``: the tail's
time beyond compute went from 0.95 to 0.74 ms).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable
from typing import Any, TypeVar

from meshnet.errors import InvalidRequest, Overloaded

__all__ = ["DEFAULT_SAMPLE_DEADLINE_S", "SamplingLane", "SamplingTooSlow"]

T = TypeVar("T")

# A token's sampling takes 0.1-40 ms under realistic grammars here (docs/api.md); a few seconds
# is far above that on a loaded machine and far below the tracker's heartbeat timeout.
DEFAULT_SAMPLE_DEADLINE_S = 2.0
_GRAMMAR_THREADS = 2


class SamplingTooSlow(InvalidRequest):
    """A sampling step passed its deadline: the request's grammar is too costly to sample with."""

    code = "grammar_too_costly"


class SamplingLane:
    def __init__(self, deadline_s: float = DEFAULT_SAMPLE_DEADLINE_S, *, grammar_threads: int = _GRAMMAR_THREADS):
        if deadline_s <= 0:
            raise ValueError(f"the sampling deadline must be > 0 seconds, got {deadline_s}")
        self.deadline_s = deadline_s
        self._threads = grammar_threads
        self._grammar = concurrent.futures.ThreadPoolExecutor(grammar_threads, thread_name_prefix="meshnet-grammar")
        self.running_late = 0  # grammar steps past their deadline that still hold a thread
        # every grammar step not yet done, and how to tell it to stop (``stop``)
        self._running: dict[asyncio.Future[Any], Callable[[], None] | None] = {}

    async def run(
        self,
        step: Callable[[], T],
        *,
        tokens: int = 1,
        grammar: bool,
        cancel: Callable[[], None] | None = None,
        progress: Callable[[], float] | None = None,
    ) -> T:
        """``step()`` — a grammar's on a worker thread of its lane, ``SamplingTooSlow`` when it decides
        no token for ``deadline_s`` (``progress``: the ``time.monotonic()`` of the last token it
        decided) or takes longer than ``deadline_s`` per token it decides (``tokens``), after telling
        the step to stop (``cancel``: a grammar's check of the vocabulary stops within one chunk of
        it); any other at once, here (module docstring)."""
        if not grammar:
            return step()
        if self.running_late >= self._threads:
            raise Overloaded(
                f"this tail's {self._threads} grammar threads are all still running steps that passed their "
                "deadline; retry in a few seconds",
                retry_after_s=5,
            )
        loop = asyncio.get_running_loop()
        began = time.monotonic()
        future = loop.run_in_executor(self._grammar, step)
        self._running[future] = cancel
        future.add_done_callback(self._running.pop)
        limit = began + self.deadline_s * max(1, tokens)
        while True:  # bounded: each pass ends at a later token decided, or fails; never past ``limit``
            last = max(began, progress()) if progress is not None else began
            wait = min(limit, last + self.deadline_s) - time.monotonic()
            if wait <= 0 and not future.done():
                break
            try:
                # shield: a timeout must not cancel the future before its thread is done with the sampler
                return await asyncio.wait_for(asyncio.shield(future), max(wait, 0))
            except TimeoutError:
                continue
        if cancel is not None:
            cancel()
        self.running_late += 1
        future.add_done_callback(self._finished_late)
        raise SamplingTooSlow(
            f"sampling {tokens} token(s) passed this tail's deadline of {self.deadline_s:.1f} s a token: "
            "the request's grammar is too costly to sample; simplify it",
            param="grammar",
        )

    def _finished_late(self, future: asyncio.Future[Any]) -> None:
        self.running_late -= 1
        _consume(future)

    def close(self) -> None:
        self._grammar.shutdown(wait=False, cancel_futures=True)

    async def stop(self, timeout_s: float) -> bool:
        """Tell every grammar step still running to stop, and wait up to ``timeout_s`` for them: whether
        none runs any more. Until then a step may still read the vocabulary, which must not be freed
        under it (a node frees its model only once this says so)."""
        for cancel in list(self._running.values()):
            if cancel is not None:
                cancel()
        running = set(self._running)
        if running:
            await asyncio.wait(running, timeout=timeout_s)
        self.close()
        return not self._running


def _consume(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()  # the generation already failed with SamplingTooSlow
