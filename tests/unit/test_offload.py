"""Where a node's decode calls run (node.offload): on the event loop only while no worker thread is
busy, the last call was short and no core lease is shared; their compute timed without hand-offs."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence

import numpy as np
import pytest

from meshnet.backends.shard import DecodeStep, ShardOutput
from meshnet.errors import MeshnetError
from meshnet.ids import SessionId
from meshnet.node.batcher import DecodeBatcher
from meshnet.node.offload import INLINE_MAX_S, ShardCalls, WorkerPool


def where() -> int:
    return threading.get_ident()


def test_the_pool_counts_what_it_runs_and_what_waits() -> None:
    pool = WorkerPool(1)
    release = threading.Event()
    try:
        assert pool.idle
        first = pool.submit(release.wait, 10)
        second = pool.submit(lambda: 2)  # waits behind the first: one worker
        assert not pool.idle
        release.set()
        assert first.result(10) is True and second.result(10) == 2
        deadline = time.monotonic() + 10
        while not pool.idle and time.monotonic() < deadline:  # the count drops just after the result is set
            time.sleep(0.001)
        assert pool.idle
    finally:
        pool.shutdown(wait=True)


def test_decode_calls_run_on_the_loop_only_when_that_cannot_block_it() -> None:
    async def main() -> dict[str, bool]:
        loop_thread = where()
        calls = ShardCalls()
        seen: dict[str, bool] = {}

        async def on_loop(name: str) -> None:
            ident, seconds = await calls.step(where)
            assert seconds >= 0.0
            seen[name] = ident == loop_thread

        await on_loop("not installed")
        calls.install(asyncio.get_running_loop(), shares_cores=False)
        calls.last_s = None
        await on_loop("first call")  # no measured call yet: a thread
        await on_loop("short and idle")
        release = threading.Event()
        busy = asyncio.get_running_loop().run_in_executor(None, release.wait, 10)  # a prefill, say
        await on_loop("a worker is busy")
        release.set()
        await busy
        calls.last_s = INLINE_MAX_S * 2
        await on_loop("the last call was long")  # a thread; this call is short again
        await on_loop("short again")
        calls.shares_cores = True
        await on_loop("a core lease")
        return seen

    seen = asyncio.run(main())
    assert seen == {
        "not installed": False,
        "first call": False,
        "short and idle": True,
        "a worker is busy": False,
        "the last call was long": False,
        "short again": True,
        "a core lease": False,
    }


def test_a_call_on_the_loop_is_timed_and_its_error_is_the_callers() -> None:
    async def main() -> tuple[float, float]:
        calls = ShardCalls()
        calls.install(asyncio.get_running_loop(), shares_cores=False)
        _, threaded = await calls.step(time.sleep, 0.02)
        _, inline = await calls.step(time.sleep, 0.02)
        assert calls.inline == 1

        def fails() -> None:
            raise RuntimeError("llama.cpp fell over")

        try:
            await calls.step(fails)
        except RuntimeError as exc:
            assert "fell over" in str(exc)
        else:
            raise AssertionError("the error was lost")
        return threaded, inline

    threaded, inline = asyncio.run(main())
    assert 0.015 < threaded < 0.5 and 0.015 < inline < 0.5


class RecordingShard:
    """Answers each step with its position; records the thread of every call and the sessions in it."""

    def __init__(self) -> None:
        self.threads: list[int] = []
        self.calls: list[list[str]] = []
        self.store = ["a", "b"]  # the sessions the node holds: more than one, so steps may batch

    def decode_many(self, steps: Sequence[DecodeStep]) -> list[ShardOutput | MeshnetError]:
        self.threads.append(where())
        self.calls.append([str(s.sid) for s in steps])
        return [ShardOutput(hidden=np.full((1, 2), s.position, dtype=np.float32)) for s in steps]


def test_the_batcher_runs_a_lone_step_on_the_loop_once_installed() -> None:
    shard = RecordingShard()

    async def main() -> int:
        calls = ShardCalls()
        calls.install(asyncio.get_running_loop(), shares_cores=False)
        batcher = DecodeBatcher(shard, calls=calls)  # type: ignore[arg-type]
        for position in range(3):
            out, seconds = await batcher.step(DecodeStep(SessionId("a"), position, token=1))
            assert float(out.hidden[0, 0]) == position and seconds >= 0.0  # type: ignore[index]
        together = await asyncio.gather(*(batcher.step(DecodeStep(SessionId(n), 3, token=1)) for n in "bcd"))
        assert [float(o.hidden[0, 0]) for o, _ in together] == [3, 3, 3]  # type: ignore[index]
        return where()

    loop_thread = asyncio.run(main())
    assert shard.threads[0] != loop_thread  # the first call: a worker thread
    assert shard.threads[1:] == [loop_thread] * 3  # then on the loop, the batch of three too


def test_a_node_holding_one_session_computes_its_step_without_waiting_a_loop_turn() -> None:
    """No other session's step could join the batch: the step computes at once, without giving the
    loop the turn it gives steps of other sessions to arrive in (a turn on every hop of every token)."""
    shard = RecordingShard()
    shard.store = ["a"]

    async def main() -> None:
        calls = ShardCalls()
        calls.install(asyncio.get_running_loop(), shares_cores=False)
        batcher = DecodeBatcher(shard, calls=calls)  # type: ignore[arg-type]
        await batcher.step(DecodeStep(SessionId("a"), 0, token=1))  # the first call: a worker thread
        step = batcher.step(DecodeStep(SessionId("a"), 1, token=1))
        with pytest.raises(StopIteration) as done:
            step.send(None)  # runs to its end without once giving the loop a turn
        out, _ = done.value.value
        assert float(out.hidden[0, 0]) == 1
        shard.store = ["a", "b"]
        step = batcher.step(DecodeStep(SessionId("a"), 2, token=1))
        step.send(None)  # two sessions: it gives the loop a turn for the other's step first
        with pytest.raises(StopIteration):
            step.send(None)

    asyncio.run(main())


def test_on_the_loop_a_lone_step_leads_its_batch_and_a_cancelled_leader_hands_it_over() -> None:
    shard = RecordingShard()

    async def main() -> None:
        calls = ShardCalls()
        calls.install(asyncio.get_running_loop(), shares_cores=False)
        batcher = DecodeBatcher(shard, calls=calls)  # type: ignore[arg-type]
        await batcher.step(DecodeStep(SessionId("warm"), 0, token=1))  # the first call: a worker thread
        # steps that arrive in one loop turn: one call, computed by the first of them in its own task
        both = await asyncio.gather(*(batcher.step(DecodeStep(SessionId(n), 1, token=1)) for n in "ab"))
        assert [float(o.hidden[0, 0]) for o, _ in both] == [1, 1]  # type: ignore[index]
        # the leader's client goes away during its one loop turn: the step that joined it still computes
        leader = asyncio.ensure_future(batcher.step(DecodeStep(SessionId("c"), 2, token=1)))
        await asyncio.sleep(0)  # the leader now waits out its turn
        joined = asyncio.ensure_future(batcher.step(DecodeStep(SessionId("d"), 2, token=1)))
        leader.cancel()
        out, _ = await asyncio.wait_for(joined, 5)
        assert float(out.hidden[0, 0]) == 2  # type: ignore[index]
        assert leader.cancelled()

    asyncio.run(main())
    assert shard.calls[1] == ["a", "b"]
    assert shard.calls[2][-1] == "d"
