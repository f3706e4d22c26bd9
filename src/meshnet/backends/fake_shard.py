"""A fake shard for fast tests of everything above the backends: the node service, the gateway's
route engine, the tracker's placement (``MixShard``).

It is *beside* the real shards (llama.cpp, PyTorch), never instead of them: the integration tests
split real models. Each position's value mixes its input with everything the session holds before
it, so a hop that misses, repeats or keeps a stale position changes the tokens, and tests compare
whole token sequences as the real-process tests do with llama.cpp. It keeps KV like a real shard
(``ShardBase``'s session store: budgets, parking, snapshots, rewind), so everything the node does
with KV runs for real on it.
"""

from __future__ import annotations

import threading

import numpy as np

from meshnet.backends.shard import F32, I32, KVFormat, SeamSpec, ShardBase, ShardInfo, ShardOutput
from meshnet.ids import SessionId
from meshnet.layers import LayerRange
from meshnet.session.store import StoreLimits

__all__ = ["TOTAL", "VOCAB", "MixShard"]

VOCAB = 50
TOTAL = 12  # the fake model's layers


class MixShard(ShardBase[list[float]]):
    """Each position's value mixes its input with everything the session holds before it."""

    def __init__(
        self, layers: str, *, max_verify: int = 4, gate: threading.Event | None = None, numerics: str = ""
    ) -> None:
        super().__init__()
        self.gate = gate
        self.salt = float(LayerRange.parse(layers, TOTAL).start + 1)
        self.info = ShardInfo(
            model_id="mix",
            architecture="mix",
            backend="fake",
            layers=LayerRange.parse(layers, TOTAL),
            seam=SeamSpec((2,)),
            n_vocab=VOCAB,
            max_positions=512,
            weight_bytes=1,
            kv=KVFormat("kv", "f32", 8, 0, (8,), "test"),
            max_verify=max_verify,
            numerics=numerics,
        )
        self._init_store(StoreLimits(8, budget_bytes=8 * 512 * 4, max_sessions=4, max_positions=512))

    def _forward(
        self, state: list[float], start: int, tokens: I32 | None, hidden: F32 | None, all_logits: bool = False
    ) -> ShardOutput:
        if self.gate is not None:
            assert self.gate.wait(10)
        inputs = [float(t) for t in tokens] if tokens is not None else [float(h[0]) for h in hidden]  # type: ignore[union-attr]
        rows = []
        for x in inputs:
            value = (x * 31 + sum(state) * 7 + self.salt) % 1009
            state.append(value)
            rows.append(value)
        if self.info.layers.is_tail:
            logits = np.zeros((len(rows), VOCAB), dtype=np.float32)
            for i, value in enumerate(rows):
                logits[i, int(value) % VOCAB] = 10.0
            return ShardOutput(logits=logits if all_logits else logits[-1])
        return ShardOutput(hidden=np.array([[v, -v] for v in rows], dtype=np.float32))

    def _new_state(self, sid: SessionId) -> list[float]:
        return []

    def _free_state(self, state: list[float]) -> None:
        state.clear()

    def _truncate_state(self, state: list[float], position: int) -> None:
        del state[position:]

    def _dump_state(self, state: list[float], position: int) -> bytes:
        return np.array(state[:position], dtype=np.float64).tobytes()

    def _load_state(self, sid: SessionId, body: bytes, position: int) -> list[float]:
        return list(np.frombuffer(body, dtype=np.float64))
