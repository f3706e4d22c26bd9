"""Drive a route of shards in-process: chunked prefill, then one position per decode step.

Written against the ``ShardBackend`` protocol only, so it drives PyTorch and llama.cpp shards
alike (tests, benchmarks, parity checks). The hidden state of one shard is handed to the next
unchanged; shards whose seam carries token ids (DeepSeek-V4) also get the chunk's tokens.

Two layers: stateless functions over ``(shards, sid, position)`` (``forward_chain``,
``prefill_chain``, ``decode_chain``, ``generate``) and ``ChainSession``, which remembers the
session id and the next position for a caller that drives one session step by step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from meshnet.backends.shard import F32, I32, ShardBackend, verify_chunk
from meshnet.ids import SessionId, new_session_id
from meshnet.sampling import Sampler, SamplingParams

__all__ = [
    "ChainSession",
    "check_route",
    "decode_chain",
    "forward_chain",
    "generate",
    "generate_greedy",
    "prefill_chain",
]


def check_route(shards: Sequence[ShardBackend]) -> None:
    """Raise ``ValueError`` unless the shards cover ``[0, total)`` head to tail without gaps."""
    if not shards:
        raise ValueError("a route holds at least one shard")
    total = shards[0].info.layers.total
    at = 0
    for shard in shards:
        layers = shard.info.layers
        if layers.total != total or layers.start != at:
            raise ValueError(f"the route expects a shard starting at layer {at} of {total}, got {layers}")
        at = layers.stop
    if at != total:
        raise ValueError(f"the route stops at layer {at} of {total}")


def _needs_tokens(shard: ShardBackend) -> bool:
    return shard.info.layers.is_head or shard.info.seam.carries_token_ids


def forward_chain(shards: Sequence[ShardBackend], sid: SessionId, start: int, tokens: I32) -> F32:
    """One chunk at absolute ``start`` through every shard; the tail's logits of its last position."""
    hidden: F32 | None = None
    logits: F32 | None = None
    for shard in shards:
        out = shard.prefill(sid, start, tokens=tokens if _needs_tokens(shard) else None, hidden=hidden)
        hidden, logits = out.hidden, out.logits
    assert logits is not None, "the last shard of a route is the tail"
    return logits


def prefill_chain(
    shards: Sequence[ShardBackend], sid: SessionId, tokens: Sequence[int], chunk: int = 64, start: int = 0
) -> F32:
    """``tokens`` from ``start`` in chunks of at most ``chunk``; the logits of the last token."""
    if chunk < 1 or not tokens:
        raise ValueError("prefill needs at least one token and a chunk size of at least 1")
    logits: F32 | None = None
    for begin in range(0, len(tokens), chunk):
        part = np.asarray(tokens[begin : begin + chunk], dtype=np.int32)
        logits = forward_chain(shards, sid, start + begin, part)
    assert logits is not None
    return logits


def decode_chain(shards: Sequence[ShardBackend], sid: SessionId, position: int, token: int) -> F32:
    """Decode one position: every shard computes exactly one new position (a one-token chunk)."""
    return forward_chain(shards, sid, position, np.asarray([token], dtype=np.int32))


class ChainSession:
    """One session across every shard of a route. Not thread-safe: one driver per session.

    ``position`` is the next absolute position. Pass ``opened=True`` to drive sessions that
    already exist on the shards (e.g. restored from snapshots at ``position``).
    """

    def __init__(
        self,
        shards: Sequence[ShardBackend],
        sid: SessionId | None = None,
        *,
        position: int = 0,
        opened: bool = False,
    ) -> None:
        check_route(shards)
        self.shards = list(shards)
        self.sid = sid or new_session_id()
        self.position = position
        if not opened:
            for shard in self.shards:
                shard.open_session(self.sid)

    def prefill(self, tokens: Sequence[int], chunk: int = 64) -> F32:
        logits = prefill_chain(self.shards, self.sid, tokens, chunk, start=self.position)
        self.position += len(tokens)
        return logits

    def step(self, token: int) -> F32:
        logits = decode_chain(self.shards, self.sid, self.position, token)
        self.position += 1
        return logits

    def verify(self, tokens: Sequence[int]) -> F32:
        """A speculative verify chunk through every shard (``verify_chunk``, as a node computes it);
        the logits of every position."""
        ids = np.asarray(tokens, dtype=np.int32)
        hidden: F32 | None = None
        for shard in self.shards:
            out = verify_chunk(
                shard, self.sid, self.position, tokens=ids if _needs_tokens(shard) else None, hidden=hidden
            )
            hidden, logits = out.hidden, out.logits
        assert logits is not None, "the last shard of a route is the tail"
        self.position += len(tokens)
        return logits

    def rewind(self, position: int) -> None:
        """Drop positions ``>= position`` on every shard (rejected drafts)."""
        for shard in self.shards:
            shard.rewind(self.sid, position)
        self.position = position

    def generate(self, logits: F32, n_new: int, sampler: Sampler | None = None) -> list[int]:
        """Sample ``n_new`` tokens starting from ``logits`` (the last position's); greedy by default."""
        sampler = sampler or Sampler(SamplingParams(temperature=0.0))
        out: list[int] = []
        for i in range(n_new):
            token, _ = sampler.sample(logits, position=self.position)
            out.append(token)
            if i + 1 < n_new:  # the last token is returned, not fed back
                logits = self.step(token)
        return out

    def snapshot(self) -> list[bytes]:
        return [shard.snapshot(self.sid) for shard in self.shards]

    def close(self) -> None:
        for shard in self.shards:
            shard.close_session(self.sid)


def generate(
    shards: Sequence[ShardBackend],
    prompt_tokens: Sequence[int],
    n_new: int,
    chunk: int = 64,
    *,
    sampler: Sampler | None = None,
) -> list[int]:
    """Open a session, prefill ``prompt_tokens`` in chunks, decode ``n_new`` tokens, close it."""
    session = ChainSession(shards)
    try:
        return session.generate(session.prefill(prompt_tokens, chunk), n_new, sampler)
    finally:
        session.close()


generate_greedy = generate
