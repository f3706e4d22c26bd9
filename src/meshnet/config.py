"""Frozen configuration records, one per component, built at the CLI (the composition root)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["PRODUCT_CONTEXT_CAP", "ServeConfig"]

# The most positions one session may hold anywhere in Meshnet (128K): nodes default to the model's
# trained context up to it, and the tracker refuses a request past it with a 400.
PRODUCT_CONTEXT_CAP = 131_072


@dataclass(frozen=True, slots=True)
class ServeConfig:
    gguf: Path
    host: str = "127.0.0.1"
    port: int = 8000
    threads: int | None = None
    ctx: int | None = None
    batch: int = 512
    model_id: str | None = None
    max_queue: int = 64
    max_body_mb: float = 16.0

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be within 0-65535 (0 picks a free port), got {self.port}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {self.threads}")
        if self.ctx is not None and self.ctx < 16:
            raise ValueError(f"--ctx must be >= 16 tokens, got {self.ctx}")
        if self.batch < 1:
            raise ValueError(f"--batch must be >= 1, got {self.batch}")
        if self.max_queue < 0:
            raise ValueError(f"--max-queue must be >= 0, got {self.max_queue}")
        if not 0 < self.max_body_mb <= 4096:
            raise ValueError(f"--max-body-mb must be within (0, 4096], got {self.max_body_mb}")
