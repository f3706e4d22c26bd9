"""Compute backends: the only package that imports llama_cpp (and, later, torch).

``base`` holds the interfaces the rest of Meshnet programs against; ``llama_full`` is the
single-node llama.cpp engine; ``fake`` is a deterministic stand-in for fast unit tests.
"""

from meshnet.backends.base import (
    EngineStep,
    ModelInfo,
    PrefillProgress,
    TextEngine,
    TokenStep,
)

__all__ = ["EngineStep", "ModelInfo", "PrefillProgress", "TextEngine", "TokenStep"]
