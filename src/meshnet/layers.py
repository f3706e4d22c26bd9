"""``LayerRange``: the half-open block range a node executes, validated once."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["LayerRange", "split_layers"]


@dataclass(frozen=True, slots=True)
class LayerRange:
    """Blocks ``[start, stop)`` of a model with ``total`` blocks.

    The head (``start == 0``) also owns the token embeddings; the tail (``stop == total``)
    also owns the final norm and the lm_head.
    """

    start: int
    stop: int
    total: int

    def __post_init__(self) -> None:
        if self.total <= 0:
            raise ValueError(f"a model has at least one layer, got total={self.total}")
        if not 0 <= self.start < self.stop <= self.total:
            raise ValueError(f"layer range {self.start}:{self.stop} must satisfy 0 <= start < stop <= {self.total}")

    @classmethod
    def full(cls, total: int) -> LayerRange:
        return cls(0, total, total)

    @classmethod
    def parse(cls, text: str, total: int) -> LayerRange:
        """Parse ``"START:STOP"`` (either side may be empty: ``":10"``, ``"20:"``)."""
        start_s, sep, stop_s = text.partition(":")
        if not sep:
            raise ValueError(f"layer range {text!r} must look like START:STOP, e.g. 10:20")
        try:
            start = int(start_s) if start_s.strip() else 0
            stop = int(stop_s) if stop_s.strip() else total
        except ValueError:
            raise ValueError(f"layer range {text!r} must hold integers, e.g. 10:20") from None
        return cls(start, stop, total)

    @property
    def is_head(self) -> bool:
        return self.start == 0

    @property
    def is_tail(self) -> bool:
        return self.stop == self.total

    @property
    def is_full(self) -> bool:
        return self.is_head and self.is_tail

    def __len__(self) -> int:
        return self.stop - self.start

    def __str__(self) -> str:
        return f"{self.start}:{self.stop}"


def split_layers(total: int, nodes: int, starts: Sequence[int] | None = None) -> list[LayerRange]:
    """``nodes`` contiguous ranges covering ``[0, total)``, sizes differing by at most one — or, when
    the model's family allows ranges to start only at ``starts`` (``shard_file.range_starts``), the
    allowed cuts nearest to that even split."""
    if not 1 <= nodes <= total:
        raise ValueError(f"--nodes must be within 1..{total} (the model has {total} layers), got {nodes}")
    base, extra = divmod(total, nodes)
    cuts, stop = [], 0
    for i in range(nodes - 1):
        stop += base + (1 if i < extra else 0)
        cuts.append(stop)
    if starts is not None:
        allowed = sorted(set(starts) - {0})
        if len(allowed) < nodes - 1:
            raise ValueError(
                f"this model's layers can be cut only before layers {allowed}: at most {len(allowed) + 1} nodes, "
                f"not {nodes}"
            )
        chosen: list[int] = []
        for i, want in enumerate(cuts):
            # leave enough allowed cuts after this one for the remaining nodes
            room = allowed[: len(allowed) - (nodes - 2 - i)]
            room = [c for c in room if not chosen or c > chosen[-1]]
            chosen.append(min(room, key=lambda c: (abs(c - want), c)))
        cuts = chosen
    bounds = [0, *cuts, total]
    return [LayerRange(a, b, total) for a, b in itertools.pairwise(bounds)]
