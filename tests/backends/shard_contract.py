"""What every shard backend must do with bad input: a named error, and the session unchanged."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from meshnet.backends.shard import ShardBackend
from meshnet.errors import InvalidRequest, PositionMismatch, SeamMismatch, SessionNotFound
from meshnet.ids import SessionId


def check_bad_inputs_change_nothing(chain: Sequence[ShardBackend], sid: SessionId, position: int) -> None:
    """``chain`` holds ``sid`` at ``position``; every bad call below must leave it there."""
    head, middle = chain[0], chain[1]
    width = middle.info.seam.shape
    good = np.zeros((1, *width), dtype=np.float32)
    narrow = np.zeros((1, *width[:-1], width[-1] - 1), dtype=np.float32)
    with pytest.raises(SeamMismatch, match="shape"):
        middle.decode_step(sid, position, hidden=narrow)
    with pytest.raises(SeamMismatch, match="float32"):
        middle.decode_step(sid, position, hidden=good.astype(np.float64))
    with pytest.raises(SeamMismatch, match="NaN"):
        middle.decode_step(sid, position, hidden=np.full_like(good, np.nan))
    with pytest.raises(PositionMismatch, match="gap"):
        middle.decode_step(sid, position + 1, hidden=good)
    with pytest.raises(PositionMismatch, match="rewind"):
        middle.decode_step(sid, position - 1, hidden=good)
    with pytest.raises(SeamMismatch):
        head.decode_step(sid, position, hidden=good)  # the head takes token ids
    with pytest.raises(InvalidRequest):
        head.decode_step(sid, position, token=10**9)
    with pytest.raises(SessionNotFound):
        middle.decode_step(SessionId("never-opened"), 0, hidden=good)
    for shard in chain:
        assert shard.store.get(sid).position == position  # nothing moved
