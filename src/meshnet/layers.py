"""``LayerRange``: the half-open block range a node executes, validated once."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LayerRange"]


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
