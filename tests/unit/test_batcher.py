"""The node's decode batcher (node.batcher) over a fake shard: who goes in which batch, errors, cancellation."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

import numpy as np
import pytest

from meshnet.backends.shard import DecodeStep, ShardOutput
from meshnet.errors import MeshnetError, PositionMismatch
from meshnet.ids import SessionId
from meshnet.node.batcher import DecodeBatcher


class FakeShard:
    """Answers each step with its position as the hidden state; the first call waits for ``release``."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.release = threading.Event()
        self.started = threading.Event()

    def decode_many(self, steps: Sequence[DecodeStep]) -> list[ShardOutput | MeshnetError]:
        self.calls.append([str(s.sid) for s in steps])
        self.started.set()
        assert self.release.wait(10)
        out: list[ShardOutput | MeshnetError] = []
        for s in steps:
            if s.position < 0:
                out.append(PositionMismatch(f"session {s.sid} expects position 0, got {s.position}"))
            else:
                out.append(ShardOutput(hidden=np.full((1, 4), s.position, dtype=np.float32)))
        return out


def step(name: str, position: int = 0) -> DecodeStep:
    return DecodeStep(SessionId(name), position, token=1)


async def wait_for(event: threading.Event) -> None:
    assert await asyncio.to_thread(event.wait, 10)


def test_a_lone_step_runs_at_once_and_the_steps_that_arrive_meanwhile_go_together() -> None:
    shard, sizes = FakeShard(), []

    async def main() -> list[ShardOutput]:
        batcher = DecodeBatcher(shard, sizes.append)  # type: ignore[arg-type]
        first = asyncio.ensure_future(batcher.step(step("a", 1)))
        await wait_for(shard.started)  # "a" computes alone: nothing waited for a batch to fill
        later = [asyncio.ensure_future(batcher.step(step(name, 2))) for name in "bcd"]
        await asyncio.sleep(0.05)
        assert batcher.waiting == 3
        shard.release.set()
        return [(await first)[0], *[(await f)[0] for f in later]]

    outs = asyncio.run(main())
    assert shard.calls == [["a"], ["b", "c", "d"]]
    assert sizes == [1, 3]
    assert [float(o.hidden[0, 0]) for o in outs] == [1, 2, 2, 2]  # type: ignore[index]


def test_a_refused_step_fails_alone() -> None:
    shard = FakeShard()
    shard.release.set()

    async def main() -> tuple[ShardOutput, BaseException | ShardOutput]:
        batcher = DecodeBatcher(shard)  # type: ignore[arg-type]
        steps = (batcher.step(step("a", 3)), batcher.step(step("b", -1)))
        good, bad = await asyncio.gather(*steps, return_exceptions=True)
        return good[0], bad  # type: ignore[index,return-value]

    good, bad = asyncio.run(main())
    assert isinstance(bad, PositionMismatch)
    assert isinstance(good, ShardOutput) and float(good.hidden[0, 0]) == 3  # type: ignore[index]
    assert shard.calls == [["a", "b"]]


def test_a_cancelled_caller_leaves_the_others_their_results() -> None:
    shard = FakeShard()

    async def main() -> ShardOutput:
        batcher = DecodeBatcher(shard)  # type: ignore[arg-type]
        head = asyncio.ensure_future(batcher.step(step("a", 1)))
        await wait_for(shard.started)
        gone = asyncio.ensure_future(batcher.step(step("b", 2)))
        kept = asyncio.ensure_future(batcher.step(step("c", 2)))
        await asyncio.sleep(0.05)
        gone.cancel()  # its client went away while it waited for the next batch
        shard.release.set()
        await head
        with pytest.raises(asyncio.CancelledError):
            await gone
        return (await kept)[0]

    out = asyncio.run(main())
    assert float(out.hidden[0, 0]) == 2  # type: ignore[index]
    assert shard.calls == [["a"], ["b", "c"]]


def test_a_fault_of_the_shard_call_fails_every_step_in_it_and_the_batcher_goes_on() -> None:
    class Faulty(FakeShard):
        def decode_many(self, steps: Sequence[DecodeStep]) -> list[ShardOutput | MeshnetError]:
            if len(self.calls) == 0:
                self.calls.append([str(s.sid) for s in steps])
                raise RuntimeError("llama.cpp fell over")
            return super().decode_many(steps)

    shard = Faulty()
    shard.release.set()

    async def main() -> tuple[list[BaseException | ShardOutput], ShardOutput]:
        batcher = DecodeBatcher(shard)  # type: ignore[arg-type]
        failed = await asyncio.gather(batcher.step(step("a")), batcher.step(step("b")), return_exceptions=True)
        return list(failed), (await batcher.step(step("c", 5)))[0]

    failed, after = asyncio.run(main())
    assert all(isinstance(f, RuntimeError) for f in failed)
    assert float(after.hidden[0, 0]) == 5  # type: ignore[index]
